#!/usr/bin/python3
"""An anchor (FULL) killed mid-stream, against a real `refit serve --anchor-undo POLICY`.

For each policy a daemon serves with a short transfer lease; `refit push` sends an anchor slowly
(one small payload at a time through fault+zmq://?delay_ms=…) and is killed with SIGKILL once the
daemon applied a payload. The lease then aborts the transfer:

- memory, file: the daemon rolls back bit-exactly to the base bytes (downloaded tensor by tensor);
- none: the old bits were not kept, so the daemon must report needs_anchor (status, reason naming
  the transfer, /metrics), refuse a delta's prepare by name, and heal with the next push — which is
  asked for as a delta (--base) and must go out as an anchor because the Publisher sees the state.

Run with Debian's /usr/bin/python3 (python3-numpy).
"""
import argparse
import json
import os
import secrets
import shutil
import sys
import time
import urllib.error
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chaos_push_kill_test as chaos  # noqa: E402  (the daemon, model and proxy helpers)

LEASE_S = 2.0


def post(daemon, path, body):
    request = urllib.request.Request(
        daemon.url + path, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {chaos.API_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=chaos.REQUEST_TIMEOUT_S) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def run_policy(args, policy):
    workdir = os.path.join(args.workdir, policy)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    env = dict(os.environ, **{chaos.KEY_ENV: chaos.API_KEY})
    rng = np.random.default_rng(29)
    base = chaos.initial_model(rng)
    base_path = os.path.join(workdir, "base.safetensors")
    chaos.write_safetensors(base_path, base)
    step = chaos.training_step(rng, base)
    step_path = os.path.join(workdir, "step.safetensors")
    chaos.write_safetensors(step_path, step)
    small = os.path.join(workdir, "small.yaml")
    with open(small, "w") as f:
        f.write(f"delta_compression:\n  sparse_bucket_size_bytes: {chaos.SMALL_BUCKET_BYTES}\n")
    port = chaos.free_ports(1)[0]
    extra = ["--anchor-undo", policy, "--anchor-undo-dir", workdir]
    daemon = chaos.Daemon(args.refit, workdir, "d0", base_path, port, [f"127.0.0.1:{port}"],
                          LEASE_S, env, extra)
    try:
        daemon.wait_ready()

        def push(checkpoint, base_checkpoint=None, slow=False):
            cmd = [args.refit, "push", checkpoint, "--api-key-env", chaos.KEY_ENV, "--json",
                   "--timeout", str(chaos.PUSH_TIMEOUT_S),
                   "--receiver", f"{daemon.url}={daemon.data}"]
            if base_checkpoint:
                cmd += ["--base", base_checkpoint]
            if slow:
                cmd += ["--config", small, "--threads", "1",
                        "--transport", f"fault+zmq://?delay_ms={chaos.SLOW_SEND_MS}"]
            return chaos.subprocess.Popen(cmd, stdout=chaos.subprocess.PIPE,
                                          stderr=chaos.subprocess.STDOUT, env=env, text=True)

        def holds(model):
            return all(np.array_equal(daemon.tensor_bits(name), bits.reshape(-1))
                       for name, bits in model.items())

        # 1. The anchor, killed once the daemon applied a payload of it.
        anchor = push(step_path, slow=True)
        deadline = time.time() + chaos.REQUEST_TIMEOUT_S
        while daemon.status()["applied_payloads"] < 1:
            if anchor.poll() is not None or time.time() > deadline:
                raise AssertionError(f"{policy}: no payload of the slowed anchor applied while it "
                                     f"ran: {daemon.status()}")
            time.sleep(0.02)
        transfer = daemon.status()["transfer_id"]
        anchor.kill()
        anchor.wait()
        anchor.stdout.close()
        deadline = time.time() + LEASE_S + chaos.LEASE_SLACK_S
        while daemon.status()["state"] != "idle":
            if time.time() > deadline:
                raise AssertionError(f"{policy}: wedged past the lease: {daemon.status()}")
            time.sleep(0.05)
        status = daemon.status()
        metrics = daemon.get("/metrics").decode()
        gauge = [line for line in metrics.splitlines() if line.startswith("refit_needs_anchor")]
        chaos.check(status["version"] == 0, f"{policy}: back at version 0", json.dumps(status))
        chaos.check(status["undo_file_bytes"] == 0, f"{policy}: the spill file is given back")
        if policy != "none":
            chaos.check(not status["needs_anchor"], f"{policy}: no anchor needed",
                        json.dumps(status))
            chaos.check(gauge == ["refit_needs_anchor 0"], f"{policy}: /metrics agrees", str(gauge))
            chaos.check(holds(base), f"{policy}: the base bytes are restored bit-exactly")
        else:
            chaos.check(status["needs_anchor"] and transfer in status["needs_anchor_reason"],
                        f"{policy}: needs_anchor, naming the transfer", json.dumps(status))
            chaos.check(gauge == ["refit_needs_anchor 1"], f"{policy}: /metrics says so", str(gauge))
            code, reply = post(daemon, "/v1/prepare",
                               {"transfer_id": secrets.token_hex(16), "base_version": 0})
            chaos.check(code == 409 and reply.get("code") == "FailedPrecondition" and
                        "needs an anchor and refuses a delta" in reply.get("message", ""),
                        f"{policy}: a delta's prepare is refused by name", f"{code} {reply}")
        # 2. The next push, asked for as a delta from the base: an anchor when one is needed.
        following = push(step_path, base_checkpoint=base_path)
        out, _ = following.communicate(timeout=chaos.PUSH_TIMEOUT_S + 30)
        chaos.check(following.returncode == 0, f"{policy}: the next push succeeds", out)
        report = json.loads(out.strip().splitlines()[-1])
        # A receiver that needs an anchor gets one of its own (a per-receiver plan): the fleet's
        # transfer stays a delta, and that receiver's outcome says how it caught up.
        expected_catch_up = "anchor" if policy == "none" else "delta"
        caught_up_by = [commit.get("caught_up_by") for commit in report.get("commits", [])]
        chaos.check(report["kind"] in ("delta", "full") and caught_up_by == [expected_catch_up],
                    f"{policy}: the daemon is caught up by {expected_catch_up}", json.dumps(report))
        status = daemon.status()
        chaos.check(not status["needs_anchor"] and status["version"] == report["version"],
                    f"{policy}: healed at version {report['version']}", json.dumps(status))
        chaos.check(holds(step), f"{policy}: the daemon holds the pushed step bit-exactly")
        leftovers = [name for name in os.listdir(workdir) if name.startswith("refit-anchor-undo")]
        chaos.check(not leftovers, f"{policy}: no spill file left on disk", str(leftovers))
    finally:
        daemon.stop()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--refit", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--policies", default="memory,file,none")
    args = parser.parse_args()
    for policy in args.policies.split(","):
        run_policy(args, policy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
