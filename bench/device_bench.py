#!/usr/bin/env python3
"""device_bench: a receiver's weights behind the device boundary against the host-mirror path.

One process, one trainer (``refit.torch.Publisher``) and two workers over zmq:// loopback, on the
same bf16 model and the same steps: a worker attached with ``memory="device"`` (every tensor
reached through refit's device boundary by the torch backend, ``refit.torch.TorchTensorMemory`` —
the GPU path, forced on CPU tensors) and one with ``memory="mirror"`` (a host copy of the model,
copied into the module after each commit: what refit did for device tensors before). For deltas
of 1, 3 and 5 % of the elements it measures, per step:

- the bytes that cross the boundary per changed element: the device path's counters (positions,
  old bits, new bits), and the mirror path's whole-model copy after each commit;
- the time from ``sync`` to the module holding the new weights, device ÷ mirror (the mirror path
  counts its copy, which runs in the commit hook).

The syncs alternate between the two workers so that a drift in the machine's load reaches both.
On a CPU the "device" is host memory: the figures measure the boundary's traffic and its call
overhead, not PCIe. Prints a table with the targets (MET / NOT MET) and, with ``--json PATH``,
every figure as JSON. See docs/benchmarking.md ("device_bench").

    PYTHONPATH=python:build/dev/python .venv/bin/python bench/device_bench.py [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

import refit
import refit.torch as rt

TARGET_BYTES_PER_CHANGE = 12.0  # device path, bytes across the boundary per changed element
TARGET_TIME_RATIO = 1.0  # device path ÷ mirror path, sync to weights in place, at <= 5 %
MIB = 1 << 20


class Model(torch.nn.Module):
    """`layers` bf16 matrices of `rows` x 1024 and a norm: a transformer's weights in miniature."""

    def __init__(self, layers: int, rows: int):
        super().__init__()
        self.layers = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(rows, 1024).to(torch.bfloat16), requires_grad=False) for _ in range(layers)]
        )
        self.norm = torch.nn.Parameter(torch.ones(1024, dtype=torch.bfloat16), requires_grad=False)


def perturb(state: Dict[str, torch.Tensor], density: float, generator: torch.Generator) -> None:
    """Change `density` of every tensor's elements, in place (an optimizer step's sparsity)."""
    with torch.no_grad():
        for tensor in state.values():
            flat = tensor.view(-1)
            count = max(1, int(flat.numel() * density))
            index = torch.randperm(flat.numel(), generator=generator)[:count]
            flat[index] = flat[index] + flat[index].abs().clamp(min=1e-2) * 0.5


def wait_for_module(receiver: rt.Receiver) -> None:
    """Return once the commit hook has run (the mirror path copies the model in there)."""
    with receiver._lock:  # noqa: SLF001 — the hook holds it while it copies
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-mib", type=int, default=128, help="model size (default 128 MiB)")
    parser.add_argument("--steps", type=int, default=3, help="steps per density (default 3)")
    parser.add_argument("--quick", action="store_true", help="32 MiB, 2 steps")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()
    if args.quick:
        args.model_mib, args.steps = 32, 2
    refit.set_log_level("warn")
    torch.manual_seed(0)
    layers = 8
    rows = max(1, args.model_mib * MIB // (layers * 1024 * 2))
    trainer = Model(layers, rows)
    state = {n: t.detach() for n, t in trainer.state_dict().items()}
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    workers = {path: Model(layers, rows) for path in ("device", "mirror")}
    for worker in workers.values():
        worker.load_state_dict(trainer.state_dict())
    receivers = {path: rt.Receiver().attach(worker, memory=path).start() for path, worker in workers.items()}
    generator = torch.Generator().manual_seed(1)
    rows_out: List[Dict[str, Any]] = []
    try:
        publishers = {path: rt.Publisher([receiver]) for path, receiver in receivers.items()}
        for publisher in publishers.values():
            publisher.adopt_baseline(state, version=0)
        for density in (0.01, 0.03, 0.05):
            figures: Dict[str, Dict[str, List[float]]] = {p: {"seconds": [], "bytes": []} for p in receivers}
            changed_total = 0
            for step in range(args.steps):
                perturb(state, density, generator)
                order = list(receivers) if step % 2 == 0 else list(reversed(list(receivers)))
                for path in order:
                    receiver = receivers[path]
                    before = receiver.status()
                    start = time.perf_counter()
                    report = publishers[path].sync(state)
                    wait_for_module(receiver)
                    seconds = time.perf_counter() - start
                    after = receiver.status()
                    if path == "device":
                        moved = (after.device_to_bytes - before.device_to_bytes) + (after.device_from_bytes - before.device_from_bytes)
                    else:
                        moved = model_bytes  # the module's copy from the mirror after the commit
                    figures[path]["seconds"].append(seconds)
                    figures[path]["bytes"].append(moved / max(1, report.changed_elements))
                    changed_total = report.changed_elements
                    for name, tensor in workers[path].state_dict().items():
                        if not torch.equal(tensor.view(torch.int16), state[name].view(torch.int16)):
                            raise SystemExit(f"device_bench: the {path} worker's '{name}' differs from the trainer")
            row = {
                "density": density,
                "changed_elements": changed_total,
                "device_bytes_per_change": statistics.median(figures["device"]["bytes"]),
                "mirror_bytes_per_change": statistics.median(figures["mirror"]["bytes"]),
                "device_seconds": statistics.median(figures["device"]["seconds"]),
                "mirror_seconds": statistics.median(figures["mirror"]["seconds"]),
            }
            row["time_ratio"] = row["device_seconds"] / row["mirror_seconds"]
            row["bytes_met"] = row["device_bytes_per_change"] <= TARGET_BYTES_PER_CHANGE
            row["time_met"] = row["time_ratio"] <= TARGET_TIME_RATIO
            rows_out.append(row)
    finally:
        for receiver in receivers.values():
            receiver.stop()

    print(f"device_bench: {model_bytes / MIB:.0f} MiB bf16 model, {args.steps} steps per density, "
          f"CPU tensors (torch {torch.__version__}, refit {refit.__version__}, compare target {refit.compare_target()})")
    print(f"{'delta':>6} {'changed':>10} {'B/change device':>16} {'B/change mirror':>16} {'device s':>9} {'mirror s':>9} {'device/mirror':>14}")
    for row in rows_out:
        print(f"{row['density'] * 100:>5.0f}% {row['changed_elements']:>10} "
              f"{row['device_bytes_per_change']:>10.1f} {'MET' if row['bytes_met'] else 'NOT MET':>5} "
              f"{row['mirror_bytes_per_change']:>16.1f} {row['device_seconds']:>9.3f} {row['mirror_seconds']:>9.3f} "
              f"{row['time_ratio']:>7.2f} {'MET' if row['time_met'] else 'NOT MET':>6}")
    print(f"targets: bytes per changed element <= {TARGET_BYTES_PER_CHANGE:g} (device path); "
          f"time device / mirror <= {TARGET_TIME_RATIO:g} at <= 5 %")
    print("trainer staging of device tensors through pinned buffers: not built — NOT MET")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"model_bytes": model_bytes, "steps": args.steps, "rows": rows_out,
                       "trainer_pinned_staging": "not built"}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
