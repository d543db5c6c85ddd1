#!/usr/bin/env bash
# Installs the Debian 12 packages refit builds and tests with. Idempotent: packages already
# present are skipped, and apt is only consulted when something is missing.
set -euo pipefail

# Build + test dependencies (Debian 12 packages; nothing is downloaded at run time).
packages=(
  build-essential cmake ninja-build pkg-config git
  libzstd-dev libxxhash-dev libhwy-dev
  libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libpugixml-dev
  libzmq3-dev cppzmq-dev libsodium-dev libcpp-httplib-dev libssl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-14 libclang-rt-14-dev clang-format
  python3-numpy python3-zmq python3-prometheus-client
  # S3 transport: libcurl for the client; boto3 and xxhash for the independent S3 test peer.
  libcurl4-openssl-dev python3-boto3 python3-xxhash
  # MPI producer group (optional in CMake): Open MPI's headers and libraries, and mpirun for its test.
  libopenmpi-dev openmpi-bin
  # The Python package: pybind11 for its core, Debian's torch (1.13, CPU) and pytest for its
  # tests, and what an offline `pip install --no-build-isolation ./python` into a venv needs.
  pybind11-dev python3-pybind11 python3-dev python3-torch python3-pytest
  python3-setuptools python3-wheel python3-build python3-venv python3-pip
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
