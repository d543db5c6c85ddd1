"""The worker extension: refit receivers inside vLLM workers, driven by ``collective_rpc``.

vLLM mixes the class named by ``LLM(..., worker_extension_cls="refit.vllm.RefitWorkerExtension")``
(or ``vllm serve --worker-extension-cls``) into its worker class at start-up — it appends it to
the worker class's ``__bases__`` in every worker process — so each method below becomes a method
of the worker, reached by name: ``llm.collective_rpc("refit_start", kwargs={...})`` calls it on
every worker and returns the list of their results (plain dicts and ints, which vLLM's msgpack
RPC carries).

vLLM refuses an extension whose non-dunder attribute names already exist on the worker class,
so every name here starts with ``refit_`` or ``_refit_``; per-worker state lives in one instance
attribute, ``_refit_runtime``, set by :meth:`RefitWorkerExtension.refit_start` (the extension's
``__init__`` is never called).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from refit.errors import FailedPrecondition

from refit.errors import InvalidArgument

from ._runtime import (
    RefitOptions,
    WorkerRuntime,
    data_endpoint_of,
    data_parallel_size,
    default_replica,
    is_zmq,
    parallel_coordinates,
)


class RefitWorkerExtension:
    """A vLLM worker extension that keeps the worker's model in sync with a refit publisher.

    It relies on the worker attributes vLLM's workers have: ``self.model_runner.model`` (the
    ``torch.nn.Module`` being served), ``self.vllm_config`` (for ``parallel_config`` and the
    engine's ``instance_id``), ``self.rank`` (the fallback for the TP rank) and ``self.device``.

    Lifecycle, from the driver (the zmq:// relay tree needs every receiver's data endpoint
    before any starts, hence the reservation round)::

        options = {
            "canonical_shapes": {name: list(t.shape) for name, t in trainer_state.items()},
            "fused": [...],                     # q,k,v → qkv_proj; gate,up → gate_up_proj
        }
        reservations = llm.collective_rpc("refit_reserve", kwargs={"options": options})
        options["peers"] = refit.vllm.peers_of(reservations)
        infos = llm.collective_rpc("refit_start", kwargs={"options": options})
        publisher = refit.torch.Publisher(receivers=refit.vllm.receivers_of(infos))
        ...
        publisher.sync(trainer_model)           # the workers' weights now match, bit for bit
        llm.collective_rpc("refit_stop")

    While a transfer is being applied, the worker's forward passes are held (``pause="gate"``):
    a generation step sees the old weights or the new ones, never a mix. vLLM's scheduler is not
    paused; see docs/vllm.md for ``pause_generation`` and the prefix cache.

    Thread-safety: vLLM calls these methods on the worker's RPC thread, one at a time.
    """

    def refit_reserve(self, options: Optional[Mapping[str, Any]] = None, **overrides: Any) -> Dict[str, Any]:
        """Choose this worker's zmq data endpoint, for the fleet's ``peers`` list; start nothing.

        Takes the options :meth:`refit_start` will get (``data_host``, ``data_port``, the TP
        overrides and ``replica`` matter here). Returns ``{data_endpoint, tp_rank, tp_size,
        dp_rank, replica}``; :func:`refit.vllm.peers_of` orders a fleet's reservations into
        ``peers``. The next :meth:`refit_start` listens on this endpoint. With a free port the
        port is probed, not held: another process may take it before the start (rare; the start
        then fails with Unavailable or AlreadyExists — reserve again).
        """
        parsed = RefitOptions.from_dict(options, **overrides)
        if not is_zmq(parsed):
            raise InvalidArgument(f"refit.vllm: refit_reserve is for zmq://, not {parsed.transport}")
        vllm_config = getattr(self, "vllm_config", None)
        tp_rank, tp_size, dp_rank = parallel_coordinates(self, vllm_config, parsed)
        replica = parsed.replica if parsed.replica is not None else default_replica(vllm_config, tp_size, dp_rank)
        endpoint = data_endpoint_of(parsed, dp_rank * tp_size + tp_rank)
        self._refit_reserved = endpoint
        return {"data_endpoint": endpoint, "tp_rank": tp_rank, "tp_size": tp_size, "dp_rank": dp_rank, "replica": replica}

    def refit_start(self, options: Optional[Mapping[str, Any]] = None, **overrides: Any) -> Dict[str, Any]:
        """Start this worker's refit receiver over its model, in place; return its endpoints.

        ``options`` (and keyword ``overrides``) are the keys of :class:`refit.vllm.RefitOptions`.
        Every parameter and buffer of ``self.model_runner.model`` is registered zero-copy: each
        commit writes the new weights into the module's own tensors. The loader maps canonical
        (checkpoint) tensors onto this worker's TP shard, its rank taken from vLLM's parallel
        state. Over zmq:// with more than one receiver, ``peers`` is required (see
        :meth:`refit_reserve`) unless ``data_port`` is fixed. Returns ``{control_url,
        producer_endpoint, version, tp_rank, tp_size, dp_rank, replica, peers, pid}``. Raises
        FailedPrecondition if already started (call :meth:`refit_stop` first), InvalidArgument
        for unknown options, missing peers or a model tensor on the meta device, and the
        receiver's errors.
        """
        if getattr(self, "_refit_runtime", None) is not None and self._refit_runtime.running:
            raise FailedPrecondition("refit.vllm: refit_start called twice; call refit_stop first")
        parsed = RefitOptions.from_dict(options, **overrides)
        vllm_config = getattr(self, "vllm_config", None)
        tp_rank, tp_size, dp_rank = parallel_coordinates(self, vllm_config, parsed)
        replica = parsed.replica if parsed.replica is not None else default_replica(vllm_config, tp_size, dp_rank)
        runtime = WorkerRuntime(
            self._refit_model(),
            parsed,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dp_rank=dp_rank,
            replica=replica,
            dp_size=data_parallel_size(vllm_config),
            data_endpoint=getattr(self, "_refit_reserved", None),
            vllm_config=vllm_config,
        )
        info = runtime.start()
        self._refit_runtime = runtime
        self._refit_reserved = None
        return info

    def refit_info(self) -> Dict[str, Any]:
        """Return this worker's receiver endpoints and place (as :meth:`refit_start` does).

        Works for the extension's own receiver and for one run by the native ``refit``
        weight-transfer engine (whose ``init_weight_transfer_engine`` returns nothing to the
        trainer). Raises FailedPrecondition when neither runs.
        """
        return self._refit_active_runtime().info()

    def refit_status(self) -> Dict[str, Any]:
        """Return the receiver's status: version, open transfer, pause state, commit/abort counts.

        Keys: the fields of :class:`refit.ReceiverStatus` (``transfer_id`` as hex), ``running``,
        ``paused`` (a transfer is being applied), ``gate_closed``, ``forwards_in_flight``,
        ``commits``, ``aborts``, ``last_event``, ``tp_rank``, ``tp_size``, ``dp_rank``, ``replica``.
        Raises FailedPrecondition when no receiver was started.
        """
        return self._refit_active_runtime().status()

    def refit_version(self) -> int:
        """Return the committed refit version this worker's weights hold."""
        return self._refit_active_runtime().version

    def refit_wait_for_version(self, version: int, timeout: Optional[float] = None) -> int:
        """Block until this worker committed ``version`` or a later one; return the version.

        Raises DeadlineExceeded after ``timeout`` s (default: the ``wait_timeout`` option).
        """
        return self._refit_active_runtime().wait_for_version(version, timeout)

    def refit_stop(self) -> Optional[Dict[str, Any]]:
        """Stop this worker's receiver (an open transfer rolls back); return its last status.

        Idempotent: returns None when no receiver runs. The model keeps the last committed
        weights.
        """
        runtime = getattr(self, "_refit_runtime", None)
        if runtime is None:
            return None
        self._refit_runtime = None
        return runtime.stop()

    # -- internals (names start with _refit_ so they cannot collide with the worker's) --------

    def _refit_model(self) -> Any:
        runner = getattr(self, "model_runner", None)
        model = getattr(runner, "model", None)
        if model is None and runner is not None and hasattr(runner, "get_model"):
            model = runner.get_model()
        if model is None:
            raise FailedPrecondition("refit.vllm: the worker has no model_runner.model (called before load_model?)")
        return model

    def _refit_active_runtime(self) -> WorkerRuntime:
        runtime = getattr(self, "_refit_runtime", None)
        if runtime is not None and runtime.running:
            return runtime
        engine = getattr(self, "weight_transfer_engine", None)
        engine_runtime = getattr(engine, "refit_runtime", None)
        if engine_runtime is not None and engine_runtime.running:
            return engine_runtime
        raise FailedPrecondition(
            "refit.vllm: no refit receiver runs in this worker; call refit_start (or "
            "init_weight_transfer_engine with the 'refit' backend) first"
        )


def _place(info: Mapping[str, Any]) -> tuple:
    return (str(info.get("replica", "")), int(info.get("dp_rank", 0)), int(info.get("tp_rank", 0)))


def peers_of(reservations: List[Mapping[str, Any]]) -> List[str]:
    """Return the fleet's ``peers`` (relay tree) from the workers' ``refit_reserve`` results.

    ``reservations``: one dict per worker, several engines' lists concatenated. The data
    endpoints, ordered by replica, DP rank and TP rank. Raises InvalidArgument for a repeated
    endpoint.
    """
    ordered = sorted(reservations, key=_place)
    peers = [str(item["data_endpoint"]) for item in ordered]
    if len(set(peers)) != len(peers):
        raise InvalidArgument(f"refit.vllm: repeated data endpoints in the reservations: {peers}")
    return peers


def receivers_of(infos: List[Mapping[str, Any]]) -> List[tuple]:
    """Return the ``receivers`` list of a :class:`refit.Publisher` from the workers' infos.

    ``infos``: what ``collective_rpc("refit_start" | "refit_info")`` returned (one dict per
    worker; several engines' lists may be concatenated). Returns ``(control_url,
    producer_endpoint)`` pairs, one per distinct receiver, in relay-tree order: the order of
    the workers' ``peers`` when they have one, else by replica, DP rank and TP rank. Raises
    InvalidArgument when the workers disagree on ``peers`` or a peer has no receiver (the tree
    would forward payloads to a receiver the publisher does not prepare).
    """
    unique: Dict[tuple, Mapping[str, Any]] = {}
    for info in infos:
        unique.setdefault((info["control_url"], info["producer_endpoint"]), info)
    trees = {tuple(info.get("peers") or ()) for info in unique.values()}
    if trees == {()}:
        return [key for key, _ in sorted(unique.items(), key=lambda item: _place(item[1]))]
    if len(trees) != 1:
        raise InvalidArgument(f"refit.vllm: the workers were started with different peers: {sorted(trees)}")
    (peers,) = trees
    by_endpoint = {key[1]: key for key in unique}
    missing = [peer for peer in peers if peer not in by_endpoint]
    if missing or len(by_endpoint) != len(peers):
        raise InvalidArgument(
            f"refit.vllm: peers {list(peers)} and the receivers' endpoints {sorted(by_endpoint)} differ "
            f"(missing: {missing}); pass every worker's info"
        )
    return [by_endpoint[peer] for peer in peers]
