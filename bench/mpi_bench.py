#!/usr/bin/python3
"""mpi:// against a raw MPI_Bcast of the dense model and against zmq://, on the same steps.

For each layout (1 producer -> 2 receivers, 2 producers -> 4 receivers) it runs `refit demo` twice
with the same simulated model, seed and densities (1 %, 3 %, 5 %): once as an MPI job
(--transport mpi://, which also times a plain MPI_Bcast of the model's bytes to every rank: the
raw-copy yardstick), once over the zmq:// relay tree to `refit serve` daemons. Every step of
both runs is verified by the demo (state digests at every flush, every receiver's bytes at the
end). Each layout and transport runs --repeats times (default 3); every figure is the median, with
the min-max spread. Prints a table and, with --json, one JSON object.

    /usr/bin/python3 bench/mpi_bench.py [--refit build/dev/src/apps/refit] [--model-bytes 64MiB]
"""

import argparse
import json
import os
import statistics
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
    parser.add_argument("--repeats", type=int, default=3, help="runs of each layout and transport")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()

    results = []
    for producers, receivers in LAYOUTS:
        # Each run `--repeats` times, alternating: a figure is the median over the runs (the same
        # steps every time: same seed and densities), with its spread.
        mpi_runs, zmq_runs = [], []
        for _ in range(args.repeats):
            mpi_runs.append(run_demo(args.refit, "mpi://", producers, receivers, args))
            zmq_runs.append(run_demo(args.refit, "", producers, receivers, args))
        raw_runs = [run[0]["raw_copy_s"] for run in mpi_runs]
        raw = statistics.median(raw_runs)
        for k, m in enumerate(mpi_runs[0]):
            z = zmq_runs[0][k]
            mpi_times = [run[k]["time_s"] for run in mpi_runs]
            zmq_times = [run[k]["time_s"] for run in zmq_runs]
            mpi_time, zmq_time = statistics.median(mpi_times), statistics.median(zmq_times)
            results.append({
                "layout": f"{producers}p->{receivers}r", "step": m["step"], "kind": m["kind"],
                "density": m["density"], "zmq_density": z["density"],
                "mpi_time_s": mpi_time, "mpi_time_spread_s": [min(mpi_times), max(mpi_times)],
                "zmq_time_s": zmq_time, "zmq_time_spread_s": [min(zmq_times), max(zmq_times)],
                "raw_bcast_s": raw, "raw_bcast_spread_s": [min(raw_runs), max(raw_runs)],
                "mpi_vs_raw": mpi_time / raw, "mpi_vs_zmq": mpi_time / max(zmq_time, 1e-9),
                "mpi_wire_bytes": m["wire_bytes"], "zmq_wire_bytes": z["wire_bytes"],
            })
    if args.json:
        print(json.dumps({"model_bytes": args.model_bytes, "threads": args.threads, "repeats": args.repeats,
                          "steps": results}))
        return
    header = ["layout", "step", "kind", "density", "mpi time", "zmq time", "raw bcast", "mpi/raw",
              "mpi/zmq", "mpi wire", "zmq wire"]
    def ms(value, spread):
        return f"{value * 1e3:.1f} ms ({spread[0] * 1e3:.0f}-{spread[1] * 1e3:.0f})"

    rows = [[r["layout"], str(r["step"]), r["kind"], f"{100 * r['density']:.2f}%",
             ms(r["mpi_time_s"], r["mpi_time_spread_s"]), ms(r["zmq_time_s"], r["zmq_time_spread_s"]),
             ms(r["raw_bcast_s"], r["raw_bcast_spread_s"]),
             f"{r['mpi_vs_raw']:.2f}x", f"{r['mpi_vs_zmq']:.2f}x", f"{r['mpi_wire_bytes'] / 2**20:.2f} MiB",
             f"{r['zmq_wire_bytes'] / 2**20:.2f} MiB"] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print(f"mpi:// vs raw MPI_Bcast of the dense model vs zmq://, {args.model_bytes} bf16 model, same steps; "
          f"median of {args.repeats} runs (min-max)")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
