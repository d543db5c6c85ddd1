"""examples/trl_grpo.py runs end to end and checks what it claims.

TRL's GRPOTrainer trains a tiny random Qwen2 on the CPU; after every optimizer step refit syncs
the bf16 policy into a separate generation process, which generates the next step's completions
(TRL's rollout_func). The generator's state dict (SHA-256) and logits must equal the trainer's
after every step, and a generator that reports one bit off must fail the run.
"""

from __future__ import annotations

import subprocess

import pytest

import example_runner
from example_runner import summary_of

pytest.importorskip("torch")
pytest.importorskip("trl")  # pinned in python/requirements-dev.txt: CI's venv has it

SCRIPT = "trl_grpo.py"


def run_example(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return example_runner.run_example(SCRIPT, *args, timeout=timeout)


def test_grpo_policy_is_refit_bit_exactly_after_every_step():
    result = run_example("--steps", "3")
    detail = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, detail
    summary = summary_of(result)
    assert summary["ok"], detail
    assert summary["trl_version"] == "1.16.0"
    # The checkpoint the generator loaded is what the trainer adopted as version 0.
    assert summary["baseline"]["sha256_equal"] and summary["baseline"]["logits_equal"], detail
    steps = summary["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3], detail
    for s in steps:
        where = f"step {s['step']}\n{detail}"
        assert s["sha256_equal"] and s["logits_equal"], where
        # Committed as the step's version, a delta from the step before (sparse, not empty).
        assert s["version"] == s["step"] and s["base_version"] == s["step"] - 1, where
        assert not s["anchor"], where
        assert 0 < s["changed_elements"] < s["total_elements"] // 2, where
        # GRPO's completions of step k were sampled by the generator from version k - 1.
        assert s["generated_by_version"] == s["step"] - 1, where
        assert s["loss"] is not None and s["reward"] is not None, where
    assert summary["generated_by_synced_version"] and summary["all_bit_identical"]
    assert summary["generator"]["version"] == 3
    assert summary["generator"]["pauses"] == 3  # one transfer applied per step


def test_a_generator_one_bit_off_fails_the_run():
    result = run_example("--steps", "2", "--fault-step", "1", "--quiet")
    detail = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 1, detail
    summary = summary_of(result)
    assert not summary["ok"], detail
    first, second = summary["steps"]
    assert not first["sha256_equal"] and not first["logits_equal"], detail
    # The fault was in a copy: the generator's module itself stayed as refit wrote it.
    assert second["sha256_equal"] and second["logits_equal"], detail
