"""Lineage and fencing from Python (docs/protocol.md "Lineage and fencing"): a receiver's status
names the run, epoch and fingerprint it holds; a second trainer of another run is refused by name;
a restarted trainer resumes its run as the next epoch with deltas, and the one it replaced is
fenced; a new run anchors the receiver above the version it holds."""

import numpy as np
import pytest

import refit


def make_model(rng):
    return {
        "embed.weight": rng.standard_normal((64, 33)).astype(np.float32),
        "layer.0.bias": rng.standard_normal(33).astype(np.float16),
    }


def copy(model):
    return {name: array.copy() for name, array in model.items()}


def step(model, rng):
    model["embed.weight"][rng.integers(0, 64), :] += 1
    model["layer.0.bias"][rng.integers(0, 33)] += 1


def test_runs_epochs_and_fingerprints_fence_the_versions_a_receiver_holds():
    rng = np.random.default_rng(40)
    trainer = make_model(rng)
    held = copy(trainer)
    receiver = refit.Receiver()
    for name, array in held.items():
        receiver.register(name, array)
    with receiver.start():
        status = receiver.status()
        assert (status.run_id, status.epoch, status.fingerprint) == (None, 0, None)

        first = refit.Publisher(receivers=[receiver], run_id="run-a")
        first.adopt_baseline(copy(trainer), version=0)
        step(trainer, rng)
        assert not first.sync(trainer).anchor
        status = receiver.status()
        assert (status.version, status.run_id, status.epoch) == (1, "run-a", 0)
        assert status.fingerprint is not None and len(status.fingerprint) == 16

        # Another run, from a checkpoint labelled version 0: it would publish version 1 again.
        other = refit.Publisher(receivers=[receiver], run_id="run-b")
        other.adopt_baseline(make_model(np.random.default_rng(41)), version=0)
        with pytest.raises(refit.FailedPrecondition, match="run 'run-b'.*run 'run-a' epoch 0"):
            other.sync(make_model(np.random.default_rng(41)))
        # The run's name without resume.
        with pytest.raises(refit.FailedPrecondition, match="held by the fleet already"):
            refit.Publisher(receivers=[receiver], run_id="run-a").sync(trainer)
        assert receiver.status().version == 1
        for name in held:
            assert held[name].tobytes() == trainer[name].tobytes(), name

        # The restarted trainer resumes the receiver's run as epoch 1, with a delta.
        resumed = refit.Publisher(receivers=[receiver], resume=True)
        resumed.adopt_baseline(copy(trainer), version=1)
        step(trainer, rng)
        assert not resumed.sync(trainer).anchor
        assert (resumed.run_id, resumed.epoch) == ("run-a", 1)
        status = receiver.status()
        assert (status.version, status.run_id, status.epoch) == (2, "run-a", 1)

        # The trainer it replaced is a zombie of epoch 0.
        with pytest.raises(refit.FailedPrecondition, match="epoch 0 .* is fenced"):
            first.sync(trainer)
        # A restart that adopts another checkpoint under the version held: its delta would make
        # version 3 with other contents; refused naming both fingerprints.
        other_checkpoint = copy(trainer)
        other_checkpoint["embed.weight"][0, 0] += 5
        wrong = refit.Publisher(receivers=[receiver], resume=True)
        wrong.adopt_baseline(other_checkpoint, version=2)
        with pytest.raises(refit.FailedPrecondition,
                           match=f"fingerprint [0-9a-f]{{16}} refused: .*fingerprint {status.fingerprint}.*"
                                 "would reuse version 3 with other contents"):
            wrong.sync(trainer)
        assert receiver.status().version == 2

        # A new run anchors above the version held.
        fresh = make_model(np.random.default_rng(42))
        report = refit.Publisher(receivers=[receiver], run_id="run-c").sync(fresh)
        assert report.anchor and report.version == 3
        status = receiver.status()
        assert (status.version, status.run_id, status.epoch) == (3, "run-c", 0)
        for name in held:
            assert held[name].tobytes() == fresh[name].tobytes(), name
