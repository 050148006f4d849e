"""A blocking WebSocket client for tests that does all its TLS in one thread.

websockets' sync client reads in a thread of its own while the caller's
thread writes. Over ``wss://`` that runs SSL_read and SSL_write on one
``ssl.SSLSocket`` at the same time, which OpenSSL does not allow for one
connection (CPython adds no lock on a build with the GIL). Now and then,
on a loaded machine, the TLS state breaks: seen in CI as a handshake that
gets no answer in 10 s, then the reader thread blocked in SSL_read for
good. The proxy under test is not involved; the client corrupts its own
connection.

This module keeps websockets' protocol code (the same handshake,
permessage-deflate and exceptions) and runs its asyncio client on one event
loop thread, shared by every connection of the test process. asyncio does
TLS through a memory BIO in that thread only. The calls block the caller
like the sync client's, with the same names: ``connect``, ``send``,
``recv(timeout=)`` (TimeoutError when nothing came), ``close``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, Self

import websockets.asyncio.client

_GRACE = 5.0  # beyond a call's own timeout, the longest the caller waits for the loop
_SEND_TIMEOUT = 30.0  # a send waits for the socket to take the frame (write flow control)
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="test-websockets", daemon=True).start()
        return _loop


def _run(coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
    """CORO's result, computed on the loop thread. A coroutine that has its own
    timeout raises TimeoutError itself; this one is the backstop."""
    future = asyncio.run_coroutine_threadsafe(coro, _event_loop())
    try:
        return future.result(None if timeout is None else timeout + _GRACE)
    except TimeoutError:
        future.cancel()
        raise


class Connection:
    """One open WebSocket, used from any one thread at a time."""

    def __init__(self, ws: websockets.asyncio.client.ClientConnection) -> None:
        self._ws = ws

    def send(self, message: str | bytes) -> None:
        _run(asyncio.wait_for(self._ws.send(message), _SEND_TIMEOUT), _SEND_TIMEOUT)

    def recv(self, timeout: float | None = None) -> str | bytes:
        """The next message; TimeoutError when none came within TIMEOUT seconds
        (websockets' recv may be cancelled without losing data)."""
        return _run(asyncio.wait_for(self._ws.recv(), timeout), timeout)

    def close(self) -> None:
        _run(self._ws.close(), self._ws.close_timeout or _SEND_TIMEOUT)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(uri: str, *, open_timeout: float = 10, **kwargs: Any) -> Connection:
    """``websockets.sync.client.connect(URI, ...)`` without its reader thread:
    the keyword arguments are the asyncio client's (proxy, ssl, close_timeout,
    additional_headers, ...). InvalidStatus and the other handshake errors are
    raised as websockets raises them."""

    async def opened() -> websockets.asyncio.client.ClientConnection:
        return await websockets.asyncio.client.connect(uri, open_timeout=open_timeout, **kwargs)

    return Connection(_run(opened(), open_timeout))
