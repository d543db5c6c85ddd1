#!/usr/bin/python3
"""`refit push --commit-policy quorum:2` against three real `refit serve` daemons, one of them
stopped with SIGSTOP (docs/protocol.md "Stragglers and quorum").

1. Every daemon answers: the push commits everywhere (v1).
2. Daemon 2 is stopped (SIGSTOP: its sockets accept and nothing answers). The push leaves it out
   — its status does not answer within request_timeout_s — and commits on the other two (v2),
   reporting it as fenced in --json; under `--commit-policy all` the same push fails.
3. After SIGCONT daemon 2 still reports v1 and serves the v1 bytes exactly: it never reports or
   serves the version it was fenced from.
4. The next push (a fresh process, v2 -> v3) catches daemon 2 up by a plan of its own — an anchor
   prepared from the version it holds — while the others get the delta; every daemon then holds
   the v3 checkpoint bit-exactly.
5. Every daemon stopped: the quorum push fails and nothing changes.
Run with Debian's /usr/bin/python3 (python3-numpy).
"""
import argparse
import json
import os
import shutil
import signal
import sys

from push_demo_test import KEY_ENV, API_KEY, Daemon, check, read_safetensors, run
from ports import free_port


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--refit", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    env = dict(os.environ, **{KEY_ENV: API_KEY})
    ck = os.path.join(args.workdir, "ck")
    result = run([args.refit, "simulate", "-o", ck, "--checkpoints", "4", "--model-bytes", "2MiB",
                  "--density", "0.03"])
    check(result.returncode == 0, f"simulate wrote checkpoints: {result.stderr}")
    steps = sorted(os.path.join(ck, f) for f in os.listdir(ck))
    ports = [free_port() for _ in range(3)]
    peers = [f"127.0.0.1:{p}" for p in ports]
    daemons = [Daemon(args.refit, args.workdir, i, steps[0], ports[i], peers, env) for i in range(3)]
    config = os.path.join(args.workdir, "quorum.yaml")
    with open(config, "w") as f:
        # A receiver whose control plane does not answer within 2 s is left out of the push.
        f.write("request_timeout_s: 2\ncommit_policy: quorum:2\n")
    receivers = []
    for d in daemons:
        receivers += ["--receiver", f"{d.url}={d.data}"]
    push = [args.refit, "push", "--api-key-env", KEY_ENV, "--timeout", "30", "--json",
            "--config", config] + receivers

    def pushed(step, base, *extra):
        result = run(push + list(extra) + [steps[step], "--base", steps[base]], env=env)
        report = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None
        return result, report

    def holds(daemon, step):
        files = read_safetensors(steps[step])
        served = daemon.tensors(list(files))
        return all(served[name] == data for name, data in files.items())

    stopped = daemons[2]
    try:
        result, report = pushed(1, 0)
        check(result.returncode == 0 and report["fenced"] == [], f"push 1 commits everywhere: "
              f"{result.stderr[-2000:]}")

        stopped.proc.send_signal(signal.SIGSTOP)
        result, _ = pushed(2, 1, "--commit-policy", "all")
        check(result.returncode != 0, "under --commit-policy all a stopped receiver fails the push")
        result, report = pushed(2, 1)
        check(result.returncode == 0, f"under quorum:2 the push commits on the two that answer: "
              f"{result.stderr[-2000:]}")
        check(report["version"] == 2 and report["fenced"] == [stopped.url],
              f"the stopped daemon is reported fenced: {report['fenced']}")
        fenced = [c for c in report["commits"] if c["receiver"] == stopped.url]
        check(len(fenced) == 1 and fenced[0]["fenced"] and not fenced[0]["committed"],
              f"its entry says fenced, not committed: {fenced}")
        for d in daemons[:2]:
            check(d.status()["version"] == 2 and holds(d, 2), f"{d.data} holds v2 bit-exactly")

        stopped.proc.send_signal(signal.SIGCONT)
        status = stopped.status()
        check(status["version"] == 1 and status["state"] == "idle",
              f"the fenced daemon still reports v1, idle: {status['version']} {status['state']}")
        check(holds(stopped, 1), "the fenced daemon serves the v1 bytes, not v2's")

        result, report = pushed(3, 2)
        check(result.returncode == 0, f"the next push succeeds: {result.stderr[-2000:]}")
        check(report["fenced"] == [] and report["base_version"] == 2 and report["kind"] == "delta",
              f"the next push is a delta from v2 with nobody fenced: {report['kind']}")
        by_name = {c["receiver"]: c for c in report["commits"]}
        caught = by_name[stopped.url]
        check(caught["held_version"] == 1 and caught["lag"] == 1 and caught["caught_up_by"] == "anchor",
              f"the fenced daemon is caught up on its own from v1: {caught}")
        for d in daemons[:2]:
            check(by_name[d.url]["caught_up_by"] == "delta", f"{d.data} gets the delta")
        for d in daemons:
            check(d.status()["version"] == 3 and holds(d, 3), f"{d.data} holds v3 bit-exactly")

        for d in daemons:
            d.proc.send_signal(signal.SIGSTOP)
        result, _ = pushed(3, 3, "--anchor")
        for d in daemons:
            d.proc.send_signal(signal.SIGCONT)
        check(result.returncode != 0, f"with every daemon stopped the quorum push fails: "
              f"{result.stderr.strip()[-300:]}")
        for d in daemons:
            check(d.status()["version"] == 3 and holds(d, 3), f"{d.data} unchanged at v3")
        for d in daemons:
            d.stop()
    finally:
        for d in daemons:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)
                d.proc.kill()
                d.proc.wait()
    print("quorum_push: all checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        sys.exit(1)
