"""The mitmproxy adapter: flows in, the sans-IO pipeline, flows out.

``Keyveil`` turns each flow into a ``_pipeline.Request``, runs the engine, and
writes the outcome back: the forwarded request, a block response, streamed
and scrubbed responses, sealed and scrubbed WebSocket messages. mitmproxy is
fail-open (a hook exception is logged and the flow goes on), so every hook
and stream callable here is guarded: an error blocks the flow. It never
decides policy itself and never logs a value.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions, http
from mitmproxy.net import encoding
from mitmproxy.net.http import url

from . import _codecs
from ._agents import REALM, AuthRequired, authenticate
from ._audit import AuditLog
from ._engine import StreamSealer
from ._errors import KeyveilError, VaultUnavailable
from ._home import Home, default_home
from ._hosts import normalize_host
from ._pipeline import Block, Engine, Outcome, Request
from ._rules import load_rules
from .vault import VaultWatcher, open_vault

log = logging.getLogger("keyveil")

_ANTHROPIC = ("api.anthropic.com",)
_OPENAI = ("api.openai.com", "chatgpt.com")
_META = "keyveil"


class Blocked(Exception):
    def __init__(self, block: Block) -> None:
        super().__init__(block.code)
        self.block = block


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


def guarded(hook: Callable) -> Callable:
    """Run a hook; on any error block the flow instead of letting it through (I4)."""

    @functools.wraps(hook)
    def wrapper(self: Keyveil, flow: http.HTTPFlow, *args: Any) -> None:
        try:
            hook(self, flow, *args)
        except Blocked as e:
            self._block(flow, e.block, hook.__name__)
        except Exception as e:  # noqa: BLE001 - fail closed on anything
            # The exception text may quote data from the flow: log its type only.
            log.error("keyveil: internal error in %s (%s); the flow is blocked", hook.__name__, type(e).__name__)
            block = Block("internal_error", f"keyveil hit an internal error ({type(e).__name__}); the flow was not forwarded")
            self._block(flow, block, hook.__name__)

    return wrapper


class KeyveilInjector:
    """The last addon in the chain: puts the values in, just before sending.

    mitmproxy sends a request (or WebSocket message) once every addon's hook
    has run, and other addons (dumper, web view, save) read flows in theirs.
    keyveil's own hooks leave the flow sealed for them; this addon, added
    after all of them, writes the injected version last.
    """

    def __init__(self) -> None:
        self.pending: dict[str, Callable[[], None]] = {}
        self.pending_ws: dict[int, bytes] = {}
        self.sent_ws: dict[str, list] = {}

    def _inject(self, flow: http.HTTPFlow) -> None:
        write = self.pending.pop(flow.id, None)
        if write is None or flow.response or flow.error:
            return
        try:
            write()
        except Exception as e:  # noqa: BLE001 - the sealed request must not go out half-written
            log.error("keyveil: could not inject (%s); the flow is blocked", type(e).__name__)
            flow.response = _block_response(Block("internal_error", "keyveil could not inject the values"), "")

    requestheaders = _inject
    request = _inject

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        message = flow.websocket.messages[-1]
        data = self.pending_ws.pop(id(message), None)
        if data is not None and not message.dropped:
            message.content = data
            self.sent_ws.setdefault(flow.id, []).append(message)


class KeyveilUnloaded:
    """Stands in for keyveil once its script is unloaded (a failed hot reload).

    mitmproxy would carry on without the script, forwarding everything as it
    is; this addon blocks every request and WebSocket message instead, until a
    working keyveil is loaded again.
    """

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        block = Block("internal_error", "keyveil is not loaded (its script failed to reload); fix it or restart the proxy")
        flow.response = _block_response(block, _safe_host(flow))

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        flow.websocket.messages[-1].drop()
        close_connections(flow)


class Keyveil:
    def __init__(self) -> None:
        self._late = KeyveilInjector()
        self._original_headers: dict[str, tuple] = {}
        self._sealed: dict[str, tuple] = {}
        self._streams: dict[tuple[str, str], StreamSealer] = {}
        self.embedded = False  # set by `keyveil start`, which maps errors to exit codes itself
        self._running = False
        self.engine: Engine | None = None
        self.load_error: KeyveilError | None = None
        self.home: Home | None = None
        self.audit: AuditLog | None = None
        # keyveil.vault: the watcher keeps the vault's snapshot current (a remote
        # store is read off the event loop); the engine is rebuilt when it changes.
        self._vault: VaultWatcher | None = None
        self._snapshot = None
        self._tunnels: dict[str, tuple[str, int]] = {}
        self._agents: dict[str, str] = {}  # keyveil agents: client connection id -> agent of its CONNECT

    # -- options and loading ---------------------------------------------------

    def load(self, loader) -> None:
        loader.add_option("keyveil_home", str, "", "keyveil home folder (default: $KEYVEIL_HOME or ~/.keyveil)")
        loader.add_option("keyveil_rules", str, "", "rules file to use instead of $KEYVEIL_HOME/config/rules.yaml")

    def configure(self, updated: set[str]) -> None:
        if self.engine is not None and not updated & {"keyveil_home", "keyveil_rules"}:
            return
        try:
            self._compile()
        except KeyveilError as e:
            self.load_error = e
            if isinstance(e, VaultUnavailable) and not self.embedded and not self._running:
                # mitmdump turns any start-up error into exit 1; SPEC §9 wants 2.
                print(f"keyveil: {e}", file=sys.stderr, flush=True)
                os._exit(e.exit_code)
            raise exceptions.OptionsError(f"keyveil: {e}") from None

    def _compile(self) -> None:
        home = Home(Path(ctx.options.keyveil_home).expanduser() if ctx.options.keyveil_home else default_home())
        home.ensure()
        rules_path = Path(ctx.options.keyveil_rules).expanduser() if ctx.options.keyveil_rules else home.rules
        rules = load_rules(rules_path)
        watcher = VaultWatcher(open_vault(home.root))
        snapshot = watcher.start()  # VaultUnavailable here stops the proxy (exit 2)
        _warn_if_exposed(rules_path, home)
        self.engine = Engine(rules, snapshot)
        if self._vault is not None:
            self._vault.close()
        self._vault, self._snapshot = watcher, snapshot
        self.home = home
        if self.audit is None or self.audit.directory != home.audit:
            self.audit = AuditLog(home.audit)
        log.info(
            "keyveil: %d secrets, %d forms, rules %s", len(self.engine.names), self.engine.sealer.form_count, rules_path
        )

    def running(self) -> None:
        self._running = True
        stand_in = ctx.master.addons.get("keyveilunloaded")
        if stand_in is not None:
            ctx.master.addons.remove(stand_in)
        if ctx.master.addons.get("keyveilinjector") is None:
            ctx.master.addons.add(self._late)
        if ctx.options.deferred:
            names = ", ".join(sorted(ctx.options.deferred))
            log.error("keyveil: unknown option(s): %s; check the spelling of --set", names)
            ctx.master.shutdown()
        if self.engine is None:
            log.error("keyveil: not configured; refusing to run")
            ctx.master.shutdown()

    def done(self) -> None:
        # Flows still waiting for their response go back to references before
        # the save addon writes the flows in progress at shutdown.
        for flow_id in list(self._sealed):
            flow, *saved = self._sealed.pop(flow_id)
            self._write(flow, *saved)
            if flow.response is not None and self.engine is not None:  # headers not yet scrubbed
                flow.response.headers.fields = self.engine.sealer.seal_fields(flow.response.headers.fields)[0]
        if ctx.master.addons.get("keyveilinjector") is self._late:
            ctx.master.addons.remove(self._late)
        if not ctx.master.should_exit.is_set() and ctx.master.addons.get("keyveilunloaded") is None:
            log.error("keyveil: unloaded while the proxy runs; every request is blocked until it is back")
            ctx.master.addons.add(KeyveilUnloaded())
        if self.audit:
            self.audit.close()
        if self._vault is not None:
            self._vault.close()

    def _current_engine(self) -> Engine:
        """The engine, recompiled when the vault's snapshot changed."""
        assert self.engine is not None
        if self._vault is not None:
            try:
                snapshot = self._vault.snapshot(time.monotonic())
            except VaultUnavailable as e:
                # Until the vault is readable again, every flow is blocked.
                raise Blocked(Block("vault_unavailable", f"the vault cannot be read: {e}")) from None
            if snapshot is not self._snapshot:
                self.engine = Engine(self.engine.rules, snapshot)
                self._snapshot = snapshot
        return self.engine

    # -- connections -----------------------------------------------------------

    def http_connect(self, flow: http.HTTPFlow) -> None:
        try:
            self._tunnels[flow.client_conn.id] = (normalize_host(flow.request.host), flow.request.port)
        except ValueError:
            flow.response = _block_response(Block("host_mismatch", "the CONNECT target is not a valid host name"), "")
        if flow.response is None and self.engine is not None and self.engine.rules.agents is not None:
            try:
                engine = self._current_engine()  # the agents' passwords as the vault holds them now
            except Blocked as e:
                flow.response = _block_response(e.block, "")
                return
            self._authenticate(flow, engine, remember=True)

    # -- keyveil agents (rules `agents:`): proxy authentication -------------------

    def _authenticate(self, flow: http.HTTPFlow, engine: Engine, remember: bool = False) -> bool:
        """Set the flow's agent from its Proxy-Authorization, or answer 407.

        A CONNECT tunnel is authenticated once (REMEMBER), for every request in it."""
        try:
            agent = authenticate(engine.rules, engine.values, flow.request.headers.get("proxy-authorization"))
        except AuthRequired as e:
            log.warning("keyveil: proxy authentication refused for %s: %s", _safe_host(flow), e)
            flow.response = http.Response.make(
                407,
                json.dumps({"error": {"type": "keyveil_proxy_auth", "message": f"keyveil: {e}"}}).encode(),
                {"content-type": "application/json", "proxy-authenticate": f'Basic realm="{REALM}"'},
            )
            return False
        except Exception as e:  # noqa: BLE001 - never let a client through unauthenticated
            log.error("keyveil: proxy authentication failed (%s)", type(e).__name__)
            flow.response = _block_response(Block("internal_error", "keyveil could not check the proxy credentials"), "")
            return False
        flow.request.headers.pop("proxy-authorization", None)
        if remember:
            self._agents[flow.client_conn.id] = agent
        flow.metadata.setdefault(_META, {})["agent"] = agent
        return True

    def _agent(self, flow: http.HTTPFlow, engine: Engine) -> bool:
        """With agents, the flow's agent (from its tunnel, else its own credentials); False: 407 sent."""
        if engine.rules.agents is None:
            return True
        agent = self._agents.get(flow.client_conn.id)
        if agent is None:
            return self._authenticate(flow, engine)
        flow.metadata[_META]["agent"] = agent
        return True

    def tls_clienthello(self, data) -> None:
        """Passthrough hosts (rules `passthrough:`) are not intercepted at all."""
        try:
            if self.engine is None:
                return
            address = data.context.server.address
            host = data.client_hello.sni or (address[0] if address else None)
            port = address[1] if address else 443
            if host and self.engine.rules.is_passthrough(normalize_host(host), port):
                data.ignore_connection = True
        except Exception as e:  # noqa: BLE001 - when unsure, intercept (and so inspect)
            log.error("keyveil: passthrough check failed (%s); intercepting", type(e).__name__)

    def client_disconnected(self, client) -> None:
        self._tunnels.pop(client.id, None)
        self._agents.pop(client.id, None)

    def _destination(self, flow: http.HTTPFlow) -> tuple[str, int]:
        """The host the client asked the proxy to reach (SPEC §6 step 1).

        That is the CONNECT target for tunnelled requests, else the host of the
        absolute-form URL; a Host / :authority or SNI naming another host is refused.
        """
        req = flow.request
        tunnel = self._tunnels.get(flow.client_conn.id)
        try:
            host, port = tunnel if tunnel else (normalize_host(req.host), req.port)
            claims = [(normalize_host(req.host), req.port)]
            if req.host_header:
                h, p = url.parse_authority(req.host_header, check=True)
                claims.append((normalize_host(h), p or (443 if req.scheme == "https" else 80)))
            if flow.client_conn.sni:
                claims.append((normalize_host(flow.client_conn.sni), port))
        except ValueError:
            raise Blocked(Block("host_mismatch", "the request names no valid host")) from None
        for claimed in claims:
            if claimed != (host, port):
                raise Blocked(Block(
                    "host_mismatch",
                    f"the request goes to {host}:{port} but names {claimed[0]}:{claimed[1]}; "
                    "keyveil refuses requests whose Host, :authority or SNI differs from their destination",
                ))
        return host, port

    # -- requests ---------------------------------------------------------------

    @guarded
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        engine = self._current_engine()
        host, port = self._destination(flow)
        flow.metadata[_META] = {"host": host, "port": port}
        if not self._agent(flow, engine):  # keyveil agents: 407 without valid proxy credentials
            return
        req = flow.request
        size = _content_length(req)
        # mitmproxy switches a body of unknown size to raw streaming only once
        # it has grown past stream_large_bodies, after this hook: keyveil
        # streams such bodies itself from the start when that option is set.
        unknown = size is None and ("transfer-encoding" in req.headers or req.is_http2 or req.is_http3)
        if req.stream or (size is not None and size > engine.policy.max_body_bytes) or (
            unknown and ctx.options.stream_large_bodies
        ):
            self._stream_request(flow, engine, host, port)
            return
        # Addons that show flows as they arrive (mitmweb) read the headers
        # after this hook: they see them sealed; the pipeline gets the originals.
        sealed, counts = engine.sealer.seal_fields(req.headers.fields)
        if counts:
            self._original_headers[flow.id] = req.headers.fields
            req.headers.fields = sealed

    def _stream_request(self, flow: http.HTTPFlow, engine: Engine, host: str, port: int) -> None:
        """A body too large to inspect whole goes through the stream sealer (never skipped).

        The body is decoded and sealed on the way, so it goes out uncompressed
        and of a new length: Content-Encoding and Content-Length are dropped.
        """
        req = flow.request
        ce = req.headers.get("content-encoding", "")
        decoder = _codecs.decoder_for(ce)
        if decoder is None:
            if engine.policy.undecodable_body == "block":
                raise Blocked(_undecodable(ce, host))
            decoder = _codecs.decoder_for("")
            dropped = {b"content-length"}
        else:
            dropped = {b"content-length", b"content-encoding"}
        outcome = engine.process_request(self._to_request(flow, host, port, body=None))
        if outcome.block:
            raise Blocked(outcome.block)
        for version in filter(None, (outcome.request, outcome.sealed_request)):
            version.headers = [(k, v) for k, v in version.headers if k.lower() not in dropped]
            if req.http_version == "HTTP/1.1" and not any(k.lower() == b"transfer-encoding" for k, _ in version.headers):
                version.headers.append((b"transfer-encoding", b"chunked"))
        self._apply(flow, outcome, None, None)
        flow.metadata[_META]["streamed"] = True
        flow.request.stream = self._stream_callable(flow, decoder, engine.sealer.stream(), "request")

    def _stream_callable(self, flow: http.HTTPFlow, decoder, stream: StreamSealer, direction: str):
        # Kept until the stream ends, so a stream cut short is still audited (error hook).
        self._streams[(flow.id, direction)] = stream
        def seal_chunk(chunk: bytes) -> list[bytes]:
            # A list, never b"": mitmproxy writes an empty bytes chunk as an
            # empty HTTP/1 chunk, which ends a chunked body early.
            try:
                if chunk:
                    out = stream.feed(decoder.feed(chunk))
                    return [out] if out else []
                out = stream.feed(decoder.flush(), final=True)
                self._end_stream(flow, direction)
                return [out] if out else []
            except Exception as e:
                # Raising tears the connection down: the rest never leaves unsealed.
                log.error("keyveil: %s stream of %s aborted (%s)", direction, flow.request.pretty_host, type(e).__name__)
                code = "undecodable_body" if isinstance(e, ValueError) else "internal_error"
                self._audit_block(flow, Block(code, "stream aborted"))
                close_connections(flow)  # else the client waits for an answer that never comes
                # mitmproxy logs what a stream raises: a type name, never data.
                raise RuntimeError(f"keyveil aborted the {direction} stream ({code})") from None

        return seal_chunk

    @guarded
    def request(self, flow: http.HTTPFlow) -> None:
        meta = flow.metadata.get(_META)
        if meta and meta.get("blocked") and self.engine is not None:
            # Blocked at its headers, its body arrived afterwards: store it sealed.
            self._seal_stored_request(flow)
            return
        if flow.response or flow.error or not flow.live:
            return
        if meta is None or meta.get("streamed"):
            return
        engine = self._current_engine()
        host, port = meta["host"], meta["port"]
        original = self._original_headers.pop(flow.id, None)
        if original is not None:
            flow.request.headers.fields = original
        body, encoding_name = self._decoded_body(flow, engine, host)
        outcome = engine.process_request(self._to_request(flow, host, port, body))
        if outcome.block:
            raise Blocked(outcome.block)
        self._apply(flow, outcome, body, encoding_name)

    def _decoded_body(self, flow: http.HTTPFlow, engine: Engine, host: str) -> tuple[bytes | None, str | None]:
        raw = flow.request.raw_content
        if not raw:
            return raw, None
        ce = flow.request.headers.get("content-encoding", "").strip().lower()
        if ce in ("", "identity"):
            return raw, None
        try:
            return _codecs.decode(raw, ce), ce
        except ValueError:
            pass
        if engine.policy.undecodable_body == "block":
            raise Blocked(_undecodable(ce, host))
        # pass: the body goes as it came, but it is still sealed as bytes
        return raw, None

    def _to_request(self, flow: http.HTTPFlow, host: str, port: int, body: bytes | None) -> Request:
        req = flow.request
        path, sep, query = req.data.path.partition(b"?")
        return Request(
            method=req.method,
            scheme=req.scheme,
            host=host,
            port=port,
            path=path,
            query=query if sep else None,
            headers=list(req.headers.fields),
            body=body,
            content_type=req.headers.get("content-type", ""),
            agent=flow.metadata.get(_META, {}).get("agent"),
        )

    def _apply(self, flow: http.HTTPFlow, outcome: Outcome, body: bytes | None, encoding_name: str | None) -> None:
        """Write the sealed request now and the injected one from the last addon.

        BODY is the decoded body as received: where a version of the request
        carries it unchanged, the raw bytes as received go out (byte for byte).
        """
        raw = flow.request.raw_content
        sealed = outcome.sealed_request or outcome.request
        self._write(flow, sealed, body, raw, encoding_name)
        if outcome.injected:
            final = outcome.request
            self._late.pending[flow.id] = functools.partial(self._write, flow, final, body, raw, encoding_name)
            self._sealed[flow.id] = (flow, sealed, body, raw, encoding_name)
        self._report(flow, outcome)

    @staticmethod
    def _write(
        flow: http.HTTPFlow, new: Request, body: bytes | None, raw: bytes | None, encoding_name: str | None
    ) -> None:
        req = flow.request
        target = new.path + (b"?" + new.query if new.query is not None else b"")
        if target != req.data.path:
            req.data.path = target
        fields = tuple(new.headers)
        if fields != tuple(req.headers.fields):
            req.headers.fields = fields
        if new.body is None or body is None:
            return
        content = raw if new.body == body else (encoding.encode(new.body, encoding_name) if encoding_name else new.body)
        if content != req.raw_content:
            req.raw_content = content
        if "content-length" in req.headers and req.headers["content-length"] != str(len(content)):
            req.headers["content-length"] = str(len(content))

    # -- responses ------------------------------------------------------------

    @guarded
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._reseal_request(flow)
        if flow.response is None or _META not in flow.metadata:
            return
        engine = self.engine
        assert engine is not None
        resp = flow.response
        fields, counts = engine.sealer.seal_fields(resp.headers.fields)
        if counts:
            resp.headers.fields = fields
            self._record(flow, "scrubbed", counts)
        ce = resp.headers.get("content-encoding", "").strip().lower()
        decoder = _codecs.decoder_for(ce)
        if decoder is None:
            raise Blocked(_undecodable(ce, flow.metadata[_META]["host"], response=True))
        if flow.request.method == "HEAD" or resp.status_code in (204, 304) or resp.status_code < 200:
            return  # no body
        if ce not in ("", "identity"):
            resp.headers.pop("content-encoding", None)
        _reframe(flow, resp)
        resp.stream = self._stream_callable(flow, decoder, engine.sealer.stream(), "response")

    @guarded
    def response(self, flow: http.HTTPFlow) -> None:
        # Responses that were not streamed (made by an addon or a block) are scrubbed whole.
        self._reseal_request(flow)
        resp = flow.response
        if resp is None or resp.stream or self.engine is None:
            return
        if resp.headers.get("x-keyveil-block"):
            return
        raw = resp.raw_content
        if raw:
            body, enc = raw, None
            ce = resp.headers.get("content-encoding", "").strip().lower()
            if ce not in ("", "identity"):
                body = _codecs.decode(raw, ce)  # ValueError → guarded → blocked
                enc = ce
            result = self.engine.sealer.scrub(body)
            if result.changed:
                resp.raw_content = encoding.encode(result.data, enc) if enc else result.data
                if "content-length" in resp.headers:
                    resp.headers["content-length"] = str(len(resp.raw_content))
                self._record(flow, "scrubbed", result.counts)

    def _end_stream(self, flow: http.HTTPFlow, direction: str) -> None:
        stream = self._streams.pop((flow.id, direction), None)
        if stream is not None and stream.counts:
            self._record(flow, "sealed" if direction == "request" else "scrubbed", stream.counts)

    def error(self, flow: http.HTTPFlow) -> None:
        try:
            for direction in ("request", "response"):
                self._end_stream(flow, direction)
            self._reseal_request(flow)
        except Exception as e:  # noqa: BLE001
            log.error("keyveil: could not reseal a failed flow (%s)", type(e).__name__)

    def _reseal_request(self, flow: http.HTTPFlow) -> None:
        """Once the request is on the wire, the stored flow goes back to references."""
        self._late.pending.pop(flow.id, None)
        self._original_headers.pop(flow.id, None)
        saved = self._sealed.pop(flow.id, None)
        if saved is not None:
            self._write(*saved)

    # -- WebSockets -------------------------------------------------------------

    @guarded
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        assert flow.websocket is not None
        message = flow.websocket.messages[-1]
        self._reseal_ws(flow)  # earlier messages are on the wire by now
        if message.dropped:
            return
        engine = self._current_engine()
        meta = flow.metadata.get(_META, {})
        if message.from_client:
            host, port = meta.get("host", flow.request.host), meta.get("port", flow.request.port)
            sealed, data, outcome = engine.process_ws_message(self._to_request(flow, host, port, None), message.content)
            if outcome.block:
                message.content = sealed
                message.drop()
                self._audit_block(flow, outcome.block)
                log.warning("keyveil: blocked a WebSocket message to %s: %s", host, outcome.block.code)
                close_connections(flow)
                return
            if sealed != message.content:
                message.content = sealed
            if data != sealed:
                # Others (dumper, view) read the message after this hook: they see
                # it sealed; the late injector puts the value in just before it is sent.
                self._late.pending_ws[id(message)] = data
            self._report(flow, outcome)
        else:
            result = engine.sealer.scrub(message.content)
            if result.changed:
                message.content = result.data
                self._record(flow, "scrubbed", result.counts)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        try:
            self._reseal_ws(flow)
        except Exception as e:  # noqa: BLE001
            log.error("keyveil: could not reseal WebSocket messages (%s)", type(e).__name__)

    def _reseal_ws(self, flow: http.HTTPFlow) -> None:
        for message in self._late.sent_ws.pop(flow.id, ()):
            message.content = self.engine.sealer.seal(message.content).data

    # -- blocking, audit, flow marks ----------------------------------------------

    def _block(self, flow: http.HTTPFlow, block: Block, phase: str = "request") -> None:
        host = flow.metadata.get(_META, {}).get("host") or _safe_host(flow)
        self._audit_block(flow, block)
        log.warning("keyveil: blocked %s %s: %s", flow.request.method, host, block.code)
        self._late.pending.pop(flow.id, None)
        self._sealed.pop(flow.id, None)
        self._original_headers.pop(flow.id, None)
        if phase == "responseheaders" and flow.response is not None:
            # The upstream body is still coming: answer with the block instead,
            # and drop every byte of it.
            made = _block_response(block, host)
            resp = flow.response
            resp.status_code, resp.reason, resp.headers = made.status_code, made.reason, made.headers
            _reframe(flow, resp)
            resp.stream = _discard_then(made.content or b"")
        elif phase == "response" and flow.response is not None:
            flow.response = _block_response(block, host)
        elif phase.startswith("websocket"):
            if flow.websocket and flow.websocket.messages:
                flow.websocket.messages[-1].drop()
            close_connections(flow)
        else:
            flow.response = _block_response(block, host)
        flow.metadata.setdefault(_META, {})["blocked"] = block.code
        flow.marked = ":no_entry:"
        flow.comment = f"keyveil: blocked ({block.code})"
        # Nothing that reads the flow later may see a value.
        if self.engine is not None:
            self._seal_stored_request(flow)

    def _seal_stored_request(self, flow: http.HTTPFlow) -> None:
        sealer = self.engine.sealer
        req = flow.request
        req.headers.fields = sealer.seal_fields(req.headers.fields)[0]
        req.data.path = sealer.seal(req.data.path).data
        if req.raw_content:
            try:
                ce = req.headers.get("content-encoding", "").strip().lower()
                body = _codecs.decode(req.raw_content, ce)
                result = sealer.seal(body)
                if result.changed:
                    req.raw_content = result.data
                    req.headers.pop("content-encoding", None)
            except ValueError:
                req.raw_content = b""  # cannot inspect what is stored: keep nothing

    def _audit_block(self, flow: http.HTTPFlow, block: Block) -> None:
        self._record(flow, "blocked", {n: 1 for n in block.names}, block.code)

    def _report(self, flow: http.HTTPFlow, outcome: Outcome) -> None:
        if outcome.sealed:
            self._record(flow, "sealed", outcome.sealed)
        if outcome.injected:
            self._record(flow, "injected", outcome.injected)
        if outcome.unknown:
            self._record(flow, "unknown_reference", {n: 1 for n in outcome.unknown})

    def _record(self, flow: http.HTTPFlow, action: str, counts, code: str | None = None) -> None:
        meta = flow.metadata.setdefault(_META, {})
        host = meta.get("host") or _safe_host(flow)
        if self.audit is not None:
            path = flow.request.data.path.split(b"?", 1)[0]
            if self.engine is not None:
                path = self.engine.sealer.seal(path).data
            path = path.decode("utf-8", "replace")
            client = flow.client_conn.peername
            self.audit.write(
                flow=flow.id,
                client=f"{client[0]}:{client[1]}" if client else "",
                method=flow.request.method,
                host=host,
                path=path,
                action=action,
                names=dict(counts),
                code=code,
                agent=meta.get("agent"),
            )
        if counts and action != "blocked":
            summary = ", ".join(f"{n} ×{c}" for n, c in sorted(counts.items()))
            note = f"keyveil: {action} {summary}"
            flow.comment = f"{flow.comment}\n{note}" if flow.comment else note
            if not flow.marked:
                flow.marked = ":lock:"


def _warn_if_exposed(rules_path: Path, home: Home) -> None:
    """Warn about files other users can read (vault, CA key) or change (rules)."""
    checks = [(rules_path, 0o022, "writable by other users: they could bind a secret to their host")]
    checks += [(p, 0o077, "readable by other users") for p in home.vault.glob("*") if p.is_file()]
    checks.append((home.certs / "mitmproxy-ca.pem", 0o077, "(the CA private key) readable by other users"))
    for path, bits, what in checks:
        try:
            mode = path.stat().st_mode & 0o777
        except OSError:
            continue
        if mode & bits:
            log.warning("keyveil: %s is %s (mode %o); run chmod %o %s", path, what, mode, mode & ~bits & 0o700 or 0o600, path)


def _safe_host(flow: http.HTTPFlow) -> str:
    try:
        return normalize_host(flow.request.host)
    except ValueError:
        return "(invalid host)"


def _content_length(req: http.Request) -> int | None:
    try:
        return int(req.headers["content-length"])
    except (KeyError, ValueError):
        return None


def _undecodable(ce: str, host: str, response: bool = False) -> Block:
    what = "response" if response else "request"
    return Block(
        "undecodable_body",
        f"the {what} body for {host} uses Content-Encoding {ce!r}, which keyveil cannot decode "
        "(it decodes gzip, deflate, br and zstd, one at a time); it was not forwarded. "
        "Send it uncompressed, or set policy.undecodable_body: pass in rules.yaml",
    )


def _envelope(block: Block, host: str) -> dict:
    text = f"keyveil blocked this request ({block.code}): {block.message}"
    if host in _ANTHROPIC:
        return {"type": "error", "error": {"type": "keyveil_blocked", "code": block.code, "message": text}}
    if host in _OPENAI:
        return {"error": {"message": text, "type": "keyveil_blocked", "param": None, "code": block.code}}
    return {"error": {"type": "keyveil_blocked", "code": block.code, "message": text}}


def _block_response(block: Block, host: str) -> http.Response:
    return http.Response.make(
        block.status,
        json.dumps(_envelope(block, host)).encode(),
        {"content-type": "application/json", "x-keyveil-block": block.code},
    )


def _reframe(flow: http.HTTPFlow, resp: http.Response) -> None:
    """The body's length will change: drop Content-Length, and keep the
    connection reusable with chunked framing toward an HTTP/1.1 client (with
    neither, HTTP/1 falls back to closing the connection after every response)."""
    resp.headers.pop("content-length", None)
    if flow.request.http_version == "HTTP/1.1" and "transfer-encoding" not in resp.headers:
        resp.headers["transfer-encoding"] = "chunked"


def _discard_then(body: bytes):
    def discard(chunk: bytes) -> list[bytes]:
        return [body] if chunk == b"" and body else []

    return discard
