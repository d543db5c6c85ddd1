"""Run an example script as a user would, with this test process's refit, and read its summary.

Shared by the tests of examples/: each example prints a JSON summary as its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_example(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run examples/``script`` with ``args`` from the repository root."""
    refit = pytest.importorskip("refit.torch").refit
    env = dict(os.environ)
    # The example (and its children) import refit from where this process did: the sources and
    # the build tree's compiled core, then whatever PYTHONPATH said.
    paths = [os.path.dirname(p) for p in refit.__path__]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
    )


def summary_of(result: subprocess.CompletedProcess) -> dict:
    """The example's JSON summary (its last non-empty line of output)."""
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines, f"no output; stderr:\n{result.stderr}"
    return json.loads(lines[-1])
