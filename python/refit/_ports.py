"""Free TCP ports for data endpoints that must be known before anything binds them.

A relay tree names every receiver's endpoint up front, so a port is chosen, released, and bound
later by the receiver. The usual probe -- bind port 0, read it back, close -- hands out a port
from the kernel's ephemeral range, the same range every outgoing connection takes its source
port from: on a busy host another process's connect() can take the port between the probe and
the bind ("Address already in use"). These helpers choose ports *outside* the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), at random, and probe each one, so only another
process choosing ports the same way could collide, and a second choice is a different random
draw. Where the ephemeral range leaves no room, they fall back to the kernel's choice.

This file imports nothing of refit's, so test scripts that run without the built extension can
load it by path.
"""

import random
import socket
from typing import List, Tuple

#: The lowest port handed out: below it sit well-known services (and 1024 needs root).
_FLOOR = 10000
#: A gap smaller than this is too crowded to draw from at random.
_MIN_GAP = 1000
_ATTEMPTS = 200


def _ephemeral_range() -> Tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(field) for field in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _candidate_ranges(count: int) -> List[Tuple[int, int]]:
    """Half-open ranges [first, last) of base ports p with p … p+count-1 outside the ephemeral range."""
    low, high = _ephemeral_range()
    ranges = []
    for first, end in ((_FLOOR, low), (high + 1, 65536)):
        last = end - count + 1
        if last - first >= _MIN_GAP:
            ranges.append((first, last))
    return ranges


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """Return a port p such that p … p+count-1 are all free on ``host`` now."""
    if count < 1:
        raise ValueError(f"free_port_block: count must be at least 1, got {count}")
    ranges = _candidate_ranges(count)
    rng = random.SystemRandom()
    for _ in range(_ATTEMPTS):
        if ranges:
            first, last = rng.choice(ranges)
            base = rng.randrange(first, last)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((host, 0))
                base = probe.getsockname()[1]
            if base + count > 65536:
                continue
        if all(_bindable(host, base + offset) for offset in range(count)):
            return base
    raise OSError(f"no block of {count} free TCP ports on {host} after {_ATTEMPTS} attempts")


def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """Return ``count`` distinct ports, each free on ``host`` now."""
    ports: List[int] = []
    while len(ports) < count:
        port = free_port_block(1, host)
        if port not in ports:
            ports.append(port)
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """Return one port free on ``host`` now."""
    return free_port_block(1, host)
