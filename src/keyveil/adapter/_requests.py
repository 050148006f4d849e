"""The request phase: destination, body decoding, the pipeline, and what is written back.

Runs SPEC §6 for each flow: the destination is the CONNECT target (or the
absolute-form host), never the spoofable Host header; headers and body are
decoded strictly (a transfer coding other than chunked, a content encoding
keyveil cannot undo or a charset other than UTF-8 is ``undecodable_body``);
the sans-IO pipeline seals, injects and enforces; others see the sealed
request, and the last addon in the chain writes the injected one.
"""

from __future__ import annotations

import functools
import json
import logging
import re

from mitmproxy import ctx, http
from mitmproxy.net import encoding
from mitmproxy.net.http import url

from .. import _codecs
from .._agents import REALM, AuthRequired, authenticate
from .._hosts import normalize_host
from .._pipeline import Block, Engine, Outcome, Request
from .._references import format_reference
from .._views import shared_scans
from ._guard import Blocked, guarded
from ._outputs import META

log = logging.getLogger("keyveil")

#: charsets a text or JSON body may declare: every other one cannot be inspected
_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})
_CHARSET = re.compile(r";\s*charset\s*=\s*\"?([^\";\s]+)", re.IGNORECASE)
_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")


class RequestPhase:
    def __init__(self, addon) -> None:
        self.addon = addon
        self.outputs = addon.outputs
        self._tunnels: dict[str, tuple[str, int]] = {}
        self._agents: dict[str, str] = {}  # client connection id → the agent its CONNECT authenticated
        self._original_headers: dict[str, tuple] = {}

    # -- connections -------------------------------------------------------------

    def http_connect(self, flow: http.HTTPFlow) -> None:
        try:
            host = normalize_host(flow.request.host)
        except ValueError:
            flow.response = self.outputs.block_response(Block("host_mismatch", "the CONNECT target is not a valid host name"), "")
            return
        self._tunnels[flow.client_conn.id] = (host, flow.request.port)
        self._refuse_value_in_host(flow, host)
        engine = self.addon.engine
        if flow.response is None and engine is not None and engine.rules.agents is not None:
            try:
                engine = self.addon.current_engine()  # the agents' passwords as the vault holds them now
            except Blocked as e:
                flow.response = self.outputs.block_response(e.block, "")
                return
            self._authenticate(flow, engine, remember=True)

    # -- agents (rules `agents:`): proxy authentication -----------------------------

    def _authenticate(self, flow: http.HTTPFlow, engine: Engine, remember: bool = False) -> bool:
        """Set the flow's agent from its Proxy-Authorization, or answer 407.

        A CONNECT tunnel is authenticated once (REMEMBER), for every request in it."""
        try:
            agent = authenticate(engine.rules, engine.values, flow.request.headers.get("proxy-authorization"))
        except AuthRequired as e:
            log.warning("keyveil: proxy authentication refused for %s: %s", self.outputs.host(flow), e)
            flow.response = http.Response.make(
                407,
                json.dumps({"error": {"type": "keyveil_proxy_auth", "message": f"keyveil: {e}"}}).encode(),
                {"content-type": "application/json", "proxy-authenticate": f'Basic realm="{REALM}"'},
            )
            return False
        except Exception as e:  # noqa: BLE001 - never let a client through unauthenticated
            log.error("keyveil: proxy authentication failed (%s)", type(e).__name__)
            flow.response = self.outputs.block_response(Block("internal_error", "keyveil could not check the proxy credentials"), "")
            return False
        flow.request.headers.pop("proxy-authorization", None)
        if remember:
            self._agents[flow.client_conn.id] = agent
        flow.metadata.setdefault(META, {})["agent"] = agent
        return True

    def _agent(self, flow: http.HTTPFlow, engine: Engine) -> bool:
        """With agents, the flow's agent (from its tunnel, else its own credentials); False: 407 sent."""
        if engine.rules.agents is None:
            return True
        agent = self._agents.get(flow.client_conn.id)
        if agent is None:
            return self._authenticate(flow, engine)
        flow.metadata[META]["agent"] = agent
        return True

    def _refuse_value_in_host(self, flow: http.HTTPFlow, host: str) -> None:
        """A value used as a host name would leave in DNS, SNI and the CONNECT line: refused before any connection."""
        engine = self.addon.engine
        if engine is None:
            return
        names = engine.memo.find_names(host.encode("utf-8", "surrogateescape"))
        if not names:
            return
        name = sorted(names)[0]
        block = Block(
            "plaintext_egress",
            f"the destination host name holds the value of {name}; keyveil never connects to it. "
            f"Use a host name, and the reference {format_reference(name)} where the credential goes",
            (name,),
        )
        flow.metadata.setdefault(META, {})["host"] = self.outputs.text(host)
        self.outputs.block(flow, block, "http_connect")
        flow.request.host = self.outputs.text(flow.request.host)

    def tls_clienthello(self, data) -> None:
        """Passthrough hosts are not intercepted; the upstream handshake names the CONNECT target."""
        try:
            engine = self.addon.engine
            if engine is None:
                return
            client = data.context.client
            tunnel = self._tunnels.get(client.id)
            if tunnel is not None and data.client_hello.sni and normalize_host(data.client_hello.sni) != tunnel[0]:
                # A client naming another host in SNI is refused at its first
                # request (host_mismatch); upstream never sees that name.
                data.context.server.sni = tunnel[0]
            address = data.context.server.address
            host = data.client_hello.sni or (address[0] if address else None)
            port = address[1] if address else 443
            if host and engine.rules.is_passthrough(normalize_host(host), port):
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
                h, p = _authority(req.host_header)
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

    # -- hooks -------------------------------------------------------------------------

    @guarded
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        engine = self.addon.current_engine()
        host, port = self._destination(flow)
        flow.metadata[META] = {"host": host, "port": port}
        if not self._agent(flow, engine):  # agents: 407 without valid proxy credentials
            return
        self._refuse_value_in_destination(engine, flow, host)
        req = flow.request
        _check_framing(req.headers, host)
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
        sealed, counts = engine.memo.seal_fields(req.headers.fields)
        if counts:
            self._original_headers[flow.id] = req.headers.fields
            req.headers.fields = sealed

    def _refuse_value_in_destination(self, engine: Engine, flow: http.HTTPFlow, host: str) -> None:
        names = engine.memo.find_names(host.encode("utf-8", "surrogateescape") + b"\n" + flow.request.data.method)
        if names:
            name = sorted(names)[0]
            flow.metadata[META]["host"] = self.outputs.text(host)
            raise Blocked(Block(
                "plaintext_egress",
                f"the request line holds the value of {name} as its host name or method; keyveil never sends it",
                (name,),
            ))

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
                raise Blocked(undecodable(ce, host))
            decoder = _codecs.decoder_for("")
            dropped = {b"content-length"}
        else:
            dropped = {b"content-length", b"content-encoding"}
        _check_charset(req.headers, None, host, engine)
        request = self._to_request(flow, host, port, body=None)
        with shared_scans():  # detection and the sealer read the same bytes: scanned once
            engine = self.addon.detection.request(flow, engine, request)  # detect: its line and headers (SPEC §3a)
            outcome = engine.process_request(request)
        if outcome.block:
            raise Blocked(outcome.block)
        for version in filter(None, (outcome.request, outcome.sealed_request)):
            version.headers = [(k, v) for k, v in version.headers if k.lower() not in dropped]
            if req.http_version == "HTTP/1.1" and not any(k.lower() == b"transfer-encoding" for k, _ in version.headers):
                version.headers.append((b"transfer-encoding", b"chunked"))
        self._apply(flow, outcome, None, None)
        flow.metadata[META]["streamed"] = True
        flow.request.stream = self.addon.stream_callable(flow, decoder, engine.sealer.stream(), "request")

    @guarded
    def request(self, flow: http.HTTPFlow) -> None:
        meta = flow.metadata.get(META)
        if meta and meta.get("blocked") and self.addon.engine is not None:
            # Blocked at its headers, its body arrived afterwards: store it sealed.
            self.outputs.seal_stored_request(flow)
            return
        if flow.response or flow.error or not flow.live:
            return
        if meta is None:
            return
        engine = self.addon.current_engine()
        host, port = meta["host"], meta["port"]
        self._seal_trailers(flow, engine, host, port)
        if meta.get("streamed"):
            return
        original = self._original_headers.pop(flow.id, None)
        if original is not None:
            flow.request.headers.fields = original
        body, encoding_name = self._decoded_body(flow, engine, host)
        request = self._to_request(flow, host, port, body)
        with shared_scans():  # detection and the sealer read the same bytes: scanned once
            engine = self.addon.detection.request(flow, engine, request)  # detect: SPEC §3a
            outcome = engine.process_request(request)
        if outcome.block:
            raise Blocked(outcome.block)
        self._apply(flow, outcome, body, encoding_name)

    def _seal_trailers(self, flow: http.HTTPFlow, engine: Engine, host: str, port: int) -> None:
        """Trailers go out after the body: sealed; a value there toward a non-provider is plaintext_egress."""
        trailers = flow.request.trailers
        if not trailers:
            return
        fields, counts = engine.memo.seal_fields(trailers.fields)
        if not counts:
            return
        trailers.fields = fields
        if not engine.rules.is_provider(host, port, flow.request.scheme) and engine.policy.plaintext_elsewhere != "seal":
            name = sorted(counts)[0]
            raise Blocked(Block(
                "plaintext_egress",
                f"the request to {host} carries the value of {name} in a trailer, where no secret is ever "
                f"injected; send the reference {format_reference(name)} in a bound header instead",
                (name,),
            ))
        self.outputs.record(flow, "sealed", counts)

    def _decoded_body(self, flow: http.HTTPFlow, engine: Engine, host: str) -> tuple[bytes | None, str | None]:
        raw = flow.request.raw_content
        if not raw:
            return raw, None
        ce = flow.request.headers.get("content-encoding", "").strip().lower()
        body, name = raw, None
        if ce not in ("", "identity"):
            try:
                body, name = _codecs.decode(raw, ce), ("gzip" if ce == "x-gzip" else ce)  # same bytes, mitmproxy's name
            except ValueError:
                if engine.policy.undecodable_body == "block":
                    raise Blocked(undecodable(ce, host)) from None
                # pass: the body goes as it came, but it is still sealed as bytes
                return raw, None
        _check_charset(flow.request.headers, body, host, engine)
        return body, name

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
            agent=flow.metadata.get(META, {}).get("agent"),
        )

    def _apply(self, flow: http.HTTPFlow, outcome: Outcome, body: bytes | None, encoding_name: str | None) -> None:
        """Write the sealed request now and the injected one from the last addon.

        BODY is the decoded body as received: where a version of the request
        carries it unchanged, the raw bytes as received go out (byte for byte).
        """
        raw = flow.request.raw_content
        sealed = outcome.sealed_request or outcome.request
        write(flow, sealed, body, raw, encoding_name)
        if outcome.injected or outcome.passed:  # detect: a passed detected value goes out as it came
            final = outcome.request
            self.addon.late.pending[flow.id] = functools.partial(write, flow, final, body, raw, encoding_name)
            self.addon.sealed[flow.id] = (flow, sealed, body, raw, encoding_name)
        self.outputs.report(flow, outcome)

    def forget(self, flow: http.HTTPFlow) -> None:
        self._original_headers.pop(flow.id, None)


def write(flow: http.HTTPFlow, new: Request, body: bytes | None, raw: bytes | None, encoding_name: str | None) -> None:
    """Write one version of the request (sealed, or injected) into FLOW."""
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
    length = req.headers.get("content-length")
    if length is not None and length != str(len(content)):
        req.headers["content-length"] = str(len(content))


@functools.lru_cache(maxsize=256)
def _authority(host_header: str) -> tuple[str, int | None]:
    """The Host header's (host, port), checked (ValueError); kept for the few a client sends."""
    return url.parse_authority(host_header, check=True)


def _check_framing(headers, host: str, response: bool = False) -> None:
    """A transfer coding other than chunked (`gzip, chunked`) would reach the sealer still encoded."""
    te = headers.get_all("transfer-encoding")
    if not te:
        return
    codings = [c.strip().lower() for value in te for c in value.split(",") if c.strip()]
    if codings != ["chunked"]:
        what = "response" if response else "request"
        raise Blocked(Block(
            "undecodable_body",
            f"the {what} for {host} uses Transfer-Encoding {', '.join(codings)!r}; keyveil reads only "
            "'chunked' (a transfer coding it cannot undo would hide what the body holds); it was not forwarded. "
            "Send the body with Content-Encoding instead",
        ))


def charset_block(headers, body: bytes | None, host: str, response: bool = False) -> Block | None:
    """A text body in another charset (UTF-16, say) cannot be inspected: the block, or None."""
    ct = headers.get("content-type", "")
    m = _CHARSET.search(ct)
    what = "response" if response else "request"
    if m and m.group(1).strip().lower() not in _CHARSETS:
        found = m.group(1).strip()
    elif body and _textual(ct) and (body.startswith(_BOMS) or _wide_text(body[:4])):
        found = "UTF-16 or UTF-32 (by its first bytes)"
    else:
        return None
    return Block(
        "undecodable_body",
        f"the {what} body for {host} is in charset {found}, which keyveil cannot inspect (it reads "
        "UTF-8 and ASCII); it was not forwarded. Send it as UTF-8, or set policy.undecodable_body: pass",
    )


def _wide_text(head: bytes) -> bool:
    """UTF-16 or UTF-32 text without a BOM, told by where its first characters' zero bytes fall (RFC 4627 §3)."""
    if len(head) < 4:
        return False
    zeros = [b == 0 for b in head]
    return zeros in ([True, False, True, False], [False, True, False, True], [True, True, True, False], [False, True, True, True])


def _textual(content_type: str) -> bool:
    ct = content_type.split(";", 1)[0].strip().lower()
    return ct.startswith("text/") or ct.endswith(("/json", "+json", "/xml", "+xml", "/x-ndjson", "/x-www-form-urlencoded"))


def _check_charset(headers, body: bytes | None, host: str, engine: Engine) -> None:
    block = charset_block(headers, body, host)
    if block is not None and engine.policy.undecodable_body == "block":
        raise Blocked(block)


def _content_length(req: http.Request) -> int | None:
    try:
        return int(req.headers["content-length"])
    except (KeyError, ValueError):
        return None


def undecodable(ce: str, host: str, response: bool = False) -> Block:
    what = "response" if response else "request"
    return Block(
        "undecodable_body",
        f"the {what} body for {host} uses Content-Encoding {ce!r}, which keyveil cannot decode "
        "(it decodes gzip, deflate, br and zstd, one at a time); it was not forwarded. "
        "Send it uncompressed, or set policy.undecodable_body: pass in rules.yaml",
    )
