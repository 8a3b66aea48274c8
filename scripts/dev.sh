#!/usr/bin/env bash
# One entry point for a fresh clone: creates (once) the project's own virtual environment in .venv/,
# installs into it, then runs the demo or the tests.
#   bash scripts/dev.sh demo [zephon-loader run args...]   # the main job on the bundled default
#   bash scripts/dev.sh test [pytest args...]              # the test suite
#   bash scripts/dev.sh env                                # only create/update .venv/
# PYTHON=/path/to/python3 selects the interpreter the environment is created from (default: python3).
# ZEPHON_VENV=DIR puts the environment elsewhere (default: .venv in the clone).
# A system interpreter that refuses installs (PEP 668, "externally managed") is never installed into.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${ZEPHON_VENV:-.venv}
VPY="$VENV/bin/python"
STAMP="$VENV/.zephon-install-stamp"
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

# What decides whether the environment is up to date: this script's install steps, the project's
# declared dependencies and the interpreter. The project itself is installed editable, so code changes
# need no reinstall.
install_stamp() {
  { sed -n '/^install()/,/^}/p' scripts/dev.sh; cat pyproject.toml scripts/constraints.txt; "$VPY" -VV; } \
    | "$VPY" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

install() {
  local pip=("$VPY" -m pip install --quiet -c scripts/constraints.txt)
  # CPU torch first and pinned: an unpinned torch pulls a multi-GB CUDA build. The constraints file
  # keeps every later install (and anything they pull in) on this torch.
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -e ".[hf,viz,test]"
  # The reference consumer, used as a test oracle; its full dependency set needs CUDA.
  "${pip[@]}" --no-deps "nemo-automodel==0.7.0"
}

ensure_env() {
  if [ ! -x "$VPY" ] || ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$VENV"
    make_venv
  fi
  local want
  want=$(install_stamp)
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && "$VPY" -c 'import torch, zephon_loader' >/dev/null 2>&1; then
    return 0
  fi
  say "installing into $VENV/ (torch==2.13.0 CPU first, then the project, then the nemo-automodel oracle)"
  rm -f "$STAMP"
  install
  echo "$want" >"$STAMP"
}

mode=${1:-}
shift || true
case "$mode" in
  demo)
    ensure_env
    exec "$VPY" -m zephon_loader.cli run "$@"
    ;;
  test)
    ensure_env
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    exec "$VPY" -m pytest -q -p no:cacheprovider "$@"
    ;;
  env)
    ensure_env
    say "ready: . $VENV/bin/activate"
    ;;
  *)
    echo "usage: bash scripts/dev.sh {demo|test|env} [args...]" >&2
    exit 2
    ;;
esac
