"""Sockets both sides bind the same way: bound to what is meant (loopback, or a node's own address), never a wildcard.

Owns only the binding; it never listens, connects or reads (the store, the listener and the node host do).
"""
from __future__ import annotations

import socket


def bound_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a port the kernel picks), not yet listening. Rank 0's store listens
    on it (TCPStore's master_listen_fd): the port is never free for another process between its choice and the
    store's listen, and the store listens on `host` alone."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.bind(address)
    except BaseException:
        s.close()
        raise
    return s
