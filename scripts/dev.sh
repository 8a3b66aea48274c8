#!/usr/bin/env bash
# One entry point for a fresh clone: creates (once) the project's own virtual environment in .venv/,
# installs into it, then runs the demo or the tests.
#   bash scripts/dev.sh demo [zephon-loader run args...]   # the main job on the bundled default
#   bash scripts/dev.sh quick [pytest args...]             # the quick test tier (a few minutes)
#   bash scripts/dev.sh test [pytest args...]              # the whole test suite (what CI runs)
#   bash scripts/dev.sh docs [build|serve]                 # the documentation site (MkDocs), strict
#   bash scripts/dev.sh env                                # only create/update .venv/ (demo and test steps)
#   bash scripts/dev.sh recipe [pytest args...]            # AutoModel's own recipe tests, in .venv-recipe/
# demo installs what the demo needs; quick/test/docs/env add the test tools (trainers, formats, Ray, docs).
# PYTHON=/path/to/python3 selects the interpreter the environment is created from (default: python3).
# ZEPHON_VENV=DIR puts the environment elsewhere (default: .venv in the clone).
# ZEPHON_RECIPE_VENV=DIR does the same for the recipe environment (default: .venv-recipe in the clone):
# nemo-automodel==0.7.0 installed with all its declared dependencies, kept apart from .venv/ because
# it pins its own transformers.
# A system interpreter that refuses installs (PEP 668, "externally managed") is never installed into.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${ZEPHON_VENV:-.venv}
VPY="$VENV/bin/python"
STAMP_PREFIX="$VENV/.zephon-install-stamp"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# An activated, unrelated environment must not leak into ours (pip and python read these).
unset VIRTUAL_ENV PYTHONHOME CONDA_PREFIX || true

say() { echo "dev.sh: $*" >&2; }

make_venv() {
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    say "no interpreter '$PYTHON' on PATH; install Python >= 3.11 or set PYTHON=/path/to/python3"
    exit 1
  fi
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    say "$("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])') is too old: zephon_loader needs Python >= 3.11 (set PYTHON=...)"
    exit 1
  fi
  if ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    say "'$PYTHON -m venv' is unavailable: install it (Debian/Ubuntu: apt-get install python3-venv) or set PYTHON=... to an interpreter that has it"
    exit 1
  fi
  say "creating the project environment in $VENV/ (from $("$PYTHON" -c 'import sys; print(sys.executable)'))"
  "$PYTHON" -m venv "$VENV"
}

# What decides whether the environment is up to date: this script's install steps (the function named
# by $1), the project's declared dependencies and the interpreter. The project itself is installed
# editable, so code changes need no reinstall.
install_stamp() {
  { sed -n "/^$1()/,/^}/p" scripts/dev.sh; cat pyproject.toml scripts/constraints.txt; "$VPY" -VV; } \
    | "$VPY" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

# Each step says what it installs and why (sizes measured on a fresh environment, Python 3.11, x86-64).
install() {
  local pip=("$VPY" -m pip install --quiet -c scripts/constraints.txt)
  # CPU torch first and pinned: an unpinned torch pulls a multi-GB CUDA build. The constraints file
  # keeps every later install (and anything they pull in) on this torch.
  say "step 1/2: torch 2.13.0, CPU build (the tensors; about 0.9 GB)"
  "${pip[@]}" "torch==2.13.0"
  say "step 2/2: zephon-loader (editable) with Zephon, transformers and matplotlib (the demo and 'inspect'; about 0.4 GB)"
  "${pip[@]}" -e ".[hf,viz]"
}

install_test() {
  local pip=("$VPY" -m pip install --quiet -c scripts/constraints.txt)
  say "test step 1/5: pytest, hypothesis, Lightning, Accelerate, moto and the object-store client (the test extra)"
  "${pip[@]}" -e ".[hf,viz,test]"
  # The shard formats tests/test_shard_formats.py reads (sources[].format): Lance and Vortex with their
  # dependencies; LitData without the torchvision it declares (PyPI's wheel is the CUDA build and fails to
  # load against the CPU torch; Zephon's LitData reader never imports it), so its other dependencies by name.
  say "test step 2/5: the shard formats the tests read (Lance, Vortex, LitData)"
  "${pip[@]}" "pylance==14.0.2" "vortex-data==0.90.0" lightning-utilities boto3 requests tifffile obstore zstd
  "${pip[@]}" --no-deps "litdata==0.2.76"
  # runtime.runner: ray (tests/test_ray_runner.py): Zephon's Ray extra, about 45 s and 380 MB.
  say "test step 3/5: Ray (runtime.runner: ray; about 380 MB)"
  "${pip[@]}" "zephon[ray]==0.2.*"
  # The reference consumer, used as a test oracle: its code only (its full dependency set, about 3 GB,
  # lives in .venv-recipe/, see `dev.sh recipe`).
  say "test step 4/5: nemo-automodel 0.7.0, code only (a test oracle)"
  "${pip[@]}" --no-deps "nemo-automodel==0.7.0"
  say "test step 5/5: MkDocs, Material and mkdocstrings (the documentation site, built strict by the tests)"
  "${pip[@]}" -e ".[docs]"
}

# The recipe environment: AutoModel's LLM recipe really runs, so nemo-automodel comes with every
# dependency it declares (the `automodel` extra), resolved together with the project's so pip picks
# the transformers nemo-automodel pins (5.18.0). Its CUDA packages (quack-kernels, nvidia-cutlass-dsl,
# cuda-bindings, triton) are plain wheels that install on a CPU machine; the extra caps triton below
# 3.9, whose autotune check breaks `import nemo_automodel.recipes.llm.train_ft` (0.7.0's LoRA kernels).
install_recipe() {
  local pip=("$VPY" -m pip install --quiet -c scripts/constraints.txt)
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -e ".[test,hf,automodel]"
}

# ensure_env INSTALL_FUNCTION IMPORT_CHECK WHAT: (re)create $VENV and run the install function unless
# the stamp matches and IMPORT_CHECK imports.
ensure_env() {
  local steps=${1:-install} check=${2:-torch, zephon_loader}
  local what=${3:-torch==2.13.0 CPU first, then the project}
  local stamp="${STAMP_PREFIX}-${steps}"
  if [ ! -x "$VPY" ] || ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$VENV"
    make_venv
  fi
  local want
  want=$(install_stamp "$steps")
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
    && "$VPY" -c "import $check" >/dev/null 2>&1; then
    return 0
  fi
  say "installing into $VENV/ ($what)"
  rm -f "$stamp"
  local started=$SECONDS
  "$steps"
  echo "$want" >"$stamp"
  say "done in $((SECONDS - started)) s; $VENV/ holds $(du -sh "$VENV" 2>/dev/null | cut -f1)"
}

# The test environment: the demo's, then the test tools.
ensure_test_env() {
  ensure_env
  ensure_env install_test "pytest, lightning, accelerate, moto, lance, ray, mkdocs" \
    "the test tools: trainers, shard formats, Ray, the AutoModel oracle, MkDocs"
}

mode=${1:-}
shift || true
case "$mode" in
  demo)
    ensure_env
    exec "$VPY" -m zephon_loader.cli run "$@"
    ;;
  test)
    ensure_test_env
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    exec "$VPY" -m pytest -q -p no:cacheprovider "$@"
    ;;
  quick)
    ensure_test_env
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    exec "$VPY" -m pytest -q -p no:cacheprovider -m "not slow" "$@"
    ;;
  docs)
    ensure_test_env
    if [ "${1:-build}" = serve ]; then
      exec "$VPY" -m mkdocs serve --strict -a 127.0.0.1:8000
    fi
    exec "$VPY" -m mkdocs build --strict --site-dir site
    ;;
  env)
    ensure_test_env
    say "ready: . $VENV/bin/activate"
    ;;
  recipe)
    VENV=${ZEPHON_RECIPE_VENV:-.venv-recipe}
    VPY="$VENV/bin/python"
    STAMP_PREFIX="$VENV/.zephon-install-stamp"
    ensure_env install_recipe "torch, zephon_loader, nemo_automodel.recipes.llm.train_ft" \
      "torch==2.13.0 CPU first, then the project with nemo-automodel==0.7.0 and all its dependencies"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    exec "$VPY" -m pytest -q -p no:cacheprovider tests/recipe "$@"
    ;;
  *)
    echo "usage: bash scripts/dev.sh {demo|quick|test|docs|env|recipe} [args...]" >&2
    exit 2
    ;;
esac
