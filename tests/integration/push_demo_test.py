#!/usr/bin/python3
"""The trainer-side commands against real daemons: `refit push` and `refit demo`.

Two `refit serve` daemons load the same checkpoint and form one relay tree. Then:
  * `refit push NEW --base OLD` commits a delta on both; every tensor served over HTTP equals
    NEW's bytes (read with numpy from the file, independently of the C++ reader);
  * a second push (--json, through a --config file) moves both to the next version;
  * a push against the wrong base is refused at prepare, naming the fingerprint of the version
    the daemons hold and the base's (docs/protocol.md "Lineage and fencing"), and both daemons
    stay at their version with unchanged bytes;
  * a push without the key is refused, and so is a push to a fleet with a receiver down;
  * an anchor push (no --base) sends every element;
  * `refit demo --json` runs a multi-producer, multi-daemon demo whose every step is verified.
Run with Debian's /usr/bin/python3 (python3-numpy).
"""
import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from ports import free_port

KEY_ENV = "REFIT_PUSH_TEST_KEY"
API_KEY = "push-" + secrets.token_hex(12)
TIMEOUT_S = 120


def check(condition, message):
    if not condition:
        raise AssertionError(message)
    print(f"ok: {message}")


def run(cmd, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def read_safetensors(path):
    """name -> raw bytes of every tensor, parsed here from the format's definition."""
    with open(path, "rb") as f:
        data = f.read()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = data[base + begin:base + end]
    return out


def read_safetensors_header(path):
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, raw bytes), written by the format's definition."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _, _, data in tensors.values():
            f.write(data)


def shard_checkpoint(path, files, rank, world, workdir):
    """Rank `rank` of `world`'s rows (torch.chunk over dim 0) of every tensor of the checkpoint at
    `path`: its local safetensors and its layout file."""
    header = read_safetensors_header(path)
    width = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1}
    local, layout = {}, []
    for name, info in sorted(header.items()):
        shape, data = info["shape"], files[name]
        rows = shape[0] if shape else 1
        row_bytes = len(data) // rows if rows else 0
        size = -(-rows // world)
        begin = min(rows, rank * size)
        end = min(rows, begin + size)
        extent = ([end - begin] + shape[1:]) if shape else []
        local[name] = (info["dtype"], extent, data[begin * row_bytes:end * row_bytes] if shape else data)
        assert not shape or row_bytes % width[info["dtype"]] == 0
        layout.append({"tensor": name, "dtype": info["dtype"].lower().replace("bf16", "bfloat16")
                       .replace("f32", "float32").replace("f16", "float16"),
                       "shape": shape, "offset": ([begin] + [0] * (len(shape) - 1)) if shape else [],
                       "extent": extent})
    checkpoint = os.path.join(workdir, f"rank{rank}.safetensors")
    write_safetensors(checkpoint, local)
    layout_file = os.path.join(workdir, f"rank{rank}.layout.json")
    with open(layout_file, "w") as f:
        json.dump(layout, f)
    return checkpoint, layout_file, layout


class Daemon:
    def __init__(self, refit, workdir, index, model, data_port, peers, env):
        self.ready = os.path.join(workdir, f"d{index}.ready")
        self.log = open(os.path.join(workdir, f"d{index}.log"), "w")
        self.control_port = free_port()
        self.data = f"127.0.0.1:{data_port}"
        self.proc = subprocess.Popen(
            [refit, "serve", "--model", model, "--data-port", str(data_port), "--control-port",
             str(self.control_port), "--peers", ",".join(peers), "--api-key-env", KEY_ENV,
             "--ready-file", self.ready], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + TIMEOUT_S
        while not os.path.exists(self.ready):
            check(self.proc.poll() is None, f"daemon {index} is running")
            if time.time() > deadline:
                raise AssertionError(f"daemon {index} not ready")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.control_port}"

    def get(self, path):
        request = urllib.request.Request(self.url + path,
                                         headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            return reply.read(), reply.headers

    def status(self):
        return json.loads(self.get("/v1/status")[0])

    def tensors(self, names):
        return {name: self.get(f"/v1/tensors/{name}")[0] for name in names}

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        check(self.proc.wait(timeout=30) == 0, f"daemon on {self.data} exits 0 on SIGTERM")
        self.log.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--refit", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    env = dict(os.environ, **{KEY_ENV: API_KEY})

    ck = os.path.join(args.workdir, "ck")
    result = run([args.refit, "simulate", "-o", ck, "--checkpoints", "4", "--model-bytes", "4MiB",
                  "--density", "0.03"])
    check(result.returncode == 0, f"simulate wrote checkpoints: {result.stderr}")
    steps = sorted(os.path.join(ck, f) for f in os.listdir(ck))
    files = [read_safetensors(p) for p in steps]
    names = sorted(files[0])

    ports = [free_port(), free_port()]
    peers = [f"127.0.0.1:{p}" for p in ports]
    daemons = [Daemon(args.refit, args.workdir, i, steps[0], ports[i], peers, env)
               for i in range(2)]
    receivers = []
    for d in daemons:
        receivers += ["--receiver", f"{d.url}={d.data}"]
    try:
        push = [args.refit, "push", "--api-key-env", KEY_ENV] + receivers
        result = run(push + [steps[1], "--base", steps[0]], env=env)
        check(result.returncode == 0, f"delta push of step 1: {result.stdout}{result.stderr}")
        check("as a delta v0 -> v1 to 2 receiver(s)" in result.stdout, "push reports the delta")
        for d in daemons:
            check(d.status()["version"] == 1, "daemon at version 1")
            check(d.tensors(names) == files[1], "every served tensor equals step 1's bytes")

        config = os.path.join(args.workdir, "fleet.yaml")
        with open(config, "w") as f:
            f.write(f"http_refit_api_key_env_var: {KEY_ENV}\nreceivers:\n")
            for d in daemons:
                f.write(f"  - {{control: {d.url}, data: {d.data}}}\n")
        result = run([args.refit, "push", steps[2], "--base", steps[1], "--config", config,
                      "--json"], env=env)
        check(result.returncode == 0, f"push through --config: {result.stderr}")
        line = json.loads(result.stdout)
        check(line["kind"] == "delta" and line["version"] == 2 and line["receivers"] == 2,
              f"JSON line reports the delta to version 2: {line}")
        check(0 < line["changed"] < line["elements"] // 10, "a 3 % step changes a few elements")
        check(all(c["committed"] for c in line["commits"]), "every receiver confirmed the commit")
        before = [d.tensors(names) for d in daemons]
        check(all(b == files[2] for b in before), "every served tensor equals step 2's bytes")

        # `refit serve` reads the same file; a flag that names a key wins over it and is checked
        # as the key is, and an error names the flag (or the file, line and key). Both are refused
        # before anything listens.
        bad = os.path.join(args.workdir, "bad-depth.yaml")
        with open(bad, "w") as f:
            f.write(f"server:\n  model: {steps[0]}\ntuning:\n  apply_queue_depth: 0\n")
        result = run([args.refit, "serve", "--config", bad], env=env)
        check(result.returncode != 0 and "bad-depth.yaml:4:3: tuning.apply_queue_depth: 0 is outside"
              in result.stderr, f"serve names the file's bad key: {result.stderr[:300]}")
        result = run([args.refit, "serve", "--config", config, "--model", steps[0],
                      "--apply-queue-depth", "0"], env=env)
        check(result.returncode != 0 and "--apply-queue-depth (tuning.apply_queue_depth): 0 is outside"
              in result.stderr, f"serve names the flag over the file: {result.stderr[:300]}")

        result = run(push + [steps[3], "--base", steps[1]], env=env)
        check(result.returncode != 0 and "FailedPrecondition" in result.stderr
              and "would reuse version 3 with other contents" in result.stderr
              and "refit push --base FILE" in result.stderr,
              f"a push against the wrong base is refused saying the base differs: "
              f"{result.stderr[:600]}")
        check(not [l for l in result.stderr.splitlines() if "[warning]" in l and "failed at" in l],
              f"and the failure is printed once, as the error, not also as a warning: "
              f"{result.stderr[:600]}")
        for d, b in zip(daemons, before):
            status = d.status()
            check(status["version"] == 2 and status["state"] == "idle",
                  "the daemon stayed idle at version 2")
            check(d.tensors(names) == b, "and its bytes did not change")

        no_key = dict(os.environ)
        no_key.pop(KEY_ENV, None)
        result = run([args.refit, "push", steps[3], "--base", steps[2]] + receivers, env=no_key)
        check(result.returncode != 0 and "PermissionDenied" in result.stderr,
              f"a push without the key is refused: {result.stderr[:200]}")
        wrong_key = dict(env, **{KEY_ENV: "not-" + API_KEY})
        result = run(push + [steps[3], "--base", steps[2]], env=wrong_key)
        check(result.returncode != 0 and "PermissionDenied" in result.stderr
              and f"push: unauthorized by {daemons[0].url}" in result.stderr
              and f"check the key in {KEY_ENV}" in result.stderr,
              f"a push with the wrong key names the receiver and the key's variable: "
              f"{result.stderr[:300]}")

        # A file of another kind given as the model: said so, before anything is sent.
        noise = os.path.join(args.workdir, "noise.safetensors")
        with open(noise, "wb") as f:
            f.write((16024638156421364339).to_bytes(8, "little") + secrets.token_bytes(4096))
        result = run(push + [noise], env=env)
        check(result.returncode != 0 and
              f"{noise}: not a safetensors file: header length 16024638156421364339" in result.stderr,
              f"random bytes are not a safetensors file: {result.stderr[:300]}")

        # A coordinator killed mid-transfer leaves the receivers receiving (no lease ends it yet):
        # `refit abort` rolls each back, and the next push goes through.
        slow = push + ["--transport", f"fault+zmq://?delay_ms=3000&api_key_env={KEY_ENV}"]
        killed = subprocess.Popen(slow + [steps[3], "--base", steps[2]], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + TIMEOUT_S
        while daemons[0].status()["state"] != "receiving":
            check(killed.poll() is None and time.time() < deadline,
                  "the slowed push reaches the stream phase")
            time.sleep(0.02)
        killed.kill()
        killed.wait()
        check(daemons[0].status()["state"] == "receiving",
              "a receiver whose coordinator was killed stays receiving")
        for d in daemons:
            result = run([args.refit, "abort", d.url, "--api-key-env", KEY_ENV], env=env)
            check(result.returncode == 0 and "at version 2" in result.stdout,
                  f"refit abort rolls {d.url} back to version 2: {result.stdout}{result.stderr}")
            status = d.status()
            check(status["state"] == "idle" and status["version"] == 2, f"{d.url} is idle at 2")
            check(d.tensors(names) == files[2], "and holds step 2's bytes again")
        result = run([args.refit, "abort", daemons[0].url, "--api-key-env", KEY_ENV], env=env)
        check(result.returncode == 0 and "nothing to abort" in result.stdout,
              f"refit abort of an idle receiver changes nothing: {result.stdout}")

        result = run(push + [steps[3]], env=env)
        check(result.returncode == 0 and "a FULL anchor v2 -> v3" in result.stdout,
              f"an anchor push: {result.stdout}{result.stderr}")
        for d in daemons:
            check(d.tensors(names) == files[3], "every served tensor equals step 3's bytes")
    finally:
        for d in daemons:
            d.stop()

    # A sharded push: two rank processes, each with its rows of step 2 and a layout, fill two
    # fresh daemons at step 0; a layout with a gap is refused before anything is sent.
    ports = [free_port(), free_port()]
    peers = [f"127.0.0.1:{p}" for p in ports]
    fresh = [Daemon(args.refit, args.workdir, 20 + i, steps[0], ports[i], peers, env)
             for i in range(2)]
    try:
        receivers = []
        for d in fresh:
            receivers += ["--receiver", f"{d.url}={d.data}"]
        shards = [shard_checkpoint(steps[2], files[2], r, 2, args.workdir) for r in range(2)]

        def push_sharded(layout_files, tag):
            group = f"tcp://127.0.0.1:{free_port()}"
            ranks = [subprocess.Popen(
                [args.refit, "push", shards[r][0], "--layout", layout_files[r], "--group", group,
                 "--rank", str(r), "--world-size", "2", "--api-key-env", KEY_ENV] + receivers,
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(2)]
            return [(rank.wait(timeout=TIMEOUT_S), *rank.communicate()) for rank in ranks]

        gap = list(shards[1][2])
        dropped = gap.pop()["tensor"]
        gap_file = os.path.join(args.workdir, "rank1.gap.json")
        with open(gap_file, "w") as f:
            json.dump(gap, f)
        results = push_sharded([shards[0][1], gap_file], "gap")
        check(results[0][0] != 0 and "InvalidArgument" in results[0][2] and dropped in results[0][2],
              f"a layout with a gap is refused naming '{dropped}': {results[0][2][:300]}")
        check(all(d.status()["version"] == 0 for d in fresh)
              and all(d.tensors(names) == files[0] for d in fresh),
              "and nothing reached the daemons")
        results = push_sharded([shards[0][1], shards[1][1]], "sharded")
        check(all(code == 0 for code, _, _ in results),
              f"both ranks pushed their shards: {[r[1] + r[2] for r in results]}")
        check("a FULL anchor v0 -> v1" in results[0][1] and "from 2 rank(s)" in results[0][1],
              f"rank 0 reports the sharded anchor: {results[0][1]}")
        for d in fresh:
            check(d.tensors(names) == files[2], "every served tensor equals step 2's bytes, "
                  "assembled from the two ranks' rows")
    finally:
        for d in fresh:
            d.stop()

    # A fleet with a receiver down: push fails before any transfer starts.
    ports = [free_port(), free_port()]
    peers = [f"127.0.0.1:{p}" for p in ports]
    odd = [Daemon(args.refit, args.workdir, 10 + i, steps[0], ports[i], peers, env)
           for i in range(1)]
    try:
        result = run([args.refit, "push", steps[1], "--base", steps[0], "--api-key-env", KEY_ENV,
                      "--receiver", f"{odd[0].url}={odd[0].data}",
                      "--receiver", f"http://127.0.0.1:{free_port()}={peers[1]}"], env=env)
        check(result.returncode != 0 and "Unavailable" in result.stderr
              and "is unreachable" in result.stderr and "connection refused" in result.stderr,
              f"a push to a receiver that is down fails before anything starts, saying "
              f"\"connection refused\": {result.stderr[:300]}")
        check(odd[0].status()["version"] == 0, "the live daemon is untouched")
    finally:
        for d in odd:
            d.stop()

    # A producer group of two rank processes: with the whole 4 MiB model in one 256 MiB export
    # chunk, rank 1 sends nothing and both ranks say why; --chunk-bytes spreads it. A --group port
    # that is taken fails rank 0 within seconds, naming the port.
    ports = [free_port(), free_port()]
    peers = [f"127.0.0.1:{p}" for p in ports]
    pair = [Daemon(args.refit, args.workdir, 30 + i, steps[0], ports[i], peers, env)
            for i in range(2)]
    try:
        receivers = []
        for d in pair:
            receivers += ["--receiver", f"{d.url}={d.data}"]

        def push_group(checkpoint, base, extra):
            group = f"tcp://127.0.0.1:{free_port()}"
            ranks = [subprocess.Popen(
                [args.refit, "push", checkpoint, "--base", base, "--group", group, "--rank", str(r),
                 "--world-size", "2", "--api-key-env", KEY_ENV] + extra +
                (receivers if r == 0 else []),
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(2)]
            return [(rank.wait(timeout=TIMEOUT_S), *rank.communicate()) for rank in ranks]

        results = push_group(steps[1], steps[0], [])
        check(all(code == 0 for code, _, _ in results),
              f"a group of 2 ranks pushed step 1: {[r[1] + r[2] for r in results]}")
        check("rank 1 of 2 owns no export chunk, so it sent nothing: the model is 1 export "
              "chunk(s) of about 256 MiB (--chunk-bytes)" in results[1][1],
              f"rank 1 says why it sent nothing: {results[1][1]}")
        check("rank(s) 1 of 2 owned no export chunk and sent nothing" in results[0][1],
              f"and rank 0 says so too: {results[0][1]}")
        results = push_group(steps[2], steps[1], ["--chunk-bytes", "1MiB"])
        check(all(code == 0 for code, _, _ in results) and
              "owns no export chunk" not in results[1][1] and
              "owned no export chunk" not in results[0][1],
              f"with --chunk-bytes 1MiB both ranks send a share: {[r[1] + r[2] for r in results]}")
        for d in pair:
            check(d.status()["version"] == 2 and d.tensors(names) == files[2],
                  "both daemons hold step 2's bytes")

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            start = time.time()
            result = run([args.refit, "push", steps[3], "--base", steps[2], "--api-key-env", KEY_ENV,
                          "--group", f"tcp://127.0.0.1:{port}", "--rank", "0", "--world-size", "2"]
                         + receivers, env=env)
            took = time.time() - start
        check(result.returncode != 0 and f"port {port} is in use" in result.stderr,
              f"a taken --group port fails rank 0 naming the port: {result.stderr[:300]}")
        check(took < 15, f"within seconds, not the 600 s --timeout ({took:.1f} s)")
    finally:
        for d in pair:
            d.stop()

    result = run([args.refit, "demo", "--model-bytes", "4MiB", "--steps", "3", "--receivers", "3",
                  "--producers", "2", "--json", "--work-dir",
                  os.path.join(args.workdir, "demo")])
    check(result.returncode == 0, f"demo ran: {result.stderr[-2000:]}")
    printed = [json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")]
    raw = [l["raw_copy"] for l in printed if "raw_copy" in l]
    lines = [l for l in printed if "step" in l]
    check(len(raw) == 1 and raw[0]["verified"] and raw[0]["receivers"] == 3 and
          0.95 * (4 << 20) <= raw[0]["bytes"] <= 4 << 20 and raw[0]["seconds"] > 0,
          f"demo printed its raw-copy yardstick: the ~4 MiB model to each of 3 receivers: {raw}")
    check(len(lines) == 4, "demo printed one JSON line per step (FULL + 3)")
    check(all(abs(l["time_over_raw_copy"] - l["time_s"] / raw[0]["seconds"]) <=
              1e-6 * l["time_over_raw_copy"] for l in lines),
          "every step's time is put against the raw copy's")
    check(lines[0]["kind"] == "full" and all(l["kind"] == "delta" for l in lines[1:]),
          "step 0 is the FULL yardstick, then deltas")
    check(all(l["digests_verified"] and l["receivers"] == 3 for l in lines),
          "every step verified on 3 daemons")
    check(all(l["wire_bytes"] < lines[0]["wire_bytes"] for l in lines[1:]),
          "every delta is smaller than the FULL transfer")
    print("push_demo: all checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        sys.exit(1)
