#!/usr/bin/env bash
# The front door's includes (scripts/check_includes.sh: the binding, the examples and the CLI
# include the installed API only), then the naming checks of .clang-tidy
# (readability-identifier-naming, STYLE.md's names) over the library, the CLI and the Python
# binding, headers included. Needs the dev build's
# compile_commands.json (cmake --preset dev). Fails, listing them, on any name out of style.
# About 2 minutes on 2 cores; scripts/test.sh runs it after the dev stage. Tests and benchmarks
# are not scanned: gtest and Google Benchmark names (BM_…) follow their frameworks, and clang-14
# cannot parse some C++20 that GCC accepts there (lambdas capturing structured bindings).
#
# Usage: scripts/lint.sh [BUILD_DIR]   (default build/dev)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/dev}
bash scripts/check_includes.sh
[[ -f $build/compile_commands.json ]] || {
  echo "lint: no $build/compile_commands.json (cmake --preset dev first)" >&2
  exit 2
}
tidy=$(command -v run-clang-tidy-14 || command -v run-clang-tidy || true)
[[ -n $tidy ]] || { echo "lint: run-clang-tidy not found (apt-get install clang-tidy-14)" >&2; exit 2; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$tidy" -p "$build" -checks='-*,readability-identifier-naming' -j "$(nproc)" -quiet \
  "$PWD/(src|python/src)/.*\.cc$" > "$log" 2>&1 || true
found=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep 'warning: .*\[readability-identifier-naming\]' | sort -u || true)
if [[ -n $found ]]; then
  echo "$found"
  echo "lint: $(wc -l <<< "$found") name(s) out of style (.clang-tidy, STYLE.md)" >&2
  exit 1
fi
if grep -q 'error:' "$log"; then
  sed 's/\x1b\[[0-9;]*m//g' "$log" | grep 'error:' | sort -u | head -20 >&2
  echo "lint: clang-tidy could not check every file" >&2
  exit 1
fi
echo "lint: every name in src/ and python/src/ is in style"
