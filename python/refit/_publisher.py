"""A publisher: one trainer rank's end of a fleet, and the plan of a sharded transfer."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _core
from ._config import Config, overrides
from ._groups import Group, in_process_group
from ._receiver import Receiver
from ._tensors import TensorsLike, buffer_tensors
from .errors import InvalidArgument

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
    #: Rank 0: how each receiver reached ``version``, one dict per receiver in ``receivers``
    #: order: ``name``, ``held_version`` (before the sync), ``lag`` (versions behind
    #: ``base_version``), ``caught_up_by`` (``"delta"``, ``"folded"``, ``"anchor"``, …) and
    #: ``wire_bytes`` (what it was sent). A newcomer or a receiver behind is caught up on its own
    #: while the others get the delta (docs/protocol.md "Per-receiver plans").
    catch_ups: Tuple[dict, ...] = ()
    #: Rank 0, under ``commit_policy="quorum:…"``: the receivers fenced in this sync (they did not
    #: flush; rolled back to the version they held and caught up at the next sync). Each one's
    #: ``catch_ups`` entry has ``fenced: True`` and ``fenced_because``.
    fenced: Tuple[str, ...] = ()
    #: Rank 0 with a membership endpoint: the members left out of this sync because they could
    #: not be reached at its start (each "url: why"), and those dropped from the fleet for it
    #: (unreachable ``drop_after_missed_syncs`` syncs in a row, default 3).
    unreachable: Tuple[str, ...] = ()
    dropped: Tuple[str, ...] = ()

    @property
    def density(self) -> float:
        """The fraction of elements that changed."""
        return self.changed_elements / self.total_elements if self.total_elements else 0.0


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
    - ``item_coding``: ``"auto"`` (context-code a delta's items where the transport's link is
      slow or billed: ``s3://``, ``file://``), ``"context"`` or ``"plain"``
      (``delta_compression.item_coding``; payload format v2);
    - ``transfer_timeout``: seconds one sync may take, on every rank;
    - ``commit_policy``: ``"all"`` (default: one receiver that fails or misses the flush deadline
      aborts the sync everywhere) or ``"quorum:N"`` / ``"quorum:0.5"`` / ``"quorum:75%"`` of the
      replicas: the sync commits on those that flushed and fences the others (``SyncReport.fenced``),
      which are caught up at the next sync (zmq:// only);
    - ``staging_bytes``: host memory that tensors in device memory (:class:`DeviceTensor`) are
      staged through, in reusable buffers (default: twice the largest chunk this rank stages);
    - ``run_id``: rank 0: the training run these syncs belong to (default: a new random one,
      or with ``resume`` the fleet's). Receivers refuse another run's deltas and any transfer
      that would reuse a version number they hold under other contents, naming both runs;
    - ``resume``: rank 0: continue the run as its next epoch (the fleet's highest + 1), which
      fences the trainer it replaces; without it a run id the fleet holds fails the first sync.
    - ``membership_port``, ``membership_host``: rank 0: serve a membership endpoint there (port 0:
      a free one; host default 127.0.0.1), where receivers join and leave with one call
      (:meth:`Receiver.join`, ``refit join``), authenticated by ``api_key``; ``receivers`` may then
      be empty. Changes take effect at the next sync. A member unreachable at a sync's start is
      left out of it and dropped after ``drop_after_missed_syncs`` (default 3) such syncs in a row.
    """

    #: The keywords that set a key of the configuration file, and the key each sets.
    _CONFIG_KEYS = {
        "receivers": "receivers",
        "transport": "transport",
        "chunk_bytes": "delta_compression.export_chunk_bytes",
        "bucket_bytes": "delta_compression.sparse_bucket_size_bytes",
        "full_sync_interval": "delta_compression.full_sync_interval",
        "commit_policy": "commit_policy",
        "item_coding": "delta_compression.item_coding",
    }

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
        item_coding: Optional[str] = None,
        transfer_timeout: float = 600.0,
        staging_bytes: Optional[int] = None,
        run_id: Optional[str] = None,
        resume: bool = False,
        commit_policy: Optional[str] = None,
        membership_port: Optional[int] = None,
        membership_host: Optional[str] = None,
        drop_after_missed_syncs: Optional[int] = None,
    ):
        if group is None:
            group = in_process_group(1)[0]
        receivers = _receiver_endpoints(receivers)
        self._core = _core.Publisher(
            group,
            config,
            overrides("Publisher", self._CONFIG_KEYS, locals()),
            api_key=api_key,
            transfer_timeout_s=float(transfer_timeout),
            staging_bytes=staging_bytes,
            run_id=run_id,
            resume=bool(resume),
            membership_host=membership_host,
            membership_port=membership_port,
            drop_after_missed_syncs=drop_after_missed_syncs,
        )

    def adopt_baseline(
        self,
        tensors: TensorsLike,
        version: Optional[int] = None,
        *,
        layout: Optional[Sequence[Mapping[str, Any]]] = None,
    ) -> None:
        """Take ``tensors`` (the whole model, in canonical order) as what the receivers hold.

        The receivers loaded that checkpoint, so the first sync is a delta. ``version``: the
        version they hold, if known. Copies this rank's share of the model once (the baseline).

        With ``layout`` (as :meth:`sync` takes it), ``tensors`` are this rank's local tensors of a
        sharded model: a trainer rank restarted from the checkpoint the fleet holds adopts its own
        pieces, and the next sharded sync is a delta. Every rank may adopt, or one rank that
        restarted alone. Local, not collective.
        """
        if layout is not None:
            pieces = [dict(piece) for piece in layout]
            self._core.adopt_baseline_sharded(pieces, buffer_tensors(tensors), version)
        else:
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
        report["catch_ups"] = tuple(report["catch_ups"])
        report["fenced"] = tuple(report["fenced"])
        report["unreachable"] = tuple(report["unreachable"])
        report["dropped"] = tuple(report["dropped"])
        return SyncReport(**report)

    def set_receivers(self, receivers: Iterable[ReceiverLike]) -> None:
        """Rank 0: replace the fleet from the next sync on."""
        self._core.set_receivers(_receiver_endpoints(receivers))

    @property
    def membership_url(self) -> str:
        """Rank 0: the membership endpoint's URL, where receivers join ("" without one)."""
        return self._core.membership_url

    def membership(self) -> dict:
        """Rank 0: the members and how each stood at the last sync (``GET /v1/members``):
        ``{"fleet_version", "members": [{control_url, data_endpoint, joined, version,
        held_version, lag, caught_up_by, wire_bytes, missed_syncs, fenced}]}``."""
        return self._core.membership()

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
    def run_id(self) -> str:
        """Rank 0: the training run this publisher's transfers belong to (given, resumed from the
        fleet at the first sync, or random); empty before a ``resume`` learnt the fleet's."""
        return self._core.run_id

    @property
    def epoch(self) -> int:
        """Rank 0: this trainer's epoch of its run: 0 for a new run, the fleet's highest + 1 for a
        resumed one (known after the first sync)."""
        return self._core.epoch

    @property
    def baseline_bytes(self) -> int:
        """Bytes this rank keeps to diff against: its share of the model (its own boxes, when
        sharded)."""
        return self._core.baseline_bytes
