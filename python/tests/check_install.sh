#!/usr/bin/env bash
# The README's offline install, checked from the outside: a fresh venv that sees the system's
# numpy and torch, `pip install --no-build-isolation --no-deps ./python` reusing a CMake build
# tree, then the installed package imported and tested from a directory outside the checkout.
# Usage: check_install.sh PYTHON BUILD_DIR WORK_DIR
set -euo pipefail
python=$1 build=$2 work=$3
checkout=$(cd "$(dirname "$0")/../.." && pwd)

rm -rf "$work"
mkdir -p "$work"
"$python" -m venv --system-site-packages "$work/venv"
REFIT_CMAKE_BUILD_DIR=$build "$work/venv/bin/pip" install --quiet --no-build-isolation \
  --no-deps --no-index "$checkout/python"

cd "$work"
unset PYTHONPATH
"$work/venv/bin/python" - "$work" <<'PY'
import sys
import refit, refit.torch, refit.vllm
assert refit.__file__.startswith(sys.argv[1]), f"imported {refit.__file__}, not the installed package"
print("installed", refit.__version__, "at", refit.__file__)
PY
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$checkout/python/tests/test_core.py"
