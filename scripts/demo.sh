#!/usr/bin/env bash
# Build the release `refit` binary and run the main job on its embedded default: `refit demo` (a
# simulated trainer refitting two `refit serve` daemons on loopback, every step verified).
# Extra arguments go to `refit demo`, e.g. scripts/demo.sh --model-bytes 256MiB --steps 10
#
# It installs and builds only what the demo needs, idempotently (a second run skips what is
# done):
#   1. the Debian packages of the C++ build (scripts/setup.sh --cpp: no Python venv, which only
#      scripts/test.sh and the Python package need);
#   2. CMake's release configuration (build/release);
#   3. the `refit` binary alone (build/release/src/apps/refit), with ccache when it is installed;
#   4. `refit demo`.
# On a terminal each stage prints one line, and the build shows its progress on one more line.
# With CI=true, or without a terminal, only the demo's own output is printed; the output of the
# configuration (and, without a terminal, the build) goes to build/release-demo.log and is shown
# when a stage fails.
set -euo pipefail
cd "$(dirname "$0")/.."

stages=4
binary=build/release/src/apps/refit
log=build/release-demo.log
tty=0
if [[ -t 1 && "${CI:-}" != true ]]; then tty=1; fi
start=$SECONDS

stage() {  # stage N WHAT: the progress line of stage N (on a terminal only)
  if [[ $tty == 1 ]]; then
    printf 'demo.sh [%d/%d] %s (%ds)\n' "$1" "$stages" "$2" $((SECONDS - start))
  fi
}

# Run a command with its output in $log; on failure show the end of the log and stop.
logged() {
  if ! "$@" >>"$log" 2>&1; then
    echo "demo.sh: '$*' failed; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}

stage 1 "packages of the C++ build (scripts/setup.sh --cpp)"
bash scripts/setup.sh --cpp

mkdir -p build
: >"$log"
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
stage 2 "configure build/release (cmake --preset release)"
logged cmake --preset release "${launcher[@]}"

stage 3 "build $binary"
if [[ $tty == 1 ]]; then
  # Ninja on a terminal keeps its progress ([done/total] and the file) on one line; errors are
  # printed as they come.
  if ! cmake --build --preset release -j"$(nproc)" --target refit; then
    echo "demo.sh: the build of $binary failed (its output is above)" >&2
    exit 1
  fi
else
  logged cmake --build --preset release -j"$(nproc)" --target refit
fi

stage 4 "$binary demo $*"
status=0
"$binary" demo "$@" || status=$?
if [[ $tty == 1 && $status == 0 ]]; then
  cat <<EOF

demo.sh: done in $((SECONDS - start)) s. To call the binary \`refit\` in this shell (the README's
next commands do):
  export PATH="$PWD/build/release/src/apps:\$PATH"
EOF
fi
exit "$status"
