"""Ports for a service to listen on, picked where no outgoing connection can take them first.

A port that was free a moment ago is closed again when it is handed out, and the service that is given it binds
it later (seconds later, for a process that loads a model first). A port from the kernel's ephemeral range
(``net.ipv4.ip_local_port_range``) can meanwhile become the local end of any process's outgoing connection: the
ranks of a parallel group open dozens, and a scheduler then failed to bind its HTTP port with EADDRINUSE. So the
ports handed out lie outside that range, where the kernel never puts an outgoing connection; bind(0), which
gives one inside it, is the fallback where the range cannot be read.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOOPBACK = "127.0.0.1"

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Below this lie the well-known and registered ports of services people run.
_LOWEST = 10_000
# A stretch of ports outside the ephemeral range counts when it holds at least this many.
_MIN_STRETCH = 1_000
# Ports free_port gave out in this process, and the lock that keeps two threads from taking the same one.
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
# Tries before free_port gives up.
_MAX_PORT_TRIES = 1000
_random = random.SystemRandom()


def listen_ports(ephemeral_range: Path = _EPHEMERAL_RANGE) -> list[range]:
    """The stretches of ports from 10,000 up that lie outside the kernel's ephemeral range ([] if unreadable)."""
    try:
        low, high = (int(field) for field in ephemeral_range.read_text().split())
    except (OSError, ValueError):
        return []
    stretches = (range(_LOWEST, low), range(max(_LOWEST, high + 1), 65536))
    return [stretch for stretch in stretches if len(stretch) >= _MIN_STRETCH]


def _candidate(stretches: list[range]) -> int:
    """A port drawn evenly from the stretches, or 0 (the kernel picks) where there are none."""
    if not stretches:
        return 0
    index = _random.randrange(sum(len(stretch) for stretch in stretches))
    for stretch in stretches:
        if index < len(stretch):
            return stretch[index]
        index -= len(stretch)
    raise AssertionError("unreachable: index within the stretches' total")


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free a moment ago on ``host``, outside the ephemeral range, never one given before in this process.

    The port is closed again when it is returned: two services started from one process would race for one the
    kernel gave twice, and the loser fails to listen; so a port given once is never given again.
    """
    stretches = listen_ports()
    with _handed_out_lock:
        for _ in range(_MAX_PORT_TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, _candidate(stretches)))
                except OSError:
                    continue  # in use (listening, connected or closing): draw another
                port: int = sock.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host} that this process was not given before ({_MAX_PORT_TRIES} tries)")
