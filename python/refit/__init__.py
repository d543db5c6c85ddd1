"""refit: keep a fleet of inference workers bit-identical to an RL trainer after every step.

The trainer side is a :class:`Publisher` per trainer rank; the workers' side is a
:class:`Receiver` per inference worker (or tensor-parallel shard), holding the worker's own
tensors. ``Publisher.sync`` sends only the elements that changed since the last sync, losslessly,
and commits on every receiver or on none (an aborted sync leaves every receiver bit-identical to
its previous version).

This module takes numpy arrays and CPU torch tensors, zero-copy. :mod:`refit.torch` adds torch
modules (``Publisher.sync(module)``, ``Receiver.attach(module)``, torch.distributed groups and
tensor-parallel loaders); :mod:`refit.vllm` integrates with vLLM workers. Errors are the classes
of :mod:`refit.errors`, which also subclass the matching builtins (``InvalidArgument`` is a
``ValueError``, ``DeadlineExceeded`` a ``TimeoutError``, …).

Example (one process, one receiver)::

    import numpy as np, refit
    weights = {"w": np.zeros(1024, np.float32)}
    with refit.Receiver() as receiver:
        for name, array in weights.items():
            receiver.register(name, array)      # the receiver writes into this array
        receiver.start()
        publisher = refit.Publisher(receivers=[receiver])
        publisher.adopt_baseline({"w": np.zeros(1024, np.float32)}, version=0)
        trainer = {"w": np.arange(1024, dtype=np.float32)}
        report = publisher.sync(trainer)        # weights["w"] now equals trainer["w"]
"""

from __future__ import annotations

# The compiled core may sit in another `refit` directory on sys.path (a build tree, during
# development); extend the package over every one of them.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)  # noqa: F821

import dataclasses
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _cuda_libraries

_cuda_libraries.preload()  # before _core: torch's CUDA libraries, not the system's (see there)

from . import _core, errors  # noqa: E402
from ._ports import free_ports
from ._tensors import DeviceTensor, TensorsLike, as_buffer_tensor, buffer_tensors
from .errors import (
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    Error,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    IoError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

__version__: str = _core.__version__

__all__ = [
    "__version__",
    "Config",
    "Loader",
    "Receiver",
    "ReceiverStatus",
    "Publisher",
    "SyncReport",
    "Group",
    "TensorMemory",
    "DeviceTensor",
    "tcp_group",
    "callback_group",
    "in_process_group",
    "plan_layouts",
    "free_ports",
    "compare_target",
    "set_log_level",
    "log_level",
] + [name for name in errors.__all__ if name[0].isupper()]

#: A refit configuration file (the YAML ``refit push`` and ``refit serve`` read):
#: ``Config.load(path)`` or ``Config.parse(text)``. Pass it as ``config=`` to a Publisher or a
#: Receiver; explicit keyword arguments override what it says.
Config = _core.Config

#: Set refit's log level ("trace", "debug", "info", "warn", "error", "critical", "off"). The log
#: goes to stderr; its level starts from the environment variable REFIT_LOG_LEVEL, else "info".
set_log_level = _core.set_log_level
#: refit's current log level.
log_level = _core.log_level

#: One rank's endpoint of a producer group, until a Publisher takes it over.
Group = _core.Group

#: A tensor behind refit's device boundary: memory the core never addresses, reached through
#: ``gather(positions, width, out)``, ``scatter(positions_or_None, width, bits)``,
#: ``read(offset, out)``, ``write(offset, data)`` and ``synchronize()``, which a subclass
#: implements (``refit.torch.TorchTensorMemory`` for any torch device). ``positions`` are packed
#: int32 (int64 for tensors of 2^31 elements or more); ``None`` in scatter means the positions
#: of the gather just before. ``traffic()`` says what crossed: bytes each way and calls.
TensorMemory = _core.TensorMemory


def compare_target() -> str:
    """The SIMD target refit's bitwise compare runs on this CPU (Highway's run-time dispatch):
    "AVX3" (AVX-512), "AVX2", …; what a benchmark should quote."""
    return _core.compare_target()


def tcp_group(
    address: str,
    rank: int,
    world_size: int,
    api_key: Optional[str] = None,
    connect_timeout: float = 60.0,
) -> Group:
    """Return this rank's endpoint of a TCP producer group.

    Rank 0 listens on ``address`` (``"tcp://host:port"`` or ``"host:port"``); the other ranks
    connect to it and prove ``api_key`` (an HMAC challenge; the key never crosses the wire).
    """
    return _core.tcp_group(address, rank, world_size, api_key or "", connect_timeout)


def callback_group(
    rank: int,
    world_size: int,
    broadcast: Callable[[Optional[bytes], float], bytes],
    gather: Callable[[bytes, float], Optional[List[bytes]]],
) -> Group:
    """Return a producer group whose two collectives are Python callables.

    ``broadcast(message, timeout_s)``: rank 0 passes its message (bytes), the others None; every
    rank returns rank 0's message. ``gather(message, timeout_s)``: rank 0 returns the list of
    every rank's message in rank order, the others None. A callable that raises fails the
    collective (TimeoutError as DeadlineExceeded). :class:`refit.torch.TorchGroup` is this over
    torch.distributed. The callables run on a thread of refit's, holding the GIL.
    """
    return _core.callback_group(rank, world_size, broadcast, gather)


def plan_layouts(layouts: Sequence[Sequence[Mapping[str, Any]]]) -> dict:
    """Plan a sharded transfer from every rank's producer layout (``layouts[r]``: rank r's pieces).

    A piece is a dict ``{tensor, dtype, shape, offset, extent}`` (an N-d box of a canonical
    tensor) with optional ``local`` (the local tensor holding it; default the tensor's name),
    ``local_offset`` (default zeros) and ``local_shape`` (default the extent), as
    :func:`refit.layout.layout_of` writes them. Returns ``{"tensors": [{name, dtype, shape,
    boxes: [{offset, extent, sender, copies}]}], "roles": [[role per piece] per rank]}`` with
    roles ``send`` (the lowest rank holding the box), ``copy`` (another rank sends it) and
    ``empty``. Raises InvalidArgument naming the tensor, the boxes and the ranks when the
    distinct boxes of a tensor leave a gap or overlap without coinciding, or the ranks disagree
    on a tensor's dtype or shape.

    :meth:`Publisher.sync` with ``layout=`` makes this plan itself at rank 0 (docs/sharded.md);
    this function lets a trainer check its layouts before it publishes.
    """
    return _core.plan_layouts([[dict(piece) for piece in rank] for rank in layouts])


def in_process_group(world_size: int) -> List[Group]:
    """Return the ``world_size`` ranks of one group, for Publishers on threads of one process."""
    return _core.in_process_group(world_size)


class Loader:
    """How a receiver holds canonical (checkpoint-coordinate) tensors in its own layout.

    ``rules`` is a list of dicts, the first match deciding, each with a ``kind``:

    - ``identity`` / ``rename`` (``match``, ``to``): the same shape, under the name ``to``
      (a regex replacement template: ``$1``…);
    - ``skip`` (``match``): not held here;
    - ``row`` / ``column`` (``match``, ``to``): a tensor-parallel shard of dim 0 / dim 1;
    - ``qkv`` (``q``, ``k``, ``v``, ``to``, ``num_heads``, ``num_kv_heads``): q, k and v fused
      into one local tensor per rank, rows [q | k | v] of the rank's heads (GQA replicates kv
      heads when there are fewer than ranks);
    - ``qkv_interleaved`` (the same keys): Megatron-Core's ``linear_qkv``, the rank's query
      groups (``num_kv_heads`` of them in the model) each laid out as [its q heads | k | v];
    - ``gate_up`` (``gate``, ``up``, ``to``): gate and up fused, [gate block | up block];
    - ``vocab`` (``match``, ``vocab_size``, ``pad_to``): a vocabulary-parallel embedding;
    - ``expert_gate_up`` (``gate``, ``up``, ``expert_group``), ``expert_down`` (``match``,
      ``expert_group``), ``stacked_gate_up`` / ``stacked_down`` (``match``), each with ``to`` and
      optionally ``num_experts``, ``experts``, ``expert_tp_rank``, ``expert_tp_size``: MoE expert
      weights, per expert or stacked, into the stack of the experts this receiver holds (vLLM's
      ``w13_weight`` / ``w2_weight``).

    Patterns are regular expressions matched against the whole canonical name. A name no rule
    matches is identity. A trainer rank that holds its tensors in these layouts describes them
    with the same rules: :func:`refit.layout.layout_from_loader`. Unknown keys and kinds raise InvalidArgument. See docs/configuration.md
    ("Loader files") for the YAML form that :meth:`from_yaml` reads.
    """

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, rules: Iterable[Mapping[str, Any]] = ()):
        self._spec = _core.check_loader(
            {"tp_rank": tp_rank, "tp_size": tp_size, "rules": [dict(rule) for rule in rules]}
        )

    @classmethod
    def from_yaml(cls, text: str, source: str = "<string>") -> "Loader":
        """Parse a loader spec from YAML text (``source`` names it in error messages)."""
        return cls._from_spec(_core.loader_from_yaml(text, source))

    @classmethod
    def from_file(cls, path: str) -> "Loader":
        """Read a loader spec YAML file (the one ``refit serve --loader`` takes)."""
        return cls._from_spec(_core.loader_from_file(str(path)))

    @classmethod
    def _from_spec(cls, spec: dict) -> "Loader":
        loader = cls.__new__(cls)
        loader._spec = spec
        return loader

    @property
    def tp_rank(self) -> int:
        """This receiver's tensor-parallel rank."""
        return self._spec["tp_rank"]

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree of the receiver's shard group (1: unsharded)."""
        return self._spec["tp_size"]

    @property
    def rules(self) -> List[dict]:
        """The rules, as dicts, in order."""
        return [dict(rule) for rule in self._spec["rules"]]

    def to_dict(self) -> dict:
        """The spec as a plain dict: {tp_rank, tp_size, rules}."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "rules": self.rules}

    def __repr__(self) -> str:
        return f"refit.Loader(tp_rank={self.tp_rank}, tp_size={self.tp_size}, rules={self.rules})"


@dataclasses.dataclass(frozen=True)
class ReceiverStatus:
    """Where a receiver stands: its committed version and its open transfer, if any."""

    #: "idle", "receiving" or "prepared".
    state: str
    #: The committed version the receiver holds.
    version: int
    #: The open transfer's id (hex), or None when idle.
    transfer_id: Optional[str]
    base_version: int
    target_version: int
    staged_payloads: int
    applied_payloads: int
    queued_payloads: int
    #: Bytes of the open transfer's undo log (the old bits of every element it touched).
    undo_bytes: int
    #: Distinct payloads staged since the receiver started, and their bytes as received: what it
    #: was sent (a TP shard is sent only its cut under routing by holdings).
    received_payloads: int
    received_bytes: int
    #: Bytes that crossed the boundary of device tensors (registered with ``register_device``)
    #: since the receiver started: positions and new bits to the device, old bits from it.
    device_to_bytes: int
    device_from_bytes: int
    #: True when an aborted anchor left the weights a mix of versions (``anchor_undo="none"``):
    #: deltas are refused until an anchor commits, and a Publisher sends one at its next sync.
    needs_anchor: bool
    #: Why the open (or last) transfer failed, or None.
    last_error: Optional[str]


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """What one successful sync did, as this rank saw it (rank 0 sees the whole transfer)."""

    transfer_id: str
    #: True for a full transfer (every element), False for a delta.
    anchor: bool
    base_version: int
    #: The version every receiver holds now.
    version: int
    payloads: int
    #: Bytes sent (payload headers + compressed bodies).
    wire_bytes: int
    changed_elements: int
    total_elements: int
    prepare_s: float
    stream_s: float
    flush_s: float
    commit_s: float
    #: Wall time of the whole transfer.
    seconds: float
    rank: int
    world_size: int
    #: The receivers' names (control URLs), rank 0 only.
    receivers: Tuple[str, ...]
    #: Bytes this rank read from device memory (:class:`DeviceTensor`) to stage its chunks.
    staged_bytes: int = 0
    #: The staging pool's budget, and the most host memory it held (0 when nothing was staged).
    staging_budget_bytes: int = 0
    staging_peak_bytes: int = 0

    @property
    def density(self) -> float:
        """The fraction of elements that changed."""
        return self.changed_elements / self.total_elements if self.total_elements else 0.0


Hook = Optional[Callable[..., None]]


class Receiver:
    """One receiver of the fleet, embedded in this process (a ReceiverNode).

    It holds either a safetensors file (``model_path``) or tensors the caller registers with
    :meth:`register` before :meth:`start` — the caller's own memory, written in place by every
    transfer and rolled back bit-exactly by an aborted one. It listens on a ZeroMQ data port and
    an HTTP control plane; a :class:`Publisher` reaches it through :attr:`endpoint`.

    Keyword arguments (all optional):

    - ``model_path``, ``mmap``: a safetensors file to hold (read into memory, or mapped);
    - ``version``: the version the model is at (default: the file's ``refit.version``, else 0);
    - ``loader``: a :class:`Loader` (tensor-parallel shards, fused and renamed tensors);
    - ``replica``, ``shard``: the shard group this receiver belongs to (required with a loader
      of ``tp_size > 1``; ``shard`` defaults to the loader's ``tp_rank``);
    - ``transport``: the data-plane URI (default ``zmq://``; ``s3://…`` for an object store);
    - ``data_endpoint``: zmq: this receiver's ``host:port`` (default: a free port on
      ``control_host``); ``data_bind``: the address to bind it on if different; ``peers``: every
      relay's endpoint in tree order, for a relay tree of receivers;
    - ``control_host``, ``control_port``: where the control plane listens (0: a free port);
    - ``api_key``: the shared secret of the control plane (default: none, or the config's);
    - ``anchor_undo``: what undoes an anchor (a FULL sync) if it aborts: ``"memory"`` (the
      default: the old bits in RAM, about 2× the model during a FULL), ``"file"`` (spilled to
      ``anchor_undo_dir``, default ``$TMPDIR``), or ``"none"`` (about 1× the model; an aborted
      anchor leaves :attr:`ReceiverStatus.needs_anchor` set and ``after_abort`` is not called,
      so generation stays paused until the next anchor commits);
    - ``config``: a :class:`Config`; explicit arguments override it;
    - ``before_first_apply(transfer_id)``, ``after_commit(transfer_id, version)``,
      ``after_abort(transfer_id, version)``: engine hooks, called on refit's threads. Pause
      generation in the first — the weights are a mix of two versions until one of the others.
    """

    def __init__(
        self,
        *,
        model_path: Optional[str] = None,
        mmap: bool = False,
        version: Optional[int] = None,
        loader: Optional[Loader] = None,
        replica: str = "",
        shard: Optional[int] = None,
        transport: Optional[str] = None,
        data_endpoint: Optional[str] = None,
        data_bind: Optional[str] = None,
        peers: Optional[Sequence[str]] = None,
        control_host: str = "127.0.0.1",
        control_port: int = 0,
        api_key: Optional[str] = None,
        anchor_undo: Optional[str] = None,
        anchor_undo_dir: Optional[str] = None,
        config: Optional[Config] = None,
        before_first_apply: Hook = None,
        after_commit: Hook = None,
        after_abort: Hook = None,
    ):
        scheme = (transport or (config.transport if config is not None else "zmq://")).split("://")[0]
        if data_endpoint is None and scheme.split("+")[-1] == "zmq":
            # Port 0: the listener binds a port the kernel chooses and reports it
            # (producer_endpoint) — no probe-then-bind for another process to race.
            data_endpoint = f"{control_host}:0"
        if loader is not None and not isinstance(loader, Loader):
            raise InvalidArgument(f"loader: expected a refit.Loader, got {type(loader).__name__}")
        self._core = _core.Receiver(
            config=config,
            model_path=str(model_path or ""),
            mmap=mmap,
            version=version,
            loader=loader._spec if loader is not None else None,
            replica=replica,
            shard=shard,
            transport=transport,
            data_endpoint=data_endpoint or "",
            data_bind=data_bind or "",
            peers=list(peers or []),
            control_host=control_host,
            control_port=control_port,
            api_key=api_key,
            anchor_undo=anchor_undo,
            anchor_undo_dir=None if anchor_undo_dir is None else str(anchor_undo_dir),
            before_first_apply=before_first_apply,
            after_commit=after_commit,
            after_abort=after_abort,
        )
        # The registered tensors, kept alive while the receiver may write into them.
        self._registered: List[Any] = []

    def register(self, name: str, tensor: Any) -> None:
        """Hold ``tensor`` (a writable contiguous numpy array or CPU torch tensor) as ``name``.

        Zero-copy: transfers write into ``tensor``'s memory. Before :meth:`start` only; costs one
        pass over the tensor (its digest). Raises AlreadyExists for a name registered before.
        """
        self._core.register(as_buffer_tensor(name, tensor, writable=True))
        self._registered.append(tensor)

    def register_device(self, name: str, memory: TensorMemory, dtype: str, shape: Sequence[int]) -> None:
        """Hold a tensor in device memory as ``name``, reached only through ``memory``.

        Transfers gather the old bits of the elements they change, compute the new ones on the
        host and scatter them back: O(changes) across the boundary, no copy of the tensor on the
        host. Before :meth:`start` only; costs one read of the tensor through ``memory`` (its
        digest). ``dtype`` is refit's or torch's spelling ("bfloat16", "torch.bfloat16").
        """
        self._core.register_device(name, str(dtype), [int(extent) for extent in shape], memory)

    def start(self) -> "Receiver":
        """Attach the loader, start the data and control planes; accept transfers from now on."""
        self._core.start()
        return self

    def stop(self) -> None:
        """Stop serving; an open transfer is rolled back. Idempotent."""
        self._core.stop()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _started(self, what: str) -> str:
        value = getattr(self._core, what)
        if not value:
            raise FailedPrecondition(f"receiver: {what} is known once the receiver is started (call start())")
        return value

    @property
    def control_url(self) -> str:
        """The control plane's base URL, ``http://host:port``. FailedPrecondition before start."""
        return self._started("control_url")

    @property
    def producer_endpoint(self) -> str:
        """What producers send payloads to: the data endpoint (zmq) or the control URL (s3).

        FailedPrecondition before start.
        """
        return self._started("producer_endpoint")

    @property
    def endpoint(self) -> Tuple[str, str]:
        """(control URL, data endpoint): this receiver as a Publisher's ``receivers`` names it."""
        return (self.control_url, self.producer_endpoint)

    @property
    def version(self) -> int:
        """The committed version held."""
        return self._core.status()["version"]

    def status(self) -> ReceiverStatus:
        """The receiver's state, version and open transfer."""
        return ReceiverStatus(**self._core.status())

    def wait_for_version(self, version: int, timeout: Optional[float] = None) -> int:
        """Block until the receiver has committed ``version`` (or a later one); return it.

        Ctrl-C interrupts the wait. Raises DeadlineExceeded after ``timeout`` seconds.
        """
        return self._core.wait_for_version(version, -1.0 if timeout is None else float(timeout))


ReceiverLike = Union[Receiver, Tuple[str, str], Mapping[str, str]]


def _receiver_endpoints(receivers: Optional[Iterable[ReceiverLike]]) -> Optional[List[Tuple[str, str]]]:
    if receivers is None:
        return None
    out = []
    for receiver in receivers:
        if isinstance(receiver, Receiver) or hasattr(receiver, "endpoint"):
            out.append(tuple(receiver.endpoint))
        elif isinstance(receiver, Mapping):
            out.append((receiver["control"], receiver.get("data", "")))
        elif isinstance(receiver, (tuple, list)) and len(receiver) == 2:
            out.append((str(receiver[0]), str(receiver[1])))
        elif isinstance(receiver, str):
            out.append((receiver, ""))
        else:
            raise InvalidArgument(
                f"receivers: expected a Receiver, (control_url, data_endpoint) or a dict, got {receiver!r:.80}"
            )
    return out


class Publisher:
    """One trainer rank's publisher: it syncs the fleet with this rank's view of the model.

    The W Publishers of a job form a producer group and call :meth:`sync` together at every
    step (SPMD). Rank p encodes and sends only the export chunks it owns; rank 0 coordinates the
    receivers' two-phase commit. Any failure on any rank or receiver aborts the sync everywhere,
    and every receiver is left bit-identical to its previous version.

    Keyword arguments:

    - ``receivers``: rank 0: the fleet — :class:`Receiver` objects, ``(control_url,
      data_endpoint)`` pairs or ``{"control": …, "data": …}`` dicts (default: the config's);
    - ``group``: this rank's :data:`Group` (default: a group of one);
      :class:`refit.torch.Publisher` uses torch.distributed;
    - ``transport``: the data-plane URI (default ``zmq://``);
    - ``config``: a :class:`Config`; the other arguments override it;
    - ``api_key``: the receivers' control-plane key;
    - ``chunk_bytes``, ``bucket_bytes``: export chunk and payload bucket targets;
    - ``full_sync_interval``: every N-th sync is a full anchor (0: only the first);
    - ``transfer_timeout``: seconds one sync may take, on every rank;
    - ``staging_bytes``: host memory that tensors in device memory (:class:`DeviceTensor`) are
      staged through, in reusable buffers (default: twice the largest chunk this rank stages).
    """

    def __init__(
        self,
        *,
        receivers: Optional[Iterable[ReceiverLike]] = None,
        group: Optional[Group] = None,
        transport: Optional[str] = None,
        config: Optional[Config] = None,
        api_key: Optional[str] = None,
        chunk_bytes: Optional[int] = None,
        bucket_bytes: Optional[int] = None,
        full_sync_interval: Optional[int] = None,
        transfer_timeout: float = 600.0,
        staging_bytes: Optional[int] = None,
    ):
        if group is None:
            group = in_process_group(1)[0]
        self._core = _core.Publisher(
            group,
            config=config,
            receivers=_receiver_endpoints(receivers),
            transport=transport,
            api_key=api_key,
            chunk_bytes=chunk_bytes,
            bucket_bytes=bucket_bytes,
            full_sync_interval=full_sync_interval,
            transfer_timeout_s=float(transfer_timeout),
            staging_bytes=staging_bytes,
        )

    def adopt_baseline(self, tensors: TensorsLike, version: Optional[int] = None) -> None:
        """Take ``tensors`` (the whole model, in canonical order) as what the receivers hold.

        The receivers loaded that checkpoint, so the first sync is a delta. ``version``: the
        version they hold, if known. Copies this rank's share of the model once (the baseline).
        """
        self._core.adopt_baseline(buffer_tensors(tensors), version)

    def sync(
        self,
        tensors: TensorsLike,
        force_anchor: bool = False,
        *,
        layout: Optional[Sequence[Mapping[str, Any]]] = None,
    ) -> SyncReport:
        """Refit the fleet with ``tensors`` (name → array, every rank the whole model in order).

        A tensor is host memory (a numpy array, a CPU torch tensor), read in place, or a
        :class:`DeviceTensor`, staged to the host through ``staging_bytes`` of reusable buffers,
        only for the chunks this rank sends.

        With ``layout``, a sharded sync: ``tensors`` are this rank's local tensors and ``layout``
        its pieces (dicts ``tensor, dtype, shape, offset, extent`` and optionally ``local,
        local_shape, local_offset``; :func:`refit.layout.layout_of` makes them from DTensors):
        which box of which canonical tensor each local tensor holds. Rank 0 checks that the
        ranks' boxes tile every tensor, each rank sends only the boxes it is the lowest holder
        of, and copies held by other ranks (data-parallel replicas) must match, or the sync fails
        naming the rank. Every rank passes a layout, or none does.

        Collective over the group. Blocks until the receivers committed, without the GIL. On
        Ctrl-C the sync is cancelled and aborted everywhere, then KeyboardInterrupt is raised.
        Raises the first failure's :class:`refit.Error`, after the abort.
        """
        if layout is not None:
            pieces = [dict(piece) for piece in layout]
            report = self._core.sync_sharded(pieces, buffer_tensors(tensors), force_anchor)
        else:
            report = self._core.sync(buffer_tensors(tensors), force_anchor)
        report["receivers"] = tuple(report["receivers"])
        return SyncReport(**report)

    def set_receivers(self, receivers: Iterable[ReceiverLike]) -> None:
        """Rank 0: replace the fleet from the next sync on."""
        self._core.set_receivers(_receiver_endpoints(receivers))

    def cancel(self) -> None:
        """Make the sync in flight (on another thread) fail soon with Cancelled."""
        self._core.cancel()

    @property
    def rank(self) -> int:
        """This rank in the producer group."""
        return self._core.rank

    @property
    def world_size(self) -> int:
        """The number of ranks W."""
        return self._core.world_size

    @property
    def version(self) -> int:
        """The version this rank last committed."""
        return self._core.version

    @property
    def baseline_bytes(self) -> int:
        """Bytes this rank keeps to diff against: its share of the model (its own boxes, when
        sharded)."""
        return self._core.baseline_bytes
