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

from . import _cuda_libraries

_cuda_libraries.preload()  # before _core: torch's CUDA libraries, not the system's (see there)

from . import _core, errors  # noqa: E402
from ._config import Config
from ._groups import Group, callback_group, in_process_group, tcp_group
from ._loader import Loader
from ._ports import free_ports
from ._publisher import Publisher, SyncReport, plan_layouts
from ._receiver import Receiver, ReceiverStatus
from ._tensors import DeviceTensor
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

#: Set refit's log level ("trace", "debug", "info", "warn", "error", "critical", "off"). The log
#: goes to stderr; its level starts from the environment variable REFIT_LOG_LEVEL, else "warn"
#: (as the ``refit`` CLI's).
set_log_level = _core.set_log_level
#: refit's current log level.
log_level = _core.log_level

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
