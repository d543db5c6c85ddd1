"""Churn soak: a fleet that changes under a training loop, every member bit-identical after every sync.

Two trainer ranks (this file run as a script, one process each, over a TCP producer group) hold
the rows of a model of plain arrays and publish a step every sync with a layout. The fleet is
`refit serve` daemons and receivers embedded in this process, mixed, started from the step-0
checkpoint; nothing about it is known in advance: rank 0 is told the fleet before each sync
(``set_receivers``), as an autoscaler would. During 32 syncs:

- an embedded receiver leaves;
- a daemon and an embedded receiver join, both loaded from the step-0 checkpoint (versions
  behind: each is caught up on its own, folded or by an anchor for it alone);
- a daemon is killed with SIGKILL and restarted from an older checkpoint (five versions behind);
- a daemon is stopped (SIGSTOP) before a sync under `commit_policy="quorum:0.6"`: the sync commits
  on the others and fences it; resumed (SIGCONT), it holds the version before, bit for bit, and is
  caught up at the next sync;
- an embedded receiver joins from the step-0 checkpoint beyond the retained history (an anchor
  for it alone);
- a daemon joins from the step-0 checkpoint copying the fleet's version from a peer replica
  (`refit serve --bootstrap-peer`): at its first sync it is current, and the trainer's links carry
  only the fleet's delta (every member is sent the same bytes);
- both trainer ranks are killed and restarted from the checkpoint of the last committed step:
  they adopt their baseline, and the next sync is a delta for every member.

After every sync every member's every tensor equals the trainer's byte for byte (daemons read
back over GET /v1/tensors) and says it is ready to serve, and the members that held the base version before the sync were
each sent exactly the same bytes (their own ``received_bytes`` counters), delta-sized: what a
newcomer or a laggard costs is paid by it alone. The model's elements move by an ulp or two (as
Adam steps of ~1e-6 do after rounding), 2 % of them per step, with odd tensor names.
"""

import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np

import refit

WORLD = 2
SYNCS = 32
KEY_ENV = "REFIT_CHURN_SOAK_KEY"
TENSORS = {
    "model.embed_tokens.weight": ((96, 64), np.float32),
    "model.layers.0.self_attn.qkv_proj.weight": ((192, 64), np.float32),
    "model.layers.0.mlp.gate_up weight %": ((128, 64), np.float16),
    "model.norm.γ": ((64,), np.float32),
    "lm_head.weight": ((3, 64), np.float16),  # uneven: rank 0 holds two rows, rank 1 one
}
# Seconds a sync, a daemon start or a request may take on a loaded 2-core machine.
TIMEOUT_S = 120


def model_at(step, _cache={}):
    """The canonical model after `step` steps: 2 % of the elements move by one or two ulps."""
    if step in _cache:
        return _cache[step]
    if step == 0:
        out = {}
        for t, (name, (shape, dtype)) in enumerate(TENSORS.items()):
            out[name] = np.random.default_rng(t).standard_normal(shape).astype(dtype)
    else:
        out = {}
        for t, (name, array) in enumerate(model_at(step - 1).items()):
            rng = np.random.default_rng(1000 * step + t)
            moved = rng.random(array.shape) < 0.02
            up = rng.random(array.shape) < 0.5
            stepped = np.where(up, np.nextafter(array, np.inf), np.nextafter(array, -np.inf))
            twice = rng.random(array.shape) < 0.25
            stepped = np.where(twice & up, np.nextafter(stepped, np.inf), stepped)
            out[name] = np.where(moved, stepped, array).astype(array.dtype)
    _cache[step] = out
    return out


def rows_of(rank, shape):
    size = -(-shape[0] // WORLD)
    begin = min(shape[0], rank * size)
    return begin, min(shape[0], begin + size)


def rank_tensors(rank, step):
    """This rank's local arrays and its layout at `step`: a block of rows of every tensor."""
    local, layout = {}, []
    for name, array in model_at(step).items():
        begin, end = rows_of(rank, array.shape)
        local[name] = np.array(array[begin:end], order="C")
        layout.append({"tensor": name, "dtype": np.dtype(array.dtype).name, "shape": list(array.shape),
                       "offset": [begin] + [0] * (array.ndim - 1),
                       "extent": [end - begin] + list(array.shape[1:])})
    return local, layout


# ---- A trainer rank: syncs the steps the test releases, with the fleet the test names. ---------


def rank_main(rank, first_step, group, workdir):
    workdir = pathlib.Path(workdir)

    def fleet_of(step):
        command = workdir / f"sync.{step}.json"
        while not command.exists():
            time.sleep(0.01)
        return [tuple(r) for r in json.loads(command.read_text())]

    publisher = refit.Publisher(receivers=fleet_of(first_step) if rank == 0 else None,
                                group=refit.tcp_group(group, rank, WORLD, connect_timeout=60),
                                api_key=os.environ[KEY_ENV], transfer_timeout=TIMEOUT_S,
                                # A member that does not answer (SIGSTOP) is fenced, not waited
                                # for: 3 s per control call, and the sync commits on the others.
                                config=refit.Config.parse("request_timeout_s: 3\n"),
                                commit_policy="quorum:0.6",
                                # Restarted: continue the fleet's run (its lineage), fencing the
                                # ranks that were killed.
                                resume=first_step > 1)
    # The fleet was loaded from the checkpoint of step first_step - 1 (step 0 at the start; the
    # last committed step after a restart): this rank adopts its own rows of it, and the first
    # sync is a delta.
    local, layout = rank_tensors(rank, first_step - 1)
    publisher.adopt_baseline(local, version=first_step - 1, layout=layout)
    for step in range(first_step, SYNCS + 1):
        fleet = fleet_of(step)  # every rank waits for the test to release the step
        if rank == 0:
            publisher.set_receivers(fleet)
        local, layout = rank_tensors(rank, step)
        report = publisher.sync(local, layout=layout)
        out = {"version": report.version, "anchor": report.anchor, "catch_ups": list(report.catch_ups),
               "fenced": list(report.fenced)}
        done = workdir / f"done.{step}.{rank}.json"
        (workdir / "tmp").mkdir(exist_ok=True)
        tmp = workdir / "tmp" / done.name
        tmp.write_text(json.dumps(out))
        os.replace(tmp, done)


# ---- Members of the fleet. -------------------------------------------------------------------


def write_safetensors(path, tensors, version):
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = array.tobytes()
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}[array.dtype]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    header["__metadata__"] = {"refit.version": str(version)}
    text = json.dumps(header, ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


class Daemon:
    """A `refit serve` process holding a safetensors checkpoint."""

    def __init__(self, workdir, name, checkpoint, *extra):
        self.workdir, self.name, self.checkpoint, self.extra = workdir, name, checkpoint, list(extra)
        self.data_port, self.proc, self.starts = refit.free_ports(1)[0], None, 0

    def start(self):
        self.starts += 1
        ready = self.workdir / f"{self.name}.{self.starts}.ready"
        log = open(self.workdir / f"{self.name}.{self.starts}.log", "w")
        # Its own copy of the checkpoint: the daemon writes the model it holds in place.
        model = self.workdir / f"{self.name}.{self.starts}.safetensors"
        model.write_bytes(pathlib.Path(self.checkpoint).read_bytes())
        self.proc = subprocess.Popen(
            [os.environ.get("REFIT_CLI", "refit"), "serve", "--model", str(model), "--data-port",
             str(self.data_port), "--control-port", "0", "--api-key-env", KEY_ENV, "--ready-file", str(ready), *self.extra],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            assert self.proc.poll() is None, f"{self.name} exited {self.proc.returncode} at start"
            assert time.monotonic() < deadline, f"{self.name} not ready in {TIMEOUT_S} s"
            time.sleep(0.05)
        self.url = json.loads(ready.read_text())["control_url"]
        self.endpoint = (self.url, f"127.0.0.1:{self.data_port}")
        return self

    def get(self, path):
        request = urllib.request.Request(self.url + path,
                                         headers={"Authorization": f"Bearer {os.environ[KEY_ENV]}"})
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            return reply.read()

    def status(self):
        return json.loads(self.get("/v1/status"))

    def holds(self):
        return {name: self.get("/v1/tensors/" + urllib.parse.quote(name, safe="")) for name in TENSORS}

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=TIMEOUT_S)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Embedded:
    """A receiver in this process, writing into numpy arrays it was handed at step `version`."""

    def __init__(self, name, version):
        self.name = name
        self.held = {n: a.copy() for n, a in model_at(version).items()}
        self.receiver = refit.Receiver(version=version, api_key=os.environ[KEY_ENV])
        for n, array in self.held.items():
            self.receiver.register(n, array)
        self.receiver.start()
        self.endpoint = tuple(self.receiver.endpoint)

    def status(self):
        s = self.receiver.status()
        return {"version": s.version, "received_bytes": s.received_bytes, "state": s.state, "ready": s.ready}

    def holds(self):
        return {n: a.tobytes() for n, a in self.held.items()}

    def stop(self):
        self.receiver.stop()


# ---- The soak. --------------------------------------------------------------------------------


def test_a_fleet_that_changes_under_the_training_loop_stays_bit_identical(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "churn-" + secrets.token_hex(12))
    model_bytes = sum(a.nbytes for a in model_at(0).values())
    step0 = tmp_path / "step0.safetensors"
    write_safetensors(step0, model_at(0), 0)
    members = {}
    for i in range(3):
        members[f"d{i}"] = Daemon(tmp_path, f"d{i}", step0).start()
        members[f"e{i}"] = Embedded(f"e{i}", 0)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def spawn_ranks(first_step):
        group = f"127.0.0.1:{refit.free_ports(1)[0]}"  # a fresh port: the killed rank 0's may linger
        return [subprocess.Popen([sys.executable, __file__, str(r), str(first_step), group, str(tmp_path)],
                                 stdout=open(tmp_path / f"rank{r}.from{first_step}.log", "w"),
                                 stderr=subprocess.STDOUT, env=env) for r in range(WORLD)]

    def rank_logs():
        return "\n".join(p.name + ":\n" + p.read_text()[-3000:] for p in sorted(tmp_path.glob("rank*.log")))

    ranks = spawn_ranks(1)
    held_version = {name: 0 for name in members}
    counted = {name: m.status()["received_bytes"] for name, m in members.items()}
    events = []
    try:
        for step in range(1, SYNCS + 1):
            # ---- Churn before this sync. ----
            if step == 6:  # an embedded receiver leaves
                members.pop("e2").stop()
                events.append((step, "e2 left"))
            if step == 9:  # two newcomers from the step-0 checkpoint
                members["d3"] = Daemon(tmp_path, "d3", step0).start()
                members["e3"] = Embedded("e3", 0)
                for name in ("d3", "e3"):
                    held_version[name] = 0
                    counted[name] = members[name].status()["received_bytes"]
                events.append((step, "d3, e3 joined at version 0"))
            if step == 10:  # a checkpoint an operator keeps
                write_safetensors(tmp_path / "step7.safetensors", model_at(7), 7)
            if step == 13:  # kill -9, restarted from the older checkpoint
                members["d1"].kill()
                members["d1"].checkpoint = tmp_path / "step7.safetensors"
                members["d1"].start()
                held_version["d1"], counted["d1"] = 7, members["d1"].status()["received_bytes"]
                assert members["d1"].status()["version"] == 7
                events.append((step, "d1 killed, restarted at version 7"))
            if step == 18:  # a newcomer beyond the retained history (8 versions): an anchor, alone
                members["e4"] = Embedded("e4", 0)
                held_version["e4"], counted["e4"] = 0, members["e4"].status()["received_bytes"]
                events.append((step, "e4 joined at version 0"))
            if step == 26:  # a newcomer copies the fleet's version from a peer replica
                members["d5"] = Daemon(tmp_path, "d5", step0, "--bootstrap-peer", members["d0"].url).start()
                held_version["d5"], counted["d5"] = step - 1, members["d5"].status()["received_bytes"]
                assert members["d5"].status()["version"] == step - 1, members["d5"].status()
                events.append((step, f"d5 joined from step 0, copied version {step - 1} from peer d0"))
            if step == 15:  # a member stops answering (SIGSTOP) under the quorum policy
                members["d2"].proc.send_signal(signal.SIGSTOP)
                stopped = members.pop("d2")
                events.append((step, "d2 stopped (SIGSTOP)"))
            if step == 16:  # back (SIGCONT): it never took version 15, and is caught up now
                stopped.proc.send_signal(signal.SIGCONT)
                members["d2"] = stopped
                status = stopped.status()
                assert status["version"] == 14, status
                assert stopped.holds() == {n: a.tobytes() for n, a in model_at(14).items()}
                counted["d2"] = status["received_bytes"]
                events.append((step, "d2 resumed (SIGCONT) at version 14"))
            if step == 22:  # both trainer ranks restart from the checkpoint of step 21
                for rank in ranks:
                    rank.send_signal(signal.SIGKILL)
                    rank.wait(timeout=TIMEOUT_S)
                ranks = spawn_ranks(22)
                events.append((step, "trainer ranks restarted from step 21"))

            fleet = [members[name].endpoint for name in sorted(members)]
            if step == 15:
                fleet.append(stopped.endpoint)
            tmp = tmp_path / "tmp"
            tmp.mkdir(exist_ok=True)
            (tmp / f"sync.{step}.json").write_text(json.dumps(fleet))
            os.replace(tmp / f"sync.{step}.json", tmp_path / f"sync.{step}.json")
            deadline = time.monotonic() + TIMEOUT_S
            done = [tmp_path / f"done.{step}.{r}.json" for r in range(WORLD)]
            while not all(d.exists() for d in done):
                for r, rank in enumerate(ranks):
                    assert rank.poll() is None, f"rank {r} exited {rank.returncode} in sync {step}\n{rank_logs()}"
                assert time.monotonic() < deadline, f"sync {step} took over {TIMEOUT_S} s\n{rank_logs()}"
                time.sleep(0.02)
            report = json.loads(done[0].read_text())
            assert report["version"] == step, report
            # Only the stopped member is fenced, in the sync it missed.
            assert report["fenced"] == ([stopped.endpoint[0]] if step == 15 else []), (step, report)

            # ---- Every member holds the trainer's step, byte for byte. ----
            expected = {n: a.tobytes() for n, a in model_at(step).items()}
            for name, member in members.items():
                holds = member.holds()
                for tensor, data in expected.items():
                    assert holds[tensor] == data, f"sync {step}: {name} differs in {tensor!r}"
                status = member.status()
                assert status["version"] == step, (name, status)
                assert status["ready"], (step, name, status)

            # ---- The members that were current got the delta, the same bytes each. ----
            received = {}
            for name, member in members.items():
                now = member.status()["received_bytes"]
                received[name], counted[name] = now - counted[name], now
            current = sorted(n for n in members if held_version[n] == step - 1)
            behind = sorted(n for n in members if held_version[n] != step - 1)
            assert current, f"sync {step}: no member was current"
            assert len({received[n] for n in current}) == 1, (step, {n: received[n] for n in current}, events)
            delta = received[current[0]]
            assert 0 < delta < model_bytes // 4, (step, delta, model_bytes)
            assert not report["anchor"], (step, report)
            catch_ups = {c["name"]: c for c in report["catch_ups"]}
            for name in behind:
                how = catch_ups[members[name].endpoint[0]]["caught_up_by"]
                assert how in ("folded", "anchor"), (step, name, how)
                events.append((step, f"{name} caught up by {how}: {received[name]} bytes (delta {delta})"))
            for name in members:
                held_version[name] = step
        for rank in ranks:
            assert rank.wait(timeout=TIMEOUT_S) == 0, rank_logs()
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
        for member in members.values():
            member.stop()
    print("\n".join(f"sync {s}: {what}" for s, what in events))
    caught = [(s, what.split()[0], what.split()[4].rstrip(":")) for s, what in events if "caught up" in what]
    assert caught == [(9, "d3", "folded"), (9, "e3", "folded"), (13, "d1", "folded"), (16, "d2", "folded"),
                      (18, "e4", "anchor")], events


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])


# ---- A peer copy that cannot be verified is refused, and nothing is written. -------------------


def serve_expecting_failure(tmp_path, name, checkpoint, *extra, env=None):
    model = tmp_path / f"{name}.safetensors"
    model.write_bytes(pathlib.Path(checkpoint).read_bytes())
    before = model.read_bytes()
    done = subprocess.run([os.environ.get("REFIT_CLI", "refit"), "serve", "--model", str(model),
                           "--data-port", str(refit.free_ports(1)[0]), "--control-port", "0",
                           "--api-key-env", KEY_ENV, *extra],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert done.returncode != 0, done.stdout
    assert model.read_bytes() == before, "a refused peer copy wrote the model"
    return done.stderr


def test_a_peer_copy_is_refused_by_name_when_it_cannot_be_verified(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "churn-" + secrets.token_hex(12))
    step0 = tmp_path / "step0.safetensors"
    write_safetensors(step0, model_at(0), 0)
    peer = Daemon(tmp_path, "peer", step0).start()
    try:
        # A receiver with another layout: one tensor of another shape.
        other = dict(model_at(0))
        other["lm_head.weight"] = np.zeros((4, 64), np.float16)
        write_safetensors(tmp_path / "other.safetensors", other, 0)
        error = serve_expecting_failure(tmp_path, "other", tmp_path / "other.safetensors",
                                        "--bootstrap-peer", peer.url)
        assert "lm_head.weight" in error and "[4, 64]" in error and "[3, 64]" in error, error
        # The wrong key: refused by the peer.
        error = serve_expecting_failure(tmp_path, "wrong_key", step0, "--bootstrap-peer", peer.url,
                                        env=dict(os.environ, **{KEY_ENV: "not-the-fleet-key"}))
        assert "wrong API key" in error, error
        # A peer that is not there.
        error = serve_expecting_failure(tmp_path, "nobody", step0, "--bootstrap-peer",
                                        f"http://127.0.0.1:{refit.free_ports(1)[0]}")
        assert "bootstrap" in error, error
    finally:
        peer.stop()
