#!/usr/bin/env bash
# Runs python/tests/engine (the real vLLM engine on the CPU) on the engine venv's interpreter:
# ctest's python_vllm_cpu_engine (label vllm-engine). The venv is REFIT_VLLM_VENV (default
# .venv-vllm at the repository root), made by scripts/setup-vllm.sh. Without it the test is
# skipped (exit 77, ctest's SKIP_RETURN_CODE) — unless REFIT_TEST_VLLM_ENGINE_REQUIRED=1
# (scripts/test.sh sets it), which makes a missing engine venv a failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
venv=${REFIT_VLLM_VENV:-.venv-vllm}
case $venv in /*) ;; *) venv=$root/$venv ;; esac
if [ ! -x "$venv/bin/python" ]; then
  if [ "${REFIT_TEST_VLLM_ENGINE_REQUIRED:-0}" = 1 ]; then
    echo "run_engine_test: no engine venv at $venv, and REFIT_TEST_VLLM_ENGINE_REQUIRED=1 (run scripts/setup-vllm.sh)" >&2
    exit 1
  fi
  echo "run_engine_test: skipped: no engine venv at $venv (scripts/setup-vllm.sh makes it)"
  exit 77
fi
export REFIT_TEST_VLLM_ENGINE_REQUIRED=${REFIT_TEST_VLLM_ENGINE_REQUIRED:-1}
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$root/python/tests/engine"
