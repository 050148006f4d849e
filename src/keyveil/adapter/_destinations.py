"""Where a sandbox of `keyveil run --isolate` may go through keyveil.

The sandbox's only network endpoint is keyveil's proxy; without this check
the agent could still ask the proxy to CONNECT to 127.0.0.1, to the cloud
metadata address 169.254.169.254, to a service on the host's own or a
private network's address, and keyveil would connect from outside the
sandbox. For flows that come from a sandbox (the bridge in `_isolate`
connects to the proxy from the loopback address SANDBOX_SOURCE, which no
sandbox can avoid), a destination is allowed at once when a secret binding
or ``policy.isolated_local_hosts`` names it. Any other destination is
resolved once; if one of its addresses is not globally routable (loopback,
link-local, unspecified, private, shared, reserved) or belongs to this host,
the flow is refused as ``host_mismatch`` before any connection is made, and
otherwise mitmproxy connects to the address that was checked, so a second
DNS answer cannot move it (no rebinding window).

This must never resolve a host name that keyveil's own checks refused (a
value used as a host name would leave in DNS): it runs after them and skips
a flow that already has an answer. It must never let a sandbox's server
connection go to an address it has not checked, and it changes nothing for
clients that are not in a sandbox.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Union

from mitmproxy import http
from mitmproxy.proxy import server_hooks

from .._hosts import HostSet, normalize_host
from .._isolate import SANDBOX_SOURCE
from .._pipeline import Block
from ._outputs import META

log = logging.getLogger("keyveil")

Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

RULES_FIELD = "policy.isolated_local_hosts"
RESOLVE_TIMEOUT = 10.0
_ALLOWED = ""  # a checked destination mitmproxy may connect to as named (no address to pin)


# -- the decision, without mitmproxy -------------------------------------------------------------


def is_sandbox(peer: tuple | None) -> bool:
    """A client connection made by the bridge of an isolated sandbox."""
    if not peer:
        return False
    host = str(peer[0])
    return host.removeprefix("::ffff:") == SANDBOX_SOURCE


def is_this_host(address: Address) -> bool:
    """ADDRESS is one of this host's own (bind accepts only those): a service here listens on it.

    Any answer but "not available here" counts as this host's, so that a doubt refuses.
    """
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(address), 0))
    except OSError as e:
        return e.errno != errno.EADDRNOTAVAIL
    return True


def refusal(address: Address, this_host: Callable[[Address], bool] = is_this_host) -> str | None:
    """Why a sandbox may not reach ADDRESS through keyveil, or None when it may."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if address.is_loopback:
        return "a loopback address (a service of this host)"
    if address.is_unspecified:
        return "the unspecified address (this host)"
    if address.is_link_local:
        return "a link-local address (where cloud metadata services answer)"
    if address.is_multicast:
        return "a multicast address"
    if not address.is_global:
        return "not a public address (a private, shared or reserved network)"
    if this_host(address):
        return "an address of this host (a service of this host)"
    return None


def suggestion(host: str, port: int, default_port: int) -> str:
    """The entry of policy.isolated_local_hosts that allows HOST:PORT, as it would be written."""
    shown = f"[{host}]" if ":" in host else host
    return f'"{shown}"' if port == default_port and ":" not in host else f'"{shown}:{port}"'


def refused(host: str, port: int, default_port: int, why: str, address: str | None = None) -> Block:
    where = f"{host}:{port}" + (f" ({address})" if address and address != host else "")
    return Block(
        "host_mismatch",
        f"keyveil does not connect an isolated sandbox (keyveil run --isolate) to {where}: {why}. "
        f"If the agent needs it, add {suggestion(host, port, default_port)} to {RULES_FIELD} in rules.yaml, "
        "or bind a secret to that host",
    )


async def resolve(host: str, port: int) -> list[Address]:
    """Every address HOST resolves to now (OSError, TimeoutError or ValueError when none)."""
    infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT)
    return [ipaddress.ip_address(info[4][0].partition("%")[0]) for info in infos]


# -- the hooks ----------------------------------------------------------------------------------------


class Destinations:
    """Checks the destination of every flow from a sandbox, and pins the address that was checked.

    A child addon of Keyveil (its hooks run right after Keyveil's, so a flow
    keyveil already refused is never resolved).
    """

    def __init__(self, addon) -> None:
        self.addon = addon
        # client connection id → (host, port) → the address to connect to, or _ALLOWED
        self._checked: dict[str, dict[tuple[str, int], str]] = {}
        self._original: dict[str, tuple] = {}  # server connection id → the address it was asked for
        self._allowed: tuple[object, HostSet] | None = None
        self.resolve = resolve

    def _allowed_hosts(self) -> HostSet:
        rules = self.addon.engine.rules
        if self._allowed is None or self._allowed[0] is not rules:
            patterns = [p for rule in rules.rules.secrets.values() for p in rule.hosts]
            patterns += rules.policy.isolated_local_hosts
            self._allowed = (rules, HostSet(patterns))
        return self._allowed[1]

    async def _check(self, flow: http.HTTPFlow, host: str, port: int, default_port: int, phase: str) -> None:
        """Allow HOST:PORT for FLOW's client connection, or answer FLOW with the refusal."""
        try:
            await self._decide(flow, host, port, default_port, phase)
        except Exception as e:  # noqa: BLE001 - mitmproxy would log it and go on: refuse instead
            log.error("keyveil: the destination check failed (%s); the flow is blocked", type(e).__name__)
            block = Block("internal_error", "keyveil could not check where this sandbox's request goes; it was not forwarded")
            self.addon.outputs.block(flow, block, phase)

    async def _decide(self, flow: http.HTTPFlow, host: str, port: int, default_port: int, phase: str) -> None:
        checked = self._checked.setdefault(flow.client_conn.id, {})
        if (host, port) in checked:
            return
        if self.addon.engine is None:
            return  # Keyveil itself refuses every flow then
        if self._allowed_hosts().matches(host, port, default_port):
            checked[(host, port)] = _ALLOWED
            return
        try:
            literal: Address | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            addresses = [literal]
        else:
            try:
                addresses = await self.resolve(host, port)
            except (OSError, asyncio.TimeoutError, ValueError) as e:
                if isinstance(e, ValueError):
                    why = "an answer that is no address"
                else:
                    why = e.strerror or "no answer in time"
                because = f"its name could not be resolved ({why}), and keyveil connects a sandbox only to addresses it checked"
                self.addon.outputs.block(flow, refused(host, port, default_port, because), phase)
                return
        for address in addresses:
            why = refusal(address)
            if why is not None:
                self.addon.outputs.block(flow, refused(host, port, default_port, why, str(address)), phase)
                return
        if not addresses:
            self.addon.outputs.block(flow, refused(host, port, default_port, "its name has no address"), phase)
            return
        checked[(host, port)] = _ALLOWED if literal is not None else str(addresses[0])

    # Plain functions that return the check's coroutine only for a sandbox's
    # flows: mitmproxy awaits what a hook returns, and every other flow goes
    # on as if this addon were not there.

    def http_connect(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        if flow.response or flow.error or not is_sandbox(flow.client_conn.peername):
            return None
        try:
            host = normalize_host(flow.request.host)
        except ValueError:
            return None  # Keyveil answered it already
        return self._check(flow, host, flow.request.port, 443, "http_connect")

    def requestheaders(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        # A request in a checked tunnel names the tunnel's host (Keyveil refuses
        # any other): found in _checked. A plain proxy request is checked here.
        if flow.response or flow.error or not flow.live or not is_sandbox(flow.client_conn.peername):
            return None
        meta = flow.metadata.get(META) or {}
        if "host" not in meta:
            return None
        default = 443 if flow.request.scheme in ("https", "wss") else 80
        return self._check(flow, meta["host"], meta["port"], default, "requestheaders")

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        try:
            self._pin(data)
        except Exception as e:  # noqa: BLE001 - mitmproxy would log it and connect: refuse instead
            log.error("keyveil: the destination check failed (%s); the connection is refused", type(e).__name__)
            data.server.error = "keyveil: the destination check failed"

    def _pin(self, data: server_hooks.ServerConnectionHookData) -> None:
        server = data.server
        if server.address is None or server.via is not None or not is_sandbox(data.client.peername):
            return
        try:
            key = (normalize_host(str(server.address[0])), int(server.address[1]))
        except ValueError:
            key = None
        pinned = self._checked.get(data.client.id, {}).get(key) if key else None
        if pinned is None:
            log.error("keyveil: a sandbox's connection to an unchecked destination was refused")
            server.error = "keyveil: the destination of this sandbox's connection was not checked"
            return
        if pinned == _ALLOWED:
            return
        if server.sni is None and (server.tls or key[1] == 443):
            server.sni = key[0]  # the name, not the address, in SNI and the certificate check
        self._original[server.id] = server.address
        server.address = (pinned, key[1])

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # mitmproxy finds a connection to reuse by its address: give back the one asked for.
        original = self._original.pop(data.server.id, None)
        if original is not None:
            object.__setattr__(data.server, "address", original)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._original.pop(data.server.id, None)

    def client_disconnected(self, client) -> None:
        self._checked.pop(client.id, None)
