#!/usr/bin/python3
"""`refit push --timeout T` is a deadline for the whole push (issue 45, item 4).

Two `refit serve` daemons on loopback; one of them is stopped (SIGSTOP: its sockets stay open and
accept, and nothing answers), once before a push and once while a push streams through
fault+zmq://?delay_ms=… . Each push must fail, naming the deadline, within T plus a small bounded
margin for the abort (MARGIN_S): before the fix a receiver stopped mid-transfer held a push with
--timeout 8 for 18.7 s, since every phase, every control call and the abort each took up to T of
their own. After SIGCONT the next push must succeed, so nothing was left half done.
Run with Debian's /usr/bin/python3 (python3-numpy).
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

from push_demo_test import KEY_ENV, API_KEY, Daemon, check, run
from ports import free_port

# The push's --timeout, and the acceptance bound on its wall time.
TIMEOUT_S = 8
BOUND_S = 10
# How long the mid-transfer push streams before a receiver is stopped: its payloads are delayed
# by the fault transport so that the transfer is still streaming then.
STREAMING_AFTER_S = 2
PAYLOAD_DELAY_MS = 400
# Small buckets, so that the delta travels as many payloads and is still streaming then.
SMALL_BUCKET_BYTES = 2 << 10


def timed_push(cmd, env, stop=None, stop_after_s=0):
    """Run `cmd`; SIGSTOP `stop` after `stop_after_s`. Return (seconds, returncode, stderr)."""
    started = time.monotonic()
    push = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    if stop is not None:
        time.sleep(stop_after_s)
        check(push.poll() is None, "the push ended before the receiver could be stopped")
        stop.proc.send_signal(signal.SIGSTOP)
    try:
        _, err = push.communicate(timeout=4 * BOUND_S)
    except subprocess.TimeoutExpired:
        push.kill()
        push.communicate()
        raise AssertionError(f"push still running after {4 * BOUND_S} s")
    return time.monotonic() - started, push.returncode, err


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--refit", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    env = dict(os.environ, **{KEY_ENV: API_KEY})
    ck = os.path.join(args.workdir, "ck")
    result = run([args.refit, "simulate", "-o", ck, "--checkpoints", "2", "--model-bytes", "4MiB",
                  "--density", "0.03"])
    check(result.returncode == 0, f"simulate wrote checkpoints: {result.stderr}")
    steps = sorted(os.path.join(ck, f) for f in os.listdir(ck))
    ports = [free_port(), free_port()]
    peers = [f"127.0.0.1:{p}" for p in ports]
    daemons = [Daemon(args.refit, args.workdir, i, steps[0], ports[i], peers, env)
               for i in range(2)]
    receivers = []
    for d in daemons:
        receivers += ["--receiver", f"{d.url}={d.data}"]
    push = [args.refit, "push", "--api-key-env", KEY_ENV, "--timeout", str(TIMEOUT_S)] + receivers
    try:
        # A receiver stopped before the push: its version query, prepare and abort all hang.
        took, code, err = timed_push(push + [steps[1], "--base", steps[0]], env,
                                     stop=daemons[1], stop_after_s=0)
        daemons[1].proc.send_signal(signal.SIGCONT)
        check(code != 0, "a push to a stopped receiver failed")
        check(took < BOUND_S, f"push --timeout {TIMEOUT_S} to a stopped receiver took {took:.1f} s: "
              f"{err[-2000:]}")
        print(f"stopped before the push: failed after {took:.1f} s")

        # A receiver stopped while the push streams.
        small = os.path.join(args.workdir, "small.yaml")
        with open(small, "w") as f:
            f.write(f"delta_compression:\n  sparse_bucket_size_bytes: {SMALL_BUCKET_BYTES}\n")
        slow = push + ["--config", small, "--transport",
                       f"fault+zmq://?delay_ms={PAYLOAD_DELAY_MS}&api_key_env={KEY_ENV}"]
        took, code, err = timed_push(slow + [steps[1], "--base", steps[0]], env,
                                     stop=daemons[1], stop_after_s=STREAMING_AFTER_S)
        daemons[1].proc.send_signal(signal.SIGCONT)
        check(code != 0, "a push whose receiver was stopped mid-transfer failed")
        check(took < BOUND_S, f"push --timeout {TIMEOUT_S} with a receiver stopped mid-transfer "
              f"took {took:.1f} s: {err[-2000:]}")
        print(f"stopped mid-transfer: failed after {took:.1f} s")

        # Nothing was left half done: the next push goes through.
        result = run(push + [steps[1], "--base", steps[0]], env=env)
        check(result.returncode == 0, f"the push after SIGCONT: {result.stderr[-2000:]}")
        for d in daemons:
            check(d.status()["version"] == 1, f"daemon {d.data} at version 1")
            d.stop()
    finally:
        for d in daemons:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)
                d.proc.kill()
                d.proc.wait()
    print("push_deadline: all checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        sys.exit(1)
