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
