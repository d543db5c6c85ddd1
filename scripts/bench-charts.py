#!/usr/bin/python3
"""PNG charts from the benchmarks' JSON (docs/benchmark-results.md shows them next to the tables).

    /usr/bin/python3 scripts/bench-charts.py --e2e e2e.json --mpi mpi.json [--codec codec.json] --out docs/img

  e2e.json    `e2e_bench --sections end-to-end --json-out e2e.json`
  mpi.json    `bench/mpi_bench.py --json > mpi.json`
  codec.json  `codec_bench --json codec.json`

Charts, each only when its input is given:
  refit_time.png     time per refit against density: delta, FULL and the raw copy (e2e_bench,
                     zmq://), and
                     mpi:// delta, zmq:// delta and the raw MPI_Bcast yardstick (mpi_bench)
  memory.png         memory over the model (receiver) and over model + baseline (producer)
                     against changed elements, with the least-squares lines e2e_bench fitted
  wire_entropy.png   wire bytes per changed element against the 0th-order entropy bound of
                     positions + values (codec_bench)
Needs Debian's python3-matplotlib (installed here when missing).
"""

import argparse
import json
import os
import subprocess
import sys


def matplotlib():
    try:
        import matplotlib as mpl  # noqa: F401
    except ImportError:
        print("bench-charts: installing python3-matplotlib", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-q", "python3-matplotlib"], check=True,
                       stdout=subprocess.DEVNULL)
    import matplotlib as mpl
    mpl.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def refit_time(plt, e2e, mpi, out):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if e2e:
        rows = e2e["end_to_end"]["rows"]
        deltas = [r for r in rows if r["kind"] == "delta"]
        full = [r for r in rows if r["kind"] == "full"]
        ax.plot([100 * r["density"] for r in deltas], [r["time_s"] for r in deltas], "o-",
                label=f"delta, zmq:// (e2e_bench, {e2e['end_to_end']['model_bytes'] / 2**30:.1f} GiB)")
        for r in full:
            ax.axhline(r["time_s"], color="C1", linestyle="--", label="FULL, zmq:// (e2e_bench)")
        raw = e2e["end_to_end"].get("raw_copy")
        if raw:
            ax.axhline(raw["seconds"], color="black", linestyle=":",
                       label="raw copy, ZeroMQ loopback (e2e_bench yardstick)")
    if mpi:
        for layout in sorted({s["layout"] for s in mpi["steps"]}):
            steps = [s for s in mpi["steps"] if s["layout"] == layout and s["kind"] == "delta"]
            x = [100 * s["density"] for s in steps]
            ax.plot(x, [s["mpi_time_s"] for s in steps], "s-", label=f"delta, mpi:// {layout} ({mpi['model_bytes']})")
            ax.plot(x, [s["zmq_time_s"] for s in steps], "^:", label=f"delta, zmq:// {layout} ({mpi['model_bytes']})")
            ax.axhline(steps[0]["raw_bcast_s"], linestyle="-.", color="gray", linewidth=1)
            ax.annotate(f"raw MPI_Bcast {layout}", (x[0], steps[0]["raw_bcast_s"]), fontsize=7,
                        xytext=(0, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("changed elements (%)")
    ax.set_ylabel("time per refit (s, log)")
    ax.set_title("refit time against density: delta, FULL and the raw copy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "refit_time.png"), dpi=110)


def memory(plt, e2e, out):
    section = e2e["end_to_end"]
    rows = [r for r in section["rows"] if r["kind"] == "delta"]
    fit = section["memory_fit"]
    changed = [r["changed"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series = (("receiver", "receiver_over_model_bytes", "receiver over the model"),
              ("producer", "producer_over_held_bytes", "producer over model + baseline"))
    for color, (key, column, label) in enumerate(series):
        ax.plot([c / 1e6 for c in changed], [r[column] / 2**20 for r in rows], "o", color=f"C{color}",
                label=label)
        line = fit[key]
        xs = [0, max(changed)]
        ax.plot([x / 1e6 for x in xs], [(line["fixed_bytes"] + line["bytes_per_changed"] * x) / 2**20 for x in xs],
                "-", color=f"C{color}",
                label=f"{key}: {line['fixed_bytes'] / 2**20:.0f} MiB + {line['bytes_per_changed']:.1f} B/changed")
    ax.set_xlabel("changed elements (millions)")
    ax.set_ylabel("peak memory beyond what is held (MiB)")
    ax.set_title(f"memory against changed elements ({section['model_bytes'] / 2**30:.1f} GiB model)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=110)


def wire_entropy(plt, codec, out):
    rows = [r for r in codec.get("encode_apply", []) if "wire_bytes_per_changed" in r]
    if not rows:
        print("bench-charts: codec JSON has no encode rows with wire_bytes_per_changed", file=sys.stderr)
        return
    density = [100 * r["density"] for r in rows]
    bound = [r["entropy_position_bytes_per_changed"] + r["entropy_value_bytes_per_changed"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(density, [r["wire_bytes_per_changed"] for r in rows], "o-", label="wire (payload bytes)")
    ax.plot(density, bound, "s--", label="0th-order entropy of positions + values")
    ax.set_xlabel("changed elements (%)")
    ax.set_ylabel("bytes per changed element")
    ax.set_ylim(bottom=0)
    ax.set_title("wire bytes per changed element against the entropy bound")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "wire_entropy.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--e2e")
    parser.add_argument("--mpi")
    parser.add_argument("--codec")
    parser.add_argument("--out", default="docs/img")
    args = parser.parse_args()
    load = lambda path: json.load(open(path)) if path else None  # noqa: E731
    e2e, mpi, codec = load(args.e2e), load(args.mpi), load(args.codec)
    if not (e2e or mpi or codec):
        parser.error("give at least one of --e2e, --mpi, --codec")
    os.makedirs(args.out, exist_ok=True)
    plt = matplotlib()
    if e2e or mpi:
        refit_time(plt, e2e, mpi, args.out)
    if e2e:
        memory(plt, e2e, args.out)
    if codec:
        wire_entropy(plt, codec, args.out)
    print(f"bench-charts: wrote {', '.join(sorted(os.listdir(args.out)))} in {args.out}")


if __name__ == "__main__":
    main()
