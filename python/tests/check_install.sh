#!/usr/bin/env bash
# The README's install, checked from the outside: a fresh venv that sees the packages of PYTHON's
# environment (the project venv's pinned torch, numpy, setuptools and pytest, through a .pth file;
# or the system's, with --system-site-packages, when PYTHON is no venv's), then
# `pip install --no-build-isolation --no-deps --no-index ./python` reusing a CMake build tree, then
# the installed package imported and tested from a directory outside the checkout.
# Usage: check_install.sh PYTHON BUILD_DIR WORK_DIR
set -euo pipefail
python=$1 build=$2 work=$3
checkout=$(cd "$(dirname "$0")/../.." && pwd)

rm -rf "$work"
mkdir -p "$work"
read -r in_venv site_packages < <("$python" -c \
  'import sys, sysconfig; print(int(sys.prefix != sys.base_prefix), sysconfig.get_paths()["purelib"])')
if [ "$in_venv" = 1 ]; then
  # No pip or setuptools of its own (ensurepip's older setuptools would shadow the pinned one):
  # both come from the project venv, through the .pth file.
  "$python" -m venv --without-pip "$work/venv"
  fresh_site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site_packages" > "$fresh_site/project-venv.pth"
else
  "$python" -m venv --system-site-packages "$work/venv"
fi
# REFIT_BUILD_PROGRESS=0: setup.py's progress lines would land on the terminal running ctest.
REFIT_BUILD_PROGRESS=0 REFIT_CMAKE_BUILD_DIR=$build "$work/venv/bin/python" -m pip install --quiet --no-build-isolation \
  --no-deps --no-index "$checkout/python"

cd "$work"
unset PYTHONPATH
"$work/venv/bin/python" - "$work" <<'PY'
import sys
import refit, refit.torch, refit.vllm
import torch
assert refit.__file__.startswith(sys.argv[1]), f"imported {refit.__file__}, not the installed package"
print("installed", refit.__version__, "at", refit.__file__, "with torch", torch.__version__)
PY
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$checkout/python/tests/test_core.py"
