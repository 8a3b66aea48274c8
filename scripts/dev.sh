#!/usr/bin/env bash
# One entry point for a fresh clone: installs everything, then runs the demo or the tests.
#   bash scripts/dev.sh demo [zephon-loader run args...]   # the main job on the bundled default
#   bash scripts/dev.sh test [pytest args...]              # the test suite
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore  # CI and these machines run as root

install() {
  # CPU torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
  "$PYTHON" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".[hf,viz,test]"
  # The reference consumer, used as a test oracle; its full dependency set needs CUDA.
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps "nemo-automodel==0.7.0"
}

mode=${1:-}
shift || true
case "$mode" in
  demo)
    install
    exec "$PYTHON" -m zephon_loader.cli run "$@"
    ;;
  test)
    install
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
    ;;
  *)
    echo "usage: bash scripts/dev.sh {demo|test} [args...]" >&2
    exit 2
    ;;
esac
