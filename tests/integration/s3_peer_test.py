#!/usr/bin/python3
"""The s3:// transport seen by an independent S3 client (Debian's python3-boto3), end to end.

Against the project's real S3 server (scripts/s3-test-server.sh; REFIT_TEST_S3_ENDPOINT):
  * `refit demo --transport s3://…&chain=1` refits two `refit serve` daemons through the bucket
    for several steps, every step verified by the demo itself;
  * boto3 reads what refit wrote: the chain index parses, lists contiguous versions starting with
    an anchor, and every payload object it names has the listed size, the listed XXH3-128 checksum
    (Debian's python3-xxhash) and a payload header (magic RFPL, the version's transfer id); no
    live object was left behind;
  * a late `refit serve --bootstrap` from the trainer's initial checkpoint replays the chain and
    reports, over its control plane, the newest version with the index's state fingerprint;
  * a chain index forged with boto3 (a payload checksum changed) makes `refit serve --bootstrap`
    refuse to start, naming the problem.
Skips (exit 77) without a server unless REFIT_TEST_S3_REQUIRED=1.
"""
import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

TIMEOUT_S = 300
SKIP = 77


def check(condition, message):
    if not condition:
        raise AssertionError(message)
    print(f"ok: {message}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--refit", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()

    endpoint = os.environ.get("REFIT_TEST_S3_ENDPOINT", "")
    if not endpoint:
        if os.environ.get("REFIT_TEST_S3_REQUIRED") == "1":
            print("REFIT_TEST_S3_REQUIRED=1 but REFIT_TEST_S3_ENDPOINT is not set")
            return 1
        print("skipped: no S3 test server (start scripts/s3-test-server.sh, export its env)")
        return SKIP
    import boto3
    import xxhash

    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    s3 = boto3.client("s3", endpoint_url=endpoint,
                      region_name=os.environ.get("AWS_REGION", "us-east-1"))
    bucket = "refit-peer-" + secrets.token_hex(6)
    s3.create_bucket(Bucket=bucket)
    region = os.environ.get("AWS_REGION", "us-east-1")
    uri = f"s3://{bucket}/run?endpoint={endpoint}&region={region}&chain=1"
    try:
        # 1. A demo through the bucket, keeping the chain.
        demo_dir = os.path.join(args.workdir, "demo")
        demo = subprocess.run(
            [args.refit, "demo", "--model-bytes", "6MiB", "--steps", "3", "--receivers", "2",
             "--producers", "2", "--transport", uri, "--work-dir", demo_dir, "--json"],
            capture_output=True, text=True, timeout=TIMEOUT_S)
        check(demo.returncode == 0, f"refit demo through s3 succeeded: {demo.stderr[-2000:]}")
        steps = [json.loads(line) for line in demo.stdout.splitlines()
                 if line.startswith("{") and "step" in json.loads(line)]
        check(len(steps) == 4 and all(s["digests_verified"] for s in steps),
              f"4 verified steps (FULL + 3 deltas): {[s['kind'] for s in steps]}")

        # 2. boto3 reads what refit wrote.
        index = json.loads(s3.get_object(Bucket=bucket, Key="run/chain/index.json")["Body"].read())
        versions = index["versions"]
        check(index["format"] == "refit-chain/1", "the index names its format")
        check([v["version"] for v in versions] == [1, 2, 3, 4],
              f"versions 1..4 recorded: {[v['version'] for v in versions]}")
        check(versions[0]["anchor"] and not any(v["anchor"] for v in versions[1:]),
              "the chain starts with an anchor followed by deltas")
        check(all(v["base_version"] == v["version"] - 1 for v in versions), "contiguous versions")
        listed = set()
        paginator = s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix="run/"):
            listed.update(obj["Key"] for obj in page.get("Contents", []))
        named = 0
        for v in versions:
            for p in v["payloads"]:
                body = s3.get_object(Bucket=bucket, Key=p["key"])["Body"].read()
                if len(body) != p["size"]:
                    raise AssertionError(f"{p['key']}: {len(body)} bytes, index says {p['size']}")
                if xxhash.xxh3_128_hexdigest(body) != p["checksum"]:
                    raise AssertionError(f"{p['key']}: XXH3-128 differs from the index")
                if body[:4] != b"RFPL":
                    raise AssertionError(f"{p['key']}: no payload magic")
                if v["transfer_id"] not in p["key"]:
                    raise AssertionError(f"{p['key']}: not under transfer {v['transfer_id']}")
                named += 1
        check(named > 4, f"all {named} payload objects readable, sizes and XXH3-128 match")
        check(not any("/live/" in key for key in listed), "no live object left behind")
        check(listed == {p["key"] for v in versions for p in v["payloads"]} |
              {"run/chain/index.json"}, "the bucket holds exactly the chain")

        # 3. A late receiver bootstraps from the trainer's initial checkpoint.
        ready = os.path.join(args.workdir, "late.ready")
        log = open(os.path.join(args.workdir, "late.log"), "w")
        late = subprocess.Popen(
            [args.refit, "serve", "--model", os.path.join(demo_dir, "model.safetensors"),
             "--transport", uri.replace("&chain=1", ""), "--bootstrap", uri,
             "--ready-file", ready],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + TIMEOUT_S
            while not os.path.exists(ready):
                if late.poll() is not None or time.time() > deadline:
                    raise AssertionError("late receiver did not start: " +
                                         open(log.name).read()[-2000:])
                time.sleep(0.1)
            info = json.load(open(ready))
            status = json.load(urllib.request.urlopen(info["control_url"] + "/v1/status"))
            check(status["version"] == 4, f"the late receiver is at version 4: {status['version']}")
            check(status["state_fingerprint"] == versions[-1]["state_fingerprint"],
                  "its state fingerprint equals the chain's newest")
        finally:
            late.send_signal(signal.SIGTERM)
            late.wait(timeout=60)

        # 4. A forged index (one checksum changed, no MAC key in play) is refused.
        forged = json.loads(json.dumps(index))
        forged["versions"][1]["payloads"][0]["checksum"] = "0" * 32
        s3.put_object(Bucket=bucket, Key="run/chain/index.json",
                      Body=json.dumps(forged).encode())
        refused = subprocess.run(
            [args.refit, "serve", "--model", os.path.join(demo_dir, "model.safetensors"),
             "--transport", uri.replace("&chain=1", ""), "--bootstrap", uri],
            capture_output=True, text=True, timeout=TIMEOUT_S)
        check(refused.returncode != 0 and "checksum" in refused.stderr,
              f"a forged chain is refused: {refused.stderr.strip()[-300:]}")

        # 5. A sharded push through the bucket: two trainer ranks (a TCP group), each with only
        # its rows of a new checkpoint and a --layout, write their own payloads; two fresh
        # daemons read them from the bucket and hold the new checkpoint bit for bit.
        sharded_push(args, uri.replace("&chain=1", "").replace("/run?", "/sharded?"),
                     os.path.join(demo_dir, "model.safetensors"))
    finally:
        paginator = s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=obj["Key"])
        s3.delete_bucket(Bucket=bucket)
    return 0


def sharded_push(args, uri, model):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ports import free_port
    from push_demo_test import read_safetensors, read_safetensors_header, shard_checkpoint, write_safetensors

    workdir = os.path.join(args.workdir, "sharded")
    os.makedirs(workdir)
    header = read_safetensors_header(model)
    old = read_safetensors(model)
    # The new checkpoint: one byte in every 97 of every tensor changed.
    new = {}
    for name, data in old.items():
        data = bytearray(data)
        data[::97] = bytes((b ^ 0x01) for b in data[::97])
        new[name] = bytes(data)
    step = os.path.join(workdir, "step.safetensors")
    write_safetensors(step, {name: (header[name]["dtype"], header[name]["shape"], new[name])
                             for name in sorted(new)})
    shards = [shard_checkpoint(step, new, r, 2, workdir) for r in range(2)]

    daemons, logs = [], []
    try:
        for index in range(2):
            ready = os.path.join(workdir, f"d{index}.ready")
            logs.append(open(os.path.join(workdir, f"d{index}.log"), "w"))
            daemons.append((subprocess.Popen(
                [args.refit, "serve", "--model", model, "--transport", uri, "--ready-file", ready,
                 "--save-on-exit", os.path.join(workdir, f"held{index}.safetensors")],
                stdout=logs[-1], stderr=subprocess.STDOUT), ready))
        urls = []
        for proc, ready in daemons:
            deadline = time.time() + TIMEOUT_S
            while not os.path.exists(ready):
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError("a daemon did not start: " + open(logs[0].name).read()[-2000:])
                time.sleep(0.1)
            urls.append(json.load(open(ready))["control_url"])
        group = f"tcp://127.0.0.1:{free_port()}"
        receivers = [flag for url in urls for flag in ("--receiver", url)]
        ranks = [subprocess.Popen(
            [args.refit, "push", shards[r][0], "--layout", shards[r][1], "--group", group,
             "--rank", str(r), "--world-size", "2", "--transport", uri, "--json"] +
            (receivers if r == 0 else []),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        results = [(rank.wait(timeout=TIMEOUT_S), *rank.communicate()) for rank in ranks]
        check(all(code == 0 for code, _, _ in results),
              f"two ranks pushed their shards through s3: {[r[2][-1500:] for r in results]}")
        reports = [json.loads(next(line for line in out.splitlines() if line.startswith("{")))
                   for _, out, _ in results]
        check(all(r["payloads"] > 0 for r in reports),
              f"each rank wrote payloads of its own: {[r['payloads'] for r in reports]}")
    finally:
        for proc, _ in daemons:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        for log in logs:
            log.close()
    for index in range(2):
        got = read_safetensors(os.path.join(workdir, f"held{index}.safetensors"))
        check(got == new, f"daemon {index} holds the new checkpoint bit for bit, from two shards")


if __name__ == "__main__":
    sys.exit(main())
