"""examples/vllm_grpo.py runs as the README says, on the CPU engine (ctest label ``vllm-engine``).

Its GRPO-style loop samples from vLLM (in-process here), trains, and syncs the engine
through vLLM's weight-transfer API after every step; the run must end with the engine at the last
step's ``weight_version``, refit's versions 1..N, and the CPU backend's repacked layers on the
reload path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from vllm import LLM  # noqa: F401 — the whole engine
except ImportError as error:  # pragma: no cover — depends on the interpreter
    if os.environ.get("REFIT_TEST_VLLM_ENGINE_REQUIRED") == "1":
        raise
    pytest.skip(f"the vLLM engine is not importable here ({error}); run scripts/setup-vllm.sh", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]


def test_the_grpo_example_syncs_the_engine_after_every_step():
    steps = 2
    # The engine in-process: the engine-process mode is test_vllm_cpu_engine.py's AsyncLLM test,
    # and this keeps the label's time down (an engine process starts in 30-40 s here, 6 s without).
    env = dict(os.environ, REFIT_LOG_LEVEL="warn", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_grpo.py"), "--steps", str(steps), "--prompts", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    # vLLM logs to stdout too (its shutdown lines come after the summary).
    summary = json.loads([line for line in run.stdout.splitlines() if line.startswith('{"engine_start_s"')][-1])
    assert summary["weight_version"] == f"step-{steps}"
    assert [row["version"] for row in summary["steps"]] == list(range(1, steps + 1))
    assert all(row["weight_version"] == f"step-{row['step']}" for row in summary["steps"])
    assert summary["paths"]["reload"] > 0 and summary["paths"]["in_place"] > 0
