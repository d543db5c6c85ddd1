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

from ._runtime import RefitOptions, WorkerRuntime, default_replica, parallel_coordinates


class RefitWorkerExtension:
    """A vLLM worker extension that keeps the worker's model in sync with a refit publisher.

    It relies on the worker attributes vLLM's workers have: ``self.model_runner.model`` (the
    ``torch.nn.Module`` being served), ``self.vllm_config`` (for ``parallel_config`` and the
    engine's ``instance_id``), ``self.rank`` (the fallback for the TP rank) and ``self.device``.

    Lifecycle, from the driver::

        infos = llm.collective_rpc("refit_start", kwargs={"options": {
            "canonical_shapes": {name: list(t.shape) for name, t in trainer_state.items()},
            "fused": {...},                     # q,k,v → qkv_proj; gate,up → gate_up_proj
        }})
        publisher = refit.torch.Publisher(receivers=refit.vllm.receivers_of(infos))
        ...
        publisher.sync(trainer_model)           # the workers' weights now match, bit for bit
        llm.collective_rpc("refit_stop")

    While a transfer is being applied, the worker's forward passes are held (``pause="gate"``):
    a generation step sees the old weights or the new ones, never a mix. vLLM's scheduler is not
    paused; see docs/vllm.md for ``pause_generation`` and the prefix cache.

    Thread-safety: vLLM calls these methods on the worker's RPC thread, one at a time.
    """

    def refit_start(self, options: Optional[Mapping[str, Any]] = None, **overrides: Any) -> Dict[str, Any]:
        """Start this worker's refit receiver over its model, in place; return its endpoints.

        ``options`` (and keyword ``overrides``) are the keys of :class:`refit.vllm.RefitOptions`.
        Every parameter and buffer of ``self.model_runner.model`` is registered zero-copy: each
        commit writes the new weights into the module's own tensors. The loader maps canonical
        (checkpoint) tensors onto this worker's TP shard, its rank taken from vLLM's parallel
        state. Returns ``{control_url, producer_endpoint, version, tp_rank, tp_size, dp_rank,
        replica, pid}``. Raises FailedPrecondition if already started (call
        :meth:`refit_stop` first), InvalidArgument for unknown options or a model tensor in device
        memory, and the receiver's errors.
        """
        if getattr(self, "_refit_runtime", None) is not None and self._refit_runtime.running:
            raise FailedPrecondition("refit.vllm: refit_start called twice; call refit_stop first")
        parsed = RefitOptions.from_dict(options, **overrides)
        vllm_config = getattr(self, "vllm_config", None)
        tp_rank, tp_size, dp_rank = parallel_coordinates(self, vllm_config, parsed)
        replica = parsed.replica if parsed.replica is not None else default_replica(vllm_config, tp_size, dp_rank)
        runtime = WorkerRuntime(
            self._refit_model(), parsed, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank, replica=replica
        )
        info = runtime.start()
        self._refit_runtime = runtime
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


def receivers_of(infos: List[Mapping[str, Any]]) -> List[tuple]:
    """Return the ``receivers`` list of a :class:`refit.Publisher` from the workers' infos.

    ``infos``: what ``collective_rpc("refit_start" | "refit_info")`` returned (one dict per
    worker; several engines' lists may be concatenated). Returns ``(control_url,
    producer_endpoint)`` pairs, one per distinct receiver, ordered by replica, DP rank, TP rank.
    """
    seen = {}
    for info in infos:
        key = (info["control_url"], info["producer_endpoint"])
        seen.setdefault(key, (str(info.get("replica", "")), int(info.get("dp_rank", 0)), int(info.get("tp_rank", 0))))
    return [key for key, _ in sorted(seen.items(), key=lambda item: item[1])]
