#!/usr/bin/env python3
"""Sharded publishing against the gathered path: W trainer ranks as processes, one model.

For each W, the same model and the same steps are published twice by W processes over a TCP
producer group into one receiver:

  sharded   each rank holds only its rows of every tensor (torch.chunk over dim 0, uneven) and
            calls Publisher.sync(local, layout=pieces): it diffs and sends only its own rows;
  gathered  each rank holds the whole model (what FSDP must all-gather today) and calls
            Publisher.sync(model): it diffs and sends the export chunks it owns (k % W).

Figures, per W (median over the runs, spread min-max):
  - a rank's peak memory over (its local tensors + its baseline), sharded: target <= 1.3, the
    fixed overhead (the process before the model: interpreter, refit, its threads) stated and
    not counted; the gathered path's ratio, printed beside it, counts the whole model it holds;
  - wire bytes of the same delta steps, sharded vs gathered: target within 1 % (the anchors'
    apart: their compression follows rates measured during each anchor);
  - a rank's stream time of the delta steps over the bytes it compares (s/GiB: its shard; a
    gathered rank's owned chunks), against one rank publishing the whole model (W = 1).
The receiver is checked bit-identical to the expected model after every run.

  bench/sharded_bench.py                      512 MiB, W = 2, 4, 8, 3 runs (minutes)
  bench/sharded_bench.py --quick              32 MiB, W = 2, 1 run (the CI smoke)
  bench/sharded_bench.py --json out.json      the figures as JSON too
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
TARGET_MEMORY_RATIO = 1.3
TARGET_WIRE_DIFFERENCE = 0.01
COLS = 2048  # bf16 columns per row: 4 KiB rows


# ---- The model: every element a function of (tensor, index, step), so a rank can make its rows
# ---- alone and the driver the whole model, bit-identical.


def tensor_rows(model_mib: int) -> List[int]:
    """Row counts of the model's tensors: about 32 MiB each, none divisible by 2, 4 or 8."""
    count = max(1, model_mib // 32)
    per = model_mib * MIB // (count * COLS * 2)
    return [per + 1 + 2 * i for i in range(count)]


def rows_at(tensor: int, begin: int, end: int, steps: int, density: float) -> np.ndarray:
    """Rows [begin, end) of tensor `tensor` after `steps` optimizer steps, as bf16 bits. Made in
    blocks of rows, so that the generator's temporaries stay small beside the rank's memory."""
    out = np.empty((end - begin, COLS), dtype=np.uint16)
    threshold = np.uint64(int(density * 65536))
    block = 128
    for first in range(begin, end, block):
        last = min(end, first + block)
        index = (np.arange(first, last, dtype=np.uint64)[:, None] * np.uint64(COLS)
                 + np.arange(COLS, dtype=np.uint64)[None, :])
        mixed = index * np.uint64(0x9E3779B97F4A7C15) + np.uint64(((tensor + 1) * 0xBF58476D1CE4E5B9) % (1 << 64))
        bits = (np.uint64(0x3C00) + (mixed >> np.uint64(56))).astype(np.uint16)
        for step in range(1, steps + 1):
            salt = np.uint64((step * 0x94D049BB133111EB) % (1 << 64))
            changed = ((mixed ^ salt) * np.uint64(0xD6E8FEB86659FD93) >> np.uint64(48)) < threshold
            bits ^= changed.astype(np.uint16)
        out[first - begin:last - begin] = bits
    return out


def chunk(n: int, parts: int, index: int):
    size = (n + parts - 1) // parts
    begin = min(n, index * size)
    return begin, min(n, begin + size)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Restart the kernel's resident high-water mark (VmHWM) from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# ---- One rank (this file with --rank) ------------------------------------------------------------


def rank_main(args) -> None:
    import torch  # noqa: PLC0415 — bf16 tensors

    import refit  # noqa: PLC0415

    rows = tensor_rows(args.model_mib)
    receivers = json.loads(args.receivers) if args.rank == 0 else None
    group = refit.tcp_group(args.group, args.rank, args.world, connect_timeout=120)
    publisher = refit.Publisher(receivers=receivers, group=group, transfer_timeout=500)
    fixed = rss_bytes()  # the process before the model: interpreter, torch, refit
    reports = []
    local_bytes = 0
    for step in range(args.steps):
        reset_peak()
        names, locals_, pieces = [], {}, []
        for t, n in enumerate(rows):
            name = f"layers.{t}.weight"
            begin, end = chunk(n, args.world, args.rank) if args.mode == "sharded" else (0, n)
            locals_[name] = torch.from_numpy(rows_at(t, begin, end, step, args.density)).view(torch.bfloat16)
            pieces.append({"tensor": name, "dtype": "bfloat16", "shape": [n, COLS],
                           "offset": [begin, 0], "extent": [end - begin, COLS]})
            names.append(name)
        local_bytes = sum(a.numel() * a.element_size() for a in locals_.values())
        tensors = {name: locals_[name] for name in names}
        started = time.perf_counter()
        if args.mode == "sharded":
            report = publisher.sync(tensors, layout=pieces)
        else:
            report = publisher.sync(tensors)
        reports.append({"anchor": report.anchor, "wire_bytes": report.wire_bytes,
                        "stream_s": report.stream_s, "seconds": time.perf_counter() - started,
                        "peak_bytes": peak_bytes()})
        del locals_, tensors
    result = {"rank": args.rank, "fixed_bytes": fixed, "local_bytes": local_bytes,
              "baseline_bytes": publisher.baseline_bytes, "reports": reports}
    with open(args.out, "w") as f:
        json.dump(result, f)


# ---- The driver ----------------------------------------------------------------------------------


def run_once(args, world: int, mode: str, workdir: str) -> Dict:
    """W rank processes publish `args.steps` steps into one receiver in this process."""
    import torch  # noqa: PLC0415

    import refit  # noqa: PLC0415

    rows = tensor_rows(args.model_mib)
    held = {f"layers.{t}.weight": np.zeros((n, COLS), dtype=np.uint16) for t, n in enumerate(rows)}
    endpoint, group = (f"127.0.0.1:{port}" for port in refit.free_ports(2))
    receiver = refit.Receiver(data_endpoint=endpoint, peers=[endpoint], version=0)
    for name, array in held.items():
        receiver.register(name, torch.from_numpy(array).view(torch.bfloat16))
    receiver.start()
    outs = [os.path.join(workdir, f"{mode}-{world}-{r}.json") for r in range(world)]
    procs = []
    try:
        for r in range(world):
            command = [sys.executable, __file__, "--rank", str(r), "--world", str(world), "--mode", mode,
                       "--group", group, "--model-mib", str(args.model_mib), "--steps", str(args.steps),
                       "--density", str(args.density), "--out", outs[r],
                       "--receivers", json.dumps([list(receiver.endpoint)])]
            procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"{mode} W={world}: a rank failed:\n" + "\n".join(l[-3000:] for l in logs))
        # The fleet holds exactly the model after the last step.
        for t, n in enumerate(rows):
            if not np.array_equal(held[f"layers.{t}.weight"], rows_at(t, 0, n, args.steps - 1, args.density)):
                raise RuntimeError(f"{mode} W={world}: the receiver's tensor {t} differs from the model")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        receiver.stop()
    ranks = []
    for out in outs:
        with open(out) as f:
            ranks.append(json.load(f))
    deltas = [i for i, r in enumerate(ranks[0]["reports"]) if not r["anchor"]]
    def ratio(rank: Dict, steps: List[int]) -> float:
        held = max(1, rank["local_bytes"] + rank["baseline_bytes"])
        return max((rank["reports"][i]["peak_bytes"] - rank["fixed_bytes"]) / held for i in steps)

    anchors = [i for i, r in enumerate(ranks[0]["reports"]) if r["anchor"]]
    memory = max(ratio(r, deltas) for r in ranks)
    peak = max(max(r["reports"][i]["peak_bytes"] for i in deltas) - r["fixed_bytes"] for r in ranks)
    anchor_memory = max(ratio(r, anchors) for r in ranks)
    # Rank 0's report counts the whole transfer's wire bytes. Deltas and anchors apart: an
    # anchor's compression is decided from rates measured during it (AnchorCompression::kAuto).
    wire = sum(ranks[0]["reports"][i]["wire_bytes"] for i in deltas)
    anchor_wire = sum(ranks[0]["reports"][i]["wire_bytes"] for i in anchors)
    # A rank's delta stream time per GiB of what it holds (its shard; the model, gathered).
    shard_gib = max(r["local_bytes"] for r in ranks) / (1 << 30)
    stream = max(sum(r["reports"][i]["stream_s"] for i in deltas) / max(1, len(deltas)) for r in ranks)
    return {"memory_ratio": memory, "anchor_memory_ratio": anchor_memory, "peak_mib": peak / MIB,
            "wire_bytes": wire, "anchor_wire_bytes": anchor_wire, "stream_s": stream,
            "stream_s_per_gib": stream / shard_gib if shard_gib else 0.0,
            "fixed_mib": max(r["fixed_bytes"] for r in ranks) / MIB,
            "local_mib": max(r["local_bytes"] for r in ranks) / MIB,
            "baseline_mib": max(r["baseline_bytes"] for r in ranks) / MIB}


def spread(values: List[float], fmt: str) -> str:
    median = statistics.median(values)
    if len(values) == 1:
        return format(median, fmt)
    return f"{format(median, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 MiB, W = 2, one run (CI)")
    parser.add_argument("--model-mib", type=int, default=512)
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="an anchor, then deltas")
    parser.add_argument("--density", type=float, default=0.03)
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--no-progress", action="store_true")
    # One rank (internal).
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--mode", choices=["sharded", "gathered"])
    parser.add_argument("--group")
    parser.add_argument("--receivers")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args)
        return 0
    if args.quick:
        args.model_mib, args.worlds, args.runs = 32, "2", 1
    worlds = [int(w) for w in args.worlds.split(",")]
    progress = sys.stderr.isatty() and not args.no_progress
    results: Dict[str, Dict] = {}
    with tempfile.TemporaryDirectory(prefix="refit-sharded-bench-") as workdir:
        plan = [(1, "gathered")] + [(w, m) for w in worlds for m in ("sharded", "gathered")]
        for k, (world, mode) in enumerate(plan):
            runs = []
            for run in range(args.runs if world > 1 else 1):
                if progress:
                    print(f"\r[{k + 1}/{len(plan)}] W={world} {mode} run {run + 1}   ", end="", file=sys.stderr, flush=True)
                runs.append(run_once(args, world, mode, workdir))
            results[f"{mode}/{world}"] = {key: [r[key] for r in runs] for key in runs[0]}
    if progress:
        print(file=sys.stderr)
    single = statistics.median(results["gathered/1"]["stream_s_per_gib"])
    rows, figures = [], []
    for world in worlds:
        sharded, gathered = results[f"sharded/{world}"], results[f"gathered/{world}"]
        memory = statistics.median(sharded["memory_ratio"])
        # Today's path, over the same denominator: what the gathered rank needs per byte the
        # sharded rank holds (≈ W: it holds the whole model).
        held_mib = statistics.median(sharded["local_mib"]) + statistics.median(sharded["baseline_mib"])
        gathered_ratio = [p / held_mib for p in gathered["peak_mib"]]
        wire_s, wire_g = statistics.median(sharded["wire_bytes"]), statistics.median(gathered["wire_bytes"])
        wire_difference = abs(wire_s - wire_g) / wire_g if wire_g else 0.0
        anchor_s = statistics.median(sharded["anchor_wire_bytes"])
        anchor_g = statistics.median(gathered["anchor_wire_bytes"])
        # A gathered rank compares and encodes only the chunks it owns, about 1/W of the model:
        # its time per GiB of those, beside the sharded rank's per GiB of its shard.
        gathered_owned = [s_per_gib * world for s_per_gib in gathered["stream_s_per_gib"]]
        figure = {
            "world": world,
            "sharded_memory_ratio": sharded["memory_ratio"],
            "sharded_anchor_memory_ratio": sharded["anchor_memory_ratio"],
            "gathered_memory_ratio_over_the_shard": gathered_ratio,
            "sharded_peak_mib": sharded["peak_mib"], "gathered_peak_mib": gathered["peak_mib"],
            "memory_met": memory <= TARGET_MEMORY_RATIO,
            "fixed_overhead_mib": statistics.median(sharded["fixed_mib"]),
            "sharded_local_mib": statistics.median(sharded["local_mib"]),
            "sharded_baseline_mib": statistics.median(sharded["baseline_mib"]),
            "sharded_wire_bytes": sharded["wire_bytes"], "gathered_wire_bytes": gathered["wire_bytes"],
            "sharded_anchor_wire_bytes": sharded["anchor_wire_bytes"],
            "gathered_anchor_wire_bytes": gathered["anchor_wire_bytes"],
            "wire_difference": wire_difference, "wire_met": wire_difference <= TARGET_WIRE_DIFFERENCE,
            "sharded_stream_s_per_gib": sharded["stream_s_per_gib"],
            "gathered_stream_s_per_gib": gathered["stream_s_per_gib"],
            "gathered_stream_s_per_owned_gib": gathered_owned,
            "single_rank_stream_s_per_gib": single,
        }
        figures.append(figure)
        rows.append([str(world), spread(sharded["memory_ratio"], ".2f"), spread(gathered_ratio, ".2f"),
                     spread(sharded["anchor_memory_ratio"], ".2f"),
                     "MET" if figure["memory_met"] else "NOT MET",
                     f"{wire_s / MIB:.1f}", f"{wire_g / MIB:.1f}", f"{100 * wire_difference:.2f} %",
                     "MET" if figure["wire_met"] else "NOT MET",
                     f"{anchor_s / MIB:.1f} / {anchor_g / MIB:.1f}",
                     spread(sharded["stream_s_per_gib"], ".2f"), spread(gathered_owned, ".2f"),
                     f"{single:.2f}"])
    headers = ["W", "peak/(shard+base) sharded", "gathered", "sharded anchor", f"<= {TARGET_MEMORY_RATIO}",
               "delta wire MiB sharded", "gathered", "diff", "<= 1 %", "anchor MiB s / g",
               "stream s/GiB sharded", "gathered (owned)", "W=1"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    import refit  # noqa: PLC0415

    target = refit.compare_target()
    print(f"sharded publishing: {args.model_mib} MiB bf16 model, {args.steps} steps "
          f"(1 anchor), {args.density:.0%} changed per step, {args.runs} run(s), compare target "
          f"{target}; median (min-max)")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print(f"fixed overhead per rank, not counted: {figures[0]['fixed_overhead_mib']:.0f} MiB "
          "(interpreter, torch, refit, the group, before the model). Peaks are of the delta steps "
          "(the target's); the anchor's is its own column. 'gathered' is over the sharded rank's "
          "shard + baseline, the memory today's path needs for the same rank. Wire: the delta "
          "steps (the target's); an anchor's compression is decided from rates measured during it "
          "(anchor_compression auto), so anchors differ with the run and are shown apart. Stream "
          "s/GiB: per GiB a rank compares (its shard; a gathered rank's owned chunks, 1/W of the "
          f"model), with W processes sharing this machine's {os.cpu_count()} cores; W=1 has them "
          "all.")
    doc = {"compare_target": target, "model_mib": args.model_mib, "steps": args.steps, "density": args.density, "runs": args.runs,
           "figures": figures}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
