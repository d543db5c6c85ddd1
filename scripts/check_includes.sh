#!/usr/bin/env bash
# The front door, checked: what stands where a user of the library stands — the Python binding
# (python/src), the examples and the configuration layer's headers (src/config: the YAML file's
# keys → the facades' options, shared with the CLI and the binding) — includes only the installed
# API (include/refit/, reached from refit/api.h) and the configuration layer; never a header of
# the library's internals (src/<layer>/). The CLI (src/apps) may include the configuration,
# testing and CLI-support layers too, and an internal header only where this file allows it: its
# developer commands (simulate, diff, encode, estimate, apply, and the demo's in-process fleet of
# trackers under one coordinator) work on the library's internals (the simulator, the compare,
# the tracker, the stream, the coordinator, the location codec, half floats, the applier), and
# the CLI is built with the library, never against an installed copy. That is decided: these
# commands keep their named internal includes, and no public "tools" API is made for them.
# Fails, listing file:line, on anything else. Runs in scripts/lint.sh.
#
# Usage: scripts/check_includes.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# Headers of the layers above the library that a front-door file may include by bare name.
config_layer="config_file.h role_options.h"
cli_layers="$config_layer $(cd src/testing && ls *.h | tr "\n" " ") $(cd src/apps && ls *.h | tr "\n" " ")"
# The CLI's internal includes, each named with the one file allowed it.
cli_internal_allowed="
src/apps/cli_common.cc util/environment.h
src/apps/progress.h util/mutex.h
src/apps/progress.cc util/mutex.h
src/apps/raw_copy.cc util/mutex.h
src/apps/simulate.cc workload/simulator.h
src/apps/simulate.cc codec/compare.h
src/apps/demo.cc workload/simulator.h
src/apps/mpi_demo.cc workload/simulator.h
src/apps/diff.cc codec/locations.h
src/apps/diff.cc codec/tracker.h
src/apps/diff.cc pipeline/bucketing.h
src/apps/encode.cc codec/tracker.h
src/apps/encode.cc pipeline/bucketing.h
src/apps/encode.cc pipeline/context_items.h
src/apps/estimate.cc core/half_float.h
src/apps/estimate.cc codec/tracker.h
src/apps/estimate.cc pipeline/bucketing.h
src/apps/estimate.cc pipeline/context_items.h
src/apps/estimate.cc receiver/apply.h
src/apps/apply_command.cc receiver/apply.h
src/apps/fleet_coordinator.h codec/tracker.h
src/apps/fleet_coordinator.h pipeline/coordinator.h
src/apps/fleet_coordinator.cc pipeline/staged_source.h
"

failures=()
check() {  # check FILE ALLOWED_BARE_HEADERS
  local file=$1 allowed=$2 line header
  while IFS= read -r line; do
    header=${line#*\"}
    header=${header%%\"*}
    local number=${line%%:*}
    if [[ $header == refit/* ]]; then
      local name=${header#refit/}
      [[ -f include/refit/$name || -f include/refit/$name.in ]] && continue
      failures+=("$file:$number: $header is not an installed header")
      continue
    fi
    [[ " $allowed " == *" $header "* ]] && continue
    if grep -qxF "$file $header" <<< "$cli_internal_allowed"; then continue; fi
    failures+=("$file:$number: \"$header\" is not part of the installed API")
  done < <(grep -n '^#include "' "$file" || true)
}

for file in src/config/*.h python/src/*.cc python/src/*.h; do
  [[ -f $file ]] && check "$file" "$config_layer"
done
while IFS= read -r file; do
  check "$file" "$config_layer"
done < <(find examples -name '*.cc' -o -name '*.h' -o -name '*.cpp' 2>/dev/null)
for file in src/apps/*.cc src/apps/*.h; do
  check "$file" "$cli_layers"
done

if ((${#failures[@]})); then
  printf '%s\n' "${failures[@]}" >&2
  echo "check_includes: ${#failures[@]} include(s) reach past the installed API" >&2
  exit 1
fi
echo "check_includes: the binding, the configuration headers, the examples and the CLI include the installed API only (the CLI's developer commands: $(grep -c . <<< "$cli_internal_allowed") allowed internal includes)"
