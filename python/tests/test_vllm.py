"""Tests of refit.vllm against stand-ins for vLLM (test_vllm_engine.py drives the real, pinned one).

The stand-ins copy what refit.vllm relies on from vLLM main (2026-09):

- a worker with ``model_runner.model``, ``device``, ``rank``, ``vllm_config.parallel_config``,
  whose class gets the extension the way ``WorkerWrapperBase.init_worker`` does it (refuse any
  non-dunder name the worker class has, then append the extension to ``__bases__``), and whose
  weight-transfer methods keep the session flag the way ``gpu_worker.Worker`` does (a failing
  ``update_weights`` ends the session, a failing ``finish_weight_update`` does not);
- an ``LLM`` whose ``collective_rpc`` runs the method on every worker, collects failures, and
  returns the results through pickle (vLLM serializes them), and whose
  ``finish_weight_update(weight_version)`` sets the version only after the RPC returned;
- a module tree ``vllm.distributed[.weight_transfer.{base,factory}]``, ``vllm.config`` with the
  base classes, the lazy-import factory and the TP-rank accessors at their real paths.

Two workers at TP=2 hold a vLLM-style sharded model (fused qkv_proj and gate_up_proj, column- and
row-parallel linears); the trainer holds the canonical (Hugging Face-style) model.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import os
import pickle
import subprocess
import sys
import threading
import time
import types
from types import SimpleNamespace
from typing import Any, Dict, Generic, List, Optional, TypeVar

import pytest

torch = pytest.importorskip("torch")

import refit  # noqa: E402
import refit.torch  # noqa: E402
import refit.vllm as rv  # noqa: E402
from refit._ports import free_port_block  # noqa: E402

TP = 2
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 8, 4, 2, 2, 16, 16
ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"

#: The trainer's (canonical) tensors: name → shape. The last one is a buffer.
CANONICAL = {
    "model.embed_tokens.weight": (VOCAB, HIDDEN),
    f"{ATTN}.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
    f"{ATTN}.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    f"{ATTN}.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
    f"{ATTN}.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
    f"{MLP}.gate_proj.weight": (INTERMEDIATE, HIDDEN),
    f"{MLP}.up_proj.weight": (INTERMEDIATE, HIDDEN),
    f"{MLP}.down_proj.weight": (HIDDEN, INTERMEDIATE),
    "model.layers.0.input_layernorm.weight": (HIDDEN,),
    "model.norm.weight": (HIDDEN,),
    "lm_head.weight": (VOCAB, HIDDEN),
    "model.layers.0.mlp.scale": (4,),
}
BUFFERS = {"model.layers.0.mlp.scale"}

#: One TP rank's tensors, as a vLLM model holds them.
LOCAL = {
    "model.embed_tokens.weight": (VOCAB // TP, HIDDEN),
    f"{ATTN}.qkv_proj.weight": ((HEADS + 2 * KV_HEADS) * HEAD_DIM // TP, HIDDEN),
    f"{ATTN}.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM // TP),
    f"{MLP}.gate_up_proj.weight": (2 * INTERMEDIATE // TP, HIDDEN),
    f"{MLP}.down_proj.weight": (HIDDEN, INTERMEDIATE // TP),
    "model.layers.0.input_layernorm.weight": (HIDDEN,),
    "model.norm.weight": (HIDDEN,),
    "lm_head.weight": (VOCAB // TP, HIDDEN),
    "model.layers.0.mlp.scale": (4,),
}

#: The loader rules of vLLM's fused tensors (regexes over canonical names; `to` names the local one).
FUSED = [
    {
        "kind": "qkv",
        "q": r"(.*)\.q_proj\.weight",
        "k": r"(.*)\.k_proj\.weight",
        "v": r"(.*)\.v_proj\.weight",
        "to": "$1.qkv_proj.weight",
        "num_heads": HEADS,
        "num_kv_heads": KV_HEADS,
    },
    {"kind": "gate_up", "gate": r"(.*)\.gate_proj\.weight", "up": r"(.*)\.up_proj\.weight", "to": "$1.gate_up_proj.weight"},
]

OPTIONS = {"canonical_shapes": {name: list(shape) for name, shape in CANONICAL.items()}, "fused": FUSED}


# --------------------------------------------------------------------------------------------
# Models


class Tiny(torch.nn.Module):
    """A module tree built from dotted names, with a forward pass (so the gate has one to hold)."""

    def forward(self, x):  # noqa: D401 — a stand-in forward
        return x * 2


def build_module(shapes: Dict[str, tuple], seed: int, buffers=BUFFERS) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    root = Tiny()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        value = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name in buffers:
            module.register_buffer(leaf, value)
        else:
            module.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
    return root


def tensors_of(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


def expected_shard(trainer: torch.nn.Module, rank: int) -> Dict[str, torch.Tensor]:
    """The rank's local tensors, sliced by hand from the canonical ones (not by refit)."""
    sd = {name: tensor.detach() for name, tensor in tensors_of(trainer).items()}

    def rows(t, parts=TP):
        n = t.shape[0] // parts
        return t[rank * n : (rank + 1) * n]

    def cols(t):
        n = t.shape[1] // TP
        return t[:, rank * n : (rank + 1) * n]

    return {
        "model.embed_tokens.weight": rows(sd["model.embed_tokens.weight"]),
        f"{ATTN}.qkv_proj.weight": torch.cat(
            [rows(sd[f"{ATTN}.q_proj.weight"]), rows(sd[f"{ATTN}.k_proj.weight"]), rows(sd[f"{ATTN}.v_proj.weight"])]
        ),
        f"{ATTN}.o_proj.weight": cols(sd[f"{ATTN}.o_proj.weight"]),
        f"{MLP}.gate_up_proj.weight": torch.cat([rows(sd[f"{MLP}.gate_proj.weight"]), rows(sd[f"{MLP}.up_proj.weight"])]),
        f"{MLP}.down_proj.weight": cols(sd[f"{MLP}.down_proj.weight"]),
        "model.layers.0.input_layernorm.weight": sd["model.layers.0.input_layernorm.weight"],
        "model.norm.weight": sd["model.norm.weight"],
        "lm_head.weight": rows(sd["lm_head.weight"]),
        "model.layers.0.mlp.scale": sd["model.layers.0.mlp.scale"],
    }


def assert_bit_identical(worker_model: torch.nn.Module, trainer: torch.nn.Module, rank: int) -> None:
    local = tensors_of(worker_model)
    expected = expected_shard(trainer, rank)
    assert set(local) == set(expected)
    for name, want in expected.items():
        got = local[name]
        assert got.shape == want.shape, name
        assert torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32)), f"rank {rank}: {name} differs"


def perturb(trainer: torch.nn.Module, step: int) -> None:
    """An optimizer step's worth of change: a few 1-ulp moves per tensor, every norm changed."""
    generator = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for name, tensor in tensors_of(trainer).items():
            flat = tensor.view(-1)
            count = flat.numel() if name.endswith("norm.weight") else 3
            index = torch.randperm(flat.numel(), generator=generator)[:count]
            flat[index] = torch.nextafter(flat[index], torch.full_like(flat[index], float("inf")))


# --------------------------------------------------------------------------------------------
# vLLM stand-ins

#: The worker a FakeLLM is calling right now (vLLM's parallel state is per process; the
#: stand-in workers share this one).
_CURRENT = threading.local()


class FakeWorkerBase:
    """The attributes refit.vllm uses of ``vllm.v1.worker.gpu_worker.Worker``, and its names.

    The weight-transfer methods copy the session handling of the real worker: ``update_weights``
    that raises ends the session; ``finish_weight_update`` that raises leaves it open.
    """

    def __init__(self, rank: int, model: torch.nn.Module, weight_transfer_config: Any = None):
        self.rank = self.local_rank = rank
        self.device = torch.device("cpu")
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=TP, pipeline_parallel_size=1, data_parallel_rank=0),
            weight_transfer_config=weight_transfer_config,
            instance_id="a1b2c3d4e5f6",
        )
        self.model_runner = SimpleNamespace(model=model)
        self.weight_transfer_engine = None
        self._weight_update_active = False

    # Names the real worker has (vLLM refuses an extension that redefines any of them).
    def init_device(self): ...
    def get_model(self): return self.model_runner.model
    def execute_model(self, scheduler_output): ...
    def sleep(self, level: int = 1): ...
    def wake_up(self, tags=None): ...
    def check_health(self): ...
    def reset_lora_state(self): ...

    def load_model(self) -> None:
        config = self.vllm_config.weight_transfer_config
        if config is not None:
            from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

            self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
                config, self.vllm_config, self.device, self.model_runner.model
            )

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        engine = self.weight_transfer_engine
        engine.init_transfer_engine(engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self.weight_transfer_engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info: dict) -> None:
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.weight_transfer_engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            self.weight_transfer_engine.reset_weight_update_target()
            raise

    def finish_weight_update(self) -> None:
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.weight_transfer_engine.finish_weight_update()
        self.weight_transfer_engine.reset_weight_update_target()
        self._weight_update_active = False

    def shutdown(self) -> None:
        if self.weight_transfer_engine is not None:
            self.weight_transfer_engine.shutdown()


def make_worker_class(extension: Optional[type] = rv.RefitWorkerExtension) -> type:
    """A fresh worker class with ``extension`` injected as vLLM's WorkerWrapperBase does."""

    class Worker(FakeWorkerBase):
        pass

    if extension is not None:
        for attr in dir(extension):
            if attr.startswith("__"):
                continue
            assert not hasattr(Worker, attr), f"the extension redefines the worker's {attr!r}"
        Worker.__bases__ = Worker.__bases__ + (extension,)
    return Worker


class FakeLLM:
    """``vllm.LLM``'s collective_rpc and weight-transfer methods, over in-process workers."""

    def __init__(self, workers: List[FakeWorkerBase]):
        self.workers = workers
        self.weight_version = "default"

    def collective_rpc(self, method: str, timeout: Optional[float] = None, args: tuple = (), kwargs: Optional[dict] = None):
        results, failures = [], []
        for worker in self.workers:
            _CURRENT.worker = worker
            try:
                results.append(pickle.loads(pickle.dumps(getattr(worker, method)(*args, **(kwargs or {})))))
            except Exception as error:  # every worker runs the RPC; the caller sees a failure
                failures.append(error)
            finally:
                _CURRENT.worker = None
        if failures:
            raise failures[0]
        return results

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": request["init_info"]})

    def start_weight_update(self) -> None:
        self.collective_rpc("start_weight_update")

    def update_weights(self, request: dict) -> None:
        self.collective_rpc("update_weights", kwargs={"update_info": request["update_info"]})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self.weight_version = weight_version


def fake_vllm_modules() -> Dict[str, types.ModuleType]:
    """vLLM's weight-transfer module tree at its real paths, with its base classes and factory."""
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    distributed = types.ModuleType("vllm.distributed")
    distributed.__path__ = []
    distributed.get_tensor_model_parallel_rank = lambda: _CURRENT.worker.rank % TP
    distributed.get_tensor_model_parallel_world_size = lambda: TP
    weight_transfer = types.ModuleType("vllm.distributed.weight_transfer")
    weight_transfer.__path__ = []
    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    factory = types.ModuleType("vllm.distributed.weight_transfer.factory")
    config = types.ModuleType("vllm.config")

    @dataclasses.dataclass
    class WeightTransferConfig:
        backend: str = "nccl"

    TInit = TypeVar("TInit")
    TUpdate = TypeVar("TUpdate")

    @dataclasses.dataclass
    class WeightTransferInitInfo(abc.ABC):  # noqa: B024
        pass

    @dataclasses.dataclass
    class WeightTransferUpdateInfo(abc.ABC):  # noqa: B024
        pass

    class WeightTransferEngine(abc.ABC, Generic[TInit, TUpdate]):
        init_info_cls: type
        update_info_cls: type
        supports_draft_weight_update: bool = True
        synchronizes = 0

        def __init__(self, config, vllm_config, device, model):
            self.config = config
            self.vllm_config = vllm_config
            self.parallel_config = vllm_config.parallel_config
            self.device = device
            self.model = model
            self._default_model = model

        def set_weight_update_target(self, model, model_config):
            self.model = model

        def reset_weight_update_target(self):
            self.model = self._default_model

        def parse_init_info(self, init_dict):
            try:
                return self.init_info_cls(**init_dict)
            except TypeError as e:
                raise ValueError(f"Invalid init_info for {self.__class__.__name__}: {e}") from e

        def parse_update_info(self, update_dict):
            try:
                return self.update_info_cls(**update_dict)
            except TypeError as e:
                raise ValueError(f"Invalid update_info for {self.__class__.__name__}: {e}") from e

        @abc.abstractmethod
        def init_transfer_engine(self, init_info): ...

        @abc.abstractmethod
        def start_weight_update(self): ...

        @abc.abstractmethod
        def finish_weight_update(self): ...

        def abort_weight_update(self): ...

        def update_weights(self, update_info):
            self.receive_weights(self.parse_update_info(update_info))
            WeightTransferEngine.synchronizes += 1  # torch.accelerator.synchronize() in vLLM

        @abc.abstractmethod
        def receive_weights(self, update_info): ...

        @abc.abstractmethod
        def shutdown(self): ...

    class WeightTransferEngineFactory:
        _registry: dict = {}

        @classmethod
        def register_engine(cls, name, module_path_or_cls, class_name=None):
            if name in cls._registry:
                raise ValueError(f"Weight transfer engine '{name}' is already registered.")
            if isinstance(module_path_or_cls, str):
                def loader():
                    return getattr(importlib.import_module(module_path_or_cls), class_name)
                cls._registry[name] = loader
            else:
                cls._registry[name] = lambda: module_path_or_cls

        @classmethod
        def create_engine(cls, config, vllm_config, device, model):
            if config.backend not in cls._registry:
                raise ValueError(f"Invalid weight transfer backend: {config.backend}.")
            return cls._registry[config.backend]()(config, vllm_config, device, model)

    WeightTransferEngineFactory.register_engine("nccl", lambda: None)
    base.WeightTransferInitInfo = WeightTransferInitInfo
    base.WeightTransferUpdateInfo = WeightTransferUpdateInfo
    base.WeightTransferEngine = WeightTransferEngine
    factory.WeightTransferEngineFactory = WeightTransferEngineFactory
    config.WeightTransferConfig = WeightTransferConfig
    vllm.distributed, vllm.config = distributed, config
    distributed.weight_transfer = weight_transfer
    weight_transfer.base, weight_transfer.factory = base, factory
    return {
        "vllm": vllm,
        "vllm.config": config,
        "vllm.distributed": distributed,
        "vllm.distributed.weight_transfer": weight_transfer,
        "vllm.distributed.weight_transfer.base": base,
        "vllm.distributed.weight_transfer.factory": factory,
    }


@pytest.fixture
def fake_vllm(monkeypatch):
    """Install the stand-in vLLM tree for one test; refit.vllm.engine binds to its base class."""
    modules = fake_vllm_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "refit.vllm.engine", raising=False)
    yield modules
    sys.modules.pop("refit.vllm.engine", None)


@pytest.fixture
def trainer():
    return build_module(CANONICAL, seed=1)


def start_workers(llm: FakeLLM, **extra: Any) -> List[dict]:
    """The extension's start: reserve every data endpoint, then start with the relay tree."""
    reservations = llm.collective_rpc("refit_reserve", kwargs={"options": OPTIONS})
    return llm.collective_rpc("refit_start", kwargs={"options": dict(OPTIONS, peers=rv.peers_of(reservations), **extra)})


def free_port_base(count: int) -> int:
    """A port p with p … p+count-1 free now (chosen as refit.vllm chooses free ports)."""
    return free_port_block(count)


# --------------------------------------------------------------------------------------------
# The worker extension


def test_extension_refits_tp2_workers_in_place(trainer):
    worker_class = make_worker_class()
    workers = [worker_class(rank, build_module(LOCAL, seed=50 + rank)) for rank in range(TP)]
    llm = FakeLLM(workers)
    infos = start_workers(llm)
    try:
        assert [info["tp_rank"] for info in infos] == [0, 1]
        assert infos[0]["replica"] == infos[1]["replica"] == "vllm-a1b2c3d4e5f6-dp0"
        assert infos[0]["control_url"] != infos[1]["control_url"]
        assert infos[0]["peers"] == infos[1]["peers"] == [info["producer_endpoint"] for info in infos]
        pointers = [{n: t.data_ptr() for n, t in tensors_of(w.model_runner.model).items()} for w in workers]

        publisher = refit.torch.Publisher(receivers=rv.receivers_of(infos))
        versions = []
        for step in range(3):
            if step:
                perturb(trainer, step)
            report = publisher.sync(trainer)
            versions.append(report.version)
            for rank, worker in enumerate(workers):
                assert_bit_identical(worker.model_runner.model, trainer, rank)
            assert llm.collective_rpc("refit_version") == [report.version] * TP
        assert versions == sorted(set(versions)), versions
        assert [{n: t.data_ptr() for n, t in tensors_of(w.model_runner.model).items()} for w in workers] == pointers

        statuses = llm.collective_rpc("refit_status")
        for status in statuses:
            assert status["version"] == versions[-1]
            assert status["state"] == "idle"
            # Every transfer changed each shard's norms, so each began applying and ended.
            assert status["pauses"] == 3 and status["commits"] == 3 and status["aborts"] == 0
            assert status["applying"] is False and status["gate_closed"] is False
            assert status["last_error"] is None
        assert llm.collective_rpc("refit_wait_for_version", args=(versions[-1], 1.0)) == [versions[-1]] * TP
        with pytest.raises(refit.DeadlineExceeded):
            llm.collective_rpc("refit_wait_for_version", args=(versions[-1] + 1, 0.2))
        # Generation still runs through the model after the commits (the gate is open).
        assert torch.equal(workers[0].model_runner.model(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        stops = llm.collective_rpc("refit_stop")
    assert all(stop is not None for stop in stops)
    assert llm.collective_rpc("refit_stop") == [None, None]
    with pytest.raises(refit.FailedPrecondition):
        llm.collective_rpc("refit_version")


def test_extension_refuses_device_memory_and_bad_options():
    worker_class = make_worker_class()
    model = build_module(LOCAL, seed=3)
    model.model.norm.weight = torch.nn.Parameter(torch.empty(HIDDEN, device="meta"), requires_grad=False)
    worker = worker_class(0, model)
    with pytest.raises(refit.InvalidArgument, match=r"'model\.norm\.weight'.*meta device"):
        worker.refit_start(OPTIONS)
    with pytest.raises(refit.InvalidArgument, match="unknown key"):
        worker_class(0, build_module(LOCAL, seed=3)).refit_start({"canonical_shape": {}})
    with pytest.raises(refit.InvalidArgument, match="canonical_shapes"):
        worker_class(0, build_module(LOCAL, seed=3)).refit_start({})  # TP=2 without a loader


def test_tp2_workers_on_free_ports_without_peers_refit(trainer):
    # No refit_reserve and no peers: each transfer's prepare names the relay tree, in the order
    # receivers_of lists the workers (replica, DP rank, TP rank).
    worker_class = make_worker_class()
    workers = [worker_class(rank, build_module(LOCAL, seed=70 + rank)) for rank in range(TP)]
    llm = FakeLLM(workers)
    infos = llm.collective_rpc("refit_start", kwargs={"options": OPTIONS})
    try:
        assert all(not info["peers"] for info in infos)
        publisher = refit.torch.Publisher(receivers=rv.receivers_of(list(reversed(infos))))
        for step in range(2):
            if step:
                perturb(trainer, step)
            report = publisher.sync(trainer)
            for rank, worker in enumerate(workers):
                assert_bit_identical(worker.model_runner.model, trainer, rank)
            assert llm.collective_rpc("refit_version") == [report.version] * TP
    finally:
        llm.collective_rpc("refit_stop")


def test_parallel_coordinates_prefer_vllm_state(fake_vllm):
    worker = SimpleNamespace(rank=0)
    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=TP, data_parallel_rank=3))
    _CURRENT.worker = SimpleNamespace(rank=1)  # vLLM's TP group says rank 1, the worker's rank 0
    try:
        assert rv.parallel_coordinates(worker, config, rv.RefitOptions()) == (1, TP, 3)
        assert rv.parallel_coordinates(worker, config, rv.RefitOptions(tp_rank=0, tp_size=1)) == (0, 1, 3)
        config.parallel_config.pipeline_parallel_size = 2
        with pytest.raises(refit.InvalidArgument, match="pipeline_parallel_size=2"):
            rv.parallel_coordinates(worker, config, rv.RefitOptions())
    finally:
        _CURRENT.worker = None


def test_receivers_follow_the_relay_tree_order():
    reservations = [
        {"data_endpoint": "h:2", "tp_rank": 1, "tp_size": 2, "dp_rank": 0, "replica": "a"},
        {"data_endpoint": "h:1", "tp_rank": 0, "tp_size": 2, "dp_rank": 0, "replica": "a"},
    ]
    peers = rv.peers_of(reservations)
    assert peers == ["h:1", "h:2"]
    infos = [
        {"control_url": "http://h:20", "producer_endpoint": "h:2", "tp_rank": 1, "replica": "a", "peers": peers},
        {"control_url": "http://h:10", "producer_endpoint": "h:1", "tp_rank": 0, "replica": "a", "peers": peers},
    ]
    assert rv.receivers_of(infos) == [("http://h:10", "h:1"), ("http://h:20", "h:2")]
    with pytest.raises(refit.InvalidArgument, match="missing"):
        rv.receivers_of(infos[:1])  # a peer without a receiver: the tree would forward to it
    with pytest.raises(refit.InvalidArgument, match="different peers"):
        rv.receivers_of([infos[0], dict(infos[1], peers=["h:1"])])
    with pytest.raises(refit.InvalidArgument, match="repeated"):
        rv.peers_of(reservations + reservations[:1])
    with pytest.raises(refit.InvalidArgument, match="receiver_kwargs may not set"):
        rv.RefitOptions.from_dict({"receiver_kwargs": {"replica": "x"}})


def test_forward_gate_holds_forward_until_opened():
    model = Tiny()
    gate = rv.ForwardGate()
    gate.install(model)
    assert gate.close(drain_timeout=1.0)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (model(torch.ones(1)), done.set()))
    thread.start()
    assert not done.wait(0.2), "a forward pass ran while the gate was closed"
    gate.open()
    assert done.wait(2.0)
    thread.join()
    gate.remove()
    assert gate.in_flight == 0 and not gate.closed


def test_forward_gate_counts_out_a_forward_pass_that_raises():
    class Failing(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("forward failed")

    model = Failing()
    gate = rv.ForwardGate()
    gate.install(model)
    with pytest.raises(RuntimeError, match="forward failed"):
        model(torch.ones(1))
    assert gate.in_flight == 0, "a raising forward pass stayed counted in flight"
    assert gate.close(drain_timeout=0.1), "close waited for a forward pass that had raised"
    gate.remove()


@pytest.mark.parametrize("memory", [{"mirror": True}, {"memory": "device"}], ids=["mirror", "device"])
def test_extension_memory_options_write_the_model_in_place(trainer, memory):
    """mirror=True (a host copy, copied in at commit) and memory="device" (the GPU path forced on
    host tensors: applied in place through the torch backend of the device boundary): either way
    the model's own tensors hold the trainer's bits, at the same data_ptr()s."""
    worker_class = make_worker_class()
    workers = [worker_class(rank, build_module(LOCAL, seed=60 + rank)) for rank in range(TP)]
    llm = FakeLLM(workers)
    infos = start_workers(llm, **memory)
    try:
        pointers = [{n: t.data_ptr() for n, t in tensors_of(w.model_runner.model).items()} for w in workers]
        publisher = refit.torch.Publisher(receivers=rv.receivers_of(infos))
        for step in range(2):
            if step:
                perturb(trainer, step)
            publisher.sync(trainer)
            for rank, worker in enumerate(workers):
                assert_bit_identical(worker.model_runner.model, trainer, rank)
        assert [{n: t.data_ptr() for n, t in tensors_of(w.model_runner.model).items()} for w in workers] == pointers
        for worker in workers:
            status = worker._refit_runtime.receiver.status()
            through_boundary = status.device_to_bytes > 0 and status.device_from_bytes > 0
            assert through_boundary == ("memory" in memory), status
    finally:
        llm.collective_rpc("refit_stop")


# --------------------------------------------------------------------------------------------
# The native weight-transfer engine


def engine_fleet(fake_vllm, trainer) -> tuple:
    from vllm.config import WeightTransferConfig

    assert rv.register() is True
    assert rv.register() is True  # the plugin runs again in a process: no error
    factory = fake_vllm["vllm.distributed.weight_transfer.factory"].WeightTransferEngineFactory
    assert "refit" in factory._registry
    worker_class = make_worker_class()
    workers = [worker_class(rank, build_module(LOCAL, seed=70 + rank), WeightTransferConfig(backend="refit")) for rank in range(TP)]
    for worker in workers:
        worker.load_model()
    llm = FakeLLM(workers)
    # One broadcast init: fixed ports, so the engine's workers are the relay tree's peers.
    llm.init_weight_transfer_engine({"init_info": dict(OPTIONS, wait_timeout=5.0, data_port=free_port_base(TP))})
    infos = llm.collective_rpc("refit_info")  # the extension reads the engine's receiver
    return llm, workers, infos


def test_engine_publishes_weight_version_only_after_commit(fake_vllm, trainer):
    llm, workers, infos = engine_fleet(fake_vllm, trainer)
    base = fake_vllm["vllm.distributed.weight_transfer.base"]
    engine_module = sys.modules["refit.vllm.engine"]
    try:
        assert isinstance(workers[0].weight_transfer_engine, base.WeightTransferEngine)
        assert type(workers[0].weight_transfer_engine) is engine_module.RefitWeightTransferEngine
        assert [info["tp_rank"] for info in infos] == [0, 1]
        publisher = refit.torch.Publisher(receivers=rv.receivers_of(infos), transfer_timeout=2.0)
        client = rv.LLMWeightSyncClient(llm)
        for step, label in enumerate(["step-0", None]):
            if step:
                perturb(trainer, step)
            report = rv.sync_weights(client, publisher, trainer, weight_version=label)
            assert llm.weight_version == (label or str(report.version))
            for rank, worker in enumerate(workers):
                assert_bit_identical(worker.model_runner.model, trainer, rank)
        committed = report.version
        assert base.WeightTransferEngine.synchronizes == 0  # refit wrote host memory: no device sync

        # A failed sync: the trainer's publisher is slower than its transfer timeout on rank 0
        # (its first apply takes 3 s), so the transfer aborts on both receivers.
        before = build_module(CANONICAL, seed=0)
        before.load_state_dict(trainer.state_dict())
        commits_before = llm.collective_rpc("refit_status")[0]["commits"]
        perturb(trainer, 7)
        runtime0 = workers[0].weight_transfer_engine.refit_runtime
        runtime0._on_pause = lambda: time.sleep(3.0)
        llm.start_weight_update()
        with pytest.raises(refit.Error):
            publisher.sync(trainer)
        runtime0._on_pause = None
        # A trainer that announces the version anyway, deferring the wait to finish:
        llm.update_weights({"update_info": {"version": committed + 1, "wait": False}})
        with pytest.raises(rv.WeightUpdateAborted):
            llm.finish_weight_update("must-not-publish")
        assert llm.weight_version == str(committed)
        assert llm.collective_rpc("refit_version") == [committed] * TP
        for rank, worker in enumerate(workers):  # rolled back bit-exactly
            assert_bit_identical(worker.model_runner.model, before, rank)
        status0 = llm.collective_rpc("refit_status")[0]
        assert status0["state"] == "idle" and status0["aborts"] == 1 and status0["commits"] == commits_before
        assert status0["last_event"]["kind"] == "abort" and status0["last_event"]["version"] == committed
        # vLLM's worker keeps a session whose finish raised; an "aborted" update closes it.
        with pytest.raises(RuntimeError, match="already active"):
            llm.start_weight_update()
        with pytest.raises(rv.WeightUpdateAborted):
            llm.update_weights({"update_info": {"aborted": True, "reason": "recover"}})

        # The default flow waits in update_weights, where a failure ends vLLM's session.
        llm.start_weight_update()
        with pytest.raises(refit.DeadlineExceeded):
            llm.update_weights({"update_info": {"version": committed + 1, "timeout": 0.3}})
        with pytest.raises(RuntimeError, match="without a matching start"):
            llm.finish_weight_update("must-not-publish")
        assert llm.weight_version == str(committed)

        # The fleet recovers: the next sync (a delta from the committed version) publishes.
        report = rv.sync_weights(client, publisher, trainer, weight_version="step-8")
        assert report.version > committed and llm.weight_version == "step-8"
        for rank, worker in enumerate(workers):
            assert_bit_identical(worker.model_runner.model, trainer, rank)
    finally:
        llm.collective_rpc("shutdown")


def test_sync_weights_ends_the_session_when_the_sync_fails(fake_vllm, trainer):
    llm, workers, infos = engine_fleet(fake_vllm, trainer)
    try:
        client = rv.LLMWeightSyncClient(llm)
        publisher = refit.torch.Publisher(receivers=rv.receivers_of(infos), transfer_timeout=2.0)
        report = rv.sync_weights(client, publisher, trainer)
        assert llm.weight_version == str(report.version)
        before = {n: t.clone() for n, t in tensors_of(workers[1].model_runner.model).items()}

        # A fleet with a receiver nobody runs: the sync fails before committing anywhere.
        unreachable = ("http://127.0.0.1:1", "127.0.0.1:1")
        broken = refit.torch.Publisher(receivers=rv.receivers_of(infos) + [unreachable], transfer_timeout=2.0)
        broken.adopt_baseline(trainer, version=report.version)
        perturb(trainer, 3)
        with pytest.raises(refit.Error) as failure:
            rv.sync_weights(client, broken, trainer, weight_version="bad")
        assert not isinstance(failure.value, rv.WeightUpdateAborted)  # the sync's own error
        assert llm.weight_version == str(report.version)
        assert [w._weight_update_active for w in workers] == [False, False]  # sessions ended
        assert llm.collective_rpc("refit_version") == [report.version] * TP
        after = tensors_of(workers[1].model_runner.model)
        assert all(torch.equal(after[n].view(torch.int32), t.view(torch.int32)) for n, t in before.items())

        llm.start_weight_update()
        with pytest.raises(refit.FailedPrecondition, match="no refit version"):
            llm.finish_weight_update("bad")  # no version announced: nothing to publish
        assert llm.weight_version == str(report.version)
    finally:
        llm.collective_rpc("shutdown")


def test_engine_rejects_unknown_init_keys(fake_vllm, trainer):
    from vllm.config import WeightTransferConfig

    rv.register()
    worker = make_worker_class()(0, build_module(LOCAL, seed=9), WeightTransferConfig(backend="refit"))
    worker.load_model()
    with pytest.raises(ValueError, match="init_info"):
        FakeLLM([worker]).init_weight_transfer_engine({"init_info": {"bogus": 1}})


# --------------------------------------------------------------------------------------------
# Without vLLM


def test_import_without_vllm():
    parents = sorted({os.path.dirname(os.path.abspath(path)) for path in refit.__path__})
    code = "\n".join(
        [
            "import importlib.abc, sys",
            "class Block(importlib.abc.MetaPathFinder):",
            "    def find_spec(self, name, path=None, target=None):",
            "        if name == 'vllm' or name.startswith('vllm.'):",
            "            raise ImportError('vllm is not installed')",
            "sys.meta_path.insert(0, Block())",
            "import refit, refit.vllm",
            "assert 'vllm' not in sys.modules and 'refit.vllm.engine' not in sys.modules",
            "assert refit.vllm.register() is False",
            "try:",
            "    refit.vllm.RefitWeightTransferEngine",
            "except ImportError as error:",
            "    assert 'needs vLLM' in str(error), error",
            "else:",
            "    raise SystemExit('the engine imported without vLLM')",
            "print('ok', refit.vllm.RefitWorkerExtension.__name__)",
        ]
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(parents))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok RefitWorkerExtension"
