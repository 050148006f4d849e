"""Benchmark-only mitmproxy addon: send every upstream connection to the local bench upstream.

Loaded last (``-s addons/keyveil.py -s bench/route_addon.py``), it swaps only
the server address in ``server_connect``, so the request, its Host header, the
SNI and certificate verification keep the original host name (as in
tests/infra/route_addon.py), and puts the original address back once
connected: mitmproxy finds a connection to reuse by its address, so a
connection left with the rewritten one is never reused (each request would
open a new upstream connection, and a client connection stalls after a few).
``bench_stream_responses`` makes the plain
mitmdump baseline stream responses, as keyveil does: plain mitmproxy buffers
every response otherwise, which would hold back Server-Sent Events
(mitmproxy issue 4469) and make no baseline for time to first event.
"""

from __future__ import annotations

from mitmproxy import ctx, http
from mitmproxy.proxy import server_hooks


class BenchRoute:
    def __init__(self) -> None:
        self._original: dict[str, tuple[str, int]] = {}

    def load(self, loader) -> None:
        loader.add_option("bench_upstream_port", int, 0, "Port of the bench TLS upstream on 127.0.0.1.")
        loader.add_option("bench_stream_responses", bool, False, "Stream every response (plain baseline).")

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        server = data.server
        if server.address is None or server.via is not None or not ctx.options.bench_upstream_port:
            return
        if server.sni is None:
            server.sni = server.address[0]
        self._original[server.id] = server.address
        server.address = ("127.0.0.1", ctx.options.bench_upstream_port)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        original = self._original.pop(data.server.id, None)
        if original is not None:
            # Server refuses a new address once open; this is the address it
            # was asked for, not a new destination, so set it underneath.
            object.__setattr__(data.server, "address", original)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._original.pop(data.server.id, None)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if ctx.options.bench_stream_responses and flow.response and not flow.response.stream:
            flow.response.stream = True


addons = [BenchRoute()]
