#!/usr/bin/env bash
# Install dependencies, build (dev preset: -Werror, debug checks on) and run every test:
# ctest labels unit, integration and slow. Usage: scripts/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
jobs=$(nproc)
cmake --preset dev >/dev/null
cmake --build --preset dev -j"$jobs"
ctest --preset dev -j"$jobs" --timeout 900 "$@"
