"""Loopback ports for the servers the tests start, taken from outside the kernel's ephemeral range.

A port found free by binding port 0 comes from the ephemeral range: the range the kernel also
gives every outgoing connection, of any process on the machine, as its local port. Between that
probe and the server's own bind (seconds for RabbitMQ, PostgreSQL or Redis, and again at each
restart of a stopped server on the same port) a client connection may take the port, and the
server fails with ``EADDRINUSE``. Ports below the ephemeral range are taken only by an explicit
bind, so they stay free unless another server asks for them; each is picked at random (from a
generator of its own, which no test seeds) and checked by binding it, so passes that run side by
side do not pick the same one.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["ephemeral_range", "free_port", "free_ports"]

#: Below this, ports belong to well-known services.
_LOWEST = 10000
#: Linux's own default, for a machine that does not say.
_DEFAULT_EPHEMERAL = (32768, 60999)
_RANDOM = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (inclusive)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bound(port: int) -> socket.socket | None:
    """A socket bound to ``127.0.0.1:port``, or None when the port is taken."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(count: int, *, paired_offset: int = 0) -> list[int]:
    """``count`` distinct ports free now, each with ``port + paired_offset`` free too when the
    offset is not 0 (a Redis Cluster node's bus port), all below the ephemeral range."""
    top = ephemeral_range()[0] - paired_offset
    if top - _LOWEST < 100 * count:
        raise RuntimeError(f"too few ports between {_LOWEST} and the ephemeral range ({top})")
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for port in _RANDOM.sample(range(_LOWEST, top), k=min(top - _LOWEST, 1000)):
            wanted = [port, port + paired_offset] if paired_offset else [port]
            sockets = [sock for number in wanted if (sock := _bound(number)) is not None]
            held += sockets
            if len(sockets) == len(wanted):
                ports.append(port)
                if len(ports) == count:
                    return ports
    finally:
        for sock in held:
            sock.close()
    raise RuntimeError(f"no {count} free ports below {top}")


def free_port() -> int:
    """One port free now, below the ephemeral range."""
    return free_ports(1)[0]
