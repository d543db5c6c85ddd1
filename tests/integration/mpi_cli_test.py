#!/usr/bin/python3
"""`refit push` and `refit serve` as the ranks of one MPI job (--transport mpi://), under mpirun.

Checkpoints are written here with numpy (odd tensor names, a tensor smaller than any chunk,
bf16 and f32), not by refit. Each run is one MPMD job: P ranks of `refit push`, R ranks of
`refit serve --save-on-exit`; push commits, closes the job, and every serve rank writes what it
holds, which is compared here byte for byte with the new checkpoint:
  * a delta (--base) from 2 producers to 2 receivers;
  * a FULL anchor (no --base) of a model smaller than one chunk from 3 producers (more producers
    than chunks: two of them own nothing) to 1 receiver;
  * a push whose layout disagrees with the receivers' (producers=2 against producers=1): every
    rank fails with an error naming the layout, well within the timeout, and no receiver writes
    anything.
Run with Debian's /usr/bin/python3 (python3-numpy).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_roundtrip_test import read_safetensors, realistic_pair, write_safetensors  # noqa: E402
from push_demo_test import check, shard_checkpoint  # noqa: E402

TIMEOUT_S = 240


def mpirun():
    flags = ["--oversubscribe"]
    if os.geteuid() == 0:
        flags.insert(0, "--allow-run-as-root")
    return ["mpirun", *flags]


def job(refit, producers, receivers, push_args, serve_args, workdir, uri, timeout=TIMEOUT_S):
    """Run one MPMD job; return (returncode, output, the files the receivers saved)."""
    saved = [os.path.join(workdir, f"held.{r}.safetensors") for r in range(receivers)]
    for path in saved:
        if os.path.exists(path):
            os.remove(path)
    # Each serve rank saves to its own file: its rank among the receivers comes from Open MPI.
    serve = ["bash", "-c",
             f'exec "$0" "$@" --save-on-exit {workdir}/held.$((OMPI_COMM_WORLD_RANK - {producers})).safetensors',
             refit, "serve", *serve_args, "--transport", uri]
    command = [*mpirun(), "-np", str(producers), refit, "push", *push_args, "--transport", uri,
               "--json", ":", "-np", str(receivers), *serve]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, saved, time.time() - started


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--refit", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    rng = np.random.default_rng(11)

    # A model of several chunks (1 MiB each by default is too coarse for a test: 64 KiB chunks).
    specs = [("model.embed_tokens.weight", "BF16", (256, 160)), ("layers.0/self_attn:q_proj", "BF16", (160, 160)),
             ("layers.0.input_layernorm.weight", "F32", (160,)), ("tiny", "BF16", (3,)),
             ("lm_head.weight", "BF16", (256, 160))]
    old, new = [], []
    for name, code, shape in specs:
        a, b = realistic_pair(rng, code, shape, 0.03)
        old.append((name, code, shape, a))
        new.append((name, code, shape, b))
    base = os.path.join(args.workdir, "base.safetensors")
    step = os.path.join(args.workdir, "step1.safetensors")
    write_safetensors(base, old, {"refit.version": "0"})
    write_safetensors(step, new)
    config = os.path.join(args.workdir, "refit.yaml")
    with open(config, "w") as f:
        f.write("delta_compression:\n  export_chunk_bytes: 64KiB\n")

    uri = "mpi://?producers=2&timeout_ms=60000"
    rc, out, saved, _ = job(args.refit, 2, 2, [step, "--base", base, "--config", config],
                            ["--model", base], args.workdir, uri)
    check(rc == 0, f"a delta from 2 producer ranks to 2 receiver ranks commits (rc {rc}):\n{out[-3000:]}")
    line = json.loads(next(line for line in out.splitlines() if line.startswith('{"') and '"rank":0' in line.replace(" ", "")))
    check(line["kind"] == "delta" and line["version"] == 1 and line["receivers"] == 2,
          f"rank 0 reports a delta to version 1 on both receivers: {line}")
    expected = read_safetensors(step)
    for path in saved:
        held = read_safetensors(path)
        check(all(np.array_equal(held[name][2], expected[name][2]) for name, _, _ in specs),
              f"{os.path.basename(path)} holds the new checkpoint bit for bit")

    # A FULL of a model smaller than one chunk, with more producers than chunks.
    small = [("only/one:tensor", "BF16", (7, 5), realistic_pair(rng, "BF16", (7, 5), 0.5)[1])]
    small_path = os.path.join(args.workdir, "small.safetensors")
    write_safetensors(small_path, small)
    uri3 = "mpi://?producers=3&timeout_ms=60000"
    rc, out, saved, _ = job(args.refit, 3, 1, [small_path], ["--model", small_path], args.workdir, uri3)
    check(rc == 0, f"a FULL from 3 producers (two own nothing) to 1 receiver commits (rc {rc}):\n{out[-3000:]}")
    line = json.loads(next(line for line in out.splitlines() if line.startswith('{"') and '"rank":0' in line.replace(" ", "")))
    check(line["kind"] == "full", f"without --base the push is an anchor: {line['kind']}")
    held = read_safetensors(saved[0])
    check(np.array_equal(held["only/one:tensor"][2], small[0][3]), "the receiver holds the small model exactly")

    # A sharded push: each producer rank holds its rows (torch.chunk over dim 0; the 3-element
    # tensor leaves rank 1 one row) in its own safetensors and a --layout file, and sends only
    # those, as an anchor, through the job's collective transport.
    files = {name: data.tobytes() for name, _, _, data in new}
    for r in range(2):
        shard_checkpoint(step, files, r, 2, args.workdir)
    producer = ["bash", "-c",
                'exec "$0" push "$1/rank$OMPI_COMM_WORLD_RANK.safetensors" '
                '--layout "$1/rank$OMPI_COMM_WORLD_RANK.layout.json" --transport "$2" --json',
                args.refit, args.workdir, uri]
    saved = [os.path.join(args.workdir, f"held.{r}.safetensors") for r in range(2)]
    for path in saved:
        if os.path.exists(path):
            os.remove(path)
    serve = ["bash", "-c",
             f'exec "$0" "$@" --save-on-exit {args.workdir}/held.$((OMPI_COMM_WORLD_RANK - 2)).safetensors',
             args.refit, "serve", "--model", base, "--transport", uri]
    done = subprocess.run([*mpirun(), "-np", "2", *producer, ":", "-np", "2", *serve],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    out = done.stdout + done.stderr
    check(done.returncode == 0, f"a sharded push from 2 ranks (--layout) commits (rc {done.returncode}):\n{out[-3000:]}")
    reports = [json.loads(line) for line in out.splitlines() if line.startswith('{"')]
    check(sorted(r["rank"] for r in reports) == [0, 1] and all(r["payloads"] > 0 for r in reports),
          f"both ranks sent payloads of their own: {reports}")
    for path in saved:
        held = read_safetensors(path)
        check(all(np.array_equal(held[name][2], expected[name][2]) for name, _, _ in specs),
              f"{os.path.basename(path)} holds the new checkpoint bit for bit, from two shards")

    # Producers and receivers given different layouts: refused on every rank, not a hang.
    push_uri = "mpi://?producers=2&timeout_ms=20000"
    serve_uri = "mpi://?producers=1&timeout_ms=20000"
    saved = [os.path.join(args.workdir, "held.mismatch.safetensors")]
    command = [*mpirun(), "-np", "2", args.refit, "push", step, "--base", base, "--transport", push_uri, ":",
               "-np", "2", args.refit, "serve", "--model", base, "--transport", serve_uri,
               "--save-on-exit", saved[0]]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    elapsed = time.time() - started
    output = done.stdout + done.stderr
    check(done.returncode != 0, f"mismatched layouts fail the job (rc {done.returncode})")
    check("every rank must be given the same layout" in output, f"the error names the layout:\n{output[-2000:]}")
    check(elapsed < 20, f"within the timeout ({elapsed:.1f} s)")
    check(not os.path.exists(saved[0]), "no receiver served anything")
    print("mpi_cli_test: all checks passed")


if __name__ == "__main__":
    main()
