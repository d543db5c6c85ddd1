#!/usr/bin/env python3
"""python_bench: the Python path against the C++ path, on the same model and steps, in one run.

Four paths sync the same checkpoints (written once by ``refit simulate``: a bf16 model, then
warm-up + K Adam steps at a calibrated density) from a trainer process to a worker process on
loopback (zmq:// data plane, HTTP control plane, an api key on both):

- ``c++ -> c++``       ``trainer_bench`` (bench/trainer_bench.cc: a one-rank C++ Publisher)
                       -> ``refit serve`` (the C++ daemon, model read into memory): the C++ path;
- ``python -> python`` a Python trainer (``refit.torch.Publisher.sync(module)``)
                       -> a Python worker (``refit.torch.Receiver().attach(module)``): the Python
                       path;
- ``python -> c++``, ``c++ -> python``: the mixed pairs, which split the Python path's cost
  between its trainer and its worker.

Both trainers do the same thing: read checkpoint 0 into memory (page-aligned buffers / a torch
module's parameters), adopt it as the baseline, then per command read checkpoint k into the same
memory in place (untimed: the training step) and time one sync, from the call to its return
(the commit). Both load the same refit YAML (chunks, buckets, threads, api key variable); both
workers run at their defaults. All eight processes live through the run, but only one path works
at a time: the checkpoints are synced forward 1..S, back S-1..0, forward again (``--passes``), and
at each one every path syncs once, in an order that rotates, so that a drift in the machine's load
reaches every path alike. Every process records its RSS after start-up (libraries / imports), once
it holds the model, and its peak (VmHWM) during set-up and during the syncs.

By default the C++ processes are the ``refit`` and ``trainer_bench`` of the build tree whose
``refit._core`` the Python processes import (``<build>/python/refit/_core…so``), so that every path
runs the same library build.

Prints a speed table and a memory table with the targets (MET / NOT MET, never adjusted), and
with ``--json PATH`` every figure as JSON. See docs/benchmarking.md ("python_bench").

    PYTHONPATH=python:build/dev/python .venv/bin/python bench/python_bench.py [--quick] [--json F]

Internal modes (this file re-executed as a child): ``--internal-trainer``, ``--internal-worker``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20

# The targets (the figures).
TARGET_TIME_RATIO = 1.1  # python -> python sync time / c++ -> c++, at most
# A process "holds no model-sized copy" when its peak RSS over its start-up RSS exceeds the
# copies it must hold (trainer: model + baseline; worker: model) by less than half a model: a
# second copy of the model would add a whole one.
COPY_THRESHOLD = 0.5

PATHS = [("c++", "c++"), ("python", "python"), ("python", "c++"), ("c++", "python")]
PATH_NAMES = {f"{t}->{w}": (t, w) for t, w in PATHS}

# The run's api key, shared through the environment (never on a command line, where `ps` shows
# it): both planes of every worker check it, as a deployment's would.
API_KEY_ENV = "REFIT_PYTHON_BENCH_API_KEY"

START_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 900.0


# ---- Shared helpers ------------------------------------------------------------------------------


def proc_status(pid: Any = "self") -> Dict[str, int]:
    """VmRSS and VmHWM of process ``pid`` in bytes (0 when unreadable)."""
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def reset_peak(pid: Any = "self") -> bool:
    """Reset VmHWM of ``pid`` to its current RSS (Linux clear_refs); False when not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def read_layout(path: str) -> List[Tuple[str, str, List[int], int, int]]:
    """A safetensors file's tensors in data order: (name, dtype code, shape, file offset, bytes)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        entries.append((begin, name, info["dtype"], list(info["shape"]), end - begin))
    entries.sort()
    return [(name, dtype, shape, 8 + length + begin, size) for begin, name, dtype, shape, size in entries]


def write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as out:
        out.write(text)
    os.replace(path + ".tmp", path)


# ---- Child: the Python trainer and the Python worker ---------------------------------------------


def _torch_module(layout):
    """A torch module with one bf16 (or other) parameter per tensor of ``layout``, uninitialised."""
    import torch  # noqa: PLC0415

    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    root = torch.nn.Module()
    params = []
    for name, dtype, shape, _, _ in layout:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtypes[dtype]), requires_grad=False)
        module.register_parameter(leaf, param)
        params.append(param)
    return root, params


def _byte_views(params):
    import torch  # noqa: PLC0415

    return [p.detach().reshape(-1).view(torch.uint8).numpy() for p in params]


def _read_into(path: str, layout, views) -> None:
    """Read checkpoint ``path`` into ``views`` (flat uint8 arrays over the parameters), in place."""
    file_layout = read_layout(path)
    if [(n, s) for n, _, _, _, s in file_layout] != [(n, s) for n, _, _, _, s in layout]:
        raise SystemExit(f"{path}: not the tensors of checkpoint 0")
    with open(path, "rb", buffering=0) as f:
        for (_, _, _, offset, size), view in zip(file_layout, views):
            f.seek(offset)
            memory = memoryview(view)
            done = 0
            while done < size:
                got = f.readinto(memory[done:])
                if not got:
                    raise SystemExit(f"{path}: unexpected end of file")
                done += got


def _emit(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def run_python_trainer(args) -> None:
    """The Python trainer: trainer_bench's protocol (see bench/trainer_bench.cc), over a torch module."""
    rss = {}
    import torch  # noqa: PLC0415

    import refit  # noqa: PLC0415
    import refit.torch  # noqa: PLC0415

    rss["start"] = proc_status()["VmRSS"]
    t0 = time.perf_counter()
    layout = read_layout(args.checkpoints[0])
    module, params = _torch_module(layout)
    views = _byte_views(params)
    _read_into(args.checkpoints[0], layout, views)
    load_s = time.perf_counter() - t0
    rss["loaded"] = proc_status()["VmRSS"]
    receivers = [tuple(spec.split("=", 1)) for spec in args.receiver]
    publisher = refit.torch.Publisher(receivers, config=refit.Config.load(args.config))
    t0 = time.perf_counter()
    publisher.adopt_baseline(module, version=0)
    adopt_s = time.perf_counter() - t0
    rss["adopted"] = proc_status()["VmRSS"]
    rss["peak_setup"] = proc_status()["VmHWM"]
    rss["peak_reset"] = reset_peak()
    _emit({
        "ready": True, "trainer": "python", "model_bytes": sum(e[4] for e in layout), "tensors": len(layout),
        "load_s": load_s, "adopt_s": adopt_s, "python": sys.version.split()[0], "torch": torch.__version__,
        "refit": refit.__version__, "core": os.path.abspath(refit._core.__file__),
    })
    for line in sys.stdin:
        command = line.split()
        if command == ["end"]:
            break
        if len(command) != 2 or command[0] != "sync" or not command[1].isdigit() or int(command[1]) >= len(args.checkpoints):
            raise SystemExit(f"stdin: expected 'sync K' or 'end', got {line!r}")
        t0 = time.perf_counter()
        _read_into(args.checkpoints[int(command[1])], layout, views)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = publisher.sync(module)
        wall_s = time.perf_counter() - t0
        _emit({
            "checkpoint": int(command[1]), "wall_s": wall_s, "refit_s": report.seconds,
            "prepare_s": report.prepare_s, "stream_s": report.stream_s, "flush_s": report.flush_s,
            "commit_s": report.commit_s, "anchor": report.anchor, "version": report.version,
            "payloads": report.payloads, "wire_bytes": report.wire_bytes,
            "changed": report.changed_elements, "elements": report.total_elements, "read_s": read_s,
        })
    status = proc_status()
    rss["peak_syncs"], rss["end"] = status["VmHWM"], status["VmRSS"]
    _emit({"rss": rss})


def run_python_worker(args) -> None:
    rss = {}
    import numpy as np  # noqa: PLC0415

    import refit.torch  # noqa: PLC0415 (imports torch)

    rss["start"] = proc_status()["VmRSS"]
    t0 = time.perf_counter()
    layout = read_layout(args.model)
    module, params = _torch_module(layout)
    views = _byte_views(params)
    _read_into(args.model, layout, views)
    load_s = time.perf_counter() - t0
    rss["loaded"] = proc_status()["VmRSS"]
    key = os.environ.get(API_KEY_ENV)
    options = {"api_key": key, "transport": f"zmq://?api_key_env={API_KEY_ENV}"} if key else {}
    receiver = refit.torch.Receiver(**options).attach(module).start()
    status = proc_status()
    rss["ready"], rss["peak_setup"] = status["VmRSS"], status["VmHWM"]
    rss["peak_reset"] = reset_peak()
    control_url, data_endpoint = receiver.endpoint
    write_atomically(args.ready_file, json.dumps({
        "pid": os.getpid(), "control_url": control_url, "data_endpoint": data_endpoint,
        "version": receiver.version, "tensors": len(layout),
    }) + "\n")
    version = receiver.wait_for_version(args.final_version, timeout=RUN_TIMEOUT_S)
    status = proc_status()
    rss["peak_syncs"], rss["end"] = status["VmHWM"], status["VmRSS"]
    # After the figures: the module's own memory must hold the last checkpoint, bit for bit.
    pointers_kept = all(v.ctypes.data == p.data_ptr() for v, p in zip(views, params))
    mismatched = []
    with open(args.verify, "rb") as f:
        for (name, _, _, offset, size), view in zip(read_layout(args.verify), views):
            f.seek(offset)
            if not np.array_equal(np.frombuffer(f.read(size), np.uint8), view):
                mismatched.append(name)
    receiver.stop()
    result = {
        "worker": "python", "model_bytes": sum(e[4] for e in layout), "load_s": load_s,
        "version": version, "rss": rss, "verified": not mismatched and pointers_kept,
        "mismatched": mismatched[:5], "module_memory_kept": pointers_kept,
    }
    write_atomically(args.result_file, json.dumps(result) + "\n")


# ---- The benchmark -------------------------------------------------------------------------------


class Failure(Exception):
    pass


def fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{sign}{value:.3g} {unit}" if value < 100 else f"{sign}{value:.0f} {unit}"
    return f"{sign}{n:.0f} B"


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def table(headers: List[str], rows: List[List[str]], right: Optional[List[bool]] = None) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    right = right or [i > 0 for i in range(len(headers))]

    def line(cells):
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def free_port() -> int:
    # refit's chooser (outside the ephemeral range), loaded by path: this driver runs the CLI
    # before it imports the extension.
    spec = importlib.util.spec_from_file_location(
        "refit_ports", os.path.join(REPO, "python", "refit", "_ports.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.free_port()


class Bench:
    def __init__(self, args):
        self.args = args
        self.children: List[subprocess.Popen] = []
        self.progress = sys.stderr.isatty() and not args.no_progress
        self.work = args.work_dir or tempfile.mkdtemp(prefix="refit-python-bench-")
        os.makedirs(self.work, exist_ok=True)
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = args.python_path or os.environ.get("PYTHONPATH") or os.pathsep.join(
            [os.path.join(REPO, "python"), os.path.join(REPO, "build", "dev", "python")])
        self.env[API_KEY_ENV] = secrets.token_hex(16)

    def say(self, text: str) -> None:
        if self.progress:
            sys.stderr.write(f"\r\033[Kpython_bench: {text}")
            sys.stderr.flush()

    def done_saying(self) -> None:
        if self.progress:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    def spawn(self, argv: List[str], log: str) -> subprocess.Popen:
        out = open(os.path.join(self.work, log), "w")
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 env=self.env, start_new_session=True)
        out.close()
        self.children.append(child)
        return child

    def log_tail(self, log: str, chars: int = 1500) -> str:
        try:
            with open(os.path.join(self.work, log)) as f:
                return f.read()[-chars:]
        except OSError:
            return "(no log)"

    def wait_exit(self, child: subprocess.Popen, log: str, timeout: float, what: str) -> None:
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise Failure(f"{what} did not finish within {timeout:.0f} s; its log:\n{self.log_tail(log)}")
        if code != 0:
            raise Failure(f"{what} exited with status {code}; its log:\n{self.log_tail(log)}")

    def wait_ready(self, path: str, child: subprocess.Popen, log: str, what: str) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(path):
            if child.poll() is not None:
                raise Failure(f"{what} exited ({child.returncode}) before it was ready; its log:\n{self.log_tail(log)}")
            if time.monotonic() > deadline:
                raise Failure(f"{what} not ready within {START_TIMEOUT_S:.0f} s; its log:\n{self.log_tail(log)}")
            time.sleep(0.01)
        with open(path) as f:
            return json.load(f)

    def stop_children(self) -> None:
        for child in self.children:
            if child.poll() is None:
                try:
                    child.terminate()
                    child.wait(timeout=15)
                except (subprocess.TimeoutExpired, OSError):
                    child.kill()
                    child.wait()

    # -- set-up

    def find_binaries(self) -> None:
        """The Python core the children import, and by default the refit and trainer_bench of its build."""
        args = self.args
        probe = subprocess.run(
            [sys.executable, "-c", "import os, refit._core as c; print(os.path.realpath(c.__file__))"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, env=self.env)
        if probe.returncode != 0:
            raise Failure(f"{sys.executable} cannot import refit._core with PYTHONPATH={self.env['PYTHONPATH']}: "
                          f"build the refit_python target or pass --python-path\n{probe.stderr[-1500:]}")
        self.core = probe.stdout.strip()
        build = os.path.dirname(os.path.dirname(os.path.dirname(self.core)))  # <build>/python/refit/_core…so
        self.refit = os.path.realpath(args.refit_binary or os.path.join(build, "src", "apps", "refit"))
        self.trainer = os.path.realpath(args.trainer_binary or os.path.join(build, "bench", "trainer_bench"))
        for what, binary, flag, target in (("refit", self.refit, "--refit-binary", "refit"),
                                           ("trainer_bench", self.trainer, "--trainer-binary", "trainer_bench")):
            if not os.access(binary, os.X_OK):
                raise Failure(f"no {what} executable at {binary} (the build of the Python core {self.core}): "
                              f"build its {target} target there, or pass {flag}")
        # The paths compare like with like only when the C++ processes and the Python core run the
        # same library build.
        self.same_build = all(os.path.commonpath([build, b]) == build for b in (self.refit, self.trainer))

    def make_checkpoints(self) -> dict:
        args = self.args
        count = 1 + args.warmup + args.steps
        out = os.path.join(self.work, "checkpoints")
        self.say(f"refit simulate: {count} checkpoints of {args.model_mib} MiB")
        t0 = time.monotonic()
        sim = subprocess.run(
            [self.refit, "simulate", "-o", out, "--model-bytes", f"{args.model_mib}MiB",
             "--checkpoints", str(count), "--density", str(args.density), "--seed", str(args.seed),
             "--threads", str(args.threads)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, env=self.env)
        simulate_s = time.monotonic() - t0
        if sim.returncode != 0:
            raise Failure(f"refit simulate failed ({sim.returncode}):\n{sim.stderr[-2000:]}")
        self.checkpoints = [os.path.join(out, f"step_{k:04d}.safetensors") for k in range(count)]
        changed = {}
        for line in sim.stdout.splitlines():
            cells = line.split()
            if len(cells) == 5 and cells[0].isdigit() and cells[3].isdigit():
                changed[int(cells[0])] = int(cells[3])
        layout = read_layout(self.checkpoints[0])
        self.model_bytes = sum(e[4] for e in layout)
        return {"bytes": self.model_bytes, "tensors": len(layout), "dtype": layout[0][1],
                "checkpoints": count, "simulate_s": simulate_s,
                "changed_per_step": [changed.get(k) for k in range(1, count)]}

    def write_config(self) -> str:
        args = self.args
        path = os.path.join(self.work, "refit.yaml")
        text = (
            "delta_compression:\n"
            f"  export_chunk_bytes: {args.chunk_mib * MIB}\n"
            f"  sparse_bucket_size_bytes: {args.bucket_mib * MIB}\n"
            "tuning:\n"
            f"  encode_workers: {args.threads}\n"
            f"  serialize_workers: {args.threads}\n"
            f"  transfer_workers: {args.threads}\n"
            f"http_refit_api_key_env_var: {API_KEY_ENV}\n")
        write_atomically(path, text)
        return path

    # -- one path

    def serve_start_rss(self) -> int:
        """The RSS of a `refit serve` holding a one-element model, once ready: its start-up RSS
        (libraries, threads, sockets), which an external process cannot sample before it loads."""
        tiny = os.path.join(self.work, "tiny.safetensors")
        header = json.dumps({"t": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}).encode()
        header += b" " * (-len(header) % 8)
        with open(tiny, "wb") as out:
            out.write(struct.pack("<Q", len(header)) + header + b"\0\0")
        ready = os.path.join(self.work, "tiny.ready")
        child = self.spawn([self.refit, "serve", "--model", tiny, "--data-port", str(free_port()),
                            "--api-key-env", API_KEY_ENV, "--ready-file", ready], "tiny.log")
        self.wait_ready(ready, child, "tiny.log", "refit serve of a one-element model")
        rss = proc_status(child.pid)["VmRSS"]
        child.terminate()
        self.wait_exit(child, "tiny.log", 30, "refit serve of a one-element model")
        return rss

    def schedule(self) -> List[int]:
        """The checkpoint each sync moves the workers to: forward 1..S, back S-1..0, forward again…"""
        last = self.args.warmup + self.args.steps
        order = []
        for p in range(self.args.passes):
            order += list(range(1, last + 1)) if p % 2 == 0 else list(range(last - 1, -1, -1))
        return order

    # -- processes of one path

    def start_worker(self, path: dict) -> None:
        kind, tag = path["worker"], path["tag"]
        path["worker_ready"] = os.path.join(self.work, f"{tag}.worker.ready")
        path["worker_log"] = f"{tag}.worker.log"
        if kind == "c++":
            path["worker_proc"] = self.spawn(
                [self.refit, "serve", "--model", self.checkpoints[0], "--data-port", str(free_port()),
                 "--api-key-env", API_KEY_ENV, "--ready-file", path["worker_ready"]], path["worker_log"])
        else:
            path["worker_result_file"] = os.path.join(self.work, f"{tag}.worker.json")
            path["worker_proc"] = self.spawn(
                [sys.executable, os.path.abspath(__file__), "--internal-worker", "--model", self.checkpoints[0],
                 "--ready-file", path["worker_ready"], "--result-file", path["worker_result_file"],
                 "--final-version", str(len(self.order)), "--verify", self.checkpoints[self.order[-1]]],
                path["worker_log"])

    def worker_ready(self, path: dict) -> None:
        child = path["worker_proc"]
        path["endpoint"] = self.wait_ready(path["worker_ready"], child, path["worker_log"],
                                           f"the {path['worker']} worker of {path['name']}")
        if path["worker"] == "c++":
            # refit serve is a plain executable: read its memory from outside.
            status = proc_status(child.pid)
            path["worker_rss"] = {"start": self.serve_start, "loaded": status["VmRSS"], "peak_setup": status["VmHWM"],
                                  "peak_reset": reset_peak(child.pid)}

    def start_trainer(self, path: dict, config: str) -> None:
        info = path["endpoint"]
        common = ["--config", config, "--receiver", f"{info['control_url']}={info['data_endpoint']}"]
        if path["trainer"] == "c++":
            argv = [self.trainer] + common + self.checkpoints
        else:
            argv = [sys.executable, os.path.abspath(__file__), "--internal-trainer"] + common + self.checkpoints
        path["trainer_log"] = f"{path['tag']}.trainer.log"
        log = open(os.path.join(self.work, path["trainer_log"]), "w")
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                 bufsize=1, env=self.env, start_new_session=True)
        log.close()
        self.children.append(child)
        path["trainer_proc"] = child

    def trainer_says(self, path: dict, what: str) -> dict:
        """The trainer's next JSON line, or Failure with its log when it exits first."""
        child = path["trainer_proc"]
        ready, _, _ = select.select([child.stdout], [], [], RUN_TIMEOUT_S)
        line = child.stdout.readline() if ready else ""
        if not line:
            if child.poll() is None:
                child.kill()
            child.wait()
            raise Failure(f"the {path['trainer']} trainer of {path['name']} gave no answer ({what}; exit "
                          f"{child.returncode}); its log:\n{self.log_tail(path['trainer_log'])}")
        return json.loads(line)

    def tell_trainer(self, path: dict, command: str) -> None:
        try:
            path["trainer_proc"].stdin.write(command + "\n")
            path["trainer_proc"].stdin.flush()
        except BrokenPipeError:
            pass  # trainer_says reports the exit and the log

    def verify_daemon(self, control_url: str, checkpoint: str) -> Tuple[bool, List[str]]:
        """Download every tensor from a `refit serve` daemon and compare it with ``checkpoint``."""
        mismatched = []
        with open(checkpoint, "rb") as f:
            for name, _, _, offset, size in read_layout(checkpoint):
                request = urllib.request.Request(
                    f"{control_url}/v1/tensors/{name}",
                    headers={"Authorization": f"Bearer {self.env[API_KEY_ENV]}"})
                with urllib.request.urlopen(request, timeout=120) as response:
                    held = response.read()
                f.seek(offset)
                if held != f.read(size):
                    mismatched.append(name)
        return not mismatched, mismatched[:5]

    def finish_path(self, path: dict) -> None:
        self.tell_trainer(path, "end")
        path["trainer_rss"] = self.trainer_says(path, "at the end")["rss"]
        path["trainer_proc"].stdin.close()
        self.wait_exit(path["trainer_proc"], path["trainer_log"], 60, f"the {path['trainer']} trainer of {path['name']}")
        worker = path["worker_proc"]
        last = self.checkpoints[self.order[-1]]
        if path["worker"] == "c++":
            status = proc_status(worker.pid)
            path["worker_rss"].update(peak_syncs=status["VmHWM"], end=status["VmRSS"])
            path["verified"], path["mismatched"] = self.verify_daemon(path["endpoint"]["control_url"], last)
            worker.terminate()
            self.wait_exit(worker, path["worker_log"], 30, f"refit serve of {path['name']}")
        else:
            self.wait_exit(worker, path["worker_log"], RUN_TIMEOUT_S, f"the python worker of {path['name']}")
            with open(path["worker_result_file"]) as f:
                result = json.load(f)
            path["worker_rss"] = result["rss"]
            path["verified"], path["mismatched"] = result["verified"], result["mismatched"]
        if not path["verified"]:
            raise Failure(f"{path['name']}: the worker does not hold checkpoint {self.order[-1]}: {path['mismatched']}")

    # -- figures

    def memory_row(self, role: str, kind: str, rss: dict, copies: int, changed: int) -> dict:
        start = rss.get("start", 0)
        peak = max(rss.get("peak_setup", 0), rss.get("peak_syncs", 0))
        expected = copies * self.model_bytes

        def over(value: int) -> int:
            return value - start - expected

        return {
            "role": role, "kind": kind, "start": start, "loaded": rss.get("loaded", 0),
            "peak_setup": rss.get("peak_setup", 0), "peak_syncs": rss.get("peak_syncs", 0),
            "peak_reset": rss.get("peak_reset", False), "peak": peak,
            "peak_over_start_in_models": (peak - start) / self.model_bytes,
            "expected_copies": copies, "over_expected_bytes": over(peak),
            "over_expected_in_models": over(peak) / self.model_bytes,
            "over_setup_bytes": over(rss.get("peak_setup", 0)), "over_syncs_bytes": over(rss.get("peak_syncs", 0)),
            "over_syncs_per_changed_element": over(rss.get("peak_syncs", 0)) / changed if changed else None,
            "no_model_copy": over(peak) < COPY_THRESHOLD * self.model_bytes,
            "no_model_copy_during_syncs": over(rss.get("peak_syncs", 0)) < COPY_THRESHOLD * self.model_bytes,
        }

    def summarise(self, path: dict) -> dict:
        syncs = path["syncs"]
        timed = syncs[self.args.warmup:]
        walls = [s["wall_s"] for s in timed]
        most_changed = max(s["changed"] for s in syncs)
        return {
            "trainer": path["trainer"], "worker": path["worker"], "timed_syncs": len(timed),
            "median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls), "total_s": sum(walls),
            "median_refit_s": statistics.median(s["refit_s"] for s in timed),
            "median_call_overhead_s": statistics.median(s["wall_s"] - s["refit_s"] for s in timed),
            "median_read_s": statistics.median(s["read_s"] for s in timed),
            "changed_per_sync": statistics.median(s["changed"] for s in timed),
            "wire_per_sync": statistics.median(s["wire_bytes"] for s in timed),
            "payloads_per_sync": statistics.median(s["payloads"] for s in timed),
            "memory": [self.memory_row("trainer", path["trainer"], path["trainer_rss"], 2, most_changed),
                       self.memory_row("worker", path["worker"], path["worker_rss"], 1, most_changed)],
            "verified": path["verified"], "trainer_info": path["trainer_info"], "syncs": syncs,
        }

    def run(self) -> dict:
        args = self.args
        load_start = list(os.getloadavg())
        t_start = time.monotonic()
        self.find_binaries()
        model = self.make_checkpoints()
        config = self.write_config()
        self.order = self.schedule()
        self.serve_start = self.serve_start_rss()
        kinds = [PATH_NAMES[p] for p in args.paths]
        if ("c++", "c++") not in kinds:
            kinds.insert(0, ("c++", "c++"))
        paths = [{"name": f"{t}->{w}", "trainer": t, "worker": w, "tag": f"{t}-{w}".replace("+", "p"),
                  "syncs": []} for t, w in kinds]
        # Every path's processes live through the whole run; only one of them works at a time.
        for number, path in enumerate(paths, 1):
            self.say(f"starting the workers ({number}/{len(paths)})")
            self.start_worker(path)
            self.worker_ready(path)
        for number, path in enumerate(paths, 1):
            self.say(f"starting the trainers ({number}/{len(paths)})")
            self.start_trainer(path, config)
            path["trainer_info"] = self.trainer_says(path, "when ready")
        # One sync of every path per checkpoint, the paths' order rotating from one checkpoint to
        # the next, so that a drift in the machine's load reaches every path alike.
        for i, checkpoint in enumerate(self.order):
            for j in range(len(paths)):
                path = paths[(i + j) % len(paths)]
                self.say(f"sync {i + 1}/{len(self.order)} (checkpoint {checkpoint}): {path['name']}")
                self.tell_trainer(path, f"sync {checkpoint}")
                step = self.trainer_says(path, f"sync {i + 1}")
                if step["anchor"]:
                    raise Failure(f"{path['name']}: sync {i + 1} was a FULL anchor where a delta was expected")
                path["syncs"].append(step)
        for number, path in enumerate(paths, 1):
            self.say(f"stopping and verifying ({number}/{len(paths)})")
            self.finish_path(path)
        self.done_saying()
        summary = {path["name"]: self.summarise(path) for path in paths}
        base = summary["c++->c++"]
        for entry in summary.values():
            entry["ratio_median"] = entry["median_s"] / base["median_s"]
            entry["ratio_total"] = entry["total_s"] / base["total_s"]
        changed = {json.dumps([s["changed"] for s in p["syncs"]]) for p in paths}
        wire = {json.dumps([s["wire_bytes"] for s in p["syncs"]]) for p in paths}
        forward = model["changed_per_step"]  # step k: checkpoint k-1 -> k
        expected_changed = [forward[max(k, prev) - 1] for prev, k in zip([0] + self.order, self.order)]
        checks = {
            "changed_identical": len(changed) == 1,
            "changed_equals_simulate": all(json.loads(c) == expected_changed for c in changed),
            "wire_identical": len(wire) == 1,
            "workers_verified": all(p["verified"] for p in paths),
        }
        cpp_info = paths[0]["trainer_info"]
        py_info = next((p["trainer_info"] for p in paths if p["trainer"] == "python"), {})
        targets = {}
        py = summary.get("python->python")
        if py is not None:
            targets["time"] = {
                "what": "python -> python median sync time / c++ -> c++ median sync time",
                "target": TARGET_TIME_RATIO, "measured": py["ratio_median"],
                "measured_total": py["ratio_total"], "met": py["ratio_median"] <= TARGET_TIME_RATIO}
        rows = [row for entry in summary.values() for row in entry["memory"]]
        for role, copies in (("trainer", 2), ("worker", 1)):
            for kind in ("python", "c++"):
                mine = [r for r in rows if r["role"] == role and r["kind"] == kind]
                if not mine:
                    continue
                worst = max(mine, key=lambda r: r["over_expected_bytes"])
                targets[f"{kind}_{role}_rss"] = {
                    "what": f"every {kind} {role} process: peak RSS - start-up RSS - {copies} x model < "
                            f"{COPY_THRESHOLD} x model (no model-sized copy)",
                    "target_of_the_python_path": kind == "python",
                    "worst_over_expected_bytes": worst["over_expected_bytes"],
                    "worst_over_expected_in_models": worst["over_expected_in_models"],
                    "worst_over_syncs_bytes": max(r["over_syncs_bytes"] for r in mine),
                    "met": all(r["no_model_copy"] for r in mine),
                    "met_during_syncs": all(r["no_model_copy_during_syncs"] for r in mine)}
        return {
            "benchmark": "python_bench",
            "machine": {"hardware_threads": os.cpu_count(),
                        "compare_simd_target": cpp_info.get("compare_simd_target"),
                        "load_average_start": load_start, "load_average_end": list(os.getloadavg()),
                        "python": py_info.get("python"), "torch": py_info.get("torch"),
                        "refit": py_info.get("refit")},
            "binaries": {"refit": self.refit, "trainer_bench": self.trainer, "python_core": self.core,
                         "python": sys.executable, "same_build": self.same_build},
            "serve_start_rss": self.serve_start,
            "options": {"model_mib": args.model_mib, "steps": args.steps, "warmup": args.warmup,
                        "passes": args.passes, "density": args.density, "threads": args.threads,
                        "chunk_mib": args.chunk_mib, "bucket_mib": args.bucket_mib, "seed": args.seed,
                        "paths": [p["name"] for p in paths], "quick": args.quick},
            "model": model,
            "schedule": self.order,
            "paths": summary,
            "targets": targets,
            "checks": checks,
            "elapsed_s": time.monotonic() - t_start,
        }


def print_report(doc: dict) -> None:
    m, opts, mach = doc["model"], doc["options"], doc["machine"]
    syncs = len(doc["schedule"])
    print(f"== python_bench: the Python path against the C++ path: bf16 model {fmt_bytes(m['bytes'])} "
          f"({m['tensors']} tensors) and {m['checkpoints'] - 1} Adam steps at {opts['density'] * 100:g}% density "
          f"from `refit simulate`; per path one trainer process -> one worker process on loopback (zmq:// + "
          f"HTTP control, api key), {syncs} syncs each ({opts['passes']} passes over the checkpoints, forward "
          f"and back; the first {opts['warmup']} of them untimed), the paths' syncs interleaved; {opts['threads']} "
          f"threads/stage, chunks {opts['chunk_mib']} MiB, buckets {opts['bucket_mib']} MiB; compare SIMD "
          f"target {mach['compare_simd_target']}, {mach['hardware_threads']} hardware threads")
    rows = []
    for name, e in doc["paths"].items():
        rows.append([e["trainer"], e["worker"], str(e["timed_syncs"]), f"{e['changed_per_sync']:.0f}",
                     fmt_bytes(e["wire_per_sync"]), f"{e['payloads_per_sync']:.0f}", fmt_s(e["median_s"]),
                     fmt_s(e["min_s"]), fmt_s(e["max_s"]), fmt_s(e["total_s"]), f"{e['ratio_median']:.3f}x",
                     f"{e['ratio_total']:.3f}x", fmt_s(e["median_refit_s"]),
                     f"{e['median_call_overhead_s'] * 1e3:.1f} ms"])
    print(table(["trainer", "worker", "syncs", "changed/sync", "wire/sync", "payloads", "sync", "min", "max",
                 "total", "vs c++", "total vs c++", "core refit", "call - core"], rows,
                [False, False] + [True] * 12))
    print("sync = median over the timed syncs of the trainer's sync call, from the call to its return after the "
          "commit (c++: Publisher::Sync; python: refit.torch.Publisher.sync(module)); vs c++ = over the "
          "c++ -> c++ median (total vs c++: the sums); core refit = the median of the report's own Refit time "
          "(Coordinator::Refit); call - core = the median of (call - core refit) per sync: what the call adds "
          "around the transfer")
    t = doc["targets"].get("time")
    if t:
        print(f"target: the Python path within {t['target']}x the C++ path's time: {t['measured']:.3f}x "
              f"(median; {t['measured_total']:.3f}x total) -> {'MET' if t['met'] else 'NOT MET'}"
              + (" (--quick: smoke sizes, a few syncs of tens of ms, where Python's fixed cost per call "
                 "weighs most; the target is stated for the default sizes)" if opts["quick"] else ""))
    print()
    rows = []
    for name, e in doc["paths"].items():
        for r in e["memory"]:
            per_changed = r["over_syncs_per_changed_element"]
            rows.append([name, r["role"], r["kind"], fmt_bytes(r["start"]), fmt_bytes(r["loaded"]),
                         fmt_bytes(r["peak_setup"]), fmt_bytes(r["peak_syncs"]) + ("" if r["peak_reset"] else "*"),
                         f"{r['peak_over_start_in_models']:.3f}", str(r["expected_copies"]),
                         fmt_bytes(r["over_setup_bytes"]), fmt_bytes(r["over_syncs_bytes"]),
                         f"{per_changed:.1f} B" if per_changed is not None else "-",
                         "yes" if r["no_model_copy"] else "NO"])
    print(table(["path", "process", "kind", "start", "loaded", "peak set-up", "peak syncs", "(peak-start)/model",
                 "copies", "over set-up", "over syncs", "syncs/changed", "no copy"], rows,
                [False, False, False] + [True] * 10))
    print(f"start = RSS after start-up (c++ trainer: at main; python: after importing torch and refit; refit "
          f"serve: the RSS of a `refit serve` of a one-element model once ready); loaded = RSS holding the model (worker: once "
          f"ready); peak set-up = VmHWM before the first sync (trainer: after adopting the baseline; worker: "
          f"after loading and starting); peak syncs = VmHWM during the syncs (reset before them; * = could not "
          f"reset: the peak since start); peak = the larger; copies = the model copies the process must hold "
          f"(trainer: model + baseline, worker: model); over = peak - start - copies x model "
          f"({fmt_bytes(m['bytes'])}), of either peak; syncs/changed = over syncs per changed element of the "
          f"largest sync; no copy = the larger over < {COPY_THRESHOLD} x model")
    for role in ("trainer", "worker"):
        for kind in ("python", "c++"):
            t = doc["targets"].get(f"{kind}_{role}_rss")
            if t is None:
                continue
            label = "target" if kind == "python" else "for comparison"
            print(f"{label}: no model-sized copy in a {kind} {role} process: worst over "
                  f"{fmt_bytes(t['worst_over_expected_bytes'])} = {t['worst_over_expected_in_models']:.3f} x model "
                  f"-> {'MET' if t['met'] else 'NOT MET'}"
                  + ("" if t["met"] == t["met_during_syncs"] else
                     f" (during the syncs alone: {fmt_bytes(t['worst_over_syncs_bytes'])} -> "
                     f"{'met' if t['met_during_syncs'] else 'not met'})"))
    c = doc["checks"]
    yes = lambda b: "yes" if b else "NO"  # noqa: E731
    print(f"checks: changed elements identical on every path at every sync: {yes(c['changed_identical'])} (and "
          f"equal to refit simulate's counts: {yes(c['changed_equals_simulate'])}); wire bytes identical: "
          f"{yes(c['wire_identical'])}; every worker holds the last checkpoint bit for bit: {yes(c['workers_verified'])}")
    b = doc["binaries"]
    print(f"binaries: {b['refit']}, {b['trainer_bench']}, python core {b['python_core']}"
          + ("" if b["same_build"] else "  WARNING: not one build tree: the paths may run different library code"))
    print(f"model simulated in {m['simulate_s']:.1f} s; python {mach['python']}, torch {mach['torch']}, refit "
          f"{mach['refit']}; load average {' '.join(f'{x:.2f}' for x in mach['load_average_start'])} at the "
          f"start, {' '.join(f'{x:.2f}' for x in mach['load_average_end'])} at the end; {doc['elapsed_s']:.0f} s in all")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--internal-trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--internal-worker", action="store_true", help=argparse.SUPPRESS)
    # Children's flags.
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--receiver", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--final-version", type=int, help=argparse.SUPPRESS)
    p.add_argument("--verify", help=argparse.SUPPRESS)
    p.add_argument("checkpoints", nargs="*", help=argparse.SUPPRESS)
    # The benchmark's.
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run (< 30 s)")
    p.add_argument("--model-mib", type=int, help="model size in MiB (default 256; --quick 32)")
    p.add_argument("--steps", type=int, help="Adam steps after the warm-up one(s): checkpoints 0..warmup+steps "
                                             "(default 5; --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first syncs of every path (default 1)")
    p.add_argument("--density", type=float, default=0.01, help="changed fraction per step (default 0.01)")
    p.add_argument("--passes", type=int, help="passes over the checkpoints, forward then back (default 3; --quick 2)")
    p.add_argument("--paths", default=",".join(PATH_NAMES),
                   help="comma-separated paths among " + ", ".join(PATH_NAMES) + " (default all; c++->c++ is always run)")
    p.add_argument("--threads", type=int, default=2, help="threads per producer stage (default 2)")
    p.add_argument("--chunk-mib", type=int, help="export chunk (default: model / 32, 1..64 MiB)")
    p.add_argument("--bucket-mib", type=int, default=32, help="payload bucket (default 32)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH ('-': stdout, no tables)")
    p.add_argument("--work-dir", help="where checkpoints and logs go (default: a fresh /tmp directory, "
                                      "removed on success, kept on failure)")
    p.add_argument("--keep-work-dir", action="store_true")
    p.add_argument("--refit-binary", help="the refit executable (default: the one of the Python core's build, "
                                          "<build>/src/apps/refit)")
    p.add_argument("--trainer-binary", help="trainer_bench (default: <build>/bench/trainer_bench of the core's build)")
    p.add_argument("--python-path",
                   help="PYTHONPATH of the Python processes (default: $PYTHONPATH, else python:build/dev/python); "
                        "the refit._core it imports decides the build whose refit and trainer_bench run")
    p.add_argument("--no-progress", action="store_true", help="no progress line even on a terminal")
    args = p.parse_args(argv)
    if not (args.internal_trainer or args.internal_worker):
        args.model_mib = args.model_mib or (32 if args.quick else 256)
        args.steps = args.steps or (2 if args.quick else 5)
        args.passes = args.passes or (2 if args.quick else 3)
        if args.chunk_mib is None:
            args.chunk_mib = min(64, max(1, args.model_mib // 32))
        args.paths = [s.strip() for s in args.paths.split(",") if s.strip()]
        unknown = [s for s in args.paths if s not in PATH_NAMES]
        if unknown:
            p.error(f"--paths: unknown {unknown}; choose among {list(PATH_NAMES)}")
        if not 0 < args.density < 1:
            p.error("--density must be in (0, 1)")
        if args.steps < 1 or args.passes < 1 or args.warmup < 0 or args.model_mib < 1:
            p.error("--steps, --passes and --model-mib must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.internal_trainer:
        run_python_trainer(args)
        return 0
    if args.internal_worker:
        run_python_worker(args)
        return 0
    bench = Bench(args)
    ok = False

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        doc = bench.run()
        ok = True
    except Failure as failure:
        bench.done_saying()
        sys.stderr.write(f"python_bench: FAILED: {failure}\npython_bench: work directory kept: {bench.work}\n")
        return 1
    except KeyboardInterrupt:
        bench.done_saying()
        sys.stderr.write(f"python_bench: interrupted; work directory kept: {bench.work}\n")
        return 130
    finally:
        bench.stop_children()
        if ok and not (args.keep_work_dir or args.work_dir):
            shutil.rmtree(bench.work, ignore_errors=True)
    if args.json == "-":
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        if args.json:
            write_atomically(args.json, json.dumps(doc, indent=1) + "\n")
        print_report(doc)
    # The targets' verdicts are figures; a failed check (different changes or bytes on the same
    # steps) means the comparison itself is broken.
    failed = [name for name, ok in doc["checks"].items() if not ok]
    if failed:
        sys.stderr.write(f"python_bench: FAILED checks: {', '.join(failed)}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
