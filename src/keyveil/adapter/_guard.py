"""Fail closed around mitmproxy's fail-open hooks.

mitmproxy logs a hook's exception and lets the flow go on. Every keyveil
hook runs inside ``guarded``: a ``Blocked`` raised anywhere becomes that
block, and any other exception blocks the flow as ``internal_error`` with
only the exception's type name in the log (its text may quote the flow).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import ctx, http

from .._pipeline import Block

log = logging.getLogger("keyveil")


class Blocked(Exception):
    def __init__(self, block: Block) -> None:
        super().__init__(block.code)
        self.block = block


def guarded(hook: Callable) -> Callable:
    """Run a phase's hook; on any error block the flow instead of letting it through (I4)."""

    @functools.wraps(hook)
    def wrapper(self, flow: http.HTTPFlow, *args: Any) -> None:
        try:
            hook(self, flow, *args)
        except Blocked as e:
            self.outputs.block(flow, e.block, hook.__name__)
        except Exception as e:  # noqa: BLE001 - fail closed on anything
            log.error("keyveil: internal error in %s (%s); the flow is blocked", hook.__name__, type(e).__name__)
            block = Block("internal_error", f"keyveil hit an internal error ({type(e).__name__}); the flow was not forwarded")
            self.outputs.block(flow, block, hook.__name__)

    return wrapper


def close_connections(flow: http.HTTPFlow) -> None:
    """Close the client's and the server's connection of FLOW now.

    For what mitmproxy's own kill does not stop: a WebSocket message (the
    layer never checks for a kill) and a body already streaming. Uses the
    proxy server's connection handler, as mitmproxy's idle timeout does.
    """
    server = ctx.master.addons.get("proxyserver")
    handler = server.connections.get(flow.client_conn.id) if server is not None else None
    if handler is None:
        return
    for conn in (flow.server_conn, flow.client_conn):
        io = handler.transports.get(conn)
        if io is not None and io.handler is not None:
            io.handler.cancel("keyveil closed the connection")
