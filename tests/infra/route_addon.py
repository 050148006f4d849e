"""Test-only mitmproxy addon: send every upstream connection to the local Upstream.

Load it after the addon under test (``-s addons/keyveil.py -s
tests/infra/route_addon.py``) with ``--set route_tls_port=N --set
route_plain_port=N --set ssl_verify_upstream_trusted_ca=<upstream CA pem>``.
It must never change a flow: the addon under test has to see exactly what it
would see in production (request.host, host_header, port, scheme, the
CONNECT target), and the upstream must see the original Host and SNI.

What works in mitmproxy 12.3 (read from proxy/layers/http/__init__.py and
addons/tlsconfig.py, and proven by tests/test_infra.py):

- Rewriting the *connection*, not the request. In the ``server_connect`` hook
  (fired just before the TCP connect, with ``connection_strategy`` lazy or
  eager) ``data.server.address`` is still the original (host, port), and for
  lazy HTTPS ``data.server.sni`` was already set to the original hostname by
  the HTTP layer (``get_connection``: ``context.server.sni =
  event.address[0]``). Swapping only ``data.server.address`` to
  ``("127.0.0.1", port)`` therefore keeps SNI and certificate-hostname
  verification on the original name, and leaves ``flow.request``
  untouched. Connection reuse is keyed by the original address, so
  different hosts never share an upstream connection.
- Rewriting ``flow.request.host``/``port`` in the ``request`` hook (the
  map_remote style) reaches the server too, but then mitmproxy creates the
  upstream ``Server`` with address 127.0.0.1 and sets its SNI to
  ``"127.0.0.1"``: an IP literal, so no SNI is sent at all and the
  certificate is verified against the IP. Every later hook (response,
  websocket_message, the ``-w`` file) would also see 127.0.0.1 as the host.
  Don't.
- ``server.tls`` is already True in ``server_connect`` when mitmproxy will
  speak TLS upstream (set by the ServerTLSLayer constructor for lazy
  connections). With ``connection_strategy=eager`` the CONNECT opens the
  connection before the TLS layer exists, so port 443 is taken as a TLS hint
  too, and SNI is then filled in by tlsconfig from the client's SNI.
"""

from __future__ import annotations

import logging

from mitmproxy import ctx
from mitmproxy.proxy import server_hooks

logger = logging.getLogger(__name__)


class Route:
    def __init__(self) -> None:
        self._original: dict[str, tuple] = {}

    def load(self, loader) -> None:
        loader.add_option("route_tls_port", int, 0, "Port of the local TLS upstream for https:// and wss://.")
        loader.add_option("route_plain_port", int, 0, "Port of the local plain-HTTP upstream for http:// and ws://.")
        loader.add_option("route_host", str, "127.0.0.1", "Address of the local upstream.")

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        server = data.server
        if server.address is None or server.via is not None:
            return
        host, port = server.address[0], server.address[1]
        tls = server.tls or port == 443
        target_port = ctx.options.route_tls_port if tls else ctx.options.route_plain_port
        if not target_port:
            return
        if tls and server.sni is None:
            server.sni = host
        self._original[server.id] = server.address
        server.address = (ctx.options.route_host, target_port)
        logger.debug("route: %s:%s -> %s:%s (sni %s)", host, port, ctx.options.route_host, target_port, server.sni)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # mitmproxy finds a connection to reuse by its address: give it back
        # the original one, or every request opens a new upstream connection
        # (and a client connection stalls after 5). Server refuses a new
        # address once open; this is the address it was asked for.
        original = self._original.pop(data.server.id, None)
        if original is not None:
            object.__setattr__(data.server, "address", original)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._original.pop(data.server.id, None)


addons = [Route()]
