#!/usr/bin/env bash
# GPU check of the attention backends against the real kernels, in one command:
#   bash scripts/gpu_check.sh [extra pytest args...]
#
# 1. creates (once) its own virtual environment, .venv-gpu/ (ZEPHON_GPU_VENV=DIR elsewhere), from
#    $PYTHON (default python3, >= 3.11);
# 2. installs, in README.md's order ("Install on a GPU machine"): the CUDA build of torch==2.13.0
#    (scripts/constraints.txt), the build tools Transformer Engine's source build uses, then the
#    project with its fa4, te, hf and test extras with --no-build-isolation (TE builds
#    transformer_engine_torch against the installed torch; NVTE_PYTORCH_FORCE_BUILD=TRUE skips its
#    attempt to fetch a prebuilt wheel from outside the package index); a second run reuses the
#    environment unless pyproject.toml, the constraints or this script changed;
# 3. runs tests/test_backends_gpu.py with -rs and ZEPHON_LOADER_REQUIRE_KERNELS=1 (a missing CUDA
#    device or kernel package fails instead of skipping), FA4's compile cache on
#    ($VENV/fa4-compile-cache, kept for the next run);
# 4. prints one summary line last: "gpu_check: PASSED ..." or "gpu_check: FAILED ...".
#
# ZEPHON_GPU_SYSTEM_TORCH=1 uses the CUDA torch already installed for $PYTHON instead (an NGC
# container, a cluster image): the environment is made with --system-site-packages, torch is not
# installed, every later install is pinned to that torch's version, and packages the image already
# has at the pinned versions (TE, FA4) are kept. Offline, point pip at a wheel folder
# (PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR) holding what the image lacks.
#
# Needs: an NVIDIA GPU with a driver for CUDA 13.0 (>= 580; PyPI's torch 2.13.0 Linux build is
# CUDA 13.0), a C++ compiler, and the package index (pip's own settings apply: PIP_INDEX_URL,
# PIP_FIND_LINKS, PIP_NO_INDEX for a local wheel folder). Budget on one H100/H200: under 10 minutes
# in all. A first install downloads about 3 GB of CUDA wheels and compiles TE's torch extension (C++
# only, MAX_JOBS = all cores); the tests' time is mostly FA4 compiling each kernel on first use, and
# ZEPHON_GPU_TEST_TIMEOUT=SECONDS bounds them (default 420).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${ZEPHON_GPU_VENV:-.venv-gpu}
VPY="$VENV/bin/python"
STAMP="$VENV/.gpu-check-install-stamp"
LOG="$VENV/gpu_check-install.log"
REPORT="$VENV/gpu_check-junit.xml"
TEST_TIMEOUT=${ZEPHON_GPU_TEST_TIMEOUT:-420}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
unset VIRTUAL_ENV PYTHONHOME CONDA_PREFIX || true
START=$SECONDS

say() { echo "gpu_check: $*" >&2; }
# The summary line, printed last on every path.
fail() {
  echo "gpu_check: FAILED $1 after $((SECONDS - START)) s${2:+ ($2)}"
  exit 1
}
show_log_tail() {
  [[ -f "$LOG" ]] && { say "last lines of $LOG:"; tail -n 40 "$LOG" >&2; }
}

command -v nvidia-smi >/dev/null 2>&1 || fail "before installing" "no nvidia-smi: this needs an NVIDIA GPU and driver"
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
[[ -n "$GPU" ]] || fail "before installing" "nvidia-smi lists no GPU"
say "GPU: $GPU"

install_stamp() {
  { cat scripts/gpu_check.sh pyproject.toml scripts/constraints.txt; "$VPY" -VV; echo "${ZEPHON_GPU_SYSTEM_TORCH:-}"; } \
    | "$VPY" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

install() {
  local constraints=scripts/constraints.txt
  if [[ -n "${ZEPHON_GPU_SYSTEM_TORCH:-}" ]]; then
    # 1. The image's CUDA torch, kept: pin it so that nothing replaces it.
    constraints="$VENV/system-torch-constraints.txt"
    "$VPY" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' >"$constraints" || return 1
    echo "using the image's $(cat "$constraints")"
  fi
  local pip=("$VPY" -m pip install -c "$constraints")
  # 1. The CUDA torch first, pinned (the constraints keep every later install on it).
  [[ -n "${ZEPHON_GPU_SYSTEM_TORCH:-}" ]] || "${pip[@]}" "torch==2.13.0" || return 1
  "$VPY" - <<'EOF' || return 1
import sys, torch
if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: install a CUDA build of "
             "torch==2.13.0 that matches the driver (PyPI's Linux build needs a CUDA 13.0 driver, >= 580)")
EOF
  # 2. What TE's source build imports when pip does not isolate it.
  "${pip[@]}" setuptools wheel packaging ninja pybind11 || return 1
  # 3. The project and its kernel extras; TE the documented way (after torch, no build isolation).
  NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "${pip[@]}" --no-build-isolation -e ".[fa4,te,hf,test]" || return 1
}

if [[ ! -x "$VPY" ]]; then
  command -v "$PYTHON" >/dev/null 2>&1 || fail "before installing" "no interpreter '$PYTHON' (set PYTHON=...)"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || fail "before installing" "$PYTHON is older than 3.11"
  VENV_ARGS=()
  if [[ -n "${ZEPHON_GPU_SYSTEM_TORCH:-}" ]]; then
    "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null \
      || fail "before installing" "ZEPHON_GPU_SYSTEM_TORCH=1 but $PYTHON has no CUDA torch that sees the GPU"
    VENV_ARGS=(--system-site-packages)
  fi
  say "creating $VENV/${VENV_ARGS:+ (with the system site-packages)}"
  "$PYTHON" -m venv "${VENV_ARGS[@]}" "$VENV" || fail "creating $VENV" "'$PYTHON -m venv' failed (Debian: apt-get install python3-venv)"
fi
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(install_stamp)" ]]; then
  say "reusing $VENV/ (installed from the same pyproject.toml, constraints and script)"
else
  say "installing into $VENV/ (log: $LOG)"
  rm -f "$STAMP"
  install >"$LOG" 2>&1 || { show_log_tail; fail "installing" "see $LOG"; }
  install_stamp >"$STAMP"
fi
INSTALLED=$((SECONDS - START))
VERSIONS=$("$VPY" - <<'EOF' 2>/dev/null
from importlib.metadata import version
import torch
print(f"torch {torch.__version__}, flash-attn-4 {version('flash-attn-4')}, transformer-engine {version('transformer-engine')}")
EOF
) || VERSIONS="versions unreadable"
say "installed in ${INSTALLED} s: $VERSIONS"

export ZEPHON_LOADER_REQUIRE_KERNELS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="$(cd "$VENV" && pwd)/fa4-compile-cache"
TEST_START=$SECONDS
timeout "$TEST_TIMEOUT" "$VPY" -m pytest -p no:cacheprovider -rs -m gpu --durations=10 \
  --junitxml="$REPORT" tests/test_backends_gpu.py "$@"
STATUS=$?
TESTED=$((SECONDS - TEST_START))
[[ $STATUS -eq 124 ]] && fail "testing: pytest ran past ZEPHON_GPU_TEST_TIMEOUT=${TEST_TIMEOUT} s" "$GPU; $VERSIONS"
COUNTS=$("$VPY" - "$REPORT" <<'EOF' 2>/dev/null
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
n = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
print(f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped")
EOF
) || COUNTS="no test report (pytest exit status $STATUS)"
SUMMARY="$COUNTS in ${TESTED} s of tests, $((SECONDS - START)) s in all (install ${INSTALLED} s); $GPU; $VERSIONS"
[[ $STATUS -eq 0 ]] || fail "testing: $COUNTS" "pytest exit status $STATUS; $GPU; $VERSIONS"
echo "gpu_check: PASSED $SUMMARY"
