#!/usr/bin/env bash
# Install dependencies, build (dev preset: -Werror, debug checks on) and run every test:
# ctest labels unit, integration and python. Usage: scripts/test.sh [extra ctest args]
#
# The s3:// integration tests need a real S3 server: this starts the project's single-node Ceph
# RGW (scripts/s3-test-server.sh, http://127.0.0.1:7480) before ctest and exports its endpoint and
# keys, with REFIT_TEST_S3_REQUIRED=1 so that those tests fail instead of skipping when it is
# unreachable. A server that was already running is reused and left running; one started here is
# stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
jobs=$(nproc)
cmake --preset dev >/dev/null
cmake --build --preset dev -j"$jobs"

if ! bash scripts/s3-test-server.sh status >/dev/null 2>&1; then
  bash scripts/s3-test-server.sh start
  trap 'bash scripts/s3-test-server.sh stop' EXIT
fi
eval "$(bash scripts/s3-test-server.sh env)"
export REFIT_TEST_S3_REQUIRED=1

ctest --preset dev -j"$jobs" --timeout 900 "$@"
