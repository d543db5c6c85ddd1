#!/usr/bin/env bash
# Run every libFuzzer target (or the ones named) from its checked-in seed corpus and print a table
# (and JSON with --json) of executions, executions per second, coverage and outcome. Exit status 1
# if any target found a crash, leak, timeout or OOM; the input that triggered it is kept under the
# work directory and named in the table.
#
#   scripts/fuzz.sh [--build DIR] [--seconds N | --runs N] [--seed S] [--json FILE] [TARGET...]
#
# Two uses:
#   - a campaign (the default, --seconds 60; a real one is --seconds 600): randomized, as long as
#     it is told. It reports findings; it does not decide whether a submission lands.
#   - the CI smoke (scripts/test.sh): --runs N --seed S, a fixed number of inputs from a fixed
#     seed, so that one commit always fuzzes the same inputs and gets the same outcome. (Every
#     corpus is also replayed by ctest, in every build.)
# The targets come from the `asan` preset (clang-14, ASan + UBSan), built beforehand:
#   cmake --preset asan && cmake --build --preset asan
# New inputs go to a scratch copy of the corpus, never into tests/fuzz/corpus/: a finding is added
# there by hand, with a regression test where the defect deserves one.
set -euo pipefail
cd "$(dirname "$0")/.."

build=build/asan
seconds=60
runs=""
seed=""
json=""
targets=()
while (($#)); do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --json) json=$2; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option '$1'" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done

if ((${#targets[@]} == 0)); then
  for source in tests/fuzz/*_fuzz.cc; do targets+=("$(basename "$source" .cc)"); done
fi

# A budget of runs makes the outcome a function of the commit alone (with a fixed seed); a budget
# of seconds makes it depend on the machine's speed.
if [[ -n "$runs" ]]; then
  # -reload=0: no periodic (time-driven) re-read of the corpus directory.
  budget=(-runs="$runs" -reload=0)
  column=runs
else
  budget=(-max_total_time="$seconds")
  column=sec
fi
if [[ -n "$seed" ]]; then budget+=(-seed="$seed"); fi

work=$(mktemp -d "${TMPDIR:-/tmp}/refit-fuzz.XXXXXX")
rows=()
failed=0
for target in "${targets[@]}"; do
  binary="$build/tests/fuzz/$target"
  if [[ ! -x "$binary" ]]; then
    echo "fuzz.sh: $binary is not built (cmake --preset asan && cmake --build --preset asan)" >&2
    exit 2
  fi
  corpus="$work/$target/corpus"
  mkdir -p "$corpus"
  if [[ -d "tests/fuzz/corpus/$target" ]]; then cp -r "tests/fuzz/corpus/$target/." "$corpus/"; fi
  log="$work/$target/log"
  # -rss_limit_mb: a parser must refuse an input before allocating for it, so 2 GiB is a finding.
  set +e
  "$binary" "${budget[@]}" -print_final_stats=1 -rss_limit_mb=2048 -timeout=10 \
    -artifact_prefix="$work/$target/" "$corpus" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  stats=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$stats")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$stats")
  units=$(ls "$corpus" | wc -l)
  outcome=ok
  artifact=$(ls "$work/$target/" | grep -E '^(crash|leak|timeout|oom|slow-unit)-' | head -1 || true)
  if ((rc != 0)) || [[ -n "$artifact" ]]; then
    outcome="FINDING ${artifact:-exit $rc} (log: $log)"
    failed=1
  fi
  rows+=("$target|${runs:-$seconds}|${execs:-0}|${rate:-0}|${cov:-0}|${ft:-0}|$units|$outcome")
done

if [[ -n "$seed" ]]; then echo "fuzz.sh: seed $seed"; fi
printf '%-26s %6s %10s %8s %6s %7s %7s  %s\n' target "$column" execs exec/s cov ft corpus outcome
for row in "${rows[@]}"; do
  IFS='|' read -r t s e r c f u o <<<"$row"
  printf '%-26s %6s %10s %8s %6s %7s %7s  %s\n' "$t" "$s" "$e" "$r" "$c" "$f" "$u" "$o"
done
if [[ -n "$json" ]]; then
  {
    echo '{"fuzz": ['
    for i in "${!rows[@]}"; do
      IFS='|' read -r t s e r c f u o <<<"${rows[$i]}"
      sep=$([[ $i -lt $((${#rows[@]} - 1)) ]] && echo , || true)
      printf '  {"target": "%s", "%s": %s, "execs": %s, "execs_per_second": %s, "coverage": %s, "features": %s, "corpus": %s, "ok": %s}%s\n' \
        "$t" "$([[ $column == sec ]] && echo seconds || echo runs)" "$s" "$e" "$r" "$c" "$f" "$u" "$([[ $o == ok ]] && echo true || echo false)" "$sep"
    done
    echo ']}'
  } >"$json"
fi
if ((failed == 0)); then rm -rf "$work"; fi
exit "$failed"
