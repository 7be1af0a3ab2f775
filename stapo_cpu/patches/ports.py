"""The torch.distributed master port of a worker group, picked where nothing else takes it meanwhile
(the patch ``cpu_master_port`` of :mod:`stapo_cpu.patches.install` says why): at random between Ray's
worker ports (:data:`LOW`) and the kernel's ephemeral range, which it never hands out by itself.
"""

from __future__ import annotations

import random
import socket
from typing import Callable, Optional

#: lowest port picked (Ray's worker ports end at 19999 by default)
LOW = 20000
#: fewer ports than this between LOW and the ephemeral range: keep verl's own choice
MIN_SPAN = 1000
#: ports tried before giving up
TRIES = 64
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> Optional[tuple[int, int]]:
    """The kernel's ephemeral port range ``(low, high)``, or None where it cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def binds(port: int) -> bool:
    """True when a TCP socket can bind ``port`` on every address right now, without address reuse (so
    no socket of any state holds it, a closed connection's TIME_WAIT included)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def master_port(ephemeral: Optional[tuple[int, int]] = None, randrange: Optional[Callable[[int, int], int]] = None,
                tries: int = TRIES) -> Optional[int]:
    """A port in ``[LOW, ephemeral_low)`` that binds now, or None (no such range, or no free port
    found in ``tries`` picks).

    Args:
        ephemeral: the kernel's ephemeral range (default: :func:`ephemeral_range`).
        randrange: ``randrange(a, b)`` drawing a port in ``[a, b)`` (default: from the OS's entropy, so
            that the runs' own seeds do not make two runs pick alike).
    """
    ephemeral = ephemeral or ephemeral_range()
    if ephemeral is None or ephemeral[0] - LOW < MIN_SPAN:
        return None
    randrange = randrange or random.SystemRandom().randrange
    for _ in range(tries):
        port = randrange(LOW, ephemeral[0])
        if binds(port):
            return port
    return None


def wrap_get_master_addr_port(original):
    """verl's remote ``get_master_addr_port`` picking the port with :func:`master_port` (verl's own
    choice where that finds none, and wherever ``master_port_range`` is given)."""
    import ray  # only where verl's worker groups run (the patch applies when their module loads)

    choose = original._function  # the plain function under ray.remote

    def get_master_addr_port(master_port_range=None):
        addr, port = choose(master_port_range=master_port_range)
        if master_port_range is None:
            port = str(master_port() or port)
        return addr, port

    return ray.remote(get_master_addr_port)
