"""The logic of the ``refit`` weight-transfer engine, without vLLM's base class.

:mod:`refit.vllm.engine` combines :class:`RefitEngineLogic` with vLLM's ``WeightTransferEngine``;
keeping the logic here lets it import without vLLM. The mapping of vLLM's four-phase protocol
onto refit, per worker:

==============================  ==============================================================
vLLM (worker-side engine)       refit
==============================  ==============================================================
``init_transfer_engine(info)``  start a receiver over ``self.model`` (in place), TP shard from
                                vLLM's parallel state; the trainer reads its endpoints with
                                ``collective_rpc("refit_info")`` or from ``endpoints_dir``
``start_weight_update()``       mark the session: later aborts count against it
(trainer)                       ``Publisher.sync(...)`` moves the data over refit's own
                                ZeroMQ data plane and commits on every receiver, or on none
``update_weights({"version":    the ack: wait until this receiver committed version N; raise
N})``                           :class:`WeightUpdateAborted` if the transfer aborted
``finish_weight_update()``      wait for (or re-check) the commit of N; raise if it aborted or
                                no version was announced. vLLM publishes ``weight_version``
                                only after every worker's finish returned, so a failed refit
                                transfer never gets a version
==============================  ==============================================================

No weights pass through ``update_weights``: refit applies payloads into the registered tensors
on its own threads, holding forward passes meanwhile (the gate), and rolls an aborted transfer
back bit-exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

from refit.errors import FailedPrecondition, InvalidArgument

from ._runtime import (
    RefitOptions,
    WeightUpdateAborted,
    WorkerRuntime,
    data_parallel_size,
    default_replica,
    parallel_coordinates,
)

#: The backend name: ``WeightTransferConfig(backend="refit")``.
BACKEND = "refit"


@dataclasses.dataclass
class RefitUpdateFields:
    """The fields of the ``update_info`` dict the ``refit`` engine takes (see the engine)."""

    #: The refit version the trainer's sync committed (``SyncReport.version``).
    version: Optional[int] = None
    #: Seconds to wait for the commit (default: the init info's ``wait_timeout``).
    timeout: Optional[float] = None
    #: Wait in ``update_weights`` (default). False: only record the version; the wait happens
    #: in ``finish_weight_update`` — where a failure leaves vLLM's worker session open.
    wait: bool = True
    #: The trainer declares the update failed (its sync raised): the engine raises
    #: :class:`WeightUpdateAborted`, which ends vLLM's session without a version.
    aborted: bool = False
    #: Why, for the error message.
    reason: str = ""


@dataclasses.dataclass
class _Session:
    mark: int
    base_version: int
    version: Optional[int] = None
    timeout: Optional[float] = None
    confirmed: bool = False
    failure: Optional[str] = None


def options_of(init_info: Any) -> RefitOptions:
    """Return the :class:`RefitOptions` an init-info object (or a dict) carries."""
    if isinstance(init_info, Mapping):
        return RefitOptions.from_dict(init_info)
    values = {field.name: getattr(init_info, field.name) for field in dataclasses.fields(RefitOptions)}
    options = RefitOptions(**values)
    options.validate()
    return options


class RefitEngineLogic:
    """vLLM's worker-side weight-transfer protocol, implemented over a refit receiver.

    Mixed in front of vLLM's ``WeightTransferEngine``, whose ``__init__(config, vllm_config,
    device, model)`` sets ``self.vllm_config`` and ``self.model`` (the worker's model). In-place
    engine: no layerwise reload, no draft-model updates.

    Thread-safety: vLLM calls the protocol methods on the worker's RPC thread, one at a time.
    """

    #: The speculative draft model is not refit's (vLLM checks this before a draft update).
    supports_draft_weight_update = False

    # -- vLLM's protocol -------------------------------------------------------------------

    def init_transfer_engine(self, init_info: Any) -> None:
        """Start (or restart) this worker's receiver with the options ``init_info`` carries.

        ``init_info``: a :class:`refit.vllm.engine.RefitWeightTransferInitInfo` (vLLM parses the
        ``init_info`` dict into one; its keys are those of :class:`refit.vllm.RefitOptions`).
        This one broadcast call cannot gather endpoints first, so a fleet of more than one
        receiver over zmq:// needs fixed ports (``data_port``; the engine's own workers are then
        the default ``peers``) or an explicit ``peers`` list. A receiver already running is
        stopped first. Raises InvalidArgument
        (bad options, a model tensor in device memory) and the receiver's errors.
        """
        options = options_of(init_info)
        vllm_config = getattr(self, "vllm_config", None)
        tp_rank, tp_size, dp_rank = parallel_coordinates(None, vllm_config, options)
        replica = options.replica if options.replica is not None else default_replica(vllm_config, tp_size, dp_rank)
        self.shutdown()
        runtime = WorkerRuntime(
            self._refit_target_model(),
            options,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dp_rank=dp_rank,
            replica=replica,
            dp_size=data_parallel_size(vllm_config),
            vllm_config=vllm_config,
        )
        runtime.start()
        self._refit = runtime
        self._refit_session = None

    def start_weight_update(self) -> None:
        """Open a weight-update session: remember the version and the last transfer outcome.

        Raises FailedPrecondition when the engine was not initialized.
        """
        runtime = self._refit_require()
        self._refit_session = _Session(mark=runtime.event_seq, base_version=runtime.version)

    def update_weights(self, update_info: Any) -> None:
        """Take one ``update_info`` dict: the trainer's ack of its refit sync.

        Keys (see :class:`RefitUpdateFields`): ``version`` (required unless ``aborted``),
        ``timeout``, ``wait``, ``aborted``, ``reason``. Unlike vLLM's base method this does not
        synchronize the device: refit wrote host memory. Raises ValueError for unknown keys,
        :class:`WeightUpdateAborted` when the transfer aborted (or the trainer says so), and
        DeadlineExceeded when the commit does not come in time; vLLM's worker then ends the
        session, and no ``weight_version`` is published.
        """
        if isinstance(update_info, Mapping):
            parse = getattr(self, "parse_update_info", None)
            update_info = parse(dict(update_info)) if parse is not None else RefitUpdateFields(**update_info)
        self.receive_weights(update_info)

    def receive_weights(self, update_info: Any, load_weights: Optional[Callable[..., None]] = None) -> None:
        """Wait for the commit ``update_info.version`` announces (the data moved already).

        ``load_weights`` (older vLLM bases pass one) is unused: refit applies in place.
        """
        runtime = self._refit_require()
        session = getattr(self, "_refit_session", None)
        if session is None:
            # vLLM's worker refuses update_weights outside a session; direct callers get one.
            session = self._refit_session = _Session(mark=runtime.event_seq, base_version=runtime.version)
        if getattr(update_info, "aborted", False):
            reason = getattr(update_info, "reason", "") or "the trainer's sync failed"
            session.failure = reason
            raise WeightUpdateAborted(
                f"refit.vllm: weight update aborted by the trainer ({reason}); tp rank "
                f"{runtime.tp_rank} of replica '{runtime.replica}' stays at version {runtime.version}"
            )
        version = getattr(update_info, "version", None)
        if version is None:
            raise InvalidArgument(
                "refit.vllm: update_info needs 'version' (the SyncReport.version of the trainer's "
                "refit sync), or 'aborted': True"
            )
        session.version = int(version)
        session.timeout = getattr(update_info, "timeout", None)
        if getattr(update_info, "wait", True):
            try:
                runtime.wait_committed(session.version, session.mark, session.base_version, session.timeout)
            except BaseException as error:
                session.failure = str(error)
                raise
            session.confirmed = True

    def finish_weight_update(self) -> None:
        """End the session once the announced version is committed on this worker.

        Waits for the commit if ``update_weights`` did not. Raises FailedPrecondition (no session,
        or no version announced: there is nothing to publish), :class:`WeightUpdateAborted` (the
        transfer aborted) and DeadlineExceeded. vLLM sets ``weight_version`` only when every
        worker's finish returned.
        """
        runtime = self._refit_require()
        session, self._refit_session = getattr(self, "_refit_session", None), None
        if session is None:
            raise FailedPrecondition("refit.vllm: finish_weight_update without start_weight_update")
        if session.failure is not None:
            raise WeightUpdateAborted(
                f"refit.vllm: this weight update failed ({session.failure}); not finishing it"
            )
        if session.version is None:
            raise FailedPrecondition(
                "refit.vllm: finish_weight_update before update_weights({'version': N}): no refit "
                "version was announced, so there is no committed update to publish"
            )
        if session.confirmed and runtime.version >= session.version:
            return
        runtime.wait_committed(session.version, session.mark, session.base_version, session.timeout)

    def abort_weight_update(self) -> None:
        """Drop the open session (vLLM's abort hook). The receiver rolls back on its own."""
        self._refit_session = None

    def shutdown(self) -> None:
        """Stop the receiver (an open transfer rolls back). Idempotent."""
        runtime, self._refit = getattr(self, "_refit", None), None
        self._refit_session = None
        if runtime is not None:
            runtime.stop()

    @staticmethod
    def trainer_send_weights(iterator: Iterator[Tuple[str, Any]], trainer_args: Any) -> None:
        """Sync ``iterator``'s (name, tensor) pairs with ``trainer_args["publisher"]``.

        For vLLM bases that still declare this static trainer-side method: ``trainer_args`` is a
        mapping with a ``publisher`` (a :class:`refit.Publisher`). Prefer
        :func:`refit.vllm.sync_weights`, which also drives the workers' sessions.
        """
        publisher = trainer_args["publisher"] if isinstance(trainer_args, Mapping) else trainer_args.publisher
        publisher.sync(list(iterator))

    # -- refit's own -----------------------------------------------------------------------

    @property
    def refit_runtime(self) -> Optional[WorkerRuntime]:
        """The worker's :class:`WorkerRuntime`, or None before ``init_transfer_engine``."""
        return getattr(self, "_refit", None)

    def refit_info(self) -> Dict[str, Any]:
        """Return this worker's receiver endpoints and place (see ``WorkerRuntime.info``)."""
        return self._refit_require().info()

    def _refit_require(self) -> WorkerRuntime:
        runtime = getattr(self, "_refit", None)
        if runtime is None or not runtime.running:
            raise FailedPrecondition(
                "refit.vllm: the refit weight-transfer engine is not initialized; call "
                "init_weight_transfer_engine first"
            )
        return runtime

    def _refit_target_model(self) -> Any:
        model = getattr(self, "model", None)
        if model is None:
            raise FailedPrecondition("refit.vllm: the weight-transfer engine was built without a model")
        return model
