#!/usr/bin/python3
"""kill -9 of `refit push` at every phase of a transfer, against real `refit serve` daemons.

A fleet of 3 daemons (one zmq relay tree) serves with a short transfer lease. Each daemon's
control plane is reached through a small HTTP proxy of this test, which can hold one route —
forward the request and keep the reply, or keep the request — so that the push can be killed at
an exact phase without any hook in refit itself:

  1. after prepare: every daemon holds the prepare, the reply of one is kept; kill -9.
  2. mid-stream: the push sends through fault+zmq://?delay_ms=… with small payloads; kill -9 once
     every daemon staged a payload.
  3. after flush: every daemon is prepared, every commit is kept by the proxies; kill -9.
  4. between receiver commits: daemon 2's commit is kept, daemons 0 and 1 commit; kill -9.
  5. a daemon killed mid-stream under `commit_policy: quorum:2`: the slowed push streams, and
     daemon 0 — the root relay of the push's tree — is killed with kill -9 once every daemon
     staged a payload. The push routes every later payload around it (to its children), commits
     on daemons 1 and 2 and fences daemon 0; daemon 0 restarts from the base checkpoint, and the
     next push brings the whole fleet to one version.

After 1 and 2 every daemon must roll back by itself within its lease (no `refit abort`) and hold
the base bytes. After 3 and 4 every prepared daemon must *stay* prepared past its lease (it may be
committed elsewhere), and the next push — a fresh `refit push` process — must resolve it by the
documented rule (implied abort from the base in 3; in 4 the next push is based on the committed
version, and the prepared daemon, behind it, is prepared from the version it holds: implied abort
and an anchor of its own, docs/protocol.md "Stragglers and quorum"). After
every scenario the next push must succeed, and every daemon must then hold the same version and
bit-exactly the bytes numpy says, downloaded tensor by tensor.

`--lease 0` runs the daemons without a lease (the behaviour before leases): scenarios 1 and 2 then
fail with "wedged". `--lease -1` passes no lease flag, to run against a refit built before leases:
there 3 and 4 fail too (the next push is refused: "wait for it or abort it first"). Run with Debian's /usr/bin/python3 (python3-numpy).
"""
import argparse
import http.client
import http.server
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import numpy as np

from ports import free_ports

KEY_ENV = "REFIT_CHAOS_TEST_KEY"
API_KEY = "chaos-" + secrets.token_hex(12)
# Seconds one HTTP request or a daemon start may take on a loaded 2-core machine.
REQUEST_TIMEOUT_S = 30
START_TIMEOUT_S = 60
# The daemons' transfer lease: long enough that a live push (a few payloads on loopback) never
# pauses that long between payloads even on a loaded machine, short enough to keep each scenario
# a few seconds.
DEFAULT_LEASE_S = 2.0
# How long past the lease a daemon may take to roll back: the expiry is checked by the apply
# thread at the deadline, so this only absorbs scheduling delays.
LEASE_SLACK_S = 10.0
# The transfer budget of every push (--timeout): far above what a push needs here.
PUSH_TIMEOUT_S = 60
# Each Send of the slowed push waits this long first, and it sends one payload at a time
# (--threads 1): the kill lands between payloads.
SLOW_SEND_MS = 1500
# Item bytes per payload of the slowed push: several payloads per tensor.
SMALL_BUCKET_BYTES = 2 << 10
DENSITY = 0.05


def check(condition, message, detail=""):
    if not condition:
        raise AssertionError(f"{message}: {detail}" if detail else message)
    print(f"ok: {message}", flush=True)




# ---- The model, written by numpy from the safetensors definition ---------------------------

def bf16_bits(values):
    b = values.astype("<f4").view("<u4").astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def initial_model(rng):
    shapes = {"model.embed_tokens.weight": (512, 64), "model.layers.0.mlp.up_proj.weight": (256, 96),
              "model.layers.0.mlp.down_proj.weight": (96, 256), "model.norm.weight": (64,)}
    return {name: bf16_bits((rng.standard_normal(shape) * 0.02).astype(np.float32))
            for name, shape in shapes.items()}


def training_step(rng, model):
    """A random 5 % of each tensor's elements move by one bf16 ulp (sign bit kept)."""
    out = {}
    for name, bits in model.items():
        flat = bits.reshape(-1).astype(np.int64).copy()
        where = rng.choice(flat.size, size=max(1, int(DENSITY * flat.size)), replace=False)
        magnitude = flat[where] & 0x7FFF
        step = np.where(magnitude == 0, 1, rng.choice([-1, 1], size=where.size))
        flat[where] = (flat[where] & 0x8000) | (magnitude + step)
        out[name] = flat.astype(np.uint16).reshape(bits.shape)
    return out


def write_safetensors(path, tensors, version=0):
    header, blobs, offset = {}, [], 0
    for name, bits in tensors.items():
        data = bits.astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(bits.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    header["__metadata__"] = {"refit.version": str(version)}
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)


# ---- A control-plane proxy that can hold one route ------------------------------------------

class HoldingProxy:
    """Forwards HTTP requests to one daemon's control plane. hold(path, mode) makes the next and
    later requests to `path` block: mode "reply" forwards the request and keeps the reply,
    mode "request" keeps the request itself (the daemon never sees it). release() frees them
    with a 503 (the client is gone by then)."""

    def __init__(self, upstream_port):
        proxy = self
        self.upstream_port = upstream_port
        self.holds = {}
        self.held = threading.Event()  # Set once a request was held.
        self.release_event = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def relay(self):
                path = self.path.split("?", 1)[0]
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length) if length else None
                mode = proxy.holds.get(path)
                if mode == "request":
                    proxy.held.set()
                    proxy.release_event.wait()
                    return self.reply(503, b'{"ok": false}', {})
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port,
                                                      timeout=REQUEST_TIMEOUT_S * 4)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection", "content-length")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                kept = {k: v for k, v in answer.getheaders()
                        if k.lower() not in ("content-length", "connection", "transfer-encoding")}
                upstream.close()
                if mode == "reply":
                    proxy.held.set()
                    proxy.release_event.wait()
                    return self.reply(503, b'{"ok": false}', {})
                self.reply(answer.status, data, kept)

            def reply(self, status, data, headers):
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # The push was killed: nobody reads this reply.

            do_GET = relay
            do_POST = relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hold(self, path, mode):
        self.holds[path] = mode

    def release(self):
        self.holds.clear()
        self.release_event.set()
        # A fresh event for the next scenario; threads held now were woken by the old one.
        self.release_event = threading.Event()
        self.held = threading.Event()

    def close(self):
        self.release()
        self.server.shutdown()
        self.server.server_close()


# ---- Daemons --------------------------------------------------------------------------------

class Daemon:
    def __init__(self, refit, workdir, name, model, data_port, peers, lease_s, env, extra=()):
        self.name, self.data = name, f"127.0.0.1:{data_port}"
        ready = os.path.join(workdir, f"{name}.ready")
        self.log_path = os.path.join(workdir, f"{name}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [refit, "serve", "--model", model, "--data-port", str(data_port),
                 "--control-port", "0", "--peers", ",".join(peers), "--api-key-env", KEY_ENV,
                 "--ready-file", ready] +
                ([] if lease_s < 0 else ["--transfer-lease", str(lease_s)]) + list(extra),
                stdout=log, stderr=subprocess.STDOUT, env=env)
        self.ready = ready

    def wait_ready(self):
        deadline = time.time() + START_TIMEOUT_S
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon {self.name} exited at start: {self.log_tail()}")
            if time.time() > deadline:
                raise AssertionError(f"daemon {self.name} not ready in {START_TIMEOUT_S} s")
            time.sleep(0.05)
        with open(self.ready) as f:
            self.url = json.load(f)["control_url"]
        self.proxy = HoldingProxy(int(self.url.rsplit(":", 1)[1]))

    def log_tail(self, chars=2000):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def get(self, path):
        request = urllib.request.Request(self.url + path,
                                         headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return reply.read()

    def status(self):
        return json.loads(self.get("/v1/status"))

    def tensor_bits(self, name):
        return np.frombuffer(self.get("/v1/tensors/" + urllib.parse.quote(name, safe="")),
                             dtype="<u2")

    def stop(self):
        self.proxy.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=REQUEST_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Chaos:
    def __init__(self, args):
        self.refit, self.lease_s = args.refit, args.lease
        self.workdir = args.workdir
        shutil.rmtree(self.workdir, ignore_errors=True)
        os.makedirs(self.workdir)
        self.env = dict(os.environ, **{KEY_ENV: API_KEY})
        self.rng = np.random.default_rng(13)
        self.model = initial_model(self.rng)
        self.version = 0
        self.files = 0
        self.expired = {}
        self.path = self.write(self.model)
        ports = free_ports(3)
        peers = [f"127.0.0.1:{p}" for p in ports]
        # Daemon d1 holds its tensors behind the device boundary (its test backend): the device
        # path must roll back, stay prepared and resolve exactly as host memory does.
        self.daemons = [Daemon(self.refit, self.workdir, f"d{i}", self.path, port, peers,
                               self.lease_s, self.env,
                               ["--device-memory-test"] if i == 1 else [])
                        for i, port in enumerate(ports)]
        for d in self.daemons:
            d.wait_ready()
        # Small payloads for the slowed push: several per tensor.
        self.small_config = os.path.join(self.workdir, "small.yaml")
        with open(self.small_config, "w") as f:
            f.write(f"delta_compression:\n  sparse_bucket_size_bytes: {SMALL_BUCKET_BYTES}\n")

    def write(self, model):
        self.files += 1
        path = os.path.join(self.workdir, f"step{self.files}.safetensors")
        write_safetensors(path, model)
        return path

    def push(self, checkpoint, base=None, transport=None, config=None, threads=None):
        cmd = [self.refit, "push", checkpoint, "--api-key-env", KEY_ENV, "--json",
               "--timeout", str(PUSH_TIMEOUT_S)]
        for d in self.daemons:
            cmd += ["--receiver", f"{d.proxy.url}={d.data}"]
        if base:
            cmd += ["--base", base]
        if transport:
            cmd += ["--transport", transport]
        if config:
            cmd += ["--config", config]
        if threads:
            cmd += ["--threads", str(threads)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=self.env, text=True)

    def wait_until(self, what, predicate, timeout, push=None):
        deadline = time.time() + timeout
        while not predicate():
            if push is not None and push.poll() is not None:
                raise AssertionError(f"the push exited ({push.returncode}) before {what}: "
                                     f"{push.stdout.read()}")
            if time.time() > deadline:
                states = [d.status() for d in self.daemons]
                raise AssertionError(f"{what} did not happen within {timeout} s: {states}")
            time.sleep(0.02)

    def kill(self, push):
        push.send_signal(signal.SIGKILL)
        push.wait(timeout=REQUEST_TIMEOUT_S)
        push.stdout.close()

    def expect_fleet(self, model, version, what):
        for d in self.daemons:
            status = d.status()
            check(status["state"] == "idle" and status["version"] == version,
                  f"{what}: {d.name} is idle at version {version}", json.dumps(status))
            for name, bits in model.items():
                got = d.tensor_bits(name)
                if not np.array_equal(got, bits.reshape(-1)):
                    raise AssertionError(f"{what}: {d.name} tensor '{name}' differs from the "
                                         f"expected bits in {np.count_nonzero(got != bits.reshape(-1))} "
                                         f"elements")
        print(f"ok: {what}: every daemon holds the expected bits at version {version}", flush=True)

    def next_push_succeeds(self, what, base):
        """A fresh push of the next training step; the fleet must commit it everywhere."""
        step = training_step(self.rng, self.model)
        path = self.write(step)
        push = self.push(path, base=base)
        out, _ = push.communicate(timeout=PUSH_TIMEOUT_S + 30)
        check(push.returncode == 0, f"{what}: the next push succeeds", out)
        report = json.loads(out.strip().splitlines()[-1])
        self.version = report["version"]
        self.model, self.path = step, path
        self.expect_fleet(self.model, self.version, f"{what}: after the next push")
        return report

    def wait_rolled_back(self, what, base_model, base_version):
        start = time.time()

        def all_idle():
            return all(d.status()["state"] == "idle" for d in self.daemons)

        deadline = max(self.lease_s, 0) + LEASE_SLACK_S
        while not all_idle():
            if time.time() - start > deadline:
                states = {d.name: d.status()["state"] for d in self.daemons}
                raise AssertionError(f"{what}: wedged: {states} {deadline:.0f} s after the kill "
                                     f"(lease {self.lease_s} s)")
            time.sleep(0.05)
        for d in self.daemons:
            status = d.status()
            error = status.get("last_error") or {}
            check(error.get("code") == "DeadlineExceeded" and "lease" in error.get("message", ""),
                  f"{what}: {d.name} reports its lease expiry", json.dumps(status))
            check(status.get("expired_leases", 0) >= 1 and
                  status["expired_leases"] > self.expired.get(d.name, 0),
                  f"{what}: {d.name} counts the lease expiry in its status", json.dumps(status))
            self.expired[d.name] = status["expired_leases"]
            metrics = d.get("/metrics").decode()
            counted = [float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("refit_transfer_leases_expired_total")]
            check(counted and counted[0] == status["expired_leases"],
                  f"{what}: {d.name} exports the lease expiries in /metrics", str(counted))
        self.expect_fleet(base_model, base_version, f"{what}: rolled back by the lease")

    # ---- Scenarios -------------------------------------------------------------------------

    def kill_after_prepare(self):
        what = "kill after prepare"
        step_path = self.write(training_step(self.rng, self.model))
        self.daemons[0].proxy.hold("/v1/prepare", "reply")
        push = self.push(step_path, base=self.path)
        self.wait_until(f"{what}: every daemon receiving",
                        lambda: all(d.status()["state"] == "receiving" for d in self.daemons),
                        REQUEST_TIMEOUT_S, push)
        self.kill(push)
        self.daemons[0].proxy.release()
        self.wait_rolled_back(what, self.model, self.version)
        self.next_push_succeeds(what, base=self.path)

    def kill_mid_stream(self):
        what = "kill mid-stream"
        step_path = self.write(training_step(self.rng, self.model))
        push = self.push(step_path, base=self.path, config=self.small_config,
                         transport=f"fault+zmq://?delay_ms={SLOW_SEND_MS}", threads=1)
        self.wait_until(f"{what}: every daemon staged a payload",
                        lambda: all(d.status()["staged_payloads"] >= 1 for d in self.daemons),
                        REQUEST_TIMEOUT_S, push)
        self.kill(push)
        self.wait_rolled_back(what, self.model, self.version)
        self.next_push_succeeds(what, base=self.path)

    def kill_after_flush(self):
        what = "kill after flush"
        before = self.version
        step_path = self.write(training_step(self.rng, self.model))
        for d in self.daemons:
            d.proxy.hold("/v1/commit", "request")
        push = self.push(step_path, base=self.path)
        self.wait_until(f"{what}: every daemon prepared and asked to commit",
                        lambda: all(d.status()["state"] == "prepared" and d.proxy.held.is_set()
                                    for d in self.daemons), REQUEST_TIMEOUT_S, push)
        self.kill(push)
        for d in self.daemons:
            d.proxy.release()
        # No lease may end a prepared transfer: it may have been committed elsewhere.
        time.sleep(max(self.lease_s, 0) * 2)
        for d in self.daemons:
            check(d.status()["state"] == "prepared", f"{what}: {d.name} still prepared past "
                  f"its lease")
        # A restarted producer (no --base: an anchor) from the fleet's version: implied abort.
        report = self.next_push_succeeds(what, base=None)
        check(report["base_version"] == before and report["kind"] == "full",
              f"{what}: the next push is an anchor from the undecided transfer's base",
              json.dumps(report))

    def kill_between_commits(self):
        what = "kill between receiver commits"
        step = training_step(self.rng, self.model)
        step_path = self.write(step)
        late = self.daemons[2]
        late.proxy.hold("/v1/commit", "request")
        push = self.push(step_path, base=self.path)
        self.wait_until(f"{what}: daemons 0 and 1 committed, daemon 2 prepared",
                        lambda: all(d.status()["state"] == "idle" and
                                    d.status()["version"] == self.version + 1
                                    for d in self.daemons[:2]) and
                        late.status()["state"] == "prepared" and late.proxy.held.is_set(),
                        REQUEST_TIMEOUT_S, push)
        self.kill(push)
        late.proxy.release()
        time.sleep(max(self.lease_s, 0) * 2)
        check(late.status()["state"] == "prepared", f"{what}: d2 still prepared past its lease")
        # The push was decided (two daemons committed it): the next push is based on the committed
        # version; d2, behind it, is prepared from the version it holds (implied abort) and caught
        # up by an anchor of its own.
        committed_version = self.version + 1
        report = self.next_push_succeeds(what, base=step_path)
        check(report["base_version"] == committed_version,
              f"{what}: the next push is based on the committed version {committed_version}",
              json.dumps(report))

    def kill_daemon_mid_stream_under_quorum(self):
        what = "a daemon killed mid-stream under quorum:2"
        step = training_step(self.rng, self.model)
        step_path = self.write(step)
        config = os.path.join(self.workdir, "quorum.yaml")
        with open(config, "w") as f:
            f.write(f"delta_compression:\n  sparse_bucket_size_bytes: {SMALL_BUCKET_BYTES}\n"
                    "commit_policy: quorum:2\nrequest_timeout_s: 5\n")
        push = self.push(step_path, base=self.path, config=config,
                         transport=f"fault+zmq://?delay_ms={SLOW_SEND_MS}", threads=1)
        self.wait_until(f"{what}: every daemon staged a payload",
                        lambda: all(d.status()["staged_payloads"] >= 1 for d in self.daemons),
                        REQUEST_TIMEOUT_S, push)
        victim = self.daemons[0]
        # Its control plane goes first (the push is streaming, so no call is in flight there),
        # then the process.
        victim.proxy.close()
        victim.proc.kill()
        victim.proc.wait(timeout=REQUEST_TIMEOUT_S)
        out, _ = push.communicate(timeout=PUSH_TIMEOUT_S + 30)
        check(push.returncode == 0, f"{what}: the push commits on the two daemons left", out)
        report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        check(report["fenced"] == [victim.proxy.url], f"{what}: the dead daemon is fenced",
              json.dumps(report))
        for commit in report["commits"]:
            dead = commit["receiver"] == victim.proxy.url
            check(commit["committed"] != dead, f"{what}: {commit['receiver']} committed: {not dead}",
                  json.dumps(commit))
        survivors = self.daemons[1:]
        for d in survivors:
            status = d.status()
            check(status["version"] == self.version + 1 and
                  all(np.array_equal(d.tensor_bits(name), bits.reshape(-1))
                      for name, bits in step.items()),
                  f"{what}: {d.name} holds the pushed step bit-exactly", json.dumps(status))
        # The dead daemon comes back from the checkpoint of the base: the next push, based on the
        # version the survivors hold, brings it along.
        restarted = Daemon(self.refit, self.workdir, "d0-restarted", self.path,
                           int(victim.data.rsplit(":", 1)[1]), [d.data for d in self.daemons],
                           self.lease_s, self.env, ["--version", str(self.version)])
        restarted.wait_ready()
        self.daemons[0] = restarted
        self.version, self.model, self.path = self.version + 1, step, step_path
        self.next_push_succeeds(what, base=self.path)

    def close(self):
        for d in self.daemons:
            d.stop()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--refit", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--lease", type=float, default=DEFAULT_LEASE_S,
                        help="the daemons' --transfer-lease in seconds (0: no lease; negative: "
                             "no flag, for a refit built before leases)")
    parser.add_argument("--only", help="run only the scenario of this name")
    args = parser.parse_args()
    chaos = Chaos(args)
    failures = []
    try:
        chaos.next_push_succeeds("first push", base=None)
        for scenario in (chaos.kill_after_prepare, chaos.kill_mid_stream, chaos.kill_after_flush,
                         chaos.kill_between_commits, chaos.kill_daemon_mid_stream_under_quorum):
            if args.only and scenario.__name__ != args.only:
                continue
            started = time.time()
            try:
                scenario()
                print(f"PASS {scenario.__name__} ({time.time() - started:.1f} s)", flush=True)
            except AssertionError as error:
                failures.append(f"{scenario.__name__}: {error}")
                print(f"FAIL {scenario.__name__}: {error}", flush=True)
                # The next scenario needs a usable fleet: abort whatever is left open.
                for d in chaos.daemons:
                    status = d.status()
                    if status["transfer_id"]:
                        request = urllib.request.Request(
                            d.url + "/v1/abort", method="POST",
                            data=json.dumps({"transfer_id": status["transfer_id"]}).encode(),
                            headers={"Authorization": f"Bearer {API_KEY}",
                                     "Content-Type": "application/json"})
                        try:
                            urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S).read()
                        except OSError:
                            pass
                chaos.daemons[0].proxy.release()
                for d in chaos.daemons:
                    d.proxy.release()
                # Re-sync what the fleet holds: an anchor of the current model.
                try:
                    chaos.next_push_succeeds("recovery", base=None)
                except AssertionError as recovery:
                    failures.append(f"recovery: {recovery}")
                    break
        device, host = chaos.daemons[1].status(), chaos.daemons[0].status()
        if not device.get("device_to_bytes") or host.get("device_to_bytes") != 0:
            failures.append("d1 (--device-memory-test) should be the only daemon whose applies crossed "
                            f"the device boundary: d1 {device.get('device_to_bytes')} bytes, "
                            f"d0 {host.get('device_to_bytes')}")
    finally:
        chaos.close()
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        for d in chaos.daemons:
            print(f"--- {d.name} log tail ---\n{d.log_tail()}")
        sys.exit(1)
    print("all chaos scenarios passed")


if __name__ == "__main__":
    main()
