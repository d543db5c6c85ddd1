"""The ``refit`` backend of vLLM's native weight-transfer API (imports vLLM).

vLLM builds this engine in every worker when the engine is configured with
``weight_transfer_config=WeightTransferConfig(backend="refit")`` (CLI:
``--weight-transfer-config '{"backend": "refit"}'``), once :func:`refit.vllm.register` has
registered the backend — which the ``vllm.general_plugins`` entry point of the refit package
does in every vLLM process. vLLM imports this module lazily, by name, when it creates the
engine; ``import refit.vllm`` alone never imports it.

Interface followed: ``vllm/distributed/weight_transfer/base.py`` of vLLM 0.34.0 (pinned in
python/requirements-dev.txt, read from the installed code): ``WeightTransferEngine.__init__(config,
vllm_config, device, model)``; the abstract ``init_transfer_engine``, ``start_weight_update``,
``finish_weight_update``, ``receive_weights(update_info)`` and ``shutdown``; and the concrete
``parse_init_info`` and ``parse_update_info``, which build ``init_info_cls(**dict)`` and
``update_info_cls(**dict)``. python/tests/test_vllm_engine.py drives it through that vLLM's
plugin loader, factory and ``Worker`` methods (docs/vllm.md, "Interface version followed").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from vllm.distributed.weight_transfer.base import (  # noqa: F401 — the real base classes
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ._engine import BACKEND, RefitEngineLogic
from ._runtime import RefitOptions

__all__ = [
    "BACKEND",
    "RefitWeightTransferEngine",
    "RefitWeightTransferInitInfo",
    "RefitWeightTransferUpdateInfo",
]


@dataclasses.dataclass
class RefitWeightTransferInitInfo(RefitOptions, WeightTransferInitInfo):
    """The ``init_info`` of the ``refit`` backend: the fields of :class:`refit.vllm.RefitOptions`.

    vLLM's ``init_weight_transfer_engine({"init_info": {...}})`` parses the dict into this class
    on every worker; unknown keys are a ValueError.
    """


@dataclasses.dataclass
class RefitWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """The ``update_info`` of the ``refit`` backend: an ack of the trainer's refit sync.

    ``{"version": report.version}`` after a successful ``Publisher.sync``; ``{"aborted": True,
    "reason": "..."}`` after a failed one (ends vLLM's session without a version). ``timeout``
    (seconds) bounds the wait for the commit; ``wait=False`` defers it to
    ``finish_weight_update``.
    """

    version: Optional[int] = None
    timeout: Optional[float] = None
    wait: bool = True
    aborted: bool = False
    reason: str = ""


class RefitWeightTransferEngine(RefitEngineLogic, WeightTransferEngine):
    """vLLM's worker-side weight-transfer engine over a refit receiver (see :mod:`refit.vllm._engine`).

    Constructed by ``WeightTransferEngineFactory.create_engine(config, vllm_config, device,
    model)`` in each worker's ``load_model``. ``model`` must be in host memory (refit writes
    weights in place there); ``init_transfer_engine`` raises InvalidArgument naming the first
    tensor that is not.
    """

    init_info_cls = RefitWeightTransferInitInfo
    update_info_cls = RefitWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: Any = None, model: Any = None) -> None:
        """Keep vLLM's configuration, device and model; the receiver starts at init time."""
        super().__init__(config, vllm_config, device, model)
        self._refit = None
        self._refit_session = None
