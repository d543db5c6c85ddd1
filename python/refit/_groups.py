"""Producer groups: how the W trainer ranks of a job reach each other (TCP, Python callables such
as torch.distributed, or threads of one process)."""

from __future__ import annotations

from typing import Callable, List, Optional

from . import _core

#: One rank's endpoint of a producer group, until a Publisher takes it over.
Group = _core.Group


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


def in_process_group(world_size: int) -> List[Group]:
    """Return the ``world_size`` ranks of one group, for Publishers on threads of one process."""
    return _core.in_process_group(world_size)
