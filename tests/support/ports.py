"""Ports for the servers tests start and restart on the same port (PostgreSQL, Kafka, ...).

A port the kernel hands out for ``bind(0)`` lies in the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 here), the same range it draws
client ports from. While such a server is down, a client retrying a connection to it can
be given that very port as its own source port and connect to itself (a TCP simultaneous
open); the server then cannot bind its port again ("Address already in use"). A CI run
lost its session PostgreSQL that way: writers retrying while the server was stopped.
So servers take a port below the ephemeral range and above Ray's worker ports
(10002-19999 by default), where no client is ever given a source port.
"""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 20_000, 32_000
_taken: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def server_port() -> int:
    """A free loopback port outside the ephemeral range, never handed out twice here."""
    high = min(_HIGH, _ephemeral_low() - 1)
    for _ in range(500):
        port = random.randint(_LOW, high)
        if port in _taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError(f"no free port in {_LOW}-{high} on 127.0.0.1")
