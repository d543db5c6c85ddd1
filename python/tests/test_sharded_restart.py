"""A sharded rank killed with SIGKILL mid-transfer, restarted: it alone sends its boxes FULL.

Three trainer ranks (this file run as a script, one process each, over a TCP producer group)
hold the rows of a model of plain arrays and publish them with a layout. Rank 2's first process
sends slowly (fault+zmq://, 2 s per payload) and SIGKILLs itself 0.3 s into the second step,
so it always dies before its share of that transfer is streamed, whatever the machine's load.
The transfer is aborted everywhere and the receiver rolls back to step 1; ranks 0 and 1 retry
the step, rank 2 restarts with no baseline and joins them: that transfer is a delta, in which
rank 2 sends every element of its rows and the others only their changes. The receiver holds
the model bit-exactly after every committed step.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import refit

WORLD = 3
STEPS = 3
TENSORS = {"embed.weight": (37, 16), "layers.0.w": (29, 16), "layers.0.b": (2,), "scale": ()}


def model_at(step):
    """The canonical model after `step` steps: a few elements change per step."""
    out = {}
    for t, (name, shape) in enumerate(TENSORS.items()):
        rng = np.random.default_rng(t)
        array = rng.standard_normal(shape).astype(np.float32)
        for s in range(1, step + 1):
            mask = np.random.default_rng(100 * s + t).random(shape) < 0.1
            array = np.where(mask, array + np.float32(0.001 * s), array).astype(np.float32)
        out[name] = np.array(array, dtype=np.float32, order="C")  # 0-d stays 0-d
    return out


def rows_of(rank, shape):
    if not shape:
        return 0, 0
    size = -(-shape[0] // WORLD)
    begin = min(shape[0], rank * size)
    return begin, min(shape[0], begin + size)


def rank_tensors(rank, step):
    """This rank's local arrays and its layout at `step` (the 0-d tensor: a copy on every rank)."""
    model, local, layout = model_at(step), {}, []
    for name, shape in TENSORS.items():
        if shape:
            begin, end = rows_of(rank, shape)
            local[name] = np.array(model[name][begin:end], order="C")
            offset = [begin] + [0] * (len(shape) - 1)
            extent = [end - begin] + list(shape[1:])
        else:
            local[name], offset, extent = model[name].copy(), [], []
        layout.append({"tensor": name, "dtype": "float32", "shape": list(shape), "offset": offset,
                       "extent": extent})
    return local, layout


def rank_main(rank, first_step, group, receivers, out):
    publisher = refit.Publisher(
        receivers=json.loads(receivers) if rank == 0 else None,
        group=refit.tcp_group(group, rank, WORLD, connect_timeout=60),
        # The first rank 2 is slowed (a delay per payload), so it is still streaming when it
        # kills itself.
        transport="fault+zmq://?delay_ms=2000" if rank == 2 and first_step == 1 else "zmq://",
        bucket_bytes=256, transfer_timeout=60)
    reports = []
    def record(entry):  # atomically: the test reads the file while this rank runs
        reports.append(entry)
        with open(out + ".tmp", "w") as f:
            json.dump(reports, f)
        os.replace(out + ".tmp", out)

    for step in range(first_step, STEPS + 1):
        local, layout = rank_tensors(rank, step)
        if rank == 2 and first_step == 1 and step == 2:
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        for attempt in range(3):
            try:
                report = publisher.sync(local, layout=layout)
                break
            except refit.Error as error:  # the step a rank was killed in: aborted, retried
                print(f"rank {rank} step {step}: {error}", flush=True)
                record({"step": step, "error": str(error)})
        else:
            raise RuntimeError(f"rank {rank}: step {step} failed 3 times")
        record({"step": step, "anchor": report.anchor, "changed": report.changed_elements,
                "elements": report.total_elements, "version": report.version})


def test_a_rank_killed_mid_transfer_restarts_and_sends_its_boxes_full(tmp_path):
    model = model_at(0)
    held = {name: np.zeros_like(array) for name, array in model.items()}
    endpoint = f"127.0.0.1:{refit.free_ports(1)[0]}"
    receiver = refit.Receiver(data_endpoint=endpoint, peers=[endpoint], version=0)
    for name, array in held.items():
        receiver.register(name, array)
    receiver.start()
    group = f"127.0.0.1:{refit.free_ports(1)[0]}"
    receivers = json.dumps([list(receiver.endpoint)])
    outs = [tmp_path / f"rank{r}.json" for r in range(WORLD)]

    def spawn(rank, first_step):
        return subprocess.Popen([sys.executable, __file__, str(rank), str(first_step), group, receivers,
                                 str(outs[rank])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    ranks = [spawn(r, 1) for r in range(WORLD)]
    try:
        # Step 1 commits; rank 2 kills itself during step 2.
        assert receiver.wait_for_version(1, timeout=120) == 1
        assert ranks[2].wait(timeout=120) == -signal.SIGKILL
        # Ranks 0 and 1 see step 2 fail: it was aborted everywhere (they wait to retry it).
        deadline = time.monotonic() + 120

        def failed_step_2(rank):
            return outs[rank].exists() and any(
                r.get("step") == 2 and "error" in r for r in json.loads(outs[rank].read_text()))

        while not (failed_step_2(0) and failed_step_2(1)):
            assert time.monotonic() < deadline, "the killed rank's transfer was not aborted"
            time.sleep(0.05)
        status = receiver.status()
        assert status.state == "idle" and status.version == 1, status
        assert all(np.array_equal(held[n], a) for n, a in model_at(1).items()), "not rolled back"
        ranks[2] = spawn(2, 2)  # restarted: a new process, no baseline
        for rank in ranks:
            output = rank.communicate(timeout=180)[0]
            assert rank.returncode == 0, output[-3000:]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
        receiver.stop()
    assert receiver.version == STEPS
    assert all(np.array_equal(held[n], a) for n, a in model_at(STEPS).items())
    reports = [json.loads(out.read_text()) for out in outs]
    # Ranks 0 and 1 saw step 2 fail once, then commit it; no step was an anchor after the first.
    for rank in (0, 1):
        steps = [r for r in reports[rank] if "error" not in r]
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert any("error" in r and r["step"] == 2 for r in reports[rank]), reports[rank]
        assert [r["anchor"] for r in steps] == [True, False, False], steps
    # The restarted rank 2 sent its rows FULL in step 2, then deltas.
    restarted = [r for r in reports[2] if "error" not in r]
    assert [r["step"] for r in restarted] == [2, 3]
    assert restarted[0]["changed"] == restarted[0]["elements"] > 0, restarted
    assert restarted[1]["changed"] < restarted[1]["elements"], restarted
    # Rank 1's step 2 was a delta: only its changes.
    rank1_step2 = [r for r in reports[1] if r.get("step") == 2 and "error" not in r][0]
    assert rank1_step2["changed"] < rank1_step2["elements"]


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
