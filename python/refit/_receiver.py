"""A receiver: one inference worker's (or tensor-parallel shard's) end of a fleet, holding the
worker's own tensors."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple, Union

from . import _core
from ._config import Config, overrides
from ._loader import Loader
from ._tensors import as_buffer_tensor
from .errors import FailedPrecondition, InvalidArgument

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
    #: The lineage of the version held (docs/protocol.md "Lineage and fencing"): the trainer run
    #: it belongs to (None: none, a checkpoint loaded without one), the highest epoch of that run
    #: seen (trainers of older epochs are refused), and the state fingerprint of the version (16
    #: hex digits; None: unknown).
    run_id: Optional[str] = None
    epoch: int = 0
    fingerprint: Optional[str] = None
    #: Whether the receiver may serve (``GET /ready``): it holds, committed, the version its fleet
    #: holds — never while a transfer is open, while it is behind, fenced, or after it left.
    ready: bool = False
    #: Why not: "ready", "fleet_version_unknown", "transfer_open", "behind", "ahead",
    #: "needs_anchor", "fenced" or "left"; ``ready_detail`` says it with the versions.
    ready_reason: str = "fleet_version_unknown"
    ready_detail: str = ""
    #: The fleet's committed version as last heard from the publisher (a join reply, a prepare, a
    #: commit), or None before that.
    fleet_version: Optional[int] = None
    #: How the last committed transfer brought it to its version: "delta", "folded", "chain" or
    #: "anchor" (None before the first).
    last_catch_up: Optional[str] = None
    #: The membership URL of the publisher it joined (:meth:`Receiver.join`), or "".
    publisher_url: str = ""


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
    - ``apply_threads``: threads that apply one payload (its tensors, and the slices of a large
      one, in parallel; default 4); ``decode_threads``: threads that decode the next payloads
      while one applies (default 2; 0: the applying thread decodes);
    - ``max_payload_bytes``: the largest payload either plane accepts, and the largest
      decompressed body, in bytes (or a size such as ``"512MiB"``); default: sized to the model
      (twice the larger of the sparse bucket size and the largest tensor, at least 256 MiB), as
      ``refit serve --max-payload-bytes`` and the file's ``server.max_payload_bytes``;
    - ``bootstrap_peer``: the control URL of a receiver of the fleet: before serving, copy the
      version it holds (verified by its state fingerprint) instead of being sent an anchor — its
      own tensors when it holds the same ones, or, with a ``loader``, the canonical tensors of a
      peer without one, cut by the loader (a TP shard joining unsharded workers);
    - ``config``: a :class:`Config`; explicit arguments override it;
    - ``before_first_apply(transfer_id)``, ``after_commit(transfer_id, version)``,
      ``after_abort(transfer_id, version)``: engine hooks, called on refit's threads. Pause
      generation in the first — the weights are a mix of two versions until one of the others.
    """

    #: The keywords that set a key of the configuration file, and the key each sets.
    _CONFIG_KEYS = {
        "model_path": "server.model",
        "mmap": "server.mmap",
        "replica": "server.replica",
        "transport": "transport",
        "control_host": "server.bind",
        "control_port": "http_refit_server_port",
        "anchor_undo": "server.anchor_undo",
        "anchor_undo_dir": "server.anchor_undo_dir",
        "apply_threads": "tuning.apply_threads",
        "decode_threads": "tuning.decode_threads",
        "max_payload_bytes": "server.max_payload_bytes",
        "bootstrap_peer": "server.bootstrap_peer",
    }

    def __init__(
        self,
        *,
        model_path: Optional[str] = None,
        mmap: Optional[bool] = None,
        version: Optional[int] = None,
        loader: Optional[Loader] = None,
        replica: Optional[str] = None,
        shard: Optional[int] = None,
        transport: Optional[str] = None,
        data_endpoint: Optional[str] = None,
        data_bind: Optional[str] = None,
        peers: Optional[Sequence[str]] = None,
        control_host: Optional[str] = None,
        control_port: Optional[int] = None,
        api_key: Optional[str] = None,
        anchor_undo: Optional[str] = None,
        anchor_undo_dir: Optional[str] = None,
        apply_threads: Optional[int] = None,
        decode_threads: Optional[int] = None,
        max_payload_bytes: Optional[Union[int, str]] = None,
        bootstrap_peer: Optional[str] = None,
        config: Optional[Config] = None,
        before_first_apply: Hook = None,
        after_commit: Hook = None,
        after_abort: Hook = None,
    ):
        scheme = (transport or (config.transport if config is not None else "zmq://")).split("://")[0]
        if data_endpoint is None and scheme.split("+")[-1] == "zmq":
            # Port 0: the listener binds a port the kernel chooses and reports it
            # (producer_endpoint) — no probe-then-bind for another process to race.
            host = control_host or (config.bind if config is not None else "127.0.0.1")
            data_endpoint = f"{host}:0"
        if loader is not None and not isinstance(loader, Loader):
            raise InvalidArgument(f"loader: expected a refit.Loader, got {type(loader).__name__}")
        self._core = _core.Receiver(
            config,
            overrides("Receiver", self._CONFIG_KEYS, locals()),
            version=version,
            loader=loader._spec if loader is not None else None,
            shard=shard,
            data_endpoint=data_endpoint or "",
            data_bind=data_bind or "",
            peers=list(peers or []),
            api_key=api_key,
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

    @property
    def ready(self) -> bool:
        """Whether the receiver may serve now (:attr:`ReceiverStatus.ready`)."""
        return bool(self._core.readiness()["ready"])

    def join(
        self,
        publisher_url: str,
        *,
        control_url: Optional[str] = None,
        data_endpoint: Optional[str] = None,
    ) -> dict:
        """Join the fleet of the publisher whose membership endpoint is ``publisher_url``.

        One authenticated call (this receiver's ``api_key``, the fleet's one key). The receiver
        takes part from the publisher's next sync, caught up on its own (folded deltas, or an
        anchor for it alone) while the other members keep receiving deltas; until it holds the
        fleet's version :attr:`ready` is False. ``control_url`` and ``data_endpoint`` advertise
        other addresses than its own (a wildcard bind, NAT). Returns the membership: ``{
        "fleet_version", "members": [{control_url, data_endpoint, version, lag, caught_up_by,
        wire_bytes, …}]}``. Raises PermissionDenied when the publisher refuses the key,
        Unavailable when it cannot be reached.
        """
        return self._core.join(publisher_url, control_url or "", data_endpoint or "")

    def leave(self) -> dict:
        """Leave the fleet joined last: the next sync goes without this receiver, and
        :attr:`ready` turns False. :meth:`stop` leaves too. Returns the membership."""
        return self._core.leave()

    def wait_for_version(self, version: int, timeout: Optional[float] = None) -> int:
        """Block until the receiver has committed ``version`` (or a later one); return it.

        The version is reported once the receiver's memory holds it: after the commit and after
        the commit hook that moves the bytes into the engine (a mirror's copy) returned. Ctrl-C
        interrupts the wait. Raises DeadlineExceeded after ``timeout`` seconds.
        """
        return self._core.wait_for_version(version, -1.0 if timeout is None else float(timeout))
