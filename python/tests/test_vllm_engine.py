"""The ``refit`` weight-transfer backend inside the real, pinned vLLM (ctest label ``vllm``).

Everything vLLM-side is vLLM's own installed code (python/requirements-dev.txt pins it):

- the backend is found the way vLLM finds plugins: ``vllm.plugins.load_general_plugins()`` reads
  the ``vllm.general_plugins`` entry points of the installed distributions (here: a dist-info
  directory carrying python/pyproject.toml's entry point, as ``pip install ./python`` writes
  it), and ``refit.vllm:register`` registers the engine with ``WeightTransferEngineFactory``;
- each worker is a ``vllm.v1.worker.gpu_worker.Worker`` whose weight-transfer methods
  (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
  ``finish_weight_update``, with their session rules) are vLLM's, on an object built without
  ``Worker.__init__`` (which needs a GPU); its engine comes from
  ``WeightTransferEngineFactory.create_engine`` as ``Worker.load_model`` makes it;
- the trainer drives the workers through the steps of ``AsyncLLM``'s weight-transfer methods
  (``InProcessEngine``: each phase a collective RPC over the in-process workers, the version set
  only after ``finish_weight_update`` returned everywhere), so ``weight_version`` is published
  exactly when vLLM publishes it.

Two workers at TP=2 (vLLM's parallel-state getters report each one's rank while it runs an RPC,
as they would in its own process) hold the fused, sharded layout of test_vllm.py; the trainer is
a real refit ``Publisher`` over the canonical model.
"""

from __future__ import annotations

import contextlib
import sys
import textwrap
import threading
import time
from types import SimpleNamespace
from typing import Any, List

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.distributed.weight_transfer.base")

import vllm.distributed  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm.config import DeviceConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

import refit  # noqa: E402
import refit.torch  # noqa: E402
import refit.vllm as rv  # noqa: E402
from test_vllm import (  # noqa: E402 — the layouts and checks the stand-in tests use
    CANONICAL,
    LOCAL,
    OPTIONS,
    TP,
    assert_bit_identical,
    build_module,
    free_port_base,
    perturb,
    tensors_of,
)

#: The worker running an RPC now; vLLM's parallel-state getters report its TP rank.
_CURRENT = threading.local()


@pytest.fixture(scope="module")
def refit_plugin(tmp_path_factory):
    """refit's ``vllm.general_plugins`` entry point, installed as pip installs it, loaded by vLLM."""
    site = tmp_path_factory.mktemp("site")
    dist_info = site / "refit-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: refit\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [vllm.general_plugins]
            refit = refit.vllm:register
            """
        )
    )
    sys.path.insert(0, str(site))
    vllm.plugins.plugins_loaded = False
    try:
        vllm.plugins.load_general_plugins()
        yield WeightTransferEngineFactory
    finally:
        sys.path.remove(str(site))


@pytest.fixture
def tp_state(monkeypatch):
    """vLLM's TP-rank getters answer for the worker that runs the current RPC."""
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: _CURRENT.worker.rank % TP)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: TP)


def vllm_config() -> VllmConfig:
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=TP),
        weight_transfer_config=WeightTransferConfig(backend="refit"),
    )


def make_worker(rank: int, model: torch.nn.Module, config: VllmConfig) -> Worker:
    """A real vLLM Worker past ``load_model``: its own methods, the state they use, the engine."""
    worker = Worker.__new__(Worker)  # Worker.__init__ initializes a CUDA device
    worker.rank = worker.local_rank = rank
    worker.vllm_config = config
    worker.speculative_config = None
    worker.device = torch.device("cpu")
    worker.model_runner = SimpleNamespace(
        model=model,
        get_model=lambda: model,
        get_draft_model=lambda: None,
        reset_lora_state=lambda: None,
        extensible_kv_cache=None,
    )
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    worker._incomplete_weight_updates = set()
    worker._weight_update_kv_cache_loan = contextlib.ExitStack()
    worker._kv_cache_reclaimable = False
    # Worker.load_model's last step, as vLLM writes it:
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        config.weight_transfer_config, config, worker.device, model
    )
    return worker


class InProcessEngine:
    """vLLM's engine-side weight-transfer calls over in-process workers, as a sync client.

    The same steps as the methods of ``LLM`` (``RLOfflineMixin``, vllm/entrypoints/rl/offline.py)
    and ``AsyncLLM`` (vllm/v1/engine/async_llm.py) in vLLM 0.34, neither imported here (both pull
    in the OpenAI server stack, which the venv does not install). ``init_weight_transfer_engine``
    is ``collective_rpc("init_weight_transfer_engine", kwargs={"init_info": request.init_info})``
    on a ``WeightTransferInitRequest``; ``start_weight_update`` and ``update_weights`` (a
    ``WeightTransferUpdateRequest``) likewise; ``finish_weight_update(weight_version)`` runs the
    RPC and only then sets the version. ``collective_rpc`` runs the method on every worker and
    raises the first failure, as vLLM's executor does. The four methods are vLLM's
    ``VLLMWeightSyncClient`` protocol, what ``refit.vllm.sync_weights`` drives.
    """

    def __init__(self, workers: List[Worker]) -> None:
        self.workers = workers
        self.weight_version = "default"

    def collective_rpc(self, method: str, kwargs: Any = None) -> list:
        results, failures = [], []
        for worker in self.workers:
            _CURRENT.worker = worker
            try:
                results.append(getattr(worker, method)(**(kwargs or {})))
            except Exception as error:  # noqa: BLE001 — every worker runs the RPC
                failures.append(error)
            finally:
                _CURRENT.worker = None
        if failures:
            raise failures[0]
        return results

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        request = WeightTransferInitRequest(init_info=dict(init_info))
        self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": request.init_info})

    def start_weight_update(self) -> None:
        self.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        request = WeightTransferUpdateRequest(update_info=dict(update_info))
        self.collective_rpc("update_weights", kwargs={"update_info": request.update_info})

    def finish_weight_update(self, weight_version: Any = None) -> None:
        self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self.weight_version = weight_version


@pytest.fixture
def fleet(refit_plugin, tp_state):
    """Two TP workers with the refit engine started, their client, and the trainer's model."""
    config = vllm_config()
    workers = [make_worker(rank, build_module(LOCAL, seed=70 + rank), config) for rank in range(TP)]
    client = InProcessEngine(workers)
    # One broadcast init: fixed ports, so the engine's own workers are the relay tree's peers.
    client.init_weight_transfer_engine(dict(OPTIONS, wait_timeout=5.0, data_port=free_port_base(TP)))
    infos = [worker.weight_transfer_engine.refit_info() for worker in workers]
    trainer = build_module(CANONICAL, seed=1)
    publisher = refit.torch.Publisher(receivers=rv.receivers_of(infos), transfer_timeout=2.0)
    try:
        yield SimpleNamespace(workers=workers, client=client, infos=infos, trainer=trainer, publisher=publisher)
    finally:
        for worker in workers:
            worker.shutdown_weight_transfer_engine()


def test_vllm_loads_the_backend_from_the_entry_point(refit_plugin):
    assert "refit" in refit_plugin._registry
    engine = refit_plugin.create_engine(
        WeightTransferConfig(backend="refit"), vllm_config(), torch.device("cpu"), build_module(LOCAL, seed=3)
    )
    from refit.vllm.engine import RefitWeightTransferEngine, RefitWeightTransferInitInfo  # noqa: PLC0415

    assert type(engine) is RefitWeightTransferEngine and isinstance(engine, WeightTransferEngine)
    assert isinstance(engine.parse_init_info({"wait_timeout": 1.0}), RefitWeightTransferInitInfo)
    with pytest.raises(ValueError, match="Invalid init_info"):
        engine.parse_init_info({"bogus": 1})
    assert rv.register()  # idempotent: vLLM may load plugins again in the same process
    assert isinstance(InProcessEngine([]), VLLMWeightSyncClient)
    assert isinstance(rv.LLMWeightSyncClient(object()), VLLMWeightSyncClient)


def test_whole_update_publishes_the_committed_version(fleet):
    assert [info["tp_rank"] for info in fleet.infos] == [0, 1]
    for step, label in enumerate(["step-0", None, "step-2"]):
        if step:
            perturb(fleet.trainer, step)
        report = rv.sync_weights(fleet.client, fleet.publisher, fleet.trainer, weight_version=label)
        assert fleet.client.weight_version == (label or str(report.version))
        for rank, worker in enumerate(fleet.workers):
            assert_bit_identical(worker.model_runner.model, fleet.trainer, rank)
            assert not worker._weight_update_active  # vLLM's worker closed the session
            assert worker.weight_transfer_engine.refit_runtime.version == report.version


def test_aborted_transfer_raises_and_publishes_no_version(fleet):
    report = rv.sync_weights(fleet.client, fleet.publisher, fleet.trainer, weight_version="step-0")
    committed = report.version
    before = {name: tensor.clone() for name, tensor in tensors_of(fleet.workers[1].model_runner.model).items()}

    # The transfer aborts: rank 0's first apply outlasts the trainer's transfer timeout.
    perturb(fleet.trainer, 7)
    runtime0 = fleet.workers[0].weight_transfer_engine.refit_runtime
    runtime0._on_pause = lambda: time.sleep(3.0)
    fleet.client.start_weight_update()
    with pytest.raises(refit.Error):
        fleet.publisher.sync(fleet.trainer)
    runtime0._on_pause = None
    # A trainer that announces the version anyway: every worker's update raises, vLLM ends the
    # sessions, and finish (hence the version) never happens.
    with pytest.raises(rv.WeightUpdateAborted):
        fleet.client.update_weights({"version": committed + 1, "timeout": 5.0})
    assert [worker._weight_update_active for worker in fleet.workers] == [False, False]
    with pytest.raises(RuntimeError, match="without a matching start_weight_update"):
        fleet.client.finish_weight_update("must-not-publish")
    assert fleet.client.weight_version == "step-0"
    for worker in fleet.workers:
        assert worker.weight_transfer_engine.refit_runtime.version == committed
    after = tensors_of(fleet.workers[1].model_runner.model)
    assert all(torch.equal(after[n].view(torch.int32), t.view(torch.int32)) for n, t in before.items())

    # Through sync_weights: the sync's own error, the sessions ended, still no version.
    unreachable = ("http://127.0.0.1:1", "127.0.0.1:1")
    broken = refit.torch.Publisher(receivers=rv.receivers_of(fleet.infos) + [unreachable], transfer_timeout=2.0)
    broken.adopt_baseline(build_module(CANONICAL, seed=1), version=committed)
    with pytest.raises(refit.Error) as failure:
        rv.sync_weights(fleet.client, broken, fleet.trainer, weight_version="bad")
    assert not isinstance(failure.value, rv.WeightUpdateAborted)
    assert fleet.client.weight_version == "step-0"
    assert [worker._weight_update_active for worker in fleet.workers] == [False, False]


def test_engine_derives_the_loader_of_vllm_parallel_layers(refit_plugin, tp_state):
    """No loader options: each worker's loader follows from its model's vLLM layers, and a sync
    leaves every rank holding what vLLM's own load_weights puts there."""
    from test_vllm_probe import ARCHS, SENTINEL, build_rank_model, index_tensors, padding_rows, vllm_loaded  # noqa: PLC0415

    arch = next(a for a in ARCHS if a.qkv_bias)  # Qwen2: qkv bias, 2 kv heads at TP=2
    config = vllm_config()
    workers = [make_worker(rank, build_rank_model(arch, rank, TP), config) for rank in range(TP)]
    client = InProcessEngine(workers)
    client.init_weight_transfer_engine({"wait_timeout": 5.0, "data_port": free_port_base(TP)})
    try:
        infos = [worker.weight_transfer_engine.refit_info() for worker in workers]
        publisher = refit.torch.Publisher(receivers=rv.receivers_of(infos), transfer_timeout=5.0)
        rv.sync_weights(client, publisher, index_tensors(arch), weight_version="probe")
        assert client.weight_version == "probe"
        want = vllm_loaded(arch, TP)
        for rank, worker in enumerate(workers):
            got = {n: t.detach().view(torch.int32) for n, t in worker.model_runner.model.named_parameters()}
            for name, rows in padding_rows(arch, rank, TP).items():
                assert bool((got[name][rows] == SENTINEL).all())
                want[rank][name][rows] = SENTINEL  # vLLM zero-fills padding at load; refit never writes it
            for name, bits in want[rank].items():
                assert torch.equal(got[name], bits), f"rank {rank}: '{name}' differs from vLLM's load"
    finally:
        for worker in workers:
            worker.shutdown_weight_transfer_engine()


def test_worker_extension_on_a_vllm_worker_of_vllm_layers(tp_state):
    """RefitWorkerExtension mixed into vLLM's real Worker class the way WorkerWrapperBase does it
    (the extension's names must not collide, then ``__bases__ += (extension,)``), over models of
    vLLM's parallel layers at TP=2, with no loader options: the loaders are derived."""
    from test_vllm_probe import ARCHS, SENTINEL, build_rank_model, index_tensors, padding_rows, vllm_loaded  # noqa: PLC0415

    class ExtendedWorker(Worker):
        pass

    for attr in dir(rv.RefitWorkerExtension):
        if not attr.startswith("__"):
            assert not hasattr(ExtendedWorker, attr), f"the extension redefines vLLM Worker's {attr!r}"
    ExtendedWorker.__bases__ = ExtendedWorker.__bases__ + (rv.RefitWorkerExtension,)

    arch = ARCHS[0]  # Llama
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=ParallelConfig(tensor_parallel_size=TP))
    workers = []
    for rank in range(TP):
        worker = ExtendedWorker.__new__(ExtendedWorker)
        worker.rank = worker.local_rank = rank
        worker.vllm_config = config
        model = build_rank_model(arch, rank, TP)
        worker.model_runner = SimpleNamespace(model=model, get_model=lambda model=model: model)
        workers.append(worker)

    def rpc(method: str, **kwargs: Any) -> list:
        results = []
        for worker in workers:
            _CURRENT.worker = worker
            try:
                results.append(getattr(worker, method)(**kwargs))
            finally:
                _CURRENT.worker = None
        return results

    reservations = rpc("refit_reserve", options={})
    infos = rpc("refit_start", options={"peers": rv.peers_of(reservations)})
    try:
        assert [info["tp_rank"] for info in infos] == [0, 1]
        publisher = refit.torch.Publisher(receivers=rv.receivers_of(infos), transfer_timeout=5.0)
        report = publisher.sync(index_tensors(arch))
        assert rpc("refit_version") == [report.version] * TP
        want = vllm_loaded(arch, TP)
        for rank, worker in enumerate(workers):
            got = {n: t.detach().view(torch.int32) for n, t in worker.model_runner.model.named_parameters()}
            for name, rows in padding_rows(arch, rank, TP).items():
                assert bool((got[name][rows] == SENTINEL).all())
                want[rank][name][rows] = SENTINEL
            for name, bits in want[rank].items():
                assert torch.equal(got[name], bits), f"rank {rank}: '{name}' differs from vLLM's load"
    finally:
        rpc("refit_stop")
