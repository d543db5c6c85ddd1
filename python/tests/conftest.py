"""Shared fixtures of the refit Python tests."""

import os

# Quiet the per-commit info lines of the receivers the tests start (errors still show).
os.environ.setdefault("REFIT_LOG_LEVEL", "warn")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import refit  # noqa: E402


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def perturb(array, rng, fraction=0.01):
    """Change about `fraction` of `array`'s elements in place (a sparse optimizer step)."""
    flat = array.reshape(-1)
    picks = rng.choice(flat.size, max(1, int(flat.size * fraction)), replace=False)
    flat[picks] += np.asarray(1.0, dtype=flat.dtype)
    return array


def run_ranks(script, world, args, timeout=300, env=None):
    """Run ``script`` as ``world`` rank processes (``python script RANK *args``) and wait for all.

    Fails the test with the tail of every rank's output unless every rank exits 0. A rank left
    waiting in a collective after another one failed is killed, not waited for.
    """
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), *map(str, args)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(world)]
    try:
        outputs = [rank.communicate(timeout=timeout)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert [r.returncode for r in ranks] == [0] * world, "\n".join(o[-4000:] for o in outputs)
    return outputs
