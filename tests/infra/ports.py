"""Loopback ports for test and bench servers."""

from __future__ import annotations

import socket


def free_port_pair() -> int:
    """A port P with P+1 free too (`bao server -dev`'s cluster listener takes P+1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of loopback ports")
