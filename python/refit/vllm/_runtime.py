"""The vLLM-free part of refit's vLLM integration: one receiver per worker, and its state.

Both the worker extension (:class:`refit.vllm.RefitWorkerExtension`) and the native weight-transfer
engine (``refit.vllm.engine.RefitWeightTransferEngine``) run a :class:`WorkerRuntime` inside a
vLLM worker process: a :class:`refit.torch.Receiver` attached to the worker's model, a
:class:`ForwardGate` that holds the model's forward passes while a transfer is being applied, and
the record of every transfer's outcome (commit or abort) that ``finish_weight_update`` waits on.
Nothing here imports vLLM, so it runs — and is tested — without it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import refit
from refit._ports import free_port
from refit.errors import Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument

from ._reload import RELOAD_MODES, checkpoint_copies, reload_into, transformed_layers
from .loaders import loader_rules

_LOG = logging.getLogger("refit.vllm")

#: How often a waiter re-reads the receiver's committed version between hook notifications, in
#: seconds. The hooks wake waiters at once; the poll only bounds the delay of a commit whose
#: hook was missed (a receiver restarted under the waiter).
_POLL_S = 0.05

#: The pause modes a worker accepts: "gate" holds forward passes from the first apply to the
#: commit or abort; "none" only records the transfer's state (the caller pauses vLLM itself).
PAUSE_MODES = ("gate", "none")


class WeightUpdateAborted(Cancelled):
    """The refit transfer of a weight update was aborted, or the trainer declared it failed.

    The receiver rolled back: the worker's weights are bit-identical to the version before the
    update, and vLLM must not publish the update's ``weight_version``.
    """


#: refit.torch.Receiver arguments the worker runtime sets itself (RefitOptions has a key for each).
_MANAGED_RECEIVER_KWARGS = frozenset(
    {"replica", "pause", "resume", "loader", "model_path", "api_key", "before_first_apply", "after_commit", "after_abort"}
)


@dataclasses.dataclass
class RefitOptions:
    """How a vLLM worker runs its refit receiver (one per worker, i.e. per TP shard).

    The same options reach every worker of an engine (``collective_rpc`` and
    ``init_weight_transfer_engine`` broadcast one dict), so everything per-worker — the
    tensor-parallel rank, the ports — is derived in the worker. All fields are optional; the
    names are the keys of the dict a caller passes.
    """

    #: The shard group's name: every TP worker of one engine must share it, and no two engines
    #: syncing from one publisher may. Default: ``""`` at TP=1 (a replica of its own), else
    #: ``"vllm-<instance id>-dp<data parallel rank>"``.
    replica: Optional[str] = None
    #: Override the tensor-parallel coordinates (default: vLLM's parallel state, else the
    #: worker's rank modulo ``parallel_config.tensor_parallel_size``).
    tp_rank: Optional[int] = None
    tp_size: Optional[int] = None
    #: The canonical (checkpoint) shape of every tensor the trainer sends, name → shape. With it
    #: the loader is inferred by :func:`refit.torch.tp_loader` (same shape: identity; dim 0 / TP:
    #: row; dim 1 / TP: column; vLLM's padded vocabulary: vocab).
    canonical_shapes: Optional[Dict[str, List[int]]] = None
    #: Loader rules for the fused local tensors, passed to :func:`refit.torch.tp_loader` before
    #: the inferred ones, e.g. ``{"kind": "qkv", "q": r"(.*)\\.q_proj\\.weight", "k": …, "v": …,
    #: "to": "$1.qkv_proj.weight", "num_heads": 32, "num_kv_heads": 8}`` and ``{"kind":
    #: "gate_up", "gate": …, "up": …, "to": "$1.gate_up_proj.weight"}``.
    fused: Optional[List[Dict[str, Any]]] = None
    #: Explicit loader rules (the dicts :class:`refit.Loader` takes), instead of inference.
    loader_rules: Optional[List[Dict[str, Any]]] = None
    #: The version the worker's weights are at (default: 0).
    version: Optional[int] = None
    #: The data-plane URI (default: ``zmq://``).
    transport: Optional[str] = None
    #: Where the zmq data port listens, and the host name producers reach it by. Port 0: a
    #: free port (or the one ``refit_reserve`` chose); otherwise ``data_port + i``, i = the
    #: worker's index in the engine, ``dp_rank * tp_size + tp_rank``.
    data_host: str = "127.0.0.1"
    data_port: int = 0
    #: The zmq relay tree: every receiver's data endpoint (``host:port``), the same list in the
    #: same order on every receiver of the fleet, this one included — and the publisher's
    #: ``receivers`` in that order (:func:`refit.vllm.receivers_of` sorts them so). Default:
    #: with a fixed ``data_port``, the engine's own workers, ``data_host:data_port + i`` for i
    #: < data_parallel_size × tp_size (right when the engine, on one host, is the whole fleet);
    #: with free ports, none, which only a fleet of one receiver can do without.
    peers: Optional[List[str]] = None
    #: Where the HTTP control plane listens. Port 0: a free port; otherwise
    #: ``control_port + i`` (as ``data_port``).
    control_host: str = "127.0.0.1"
    control_port: int = 0
    #: The name of an environment variable of the worker holding the control plane's key (the
    #: key itself never travels in these options, which vLLM logs and sends over RPC).
    api_key_env: Optional[str] = None
    #: How refit reaches the model's tensors (``refit.torch.Receiver.attach(memory=…)``):
    #: "auto" (default) — host tensors zero-copy, GPU tensors in place through the device
    #: boundary in O(changes); "device" — every tensor through the boundary (the device path
    #: forced, e.g. to test it on the CPU); "host" — a GPU tensor is an InvalidArgument;
    #: "mirror" — a host copy of the model copied in after each commit (explicit opt-in).
    memory: str = "auto"
    #: The older spelling of memory="mirror".
    mirror: bool = False
    #: Which layers take the reload path (refit's checkpoint-format copy, handed to vLLM's
    #: ``reload_weights`` after each commit that changed it) instead of in-place writes:
    #: "auto" (default) — the layers whose engine does not read their weights as loaded (vLLM's
    #: CPU backend repacks every linear layer; quantized layers); "never"; "always" (every layer
    #: with a weight). See :mod:`refit.vllm._reload`.
    reload: str = "auto"
    #: "gate" (default) or "none"; see :data:`PAUSE_MODES`.
    pause: str = "gate"
    #: Seconds the gate waits for forward passes in flight to finish before a transfer applies.
    drain_timeout: float = 60.0
    #: Seconds a weight update waits for its transfer to commit (``update_weights`` /
    #: ``finish_weight_update`` of the engine, ``refit_wait_for_version``'s default).
    wait_timeout: float = 600.0
    #: A directory where each worker writes ``<replica>-tp<rank>.json`` (its endpoints), for a
    #: trainer that cannot call ``collective_rpc``.
    endpoints_dir: Optional[str] = None
    #: Further keyword arguments of :class:`refit.torch.Receiver` (``peers``, ``config``, …).
    receiver_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, options: Optional[Mapping[str, Any]] = None, **overrides: Any) -> "RefitOptions":
        """Return the options a dict (and keyword overrides) names; unknown keys are an error.

        Raises InvalidArgument naming the unknown keys, or a bad ``pause`` mode.
        """
        merged = dict(options or {})
        merged.update(overrides)
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise InvalidArgument(
                f"refit.vllm options: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        made = cls(**merged)
        made.validate()
        return made

    def validate(self) -> None:
        """Check the fields that can be checked without a model. Raises InvalidArgument."""
        if self.pause not in PAUSE_MODES:
            raise InvalidArgument(f"refit.vllm options: pause={self.pause!r}, expected one of {PAUSE_MODES}")
        if self.reload not in RELOAD_MODES:
            raise InvalidArgument(f"refit.vllm options: reload={self.reload!r}, expected one of {RELOAD_MODES}")
        if self.loader_rules is not None and self.canonical_shapes is not None:
            raise InvalidArgument("refit.vllm options: give loader_rules or canonical_shapes, not both")
        managed = sorted(set(self.receiver_kwargs) & _MANAGED_RECEIVER_KWARGS)
        if managed:
            raise InvalidArgument(
                f"refit.vllm options: receiver_kwargs may not set {managed}: the worker sets them "
                "(use the options replica, version, transport, api_key_env, loader_rules/canonical_shapes)"
            )
        for name in ("data_port", "control_port"):
            port = getattr(self, name)
            if not 0 <= int(port) < 65536:
                raise InvalidArgument(f"refit.vllm options: {name}={port} is not a port")


class ForwardGate:
    """Hold a module's forward passes while a refit transfer writes its weights.

    Installed as a forward pre-hook and a forward hook on the worker's top-level model:
    :meth:`close` (the receiver's ``before_first_apply``) stops new forward passes and waits for
    the ones in flight to return; :meth:`open` (``after_commit`` / ``after_abort``) lets them run
    again. A forward pass therefore sees either the old version or the new one, never a mix.

    Thread-safety: every method may be called from any thread. The forward hook is registered
    with ``always_call=True``, so a forward pass that raises leaves the gate as well.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._in_flight = 0
        self._handles: List[Any] = []
        self.closes = 0

    def install(self, module: Any) -> None:
        """Hook ``module`` (a torch.nn.Module). Idempotent per gate."""
        if self._handles:
            return
        self._handles.append(module.register_forward_pre_hook(self._enter))
        self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def remove(self) -> None:
        """Unhook the module and open the gate."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.open()

    @property
    def closed(self) -> bool:
        """Whether forward passes are being held."""
        with self._cond:
            return self._closed

    @property
    def in_flight(self) -> int:
        """Forward passes that entered and have not returned."""
        with self._cond:
            return self._in_flight

    def close(self, drain_timeout: float) -> bool:
        """Hold new forward passes; wait up to ``drain_timeout`` s for those in flight.

        Returns whether they all finished in time.
        """
        deadline = time.monotonic() + drain_timeout
        with self._cond:
            self._closed = True
            self.closes += 1
            while self._in_flight > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def open(self) -> None:
        """Let forward passes run."""
        with self._cond:
            self._closed = False
            self._cond.notify_all()

    def _enter(self, module: Any, inputs: Any) -> None:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._in_flight += 1

    def _leave(self, module: Any, inputs: Any, output: Any) -> None:
        with self._cond:
            self._in_flight = max(0, self._in_flight - 1)
            self._cond.notify_all()


@dataclasses.dataclass(frozen=True)
class TransferEvent:
    """One engine-hook call of a worker's receiver: a transfer began applying, or it ended."""

    #: A sequence number, increasing per worker: ``seq > mark`` means "after the mark".
    seq: int
    #: "pause" (the first payload of a transfer is about to be applied), then "commit" or
    #: "abort" (that transfer ended; "resume" if the hook was not told which).
    kind: str
    #: Commit: the version now held. Abort: the version held again (rolled back to).
    version: Optional[int]
    #: time.monotonic() when the hook ran.
    at: float


def data_parallel_size(vllm_config: Any) -> int:
    """Return ``vllm_config.parallel_config.data_parallel_size`` (1 when absent)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "data_parallel_size", 1) or 1)


def parallel_coordinates(worker: Any, vllm_config: Any, options: RefitOptions) -> Tuple[int, int, int]:
    """Return (tp_rank, tp_size, dp_rank) of the calling vLLM worker.

    In order: the options' explicit ``tp_rank``/``tp_size``; vLLM's parallel state
    (``vllm.distributed.get_tensor_model_parallel_rank`` / ``_world_size``) when vLLM is
    importable and its TP group is up; else ``worker.rank % parallel_config.tensor_parallel_size``.
    Raises InvalidArgument for a rank outside [0, tp_size), and for pipeline parallelism (a
    stage holds only some layers; refit.vllm maps tensor-parallel shards only).
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp_size > 1:
        raise InvalidArgument(
            f"refit.vllm: pipeline_parallel_size={pp_size} is not supported (tensor parallelism only)"
        )
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    config_tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    tp_rank: Optional[int] = options.tp_rank
    tp_size: Optional[int] = options.tp_size
    if tp_rank is None or tp_size is None:
        state_rank = state_size = None
        try:
            from vllm.distributed import (  # noqa: PLC0415 — vLLM is optional
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            state_rank = int(get_tensor_model_parallel_rank())
            state_size = int(get_tensor_model_parallel_world_size())
        except Exception:  # noqa: BLE001 — no vLLM, or its TP group is not initialized here
            pass
        if tp_size is None:
            tp_size = state_size if state_size is not None else config_tp
        if tp_rank is None:
            if state_rank is not None:
                tp_rank = state_rank
            else:
                tp_rank = int(getattr(worker, "rank", 0) or 0) % tp_size
    if not 0 <= tp_rank < tp_size:
        raise InvalidArgument(f"refit.vllm: tp_rank={tp_rank} is outside [0, tp_size={tp_size})")
    return int(tp_rank), int(tp_size), dp_rank


def default_replica(vllm_config: Any, tp_size: int, dp_rank: int) -> str:
    """Return the default shard-group name: "" at TP=1, else one per engine and DP rank.

    The name uses ``vllm_config.instance_id`` (one per engine, the same in all its workers) when
    the config has one, so two engines syncing from one publisher do not merge into one group.
    """
    if tp_size <= 1:
        return ""
    instance = str(getattr(vllm_config, "instance_id", "") or "")
    return f"vllm-{instance[:16]}-dp{dp_rank}" if instance else f"vllm-dp{dp_rank}"


def model_tensors(model: Any) -> List[Tuple[str, Any]]:
    """Return every parameter and buffer of ``model`` (deduplicated, as attach registers them)."""
    return list(model.named_parameters()) + list(model.named_buffers())


def check_addressable(model: Any, skip: Any = frozenset()) -> None:
    """Raise InvalidArgument naming the first tensor of ``model`` that has no memory (meta).

    ``skip``: tensor names on the reload path, which refit does not write.

    Host tensors are written in place, zero-copy; device tensors in place through refit's device
    boundary (refit.torch.TorchTensorMemory, O(changes) per transfer); a meta tensor has nothing
    to write (see docs/vllm.md, "Device memory").
    """
    for name, tensor in model_tensors(model):
        if name in skip:
            continue
        device = getattr(tensor, "device", None)
        if device is not None and getattr(device, "type", "cpu") == "meta":
            raise InvalidArgument(
                f"refit.vllm: tensor '{name}' of the worker's model is on the meta device: it has "
                "no memory for refit to write; load the model's weights before starting refit"
            )


def is_zmq(options: RefitOptions) -> bool:
    """Whether the options' data plane is zmq:// (possibly wrapped, e.g. fault+zmq://)."""
    return (options.transport or "zmq://").split("://")[0].split("+")[-1] == "zmq"


def data_endpoint_of(options: RefitOptions, index: int) -> str:
    """Return the data endpoint of the engine's worker ``index``: fixed port, else a free one."""
    port = options.data_port + index if options.data_port else free_port(options.data_host)
    return f"{options.data_host}:{port}"


def default_peers(options: RefitOptions, tp_size: int, dp_size: int) -> List[str]:
    """Return the options' peers, or the engine's own workers when its ports are fixed."""
    if options.peers is not None:
        return [str(peer) for peer in options.peers]
    if options.data_port and tp_size * dp_size > 1:
        return [f"{options.data_host}:{options.data_port + i}" for i in range(tp_size * dp_size)]
    return []


class WorkerRuntime:
    """One vLLM worker's refit receiver over its model, and the hook calls of its transfers.

    The receiver is a :class:`refit.torch.Receiver` attached to the model in place. Its
    ``pause`` hook (before a transfer's first apply) closes the :class:`ForwardGate` and its
    ``resume(committed, version)`` hook (after the commit or the abort) opens it; both are
    recorded as :class:`TransferEvent` s, which :meth:`wait_committed` reads to tell an aborted
    transfer from one still to come.

    Thread-safety: :meth:`start` and :meth:`stop` are called from the worker's thread; the
    accessors and the waits may be called from any thread. The hooks run on refit's threads and
    touch only this object's condition variable, never the receiver (the core's hooks must not
    call into the receiver); waiters read the receiver without holding that condition variable.
    """

    def __init__(
        self,
        model: Any,
        options: RefitOptions,
        *,
        tp_rank: int,
        tp_size: int,
        dp_rank: int = 0,
        replica: str = "",
        dp_size: int = 1,
        data_endpoint: Optional[str] = None,
        on_pause: Optional[Callable[[], None]] = None,
        on_resume: Optional[Callable[[], None]] = None,
        vllm_config: Any = None,
    ) -> None:
        """Describe the receiver to run; :meth:`start` starts it.

        ``data_endpoint``: the zmq endpoint to listen on (one :func:`reserve_data_endpoint`
        chose); default: from the options. ``on_pause`` / ``on_resume``: extra callables run by
        the hooks (after the gate closed / after it opened), on refit's threads. ``vllm_config``:
        the engine's configuration, which the reload path needs (its checkpoint and
        ``reload_weights``); without it a model with transformed layers is refused.
        """
        self._model = model
        self._options = options
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.dp_rank = dp_rank
        self.replica = replica
        self.dp_size = dp_size
        self._data_endpoint = data_endpoint
        self._on_pause = on_pause
        self._on_resume = on_resume
        self._gate = ForwardGate() if options.pause == "gate" else None
        self._cond = threading.Condition()
        self._events: List[TransferEvent] = []
        self._seq = 0
        self._pauses = 0
        self._commits = 0
        self._aborts = 0
        self._applying = False
        self._vllm_config = vllm_config
        self._receiver: Any = None
        self._info: Dict[str, Any] = {}
        # module name -> why, for the layers on the reload path (filled by start).
        self._reload_layers: Dict[str, str] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Dict[str, Any]:
        """Build the loader, attach the receiver to the model in place, start it; return info.

        Raises InvalidArgument for a tensor without memory (meta), or bad loader
        options, and the receiver's errors (a port taken: Unavailable / AlreadyExists).
        """
        import refit.torch as refit_torch  # noqa: PLC0415 — needs torch, present in any worker

        options = self._options
        reload = self._make_reload_path(refit_torch)
        check_addressable(self._model, skip=reload.skip if reload is not None else frozenset())
        loader = self._make_loader(refit_torch, reload.skip if reload is not None else frozenset())
        kwargs: Dict[str, Any] = dict(options.receiver_kwargs)
        if options.version is not None:
            kwargs["version"] = int(options.version)
        if options.transport is not None:
            kwargs["transport"] = options.transport
        if options.api_key_env:
            key = os.environ.get(options.api_key_env)
            if key is None:
                raise InvalidArgument(
                    f"refit.vllm: api_key_env={options.api_key_env!r} is not set in the worker"
                )
            kwargs["api_key"] = key
        index = self.dp_rank * self.tp_size + self.tp_rank
        if is_zmq(options):
            peers = list(kwargs.get("peers") or default_peers(options, self.tp_size, self.dp_size))
            # Without a fixed port, a reserved endpoint or peers to be named in, port 0: the
            # listener binds a port the kernel chooses and reports it (producer_endpoint).
            fixed = self._data_endpoint or options.data_port or peers
            default = data_endpoint_of(options, index) if fixed else f"{options.data_host}:0"
            endpoint = kwargs.setdefault("data_endpoint", self._data_endpoint or default)
            if peers and endpoint not in peers:
                raise InvalidArgument(
                    f"refit.vllm: this worker's data endpoint {endpoint} is not in peers {peers}"
                )
            kwargs["peers"] = peers
        kwargs.setdefault("control_host", options.control_host)
        kwargs.setdefault("control_port", options.control_port + index if options.control_port else 0)
        receiver = refit_torch.Receiver(
            replica=self.replica, pause=self._hook_pause, resume=self._hook_resume, **kwargs
        )
        receiver.attach(
            self._model, loader=loader, memory="mirror" if options.mirror else options.memory, reload=reload
        )
        if self._gate is not None:
            self._gate.install(self._model)
        try:
            receiver.start()
        except BaseException:
            if self._gate is not None:
                self._gate.remove()
            receiver.stop()
            raise
        self._receiver = receiver
        self._info = {
            "control_url": receiver.control_url,
            "producer_endpoint": receiver.producer_endpoint,
            "version": int(receiver.version),
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "dp_rank": self.dp_rank,
            "replica": self.replica,
            "peers": list(kwargs.get("peers") or []),
            "pid": os.getpid(),
            "paths": self._path_summary(receiver),
        }
        if options.endpoints_dir:
            self._write_endpoints_file(options.endpoints_dir)
        _LOG.info("refit receiver started: %s", self._info)
        return self.info()

    def stop(self) -> Optional[Dict[str, Any]]:
        """Stop the receiver (an open transfer rolls back) and unhook the gate. Idempotent.

        Returns the last status, or None if the receiver was not running.
        """
        receiver = self._receiver
        if receiver is None:
            return None
        last = self.status()
        self._receiver = None
        receiver.stop()
        if self._gate is not None:
            self._gate.remove()
        with self._cond:
            self._applying = False
            self._cond.notify_all()
        last["running"] = False
        return last

    @property
    def running(self) -> bool:
        """Whether the receiver is started and not stopped."""
        return self._receiver is not None

    @property
    def receiver(self) -> Any:
        """The :class:`refit.torch.Receiver`. Raises FailedPrecondition when not running."""
        if self._receiver is None:
            raise FailedPrecondition("refit.vllm: the worker's refit receiver is not running")
        return self._receiver

    # -- accessors -------------------------------------------------------------------------

    def info(self) -> Dict[str, Any]:
        """Return this worker's endpoints and place: picklable, msgpack-able plain types.

        Keys: control_url, producer_endpoint, version (current), tp_rank, tp_size, dp_rank,
        replica, peers (the relay tree it was started with; [] alone), pid.
        """
        info = dict(self._info)
        if self._receiver is not None:
            info["version"] = int(self._receiver.version)
        return info

    @property
    def version(self) -> int:
        """The committed version the worker's weights hold."""
        return int(self.receiver.version)

    @property
    def event_seq(self) -> int:
        """The sequence number of the last hook call recorded (0: none yet)."""
        with self._cond:
            return self._seq

    def events_since(self, mark: int) -> List[TransferEvent]:
        """Return the hook calls recorded after sequence number ``mark`` (the last 256 at most)."""
        with self._cond:
            return [event for event in self._events if event.seq > mark]

    def status(self) -> Dict[str, Any]:
        """Return the receiver's status and this worker's pause state, as plain types.

        Keys: the fields of :class:`refit.ReceiverStatus` (when running), plus ``running``,
        ``applying`` (between a transfer's first apply and its end), ``gate_closed``,
        ``forwards_in_flight``, ``pauses`` (transfers that began applying), ``commits`` and
        ``aborts`` (how those ended), ``last_event`` (a dict, or None), ``reloads`` and
        ``last_reload`` (the reload path's commits; see :class:`refit.torch.ReloadPath`),
        ``tp_rank``, ``tp_size``, ``dp_rank``, ``replica``.
        """
        receiver = self._receiver
        status = dataclasses.asdict(receiver.status()) if receiver is not None else {}
        with self._cond:
            status.update(
                applying=self._applying,
                pauses=self._pauses,
                commits=self._commits,
                aborts=self._aborts,
                last_event=dataclasses.asdict(self._events[-1]) if self._events else None,
            )
        status.update(
            # The reload path (docs/vllm.md): commits that handed tensors to the engine's
            # reload_weights, and the last one's changed / loaded names and seconds.
            reloads=int(getattr(receiver, "reloads", 0) or 0),
            last_reload=getattr(receiver, "last_reload", None),
            running=receiver is not None,
            gate_closed=self._gate.closed if self._gate is not None else False,
            forwards_in_flight=self._gate.in_flight if self._gate is not None else 0,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            dp_rank=self.dp_rank,
            replica=self.replica,
        )
        return status

    # -- waits -----------------------------------------------------------------------------

    def wait_for_version(self, version: int, timeout: Optional[float] = None) -> int:
        """Block until the worker committed ``version`` or a later one; return the version.

        Raises DeadlineExceeded after ``timeout`` s (default: the options' ``wait_timeout``).
        """
        timeout = self._options.wait_timeout if timeout is None else timeout
        return int(self.receiver.wait_for_version(int(version), timeout))

    def wait_committed(self, version: int, since: int, base_version: int, timeout: Optional[float] = None) -> int:
        """Block until ``version`` is committed; fail when this session's transfer aborted.

        ``since`` and ``base_version``: :attr:`event_seq` and :attr:`version` when the session
        began. A transfer that began applying after the mark and was aborted (rolled back), with
        the receiver idle again below ``version``, raises :class:`WeightUpdateAborted` at once;
        so does one that ended without moving the receiver past ``base_version`` when the hook
        did not say how it ended. A transfer aborted before its first apply calls no hook and
        ends in DeadlineExceeded instead. Returns the committed version (≥ ``version``). Raises
        DeadlineExceeded after ``timeout`` s (default: the options' ``wait_timeout``).
        """
        timeout = self._options.wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                recent = [event for event in self._events if event.seq > since]
                applying = self._applying
            aborted = any(event.kind == "abort" for event in recent)
            unexplained = any(event.kind == "resume" for event in recent)
            # Read the receiver outside the condition variable (see the class comment); a hook
            # recorded above ran after the receiver's state changed, so this read sees it.
            status = self.receiver.status()
            if status.version >= version:
                return int(status.version)
            if (aborted or (unexplained and status.version <= base_version)) and not applying and status.state == "idle":
                reason = f": {status.last_error}" if status.last_error else ""
                raise WeightUpdateAborted(
                    f"refit.vllm: the transfer to version {version} aborted{reason}; tp rank "
                    f"{self.tp_rank} of replica '{self.replica}' rolled back to version {status.version}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"refit.vllm: version {version} not committed within {timeout:g} s on tp rank "
                    f"{self.tp_rank} of replica '{self.replica}' (at version {status.version}, "
                    f"state {status.state})"
                )
            with self._cond:
                self._cond.wait(min(remaining, _POLL_S))

    # -- internals -------------------------------------------------------------------------

    def _make_reload_path(self, refit_torch: Any) -> Any:
        """The reload path of the layers the engine transformed after loading, or None."""
        layers = transformed_layers(self._model, self._options.reload)
        self._reload_layers = layers
        if not layers:
            return None
        if self._vllm_config is None:
            raise FailedPrecondition(
                f"refit.vllm: layers {sorted(layers)[:3]} need the reload path "
                f"({next(iter(layers.values()))}), which needs the engine's vllm_config"
            )
        copies = checkpoint_copies(self._vllm_config, self._model, layers)
        module_of = {name: module for name, _, module in copies}
        skip = [
            f"{prefix}.{pname}"
            for prefix in layers
            for pname, _ in self._model.get_submodule(prefix).named_parameters(recurse=False)
        ]
        vllm_config, model = self._vllm_config, self._model
        return refit_torch.ReloadPath(
            skip,
            [(name, tensor) for name, tensor, _ in copies],
            load=lambda weights: reload_into(vllm_config, model, weights),
            group_of=module_of.__getitem__,
        )

    def _path_summary(self, receiver: Any) -> Dict[str, Any]:
        paths = receiver.paths
        return {
            "in_place": sorted(name for name, path in paths.items() if path != "reload"),
            "reload": sorted(name for name, path in paths.items() if path == "reload"),
            "reload_layers": dict(self._reload_layers),
        }

    def _make_loader(self, refit_torch: Any, skip: Any = frozenset()) -> Any:
        loader = self._make_rules_loader(refit_torch)
        if loader is None or not skip:
            return loader
        # Rules that write a tensor on the reload path would write memory the engine no longer
        # reads: the reload path's canonical copies take those tensors (identity, by name).
        patterns = set(skip) | {re.escape(name) for name in skip}
        rules = [rule for rule in loader.rules if rule.get("to", rule.get("match")) not in patterns]
        return refit.Loader(tp_rank=loader.tp_rank, tp_size=loader.tp_size, rules=rules)

    def _make_rules_loader(self, refit_torch: Any) -> Any:
        options = self._options
        if options.loader_rules is not None:
            return refit.Loader(tp_rank=self.tp_rank, tp_size=self.tp_size, rules=options.loader_rules)
        if options.canonical_shapes is not None:
            shapes = {name: tuple(int(d) for d in shape) for name, shape in options.canonical_shapes.items()}
            return refit_torch.tp_loader(self._model, shapes, self.tp_rank, self.tp_size, fused=options.fused or None)
        if options.fused:
            raise InvalidArgument("refit.vllm: fused rules need canonical_shapes")
        # A vLLM model: the rules follow from its parallel layers (refit.vllm.loaders), at any TP
        # (its qkv_proj and gate_up_proj are fused even at TP=1). Raises InvalidArgument naming
        # a parameter of a layer it cannot map.
        rules = loader_rules(self._model)
        if rules:
            return refit.Loader(tp_rank=self.tp_rank, tp_size=self.tp_size, rules=rules)
        if self.tp_size > 1:
            raise InvalidArgument(
                f"refit.vllm: tensor parallelism {self.tp_size} needs canonical_shapes (the "
                "trainer's tensor shapes) or loader_rules to map the checkpoint onto this shard "
                "(the model has no vLLM parallel layers to derive them from)"
            )
        return None

    def _write_endpoints_file(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.replica or 'replica'}-dp{self.dp_rank}-tp{self.tp_rank}.json")
        scratch = f"{path}.{os.getpid()}.tmp"
        with open(scratch, "w", encoding="utf-8") as out:
            json.dump(self._info, out)
        os.replace(scratch, path)

    def _record(self, kind: str, version: Optional[int] = None) -> None:
        # Called with self._cond held.
        self._seq += 1
        self._events.append(TransferEvent(self._seq, kind, version, time.monotonic()))
        # Bound the record: waiters only look at events after their own recent mark.
        del self._events[:-256]
        self._cond.notify_all()

    def _hook_pause(self) -> None:
        with self._cond:
            self._applying = True
            self._pauses += 1
            self._record("pause")
        if self._gate is not None and not self._gate.close(self._options.drain_timeout):
            _LOG.warning(
                "refit.vllm: %d forward pass(es) still in flight after %g s; applying the transfer anyway",
                self._gate.in_flight, self._options.drain_timeout,
            )
        if self._on_pause is not None:
            self._on_pause()

    def _hook_resume(self, committed: Optional[bool] = None, version: Optional[int] = None, *rest: Any) -> None:
        if self._gate is not None:
            self._gate.open()
        with self._cond:
            self._applying = False
            if committed is None:
                kind = "resume"
            elif committed:
                kind = "commit"
                self._commits += 1
            else:
                kind = "abort"
                self._aborts += 1
            self._record(kind, None if version is None else int(version))
        if self._on_resume is not None:
            self._on_resume()
