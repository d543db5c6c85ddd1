#!/usr/bin/env bash
# Installs what refit builds and tests with. Idempotent and quick when nothing changed. Usage:
#   scripts/setup.sh          everything below (scripts/test.sh runs this)
#   scripts/setup.sh --cpp    only the packages of the C++ build (cpp_packages), no venv: what
#                             scripts/demo.sh needs to build and run the `refit` binary
# 1. Debian 12 packages (the C++ build; the system Python's modules for the integration tests'
#    independent peers). Packages already present are skipped; apt is consulted only when
#    something is missing.
# 2. The project's virtual environment, .venv (REFIT_VENV overrides), made from /usr/bin/python3,
#    holding exactly the pins of python/requirements-dev.txt (torch, numpy, pytest, vLLM, ...),
#    installed with --no-deps. A stamp of that file's hash in the venv skips pip when nothing
#    changed. The wheels are kept in a wheelhouse outside the venv (REFIT_WHEELHOUSE, default
#    ~/.cache/refit/wheels), so a venv made again installs offline: pip's own cache stays on, but
#    the package index this project reaches serves responses that pip's HTTP cache does not keep.
#    CMake picks .venv/bin/python for the Python module and tests (CMakeLists.txt, REFIT_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."

cpp_only=0
case "${1:-}" in
  "") ;;
  --cpp) cpp_only=1 ;;
  *) echo "setup: unknown argument '$1' (expected nothing, or --cpp for the C++ build only)" >&2
     exit 2 ;;
esac

# What every CMake preset needs to configure and build (Debian 12 packages): the libraries, and
# GoogleTest and Google Benchmark, since the presets build the tests and benchmarks too.
cpp_packages=(
  build-essential cmake ninja-build pkg-config git
  libzstd-dev libxxhash-dev libhwy-dev
  libhtscodecs-dev
  libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libpugixml-dev
  libzmq3-dev cppzmq-dev libsodium-dev libcpp-httplib-dev libssl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  # S3 transport: libcurl for the client.
  libcurl4-openssl-dev
)
# Build + test dependencies (Debian 12 packages; nothing is downloaded at run time).
packages=(
  "${cpp_packages[@]}"
  clang-14 libclang-rt-14-dev clang-format clang-tidy-14
  # The system Python's modules for the integration tests' peers (tests/integration/*.py run on
  # /usr/bin/python3, not the venv): numpy, pyzmq for hostile data-plane clients, the Prometheus
  # parser for /metrics.
  python3-numpy python3-zmq python3-prometheus-client
  # S3 transport: boto3 and xxhash for the independent S3 test peer (libcurl: cpp_packages).
  python3-boto3 python3-xxhash
  # MPI producer group (optional in CMake): Open MPI's headers and libraries, and mpirun for its test.
  libopenmpi-dev openmpi-bin
  # The Python package: pybind11's CMake package and Python's headers for its core, and venv +
  # pip for the project venv (torch, pytest and the rest come from PyPI into it, below).
  pybind11-dev python3-dev python3-venv python3-pip
)

if [ "$cpp_only" = 1 ]; then packages=("${cpp_packages[@]}"); fi
missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -ne 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ "$cpp_only" = 1 ]; then exit 0; fi

# The project venv. Made from /usr/bin/python3 without the system's site-packages (Debian's numpy
# or an old torch must not shadow the pins); a venv made otherwise (the README's former
# `--system-site-packages` recipe) is made again.
venv=${REFIT_VENV:-.venv}
requirements=python/requirements-dev.txt
stamp=$venv/.refit-requirements.sha256
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
if [ -f "$venv/pyvenv.cfg" ] && grep -qi '^include-system-site-packages *= *true' "$venv/pyvenv.cfg"; then
  echo "setup: $venv sees the system's site-packages; making it again" >&2
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating the venv $venv" >&2
  /usr/bin/python3 -m venv "$venv"
fi
# Every pin is in the file, so --no-deps: pip resolves nothing and installs exactly the list. The
# wheelhouse is tried first, offline; only what it lacks is downloaded (pip download keeps the
# files it finds there).
wheels=${REFIT_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/refit/wheels}
mkdir -p "$wheels"
pip_install=("$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps
             --find-links "$wheels" -r "$requirements")
if ! "${pip_install[@]}" --no-index >/dev/null 2>&1; then
  echo "setup: downloading the pinned wheels of $requirements into $wheels" >&2
  "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps -r "$requirements" -d "$wheels"
  "${pip_install[@]}" --no-index
fi
echo "$want" > "$stamp"
