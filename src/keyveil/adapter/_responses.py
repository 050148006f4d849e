"""The response phase: everything that comes back is scrubbed on its way to the client.

Status line (the reason phrase too), headers, body, trailers: every value
becomes its reference (SPEC §7). Bodies are streamed through the stream
sealer, decompressed on the way; a body keyveil cannot decode is replaced by
an ``undecodable_body`` block, except where a response has no body (HEAD,
204, 304, 1xx), whose Content-Encoding means nothing.

Two exceptions to streaming, both for bodies of known length:

- A compressed body within ``max_body_bytes`` is read whole first. Its
  decoding can fail (a body that says gzip and is not), and only before the
  status line has gone out can the client get a clear ``undecodable_body``
  instead of a cut connection. Compressed streams of unknown length (SSE) are
  still streamed: if one turns out not to decode, the connection is closed
  and the audit log says why.
- A body of at most ``READ_WHOLE_BYTES`` is read whole too. A client gains
  nothing from getting 64 KiB in pieces, and the body keeps its
  Content-Length: a stream is re-framed as chunked, and each chunk, and the
  chunked end, is a write of its own through mitmproxy's layers, which cost
  more than keyveil's scrub of a small body (bench/RESULTS.md).
"""

from __future__ import annotations

import logging

from mitmproxy import http
from mitmproxy.net import encoding

from .. import _codecs
from ._guard import Blocked, guarded
from ._outputs import META, reframe
from ._requests import _check_framing, charset_block, undecodable


READ_WHOLE_BYTES = 64 * 1024


class ResponsePhase:
    def __init__(self, addon) -> None:
        self.addon = addon
        self.outputs = addon.outputs

    @guarded
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self.addon.reseal_request(flow)
        if flow.response is None or META not in flow.metadata or flow.response.headers.get("x-keyveil-block"):
            return  # keyveil's own block responses are made sealed
        engine = self.addon.engine
        assert engine is not None
        resp = flow.response
        host = self.outputs.host(flow)
        self._scrub_head(flow, resp)
        if flow.request.method == "HEAD" or resp.status_code in (204, 304) or resp.status_code < 200:
            return  # no body: its Content-Encoding and charset describe nothing here
        _check_framing(resp.headers, host, response=True)
        ce = resp.headers.get("content-encoding", "").strip().lower()
        decoder = _codecs.decoder_for(ce)
        if decoder is None:
            raise Blocked(undecodable(ce, host, response=True))
        block = charset_block(resp.headers, None, host, response=True)
        if block is not None:
            raise Blocked(block)
        identity = ce in ("", "identity")
        size = resp.headers.get("content-length", "")
        # mitmproxy's stream_large_bodies marks a body for raw streaming before
        # this hook: such a body is never left to be read whole (it would pass raw).
        if not resp.stream and size.isdigit() and int(size) <= (READ_WHOLE_BYTES if identity else engine.policy.max_body_bytes):
            flow.metadata[META]["head_scrubbed"] = True
            return  # read whole, scrubbed (decoded first) in `response`: a bad body gets a clear block
        if not identity:
            resp.headers.pop("content-encoding", None)
        reframe(flow, resp)
        resp.stream = self.addon.stream_callable(flow, decoder, engine.sealer.stream(), "response")

    def _scrub_head(self, flow: http.HTTPFlow, resp: http.Response) -> None:
        memo = self.addon.engine.memo
        fields, counts = memo.seal_fields(resp.headers.fields)
        if counts:
            resp.headers.fields = fields
        reason = memo.seal(resp.data.reason)
        if reason.changed:
            resp.data.reason = reason.data
            counts.update(reason.counts)
        if counts:
            self.outputs.record(flow, "scrubbed", counts)

    @guarded
    def response(self, flow: http.HTTPFlow) -> None:
        self.addon.reseal_request(flow)
        resp = flow.response
        engine = self.addon.engine
        if resp is None or engine is None:
            return
        if resp.trailers:
            # Sent after this hook, streamed body or not.
            fields, counts = engine.memo.seal_fields(resp.trailers.fields)
            if counts:
                resp.trailers.fields = fields
                self.outputs.record(flow, "scrubbed", counts)
        if resp.stream or resp.headers.get("x-keyveil-block"):
            return
        # Not streamed: a body of known size (compressed, or small), or made by
        # an addon (or a block) after responseheaders. Scrubbed whole.
        if not flow.metadata.get(META, {}).pop("head_scrubbed", False):
            self._scrub_head(flow, resp)
        raw = resp.raw_content
        if raw:
            body, enc = raw, None
            ce = resp.headers.get("content-encoding", "").strip().lower()
            if ce not in ("", "identity"):
                try:
                    body = _codecs.decode(raw, ce)
                except ValueError:
                    raise Blocked(undecodable(ce, self.outputs.host(flow), response=True)) from None
                enc = "gzip" if ce == "x-gzip" else ce
            result = engine.sealer.scrub(body)
            if result.changed:
                resp.raw_content = encoding.encode(result.data, enc) if enc else result.data
                if "content-length" in resp.headers:
                    resp.headers["content-length"] = str(len(resp.raw_content))
                self.outputs.record(flow, "scrubbed", result.counts)

    def error(self, flow: http.HTTPFlow) -> None:
        try:
            for direction in ("request", "response"):
                self.addon.end_stream(flow, direction)
            self.addon.reseal_request(flow)
        except Exception as e:  # noqa: BLE001
            logging.getLogger("keyveil").error("keyveil: could not reseal a failed flow (%s)", type(e).__name__)
