"""The exceptions refit raises.

Every error of the C++ core carries a status code; it reaches Python as the class below of that
code, with the C++ message unchanged. Each class is also the builtin exception a Python caller
would expect for that kind of failure, so ``except ValueError`` and ``except TimeoutError`` work
as well as ``except refit.InvalidArgument``:

====================  ======================================  ===========================
class                 also a                                  raised for
====================  ======================================  ===========================
Error                 RuntimeError                            the base of all below
InvalidArgument       ValueError                              bad input, a malformed payload or URI
DataLoss              —                                       a corrupt or truncated payload or file
FailedPrecondition    —                                       the wrong state (version mismatch, …)
Unavailable           ConnectionError                         a peer that cannot be reached
DeadlineExceeded      TimeoutError                            a timeout
ResourceExhausted     —                                       a size or count limit
Cancelled             —                                       a cancelled or aborted transfer
PermissionDenied      PermissionError                         a peer that failed authentication
NotFound              KeyError                                a tensor, file or transfer not there
AlreadyExists         —                                       a duplicate tensor or name
IoError               OSError                                 a failed system call
Internal              —                                       a bug in refit: please report it
====================  ======================================  ===========================
"""

from __future__ import annotations

from typing import Optional, Type

__all__ = [
    "Error",
    "InvalidArgument",
    "DataLoss",
    "FailedPrecondition",
    "Unavailable",
    "DeadlineExceeded",
    "ResourceExhausted",
    "Cancelled",
    "PermissionDenied",
    "NotFound",
    "AlreadyExists",
    "IoError",
    "Internal",
    "error_class",
    "code_of",
]


class Error(RuntimeError):
    """The base class of every error refit raises. ``code`` is the status code's name."""

    code = "Unknown"

    def __str__(self) -> str:
        # KeyError's __str__ quotes its argument; keep the C++ message as it is for all classes.
        return str(self.args[0]) if self.args else ""


class InvalidArgument(Error, ValueError):
    """Bad input from a caller, a file, a peer or the wire."""

    code = "InvalidArgument"


class DataLoss(Error):
    """A checksum mismatch: a corrupt or truncated payload or file."""

    code = "DataLoss"


class FailedPrecondition(Error):
    """The system is not in the state the call needs (a version mismatch, no baseline, …)."""

    code = "FailedPrecondition"


class Unavailable(Error, ConnectionError):
    """A peer or resource cannot be reached; retrying may succeed."""

    code = "Unavailable"


class DeadlineExceeded(Error, TimeoutError):
    """A deadline passed first."""

    code = "DeadlineExceeded"


class ResourceExhausted(Error):
    """A hard limit (size, count, memory) was hit.

    Not a MemoryError: that one means the interpreter ran out of memory, and code that catches it
    to shed load (or lets it kill the process) must not mistake a refused oversized payload for
    one."""

    code = "ResourceExhausted"


class Cancelled(Error):
    """The operation was cancelled: a Ctrl-C, an abort by rank 0 or by an operator."""

    code = "Cancelled"


class PermissionDenied(Error, PermissionError):
    """A peer failed authentication, or a key was refused."""

    code = "PermissionDenied"


class NotFound(Error, KeyError):
    """A named thing (file, tensor, transfer) does not exist."""

    code = "NotFound"


class AlreadyExists(Error):
    """A named thing exists already (a tensor registered twice, …)."""

    code = "AlreadyExists"


class IoError(Error, OSError):
    """An operating-system I/O call failed (open, mmap, write)."""

    code = "IoError"


class Internal(Error):
    """A broken internal invariant: a bug in refit."""

    code = "Internal"


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        DataLoss,
        FailedPrecondition,
        Unavailable,
        DeadlineExceeded,
        ResourceExhausted,
        Cancelled,
        PermissionDenied,
        NotFound,
        AlreadyExists,
        IoError,
        Internal,
    )
}


def error_class(code: str) -> Type[Error]:
    """Return the exception class of the status code named ``code`` (``Error`` if unknown)."""
    return _BY_CODE.get(code, Error)


def code_of(exception: BaseException) -> Optional[str]:
    """Return the status code name of a refit exception, or None for any other exception."""
    return exception.code if isinstance(exception, Error) else None
