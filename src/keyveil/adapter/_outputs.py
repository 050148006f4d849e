"""The one scrub point: every byte keyveil writes toward the client or into an output.

Block responses, audit records, log lines and flow comments are built
here, and each goes through the sealer on its way out: a host name, a path
or a message that quotes a request can hold a value (a value used as a host
name, a path after injection), and none may leave in one. Responses from
upstream are scrubbed by the response phase with the same sealer
(``scrub_fields``, ``scrub_text`` here; bodies by its stream sealer).
"""

from __future__ import annotations

import json
import logging

from mitmproxy import http

from .. import _codecs
from .._hosts import normalize_host
from .._pipeline import Block
from ._guard import close_connections

log = logging.getLogger("keyveil")

_ANTHROPIC = ("api.anthropic.com",)
_OPENAI = ("api.openai.com", "chatgpt.com")
META = "keyveil"


class Outputs:
    """Writes blocks, audit records and flow marks for one keyveil addon, always sealed."""

    def __init__(self, addon) -> None:
        self._addon = addon

    @property
    def _sealer(self):
        engine = self._addon.engine
        return engine.sealer if engine is not None else None

    # -- sealing what is written -----------------------------------------------

    def text(self, text: str) -> str:
        """TEXT with every value in it sealed; without a sealer, nothing that came from a flow is written."""
        engine = self._addon.engine
        if engine is None:
            return "(unavailable)"
        data = text.encode("utf-8", "surrogateescape")
        return engine.memo.seal(data).data.decode("utf-8", "replace")

    def data(self, data: bytes) -> bytes:
        engine = self._addon.engine
        return engine.memo.seal(data).data if engine is not None else b""

    def host(self, flow: http.HTTPFlow) -> str:
        """The destination as keyveil names it in outputs: normalised and sealed."""
        host = flow.metadata.get(META, {}).get("host")
        if not host:
            try:
                host = normalize_host(flow.request.host)
            except ValueError:
                return "(invalid host)"
        return self.text(host)

    # -- blocks ----------------------------------------------------------------

    def block(self, flow: http.HTTPFlow, block: Block, phase: str = "request") -> None:
        addon = self._addon
        host = self.host(flow)
        self.record(flow, "blocked", {n: 1 for n in block.names}, block.code)
        log.warning("keyveil: blocked %s %s: %s", self.text(flow.request.method), host, block.code)
        addon.forget(flow)
        if phase == "responseheaders" and flow.response is not None:
            # The upstream body is still coming: answer with the block instead,
            # and drop every byte of it.
            made = self.block_response(block, host)
            resp = flow.response
            resp.status_code, resp.reason, resp.headers = made.status_code, made.reason, made.headers
            resp.trailers = None
            reframe(flow, resp)
            resp.stream = _discard_then(made.content or b"")
        elif phase == "response" and flow.response is not None:
            flow.response = self.block_response(block, host)
        elif phase.startswith("websocket"):
            if flow.websocket and flow.websocket.messages:
                flow.websocket.messages[-1].drop()
            close_connections(flow)
        else:
            flow.response = self.block_response(block, host)
        flow.metadata.setdefault(META, {})["blocked"] = block.code
        flow.marked = ":no_entry:"
        flow.comment = f"keyveil: blocked ({block.code})"
        if block.code == "undecodable_body":
            # What keyveil could not read it cannot seal: nothing of it is kept
            # for the console, the flow file or the web view (a UTF-16 body
            # would be shown decoded there).
            flow.request.raw_content = b""
        self.seal_stored_request(flow)

    def block_response(self, block: Block, host: str) -> http.Response:
        """The proxy's own answer to a blocked request (SPEC §6), sealed like any byte to the client."""
        body = json.dumps(_envelope(block, host)).encode()
        return http.Response.make(
            block.status, self.data(body) if self._sealer is not None else body,
            {"content-type": "application/json", "x-keyveil-block": block.code},
        )

    def seal_stored_request(self, flow: http.HTTPFlow) -> None:
        """Nothing that reads the flow later (dumper, -w, mitmweb) may see a value."""
        sealer = self._sealer
        if sealer is None:
            return
        req = flow.request
        req.headers.fields = sealer.seal_fields(req.headers.fields)[0]
        if req.trailers:
            req.trailers.fields = sealer.seal_fields(req.trailers.fields)[0]
        req.data.path = sealer.seal(req.data.path).data
        req.data.method = sealer.seal(req.data.method).data
        req.data.host = self.text(req.data.host)
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

    # -- audit and flow marks -------------------------------------------------------

    def report(self, flow: http.HTTPFlow, outcome) -> None:
        if outcome.sealed:
            self.record(flow, "sealed", outcome.sealed)
        if outcome.injected:
            self.record(flow, "injected", outcome.injected)
        if outcome.unknown:
            self.record(flow, "unknown_reference", {n: 1 for n in outcome.unknown})
        if outcome.passed:  # detect: detected values forwarded as they came (audit only)
            self.record(flow, "detected", outcome.passed)

    def record(self, flow: http.HTTPFlow, action: str, counts, code: str | None = None) -> None:
        addon = self._addon
        if addon.audit is not None:
            path = flow.request.data.path.split(b"?", 1)[0]
            client = flow.client_conn.peername
            addon.audit.write(
                flow=flow.id,
                client=f"{client[0]}:{client[1]}" if client else "",
                method=self.text(flow.request.method),
                host=self.host(flow),
                path=self.data(path).decode("utf-8", "replace"),
                action=action,
                names=dict(counts),
                code=code,
                agent=flow.metadata.get(META, {}).get("agent"),
            )
        if counts and action != "blocked":
            summary = ", ".join(f"{n} ×{c}" for n, c in sorted(counts.items()))
            note = f"keyveil: {action} {summary}"
            flow.comment = f"{flow.comment}\n{note}" if flow.comment else note
            if not flow.marked:
                flow.marked = ":lock:"


def _envelope(block: Block, host: str) -> dict:
    text = f"keyveil blocked this request ({block.code}): {block.message}"
    if host in _ANTHROPIC:
        return {"type": "error", "error": {"type": "keyveil_blocked", "code": block.code, "message": text}}
    if host in _OPENAI:
        return {"error": {"message": text, "type": "keyveil_blocked", "param": None, "code": block.code}}
    return {"error": {"type": "keyveil_blocked", "code": block.code, "message": text}}


def unsealed_block_response(block: Block, host: str) -> http.Response:
    """A block made before any sealer exists (keyveil not loaded): it quotes nothing from the flow."""
    return http.Response.make(
        block.status,
        json.dumps(_envelope(block, "")).encode(),
        {"content-type": "application/json", "x-keyveil-block": block.code},
    )


def reframe(flow: http.HTTPFlow, resp: http.Response) -> None:
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
