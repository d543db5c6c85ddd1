#!/usr/bin/python3
"""mpi:// against a raw MPI_Bcast of the dense model and against zmq://, on the same steps.

For each layout (1 producer -> 2 receivers, 2 producers -> 4 receivers) it runs `refit demo` twice
with the same simulated model, seed and densities (1 %, 3 %, 5 %): once as an MPI job
(--transport mpi://, which also times a plain MPI_Bcast of the model's bytes to every rank: the
raw-copy yardstick), once over the zmq:// relay tree to `refit serve` daemons. Every step of
both runs is verified by the demo (state digests at every flush, every receiver's bytes at the
end). Prints a table and, with --json, one JSON object.

    /usr/bin/python3 bench/mpi_bench.py [--refit build/dev/src/apps/refit] [--model-bytes 64MiB]
"""

import argparse
import json
import os
import subprocess
import sys

LAYOUTS = [(1, 2), (2, 4)]
DENSITIES = [0.01, 0.03, 0.05]


def run_demo(refit, transport, producers, receivers, args):
    command = [refit, "demo", "--json", "--model-bytes", args.model_bytes, "--steps", str(len(DENSITIES)),
               "--density", *[str(d) for d in DENSITIES], "--producers", str(producers),
               "--receivers", str(receivers), "--threads", str(args.threads), "--seed", "7"]
    if transport:
        command += ["--transport", transport]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        sys.exit(f"mpi_bench: {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refit", default=os.path.join(os.path.dirname(__file__), "..", "build", "dev",
                                                        "src", "apps", "refit"))
    parser.add_argument("--model-bytes", default="64MiB")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()

    results = []
    for producers, receivers in LAYOUTS:
        mpi = run_demo(args.refit, "mpi://", producers, receivers, args)
        zmq = run_demo(args.refit, "", producers, receivers, args)
        raw = mpi[0]["raw_copy_s"]
        for m, z in zip(mpi, zmq):
            results.append({
                "layout": f"{producers}p->{receivers}r", "step": m["step"], "kind": m["kind"],
                "density": m["density"], "zmq_density": z["density"],
                "mpi_time_s": m["time_s"], "zmq_time_s": z["time_s"], "raw_bcast_s": raw,
                "mpi_vs_raw": m["time_s"] / raw, "mpi_vs_zmq": m["time_s"] / max(z["time_s"], 1e-9),
                "mpi_wire_bytes": m["wire_bytes"], "zmq_wire_bytes": z["wire_bytes"],
                "model_bytes": m["full_wire_bytes"] if m["kind"] == "full" else None,
            })
    if args.json:
        print(json.dumps({"model_bytes": args.model_bytes, "threads": args.threads, "steps": results}))
        return
    header = ["layout", "step", "kind", "density", "mpi time", "zmq time", "raw bcast", "mpi/raw",
              "mpi/zmq", "mpi wire", "zmq wire"]
    rows = [[r["layout"], str(r["step"]), r["kind"], f"{100 * r['density']:.2f}%",
             f"{r['mpi_time_s'] * 1e3:.1f} ms", f"{r['zmq_time_s'] * 1e3:.1f} ms", f"{r['raw_bcast_s'] * 1e3:.1f} ms",
             f"{r['mpi_vs_raw']:.2f}x", f"{r['mpi_vs_zmq']:.2f}x", f"{r['mpi_wire_bytes'] / 2**20:.2f} MiB",
             f"{r['zmq_wire_bytes'] / 2**20:.2f} MiB"] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print(f"mpi:// vs raw MPI_Bcast of the dense model vs zmq://, {args.model_bytes} bf16 model, same steps")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
