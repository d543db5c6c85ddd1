#!/usr/bin/env bash
# Install dependencies, build the release `refit` binary and run the main job on its embedded
# default: `refit demo` (a simulated trainer refitting a receiver, every step verified).
# Extra arguments go to `refit demo`, e.g. scripts/demo.sh --model-bytes 256MiB --steps 10
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j"$(nproc)" --target refit >/dev/null
exec build/release/src/apps/refit demo "$@"
