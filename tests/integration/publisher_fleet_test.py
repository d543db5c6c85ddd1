#!/usr/bin/python3
"""Multi-process publishers and tensor-parallel shard groups against real `refit serve` daemons.

Every input is written here with numpy, straight from the safetensors format's definition (8-byte
little-endian header length, JSON header, tensor bytes), never by refit's own simulator: bf16,
fp16 and fp32 weights where 1–5 % of the elements of a tensor move by an ulp or two between
steps, as Adam steps of ~1e-6 do after rounding to bf16, with odd tensor names (spaces, dots,
percent signs, unicode, a 0-d tensor). After every step every tensor is downloaded from every
daemon (GET /v1/tensors/{name}) and compared byte for byte with what numpy says it must be.

  1. Processes, not threads: W = 1, 2, 3, 4 `refit push --group` processes (one per rank,
     started together) refit a fleet of 2 daemons with a FULL anchor and then deltas (--base);
     W = 8 on a model of exactly 2 export chunks (delta_compression.export_chunk_bytes in a
     --config file), so that 6 ranks own nothing; W = 2 as threads (--producers 2) and as
     processes on a checkpoint smaller than one chunk, where rank 1 owns nothing (the old
     "producer 1 plans an anchor but producer 0 plans a delta").
  2. kill -9 of a publisher rank mid-stream: rank 1 of 3 sends through
     fault+zmq://?delay_ms=… and is killed once the daemons are receiving; ranks 0 and 2 must
     fail naming rank 1 (or the abort) within the transfer timeout, and every daemon must be idle
     at the base version with the base bytes. The same step then commits with 3 fresh processes,
     and a second killed step commits with the rank dropped (W = 2).
  3. Tensor-parallel shard groups: a TP = 2 and a TP = 4 replica of a small Llama-like model
     (GQA, fused qkv_proj and gate_up_proj, column-sharded o_proj / down_proj, vocabulary-
     parallel embed_tokens / lm_head with padding, identity norms) and one unsharded daemon, in
     one fleet, refit over 3 steps; each shard's local tensors must equal the numpy slices of the
     trainer's canonical tensors, padding rows untouched; each shard is sent only its cut
     (routing by holdings), read from its own GET /v1/status counters.
  4. kill -9 of one shard daemon of the TP = 2 replica mid-transfer: the push fails and every
     survivor is idle at the base version with its bytes. Then the killed shard restarts from its
     original shard file (version 0, behind the others) and the next push commits everywhere as
     an anchor, which a receiver accepts at any version. A push that leaves the unsharded daemon
     out commits on the shards and leaves it as it was; it rejoins with an anchor.
Every daemon is started on its own, with no --peers list, in the reverse of the order the pushes
list them: each transfer names its relay trees.
A part that fails stops, and the next part (its own fleet) still runs; every failure is listed at
the end and the exit status is 1.
Run with Debian's /usr/bin/python3 (python3-numpy).
"""
import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np

from ports import free_port, free_ports

KEY_ENV = "REFIT_PUBLISHER_FLEET_TEST_KEY"
API_KEY = "fleet-" + secrets.token_hex(12)
# Seconds one HTTP request, a daemon start or a daemon exit may take on a loaded 2-core machine.
REQUEST_TIMEOUT_S = 30
START_TIMEOUT_S = 60
# The transfer budget of every push (--timeout), and how much longer the test waits for the
# processes to exit before calling it a hang.
PUSH_TIMEOUT_S = 90
PUSH_EXIT_SLACK_S = 30
# The export chunk target of the multi-chunk pushes: small models then span several chunks, so
# every rank of a small group owns some of them.
CHUNK_BYTES = 32 << 10
# The default export chunk (docs/configuration.md): a model below it is one chunk, owned by rank 0.
DEFAULT_CHUNK_BYTES = 256 << 20
# How long the slowed rank (or pusher) waits before every Send: far longer than it takes to see
# the daemons receiving and kill a process, so the kill surely lands mid-stream.
SLOW_SEND_MS = 4000
# The zmq ACK timeout of a push whose relay tree loses a daemon: a payload whose subtree holds
# the dead relay is never ACKed, so the sender gives up after its retries (4 attempts) of this
# many ms each; the default, 10 s, makes that 40 s.
DEAD_RELAY_ACK_TIMEOUT_MS = 3000
# The fraction of elements a training step moves, drawn per tensor.
DENSITY = (0.01, 0.05)

# dtype name -> (numpy storage of the bits, bit width, largest finite magnitude).
DTYPES = {
    "BF16": (np.uint16, 16, 0x7F7F),
    "F16": (np.uint16, 16, 0x7BFF),
    "F32": (np.uint32, 32, 0x7F7FFFFF),
}


def check(condition, message, detail=""):
    """Assert `condition`; `detail` (process output) is shown only when it fails."""
    if not condition:
        raise AssertionError(f"{message}: {detail}" if detail else message)
    print(f"ok: {message}", flush=True)




# ---- Tensors and safetensors files, independently of refit ------------------------------------

class Tensor:
    """A tensor as its bits: `bits` is a numpy array of unsigned integers of the dtype's width."""

    def __init__(self, dtype, shape, bits):
        self.dtype = dtype
        self.shape = tuple(shape)
        self.bits = np.ascontiguousarray(bits, dtype=DTYPES[dtype][0]).reshape(self.shape)

    def tobytes(self):
        return self.bits.astype(self.bits.dtype.newbyteorder("<"), copy=False).tobytes()


def bf16_bits(values):
    """Round float32 values to bf16 bit patterns, round-to-nearest-even (as a trainer exports)."""
    b = values.astype("<f4").view("<u4").astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def random_tensor(rng, dtype, shape, scale=0.02):
    values = (rng.standard_normal(shape) * scale).astype(np.float32)
    if dtype == "BF16":
        bits = bf16_bits(values)
    elif dtype == "F16":
        bits = values.astype("<f2").view("<u2")
    else:
        bits = values.view("<u4")
    return Tensor(dtype, shape, bits)


def training_step(rng, model, unchanged_probability=0.1):
    """The next export: in each tensor a random 1–5 % of elements move by ±1–2 ulp; now and then
    a tensor does not change at all (an empty delta item)."""
    out = {}
    for name, tensor in model.items():
        flat = tensor.bits.reshape(-1).astype(np.int64)
        if flat.size == 0 or rng.random() < unchanged_probability:
            out[name] = Tensor(tensor.dtype, tensor.shape, flat)
            continue
        _, width, max_magnitude = DTYPES[tensor.dtype]
        sign = 1 << (width - 1)
        count = max(1, int(round(rng.uniform(*DENSITY) * flat.size)))
        where = rng.choice(flat.size, size=count, replace=False)
        magnitude = flat[where] & (sign - 1)
        step = rng.choice([-2, -1, 1, 2], size=count, p=[0.1, 0.4, 0.4, 0.1])
        step = np.where(magnitude + step < 0, np.abs(step), step)
        step = np.where(magnitude + step > max_magnitude, -np.abs(step), step)
        flat[where] = (flat[where] & sign) | (magnitude + step)
        out[name] = Tensor(tensor.dtype, tensor.shape, flat)
    return out


def write_safetensors(path, tensors, version=0):
    """Write `tensors` (name -> Tensor, in this order) as a safetensors file."""
    header = {}
    offset = 0
    blobs = []
    for name, tensor in tensors.items():
        data = tensor.tobytes()
        header[name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    header["__metadata__"] = {"refit.version": str(version)}
    text = json.dumps(header, ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def as_bytes(tensors):
    return {name: t.tobytes() for name, t in tensors.items()}


def chunk_of_each(tensors, target):
    """The export chunk of each tensor, by the chunking rule of src/pipeline/chunking.h
    (Chunker) in canonical order (the file's)."""
    chunk, total, open_ = -1, 0, False
    for tensor in tensors.values():
        size = tensor.bits.nbytes
        # A tensor that would push a non-empty chunk over the target starts the next one.
        if not open_ or total + size > target:
            chunk, total, open_ = chunk + 1, 0, True
        total += size
        # Once the total reaches the target, the chunk closes.
        if total >= target:
            open_ = False
        yield chunk


def chunk_count(tensors, target):
    return max(chunk_of_each(tensors, target)) + 1


def changed_per_rank(old, new, target, world, anchor):
    """What each rank must report: (changed, elements) of the chunks it owns (chunk % W)."""
    out = [[0, 0] for _ in range(world)]
    for (name, tensor), chunk in zip(new.items(), chunk_of_each(new, target)):
        elements = tensor.bits.size
        changed = elements if anchor else int(np.count_nonzero(tensor.bits != old[name].bits))
        out[chunk % world][0] += changed
        out[chunk % world][1] += elements
    return out


# ---- Daemons ------------------------------------------------------------------------------

class Daemon:
    """One `refit serve` process; restartable on the same ports. `data_port` 0: the kernel
    chooses it at the first start (read back from the ready file), kept for restarts."""

    def __init__(self, refit, workdir, name, model, data_port, env, loader=None, replica=None):
        self.refit, self.workdir, self.name, self.model = refit, workdir, name, model
        self.data_port, self.env, self.loader, self.replica = data_port, env, loader, replica
        self.data = f"127.0.0.1:{data_port}"
        self.control_port = 0
        self.proc = None
        self.starts = 0

    def start(self):
        self.starts += 1
        ready = os.path.join(self.workdir, f"{self.name}.ready")
        # A kill -9 leaves the ready file behind: it must not announce the restarted process.
        if os.path.exists(ready):
            os.remove(ready)
        self.log_path = os.path.join(self.workdir, f"{self.name}.{self.starts}.log")
        log = open(self.log_path, "w")
        cmd = [self.refit, "serve", "--model", self.model, "--data-port", str(self.data_port),
               "--control-port", str(self.control_port),
               "--api-key-env", KEY_ENV, "--ready-file", ready]
        if self.loader:
            cmd += ["--loader", self.loader]
        if self.replica:
            cmd += ["--replica", self.replica]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        return ready

    def wait_ready(self, ready):
        deadline = time.time() + START_TIMEOUT_S
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon {self.name} exited {self.proc.returncode} at start: "
                                     f"{self.log_tail()}")
            if time.time() > deadline:
                raise AssertionError(f"daemon {self.name} not ready in {START_TIMEOUT_S} s")
            time.sleep(0.05)
        with open(ready) as f:
            info = json.load(f)
        self.url = info["control_url"]
        self.control_port = int(self.url.rsplit(":", 1)[1])
        check(self.data_port in (0, int(info["data_endpoint"].rsplit(":", 1)[1])),
              f"daemon {self.name} binds its data port {self.data_port}")
        self.data = info["data_endpoint"]
        self.data_port = int(self.data.rsplit(":", 1)[1])
        check(self.data_port != 0, f"daemon {self.name} reports the data port the kernel chose")

    def log_tail(self, chars=1500):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def get(self, path):
        request = urllib.request.Request(self.url + path,
                                         headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return reply.read(), reply.headers

    def status(self):
        return json.loads(self.get("/v1/status")[0])

    def tensor(self, name):
        body, headers = self.get("/v1/tensors/" + urllib.parse.quote(name, safe=""))
        return body, json.loads(headers["X-Refit-Shape"])

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=REQUEST_TIMEOUT_S)

    def stop(self):
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=REQUEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon {self.name} did not exit on SIGTERM")
        check(code == 0, f"daemon {self.name} exits 0 on SIGTERM")


class Fleet:
    """Daemons started independently: no --peers list, started in the reverse of the order the
    pushes list them. Every push names each transfer's relay
    tree (docs/protocol.md "Relay tree"), so no daemon needs to know the others."""

    def __init__(self, daemons):
        self.daemons = daemons
        readies = {d.name: d.start() for d in reversed(daemons)}
        for d in daemons:
            d.wait_ready(readies[d.name])

    def receiver_args(self, daemons=None):
        args = []
        for d in daemons if daemons is not None else self.daemons:
            args += ["--receiver", f"{d.url}={d.data}"]
        return args

    def wait_state(self, state, daemons=None, timeout=START_TIMEOUT_S, while_running=()):
        """Wait until every daemon (default: the live ones) reports `state`."""
        targets = daemons if daemons is not None else [d for d in self.daemons if d.alive()]
        deadline = time.time() + timeout
        while True:
            states = [d.status()["state"] for d in targets]
            if all(s == state for s in states):
                return
            for proc in while_running:
                if proc.poll() is not None:
                    raise AssertionError(f"a push exited ({proc.returncode}) while waiting for "
                                         f"the daemons to be {state}: they are {states}")
            if time.time() > deadline:
                raise AssertionError(f"daemons not {state} within {timeout} s: {states}")
            time.sleep(0.02)

    def stop(self):
        errors = []
        for d in self.daemons:
            try:
                d.stop()
            except AssertionError as error:
                errors.append(str(error))
        for d in self.daemons:
            if d.alive():
                d.proc.kill()
                d.proc.wait()
        if errors:
            raise AssertionError("; ".join(errors))


# ---- Pushes -------------------------------------------------------------------------------

class Push:
    """W `refit push` processes of one producer group (or one process with --producers)."""

    def __init__(self, ctx, label, checkpoint, base, world, receivers, config=None,
                 transports=None, threads_world=None, group=True, timeout=PUSH_TIMEOUT_S):
        self.label, self.world, self.timeout = label, world, timeout
        port = free_port()
        self.procs, self.logs = [], []
        for rank in range(world):
            cmd = [ctx.refit, "push", checkpoint, "--api-key-env", KEY_ENV, "--json",
                   "--timeout", str(timeout)]
            if base:
                cmd += ["--base", base]
            if config:
                cmd += ["--config", config]
            if group:
                cmd += ["--group", f"tcp://127.0.0.1:{port}", "--rank", str(rank),
                        "--world-size", str(world)]
            if threads_world:
                cmd += ["--producers", str(threads_world)]
            if rank == 0:
                cmd += receivers
            if transports and rank in transports:
                cmd += ["--transport", transports[rank]]
            tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
            out = os.path.join(ctx.workdir, f"push.{tag}.r{rank}.out")
            err = os.path.join(ctx.workdir, f"push.{tag}.r{rank}.err")
            self.logs.append((out, err))
            with open(out, "w") as o, open(err, "w") as e:
                self.procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, env=ctx.env))
        self.started = time.time()

    def wait(self):
        """Wait for every rank; return [(returncode, stdout, stderr, exit time)]."""
        results = []
        deadline = self.started + self.timeout + PUSH_EXIT_SLACK_S
        for proc, (out, err) in zip(self.procs, self.logs):
            try:
                proc.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                raise AssertionError(f"push {self.label}: a rank still runs "
                                     f"{self.timeout + PUSH_EXIT_SLACK_S} s after the start")
            with open(out) as o, open(err) as e:
                results.append([proc.returncode, o.read(), e.read()])
        return results

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def json_line(stdout):
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def check_caught_up(results, label, anchors, receivers):
    """Rank 0's report: `anchors` receivers caught up by an anchor of their own, the others by
    the delta, and each anchor's bytes larger than every delta receiver's."""
    line = json_line(results[0][1]) or {}
    commits = line.get("commits", [])
    how = [c.get("caught_up_by") for c in commits]
    check(len(commits) == receivers and how.count("anchor") == anchors
          and how.count("delta") == receivers - anchors,
          f"{label}: {anchors} receiver(s) caught up by an anchor alone, the others by the delta",
          str(commits))
    anchor_bytes = [c["wire_bytes"] for c in commits if c.get("caught_up_by") == "anchor"]
    delta_bytes = [c["wire_bytes"] for c in commits if c.get("caught_up_by") == "delta"]
    check(not anchor_bytes or not delta_bytes or min(anchor_bytes) > max(delta_bytes),
          f"{label}: the members' payloads stay delta-sized", str(commits))


def check_committed(results, label, kind, version, receivers, world, shares=None):
    """Every rank exited 0; rank 0 reports the commit; with `shares` (changed_per_rank), each
    rank ≥ 1 reports exactly the changed and total elements of the chunks it owns, and rank 0
    the whole model's."""
    for rank, (code, out, err) in enumerate(results):
        check(code == 0, f"{label}: rank {rank} of {world} exits 0", f"{out[-400:]}{err[-1500:]}")
    line = json_line(results[0][1])
    check(line is not None and line["kind"] == kind and line["version"] == version
          and line["receivers"] == receivers and line["world_size"] == world
          and all(c["committed"] for c in line["commits"]),
          f"{label}: rank 0 reports a committed {kind} to v{version} on {receivers} receivers "
          f"from {world} rank(s)", str(line))
    if shares is not None:
        total = [sum(s[0] for s in shares), sum(s[1] for s in shares)]
        check([line["changed"], line["elements"]] == total,
              f"{label}: rank 0 reports {total[0]} changed of {total[1]} elements, as numpy "
              f"counts them", str(line))
    for rank in range(1, len(results)):
        other = json_line(results[rank][1])
        check(other is not None and other["rank"] == rank and other["version"] == version
              and other["kind"] == kind,
              f"{label}: rank {rank} reports its share of the {kind} to v{version}", str(other))
        if shares is not None:
            check([other["changed"], other["elements"]] == shares[rank],
                  f"{label}: rank {rank} sent exactly the chunks it owns ({shares[rank][0]} "
                  f"changed of {shares[rank][1]} elements)", str(other))
    return line


class Context:
    def __init__(self, refit, workdir):
        self.refit, self.workdir = refit, workdir
        self.env = dict(os.environ, **{KEY_ENV: API_KEY})
        # Checks that failed without stopping the test (the ones after them still mean
        # something); reported at the end.
        self.failures = []
        self.chunk_config = os.path.join(workdir, "chunks.yaml")
        with open(self.chunk_config, "w") as f:
            f.write(f"delta_compression:\n  export_chunk_bytes: {CHUNK_BYTES}\n")


def check_fleet_holds(daemons, expected, version, label):
    """Every daemon idle at `version`, every tensor's bytes equal to `expected[name]`."""
    for d in daemons:
        status = d.status()
        check(status["state"] == "idle" and status["version"] == version,
              f"{label}: {d.name} is idle at v{version} ({status['state']}, v{status['version']})")
        wrong = [name for name, data in expected.items() if d.tensor(name)[0] != data]
        check(not wrong, f"{label}: every tensor of {d.name} equals the expected bytes "
                         f"(wrong: {wrong[:5]})")


# ---- 1 and 2: processes, and kill -9 of a rank -------------------------------------------

def model_a(rng):
    """~240 KiB in 8 export chunks of CHUNK_BYTES, odd names included."""
    spec = [
        ("model.embed_tokens.weight", "BF16", (256, 96)),
        ("model.layers.0.self_attn.q_proj.weight", "BF16", (96, 96)),
        ("layer 0 / attn.k proj (odd)", "BF16", (32, 96)),
        ("model.layers.0.mlp.up_proj.weight", "BF16", (192, 96)),
        ("ünïcødé.层.权重", "BF16", (64, 64)),
        ("name with  two spaces. and.dots..weight", "BF16", (128, 64)),
        ("percent%2F & ?query=#frag", "F32", (512,)),
        ("emoji 🚀.norm", "F32", (96,)),
        ("model.layers.1.mlp.down_proj.weight", "BF16", (96, 192)),
        ("fp16.tensor", "F16", (100, 50)),
        ("model.norm.weight", "BF16", (96,)),
        ("lm_head.weight", "BF16", (256, 96)),
        ("model.logit_scale", "F32", ()),
    ]
    return {name: random_tensor(rng, dtype, shape) for name, dtype, shape in spec}


def model_b(rng):
    """Exactly 2 export chunks of CHUNK_BYTES (the first tensor fills chunk 0 exactly)."""
    spec = [
        ("blk.0 weight ✓", "BF16", (128, 128)),
        ("blk.1.weight", "BF16", (64, 128)),
        ("blk.1 bias (odd)", "F32", (128,)),
        ("ñ.norm", "BF16", (128,)),
    ]
    return {name: random_tensor(rng, dtype, shape) for name, dtype, shape in spec}


def write_steps(workdir, prefix, first, rng, count):
    steps = [first]
    for _ in range(count - 1):
        steps.append(training_step(rng, steps[-1]))
    paths = []
    for index, step in enumerate(steps):
        path = os.path.join(workdir, f"{prefix}_{index:02d}.safetensors")
        write_safetensors(path, step)
        paths.append(path)
    return steps, paths


def test_process_groups(ctx, rng):
    first = model_a(rng)
    check(chunk_count(first, CHUNK_BYTES) == 8, "model A spans 8 export chunks")
    # 4 group sizes × (FULL, delta) and 3 steps of the kill tests.
    steps, paths = write_steps(ctx.workdir, "a", first, rng, 12)
    expected = [as_bytes(s) for s in steps]
    # Daemon a1 binds port 0: the kernel's choice, as `refit serve` does by default.
    ports = [free_port(), 0]
    daemons = [Daemon(ctx.refit, ctx.workdir, f"a{i}", paths[0], ports[i], ctx.env)
               for i in range(2)]
    fleet = Fleet(daemons)
    try:
        receivers = fleet.receiver_args()
        check_fleet_holds(daemons, expected[0], 0, "fleet A at start")
        step = 0
        for world in (1, 2, 3, 4):
            for kind in ("full", "delta"):
                step += 1
                base = paths[step - 1] if kind == "delta" else None
                label = f"W={world} processes, {kind} step {step}"
                push = Push(ctx, f"a{step}", paths[step], base, world, receivers,
                            config=ctx.chunk_config)
                shares = changed_per_rank(steps[step - 1], steps[step], CHUNK_BYTES, world,
                                          kind == "full")
                check_committed(push.wait(), label, kind, step, 2, world, shares)
                check_fleet_holds(daemons, expected[step], step, label)
        test_kill_rank(ctx, fleet, steps, paths, step)
    finally:
        fleet.stop()


def kill_rank_1(ctx, fleet, label, checkpoint, base, base_version, expected_base):
    """Push with 3 ranks, rank 1 slowed, and kill -9 rank 1 once the daemons are receiving."""
    slow = f"fault+zmq://?delay_ms={SLOW_SEND_MS}"
    push = Push(ctx, label, checkpoint, base, 3, fleet.receiver_args(), config=ctx.chunk_config,
                transports={1: slow})
    try:
        fleet.wait_state("receiving", while_running=push.procs)
        time.sleep(0.3)
        check(push.procs[1].poll() is None, f"{label}: rank 1 still streams (its sends wait "
                                            f"{SLOW_SEND_MS} ms) when it is killed")
        push.procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        results = push.wait()
    finally:
        push.kill()
    check(results[1][0] == -signal.SIGKILL, f"{label}: rank 1 died of SIGKILL")
    for rank in (0, 2):
        code, out, err = results[rank]
        reason = err.strip().splitlines()[-1] if err.strip() else ""
        check(code != 0 and re.search(r"rank 1|abort", reason, re.IGNORECASE) is not None,
              f"{label}: rank {rank} exits non-zero ({code}) naming rank 1 or the abort: "
              f"{reason[:300]}", err[-1500:])
    elapsed = time.time() - killed_at
    check(elapsed < PUSH_TIMEOUT_S, f"{label}: ranks 0 and 2 gave up {elapsed:.1f} s after the "
                                    f"kill, within the transfer timeout of {PUSH_TIMEOUT_S} s")
    fleet.wait_state("idle")
    check_fleet_holds(fleet.daemons, expected_base, base_version,
                      f"{label}: after the abort, rolled back")


def test_kill_rank(ctx, fleet, steps, paths, step):
    expected = [as_bytes(s) for s in steps]
    # Rank 1 of 3 owns chunks 1, 4 and 7 of model A.
    label = f"kill -9 rank 1 of 3, delta step {step + 1}"
    kill_rank_1(ctx, fleet, label, paths[step + 1], paths[step], step, expected[step])
    step += 1
    push = Push(ctx, f"a{step}-again", paths[step], paths[step - 1], 3, fleet.receiver_args(),
                config=ctx.chunk_config)
    label = f"the same step {step} with rank 1 restarted (3 fresh processes)"
    shares = changed_per_rank(steps[step - 1], steps[step], CHUNK_BYTES, 3, False)
    check_committed(push.wait(), label, "delta", step, 2, 3, shares)
    check_fleet_holds(fleet.daemons, expected[step], step, label)

    label = f"kill -9 rank 1 of 3, delta step {step + 1}"
    kill_rank_1(ctx, fleet, label + " (again)", paths[step + 1], paths[step], step,
                expected[step])
    step += 1
    push = Push(ctx, f"a{step}-dropped", paths[step], paths[step - 1], 2, fleet.receiver_args(),
                config=ctx.chunk_config)
    label = f"step {step} with the killed rank dropped (W = 2 processes)"
    shares = changed_per_rank(steps[step - 1], steps[step], CHUNK_BYTES, 2, False)
    check_committed(push.wait(), label, "delta", step, 2, 2, shares)
    check_fleet_holds(fleet.daemons, expected[step], step, label)


def test_few_chunks(ctx, rng):
    first = model_b(rng)
    check(chunk_count(first, CHUNK_BYTES) == 2, "model B is exactly 2 export chunks")
    check(chunk_count(first, DEFAULT_CHUNK_BYTES) == 1, "and one chunk at the default target")
    steps, paths = write_steps(ctx.workdir, "b", first, rng, 8)
    expected = [as_bytes(s) for s in steps]
    ports = free_ports(2)
    daemons = [Daemon(ctx.refit, ctx.workdir, f"b{i}", paths[0], ports[i], ctx.env)
               for i in range(2)]
    fleet = Fleet(daemons)
    try:
        receivers = fleet.receiver_args()
        runs = [
            # W = 8 on 2 chunks: ranks 2–7 own nothing.
            ("W=8 processes on 2 chunks", "full", 8, ctx.chunk_config, False),
            ("W=8 processes on 2 chunks", "delta", 8, ctx.chunk_config, False),
            # Below one chunk: rank 1 owns nothing, as threads and as processes.
            ("W=2 threads below one chunk", "full", 2, None, True),
            ("W=2 threads below one chunk", "delta", 2, None, True),
            ("W=2 processes below one chunk", "delta", 2, None, False),
            ("W=2 processes below one chunk", "full", 2, None, False),
            ("W=2 processes below one chunk", "delta", 2, None, False),
        ]
        for step, (what, kind, world, config, threads) in enumerate(runs, start=1):
            base = paths[step - 1] if kind == "delta" else None
            label = f"{what}, {kind} step {step}"
            if threads:
                push = Push(ctx, f"b{step}", paths[step], base, 1, receivers, config=config,
                            threads_world=world, group=False)
            else:
                push = Push(ctx, f"b{step}", paths[step], base, world, receivers, config=config)
            shares = changed_per_rank(steps[step - 1], steps[step],
                                      CHUNK_BYTES if config else DEFAULT_CHUNK_BYTES, world,
                                      kind == "full")
            # With threads only rank 0 prints: its totals are checked.
            results = push.wait()
            check_committed(results, label, kind, step, 2, world, shares)
            if not threads:
                idle = [r for r in range(world) if shares[r][1] == 0]
                check(len(idle) == world - (2 if config else 1),
                      f"{label}: ranks {idle} own no chunk and still took part")
            check_fleet_holds(daemons, expected[step], step, label)
    finally:
        fleet.stop()


# ---- 3 and 4: tensor-parallel shard groups ----------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, PAD_TO, LAYERS = 64, 8, 2, 8, 128, 100, 8, 2
# The most bytes a TP 4 (TP 2) shard may be sent per push, as a fraction of the unsharded
# daemon's: about 1/TP of the items, plus the payload and item headers every class pays on a
# model this small (measured for the deltas: TP 4 0.44-0.48, TP 2 0.63-0.65; unrouted, a shard
# would be sent all of it, 1.0). A benchmark measures the ratio at a real size: e2e_bench's tp
# section. Anchors are not checked here: anchor_compression auto sends some of each route's
# payloads raw, as it measures, so their shares depend on timing (node_test checks an anchor's
# routes exactly).
ROUTED_TP4_MAX, ROUTED_TP2_MAX = 0.6, 0.8
# A recognisable bf16 pattern (1.0) in the padding rows of vocabulary shards: never written.
PADDING_BITS = 0x3F80
ODD_NAME = "model.ünï scale (odd)"

LOADER_RULES = r"""rules:
  - kind: qkv
    q: 'model\.layers\.(\d+)\.self_attn\.q_proj\.weight'
    k: 'model\.layers\.(\d+)\.self_attn\.k_proj\.weight'
    v: 'model\.layers\.(\d+)\.self_attn\.v_proj\.weight'
    to: 'model.layers.$1.self_attn.qkv_proj.weight'
    num_heads: {heads}
    num_kv_heads: {kv_heads}
  - kind: gate_up
    gate: 'model\.layers\.(\d+)\.mlp\.gate_proj\.weight'
    up: 'model\.layers\.(\d+)\.mlp\.up_proj\.weight'
    to: 'model.layers.$1.mlp.gate_up_proj.weight'
  - {{kind: column, match: 'model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight'}}
  - kind: vocab
    match: 'model\.embed_tokens\.weight|lm_head\.weight'
    vocab_size: {vocab}
    pad_to: {pad_to}
  - {{kind: identity, match: 'model\.layers\.\d+\.input_layernorm\.weight'}}
"""


def llama(rng):
    model = {"model.embed_tokens.weight": random_tensor(rng, "BF16", (VOCAB, HIDDEN))}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        model[p + "input_layernorm.weight"] = random_tensor(rng, "BF16", (HIDDEN,), 1.0)
        model[p + "self_attn.q_proj.weight"] = random_tensor(rng, "BF16",
                                                             (HEADS * HEAD_DIM, HIDDEN))
        model[p + "self_attn.k_proj.weight"] = random_tensor(rng, "BF16",
                                                             (KV_HEADS * HEAD_DIM, HIDDEN))
        model[p + "self_attn.v_proj.weight"] = random_tensor(rng, "BF16",
                                                             (KV_HEADS * HEAD_DIM, HIDDEN))
        model[p + "self_attn.o_proj.weight"] = random_tensor(rng, "BF16",
                                                             (HIDDEN, HEADS * HEAD_DIM))
        model[p + "mlp.gate_proj.weight"] = random_tensor(rng, "BF16", (INTERMEDIATE, HIDDEN))
        model[p + "mlp.up_proj.weight"] = random_tensor(rng, "BF16", (INTERMEDIATE, HIDDEN))
        model[p + "mlp.down_proj.weight"] = random_tensor(rng, "BF16", (HIDDEN, INTERMEDIATE))
    model["model.norm.weight"] = random_tensor(rng, "BF16", (HIDDEN,), 1.0)
    model[ODD_NAME] = random_tensor(rng, "F32", (8,), 1.0)
    model["lm_head.weight"] = random_tensor(rng, "BF16", (VOCAB, HIDDEN))
    return model


def padded_vocab(tp):
    """loader.h kVocab: V rounded up to a multiple of pad_to × TP."""
    multiple = PAD_TO * tp
    return -(-VOCAB // multiple) * multiple


def shard(model, rank, tp):
    """The local tensors of TP rank `rank`, sliced from the canonical ones with numpy."""
    local = {}
    q_rows = HEADS // tp * HEAD_DIM
    if KV_HEADS >= tp:
        kv_begin, kv_rows = rank * (KV_HEADS // tp) * HEAD_DIM, KV_HEADS // tp * HEAD_DIM
    else:  # each kv head replicated on tp / kv_heads consecutive ranks
        kv_begin, kv_rows = rank // (tp // KV_HEADS) * HEAD_DIM, HEAD_DIM
    rows = padded_vocab(tp) // tp
    for name, tensor in model.items():
        bits = tensor.bits
        m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight", name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = np.full((rows, HIDDEN), PADDING_BITS, dtype=np.uint16)
            real = bits[rank * rows:min((rank + 1) * rows, VOCAB)]
            part[:real.shape[0]] = real
            local[name] = Tensor("BF16", part.shape, part)
        elif m and m.group(3) == "q_proj":
            p = f"model.layers.{m.group(1)}.self_attn."
            fused = np.concatenate([
                model[p + "q_proj.weight"].bits[rank * q_rows:(rank + 1) * q_rows],
                model[p + "k_proj.weight"].bits[kv_begin:kv_begin + kv_rows],
                model[p + "v_proj.weight"].bits[kv_begin:kv_begin + kv_rows]])
            local[p + "qkv_proj.weight"] = Tensor("BF16", fused.shape, fused)
        elif m and m.group(3) == "gate_proj":
            p = f"model.layers.{m.group(1)}.mlp."
            block = INTERMEDIATE // tp
            fused = np.concatenate([
                model[p + "gate_proj.weight"].bits[rank * block:(rank + 1) * block],
                model[p + "up_proj.weight"].bits[rank * block:(rank + 1) * block]])
            local[p + "gate_up_proj.weight"] = Tensor("BF16", fused.shape, fused)
        elif m and m.group(3) in ("o_proj", "down_proj"):
            cols = bits.shape[1] // tp
            part = bits[:, rank * cols:(rank + 1) * cols]
            local[name] = Tensor("BF16", part.shape, part)
        elif m and m.group(3) in ("k_proj", "v_proj", "up_proj"):
            continue  # fused above
        else:  # norms and the odd tensor: identity
            local[name] = tensor
    return local


class TpFleet:
    """tp2 (2 shards), tp4 (4 shards) and one unsharded daemon, each started on its own; the
    pushes list the unsharded daemon first, then tp4, then tp2."""

    def __init__(self, ctx, canonical):
        self.ctx = ctx
        self.shard_files = {}
        ports = free_ports(7)
        full_model = os.path.join(ctx.workdir, "tp_full_00.safetensors")
        write_safetensors(full_model, canonical)
        self.full = Daemon(ctx.refit, ctx.workdir, "full", full_model, ports[0], ctx.env)
        self.shards = {2: [], 4: []}
        index = 1
        for tp in (4, 2):
            for rank in range(tp):
                name = f"tp{tp}r{rank}"
                model = os.path.join(ctx.workdir, f"{name}_00.safetensors")
                write_safetensors(model, shard(canonical, rank, tp))
                loader = os.path.join(ctx.workdir, f"{name}.loader.yaml")
                with open(loader, "w") as f:
                    f.write(f"tp_rank: {rank}\ntp_size: {tp}\n")
                    f.write(LOADER_RULES.format(heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB,
                                                pad_to=PAD_TO))
                self.shards[tp].append(Daemon(ctx.refit, ctx.workdir, name, model, ports[index],
                                              ctx.env, loader=loader, replica=f"tp{tp}"))
                index += 1
        self.fleet = Fleet([self.full] + self.shards[4] + self.shards[2])

    def check_routed(self, label, check_shares=True):
        """Routing by holdings, from each daemon's own counters (GET /v1/status
        received_bytes): in the push just made, every shard was sent only its class's cut — a
        TP 4 shard at most ROUTED_TP4_MAX of the unsharded daemon's bytes, a TP 2 shard at most
        ROUTED_TP2_MAX — and something (every shard holds a part of every changed tensor)."""
        received = {d.name: d.status()["received_bytes"] for d in self.fleet.daemons}
        last = getattr(self, "_received", {name: 0 for name in received})
        sent = {name: received[name] - last[name] for name in received}
        self._received = received
        if not check_shares:
            return
        full = sent[self.full.name]
        check(full > 0, f"{label}: the unsharded daemon was sent payloads ({full} bytes)")
        for tp, shards in self.shards.items():
            ratios = [sent[d.name] / full for d in shards]
            limit = ROUTED_TP4_MAX if tp == 4 else ROUTED_TP2_MAX
            check(all(0 < r <= limit for r in ratios),
                  f"{label}: each TP {tp} shard was sent only its cut: "
                  f"{', '.join(f'{r:.2f}' for r in ratios)} of the unsharded daemon's bytes "
                  f"(at most {limit})")

    def check_holds(self, canonical, version, label, daemons=None):
        targets = daemons if daemons is not None else [d for d in self.fleet.daemons if d.alive()]
        for d in targets:
            status = d.status()
            check(status["state"] == "idle" and status["version"] == version,
                  f"{label}: {d.name} is idle at v{version} "
                  f"({status['state']}, v{status['version']})")
            if d is self.full:
                expected = canonical
            else:
                tp = int(status["shards"])
                check(status["replica"] == f"tp{tp}" and status["shard"] == int(d.name[-1]),
                      f"{label}: {d.name} reports replica tp{tp} shard {d.name[-1]} of {tp}")
                expected = shard(canonical, status["shard"], tp)
            wrong = []
            for name, tensor in expected.items():
                data, shape = d.tensor(name)
                if data != tensor.tobytes() or tuple(shape) != tensor.shape:
                    wrong.append(name)
            check(not wrong, f"{label}: every local tensor of {d.name} equals the numpy slice "
                             f"of the canonical step (padding untouched; wrong: {wrong[:4]})")


def test_tensor_parallel(ctx, rng):
    first = llama(rng)
    steps, paths = write_steps(ctx.workdir, "tp", first, rng, 7)
    check(padded_vocab(2) == 112 and padded_vocab(4) == 128,
          "the vocabulary pads to 112 rows at TP 2 and 128 at TP 4")
    tp = TpFleet(ctx, first)
    fleet = tp.fleet
    try:
        tp.check_holds(steps[0], 0, "shard files as loaded")
        receivers = fleet.receiver_args()
        check(chunk_count(first, CHUNK_BYTES) == 6, "the Llama-like model spans 6 export chunks")
        runs = [("full", 1, None, False), ("delta", 2, ctx.chunk_config, True),
                ("delta", 2, ctx.chunk_config, False)]
        for step, (kind, world, config, threads) in enumerate(runs, start=1):
            label = (f"TP fleet, {kind} step {step} from W={world} "
                     f"{'threads' if threads else 'processes'}")
            base = paths[step - 1] if kind == "delta" else None
            if threads:
                push = Push(ctx, f"tp{step}", paths[step], base, 1, receivers, config=config,
                            threads_world=world, group=False)
            else:
                push = Push(ctx, f"tp{step}", paths[step], base, world, receivers, config=config)
            shares = changed_per_rank(steps[step - 1], steps[step],
                                      CHUNK_BYTES if config else DEFAULT_CHUNK_BYTES, world,
                                      kind == "full")
            check_committed(push.wait(), label, kind, step, 7, world, shares)
            tp.check_holds(steps[step], step, label)
            # An anchor's payloads go compressed or raw as anchor_compression auto measures
            # them, per route: its byte shares depend on timing, a delta's do not.
            tp.check_routed(label, check_shares=kind == "delta")
        test_kill_shard(ctx, tp, steps, paths, 3)
    finally:
        fleet.stop()


def kill_shard(ctx, tp, label, checkpoint, base, base_version, canonical_base):
    """Push slowly, kill -9 shard 1 of the TP = 2 replica once the daemons are receiving."""
    victim = tp.shards[2][1]
    slow = f"fault+zmq://?delay_ms={SLOW_SEND_MS}&timeout_ms={DEAD_RELAY_ACK_TIMEOUT_MS}"
    push = Push(ctx, label, checkpoint, base, 1, tp.fleet.receiver_args(),
                transports={0: slow})
    try:
        tp.fleet.wait_state("receiving", while_running=push.procs)
        victim.kill9()
        killed_at = time.time()
        (code, out, err), = push.wait()
    finally:
        push.kill()
    reason = err.strip().splitlines()[-1] if err.strip() else ""
    check(code != 0, f"{label}: the push fails ({code}): {reason[:400]}", err[-1500:])
    elapsed = time.time() - killed_at
    check(elapsed < PUSH_TIMEOUT_S, f"{label}: within the transfer timeout ({elapsed:.1f} s)")
    tp.fleet.wait_state("idle")
    tp.check_holds(canonical_base, base_version, f"{label}: survivors rolled back")


def test_kill_shard(ctx, tp, steps, paths, step):
    victim = tp.shards[2][1]
    label = f"kill -9 of {victim.name} during step {step + 1}"
    kill_shard(ctx, tp, label, paths[step + 1], paths[step], step, steps[step])

    # (a) The killed shard comes back from its original shard file: version 0, behind the
    # others. Each Sync asks every receiver where it stands: the others get the delta and it an
    # anchor of its own, which a receiver takes at any version (per-receiver plans).
    victim.wait_ready(victim.start())
    tp.check_holds(steps[0], 0, f"{victim.name} restarted from its shard file", [victim])
    push = Push(ctx, f"tp{step + 1}-rejoined", paths[step + 1], paths[step], 1,
                tp.fleet.receiver_args())
    results = push.wait()
    label = f"step {step + 1} with {victim.name} back at version 0"
    check_committed(results, label, "delta", step + 1, 7, 1)
    check_caught_up(results, label, anchors=1, receivers=7)
    step += 1
    tp.check_holds(steps[step], step, label)
    # (b) The fleet changes between pushes: the unsharded daemon, the first of every tree so far,
    # is left out of the next push. Its tree is named per transfer, so no payload crosses it, and
    # it stays where it was.
    others = tp.shards[4] + tp.shards[2]
    push = Push(ctx, f"tp{step + 1}-without-full", paths[step + 1], paths[step], 1,
                tp.fleet.receiver_args(others))
    label = f"step {step + 1} without {tp.full.name}"
    check_committed(push.wait(), label, "delta", step + 1, len(others), 1)
    tp.check_holds(steps[step + 1], step + 1, label, others)
    tp.check_holds(steps[step], step, f"{label}: {tp.full.name} left as it was", [tp.full])
    # (c) It joins again, one version behind the others: it alone gets an anchor.
    push = Push(ctx, f"tp{step + 2}-full-rejoins", paths[step + 2], paths[step + 1], 1,
                tp.fleet.receiver_args())
    label = f"step {step + 2} with {tp.full.name} back"
    results = push.wait()
    check_committed(results, label, "delta", step + 2, 7, 1)
    check_caught_up(results, label, anchors=1, receivers=7)
    tp.check_holds(steps[step + 2], step + 2, label)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--refit", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--only", choices=["groups", "chunks", "tp"], default=None,
                        help="run one part (for debugging)")
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    ctx = Context(os.path.abspath(args.refit), args.workdir)
    started = time.time()
    parts = [("groups", test_process_groups), ("chunks", test_few_chunks),
             ("tp", test_tensor_parallel)]
    for index, (name, part) in enumerate(parts):
        if args.only not in (None, name):
            continue
        # The parts use fleets of their own: one that fails does not stop the next.
        try:
            part(ctx, np.random.default_rng(1000 + index))
        except AssertionError as error:
            ctx.failures.append(f"[{name}] {error}")
            print(f"FAILED: part '{name}' stopped: {error}", flush=True)
    print(f"publisher_fleet: finished in {time.time() - started:.0f} s", flush=True)
    if ctx.failures:
        raise AssertionError(f"{len(ctx.failures)} check(s) failed:\n  " +
                             "\n  ".join(ctx.failures))
    print(f"publisher_fleet: all checks passed in {time.time() - started:.0f} s")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        sys.exit(1)
