"""The WebSocket phase: client messages sealed, injected and enforced; server messages scrubbed.

mitmproxy relays close frames and pings inside its WebSocket layer, with no
hook before they are sent (and logs ping payloads): keyveil wraps that
layer's frame reader so that a close reason or a ping/pong payload is sealed
before mitmproxy sees it, in both directions. Without a sealer (keyveil not
loaded) they are emptied.
"""

from __future__ import annotations

import logging

import wsproto.events
from mitmproxy import http
from mitmproxy.proxy.layers import websocket as mitm_websocket

from .._views import shared_scans
from ._guard import close_connections, guarded
from ._outputs import META

log = logging.getLogger("keyveil")

_sealer_for_frames = None  # set by the loaded addon: the current engine's sealer


def use_sealer(get_sealer) -> None:
    global _sealer_for_frames
    _sealer_for_frames = get_sealer


def _sealed_events(events):
    for event in events:
        if isinstance(event, wsproto.events.CloseConnection) and event.reason:
            sealer = _sealer_for_frames() if _sealer_for_frames else None
            reason = sealer.seal(event.reason.encode("utf-8", "surrogateescape")).data.decode("utf-8", "replace") if sealer else ""
            # A close frame holds at most 123 bytes of reason.
            event = wsproto.events.CloseConnection(code=event.code, reason=reason.encode()[:123].decode("utf-8", "ignore"))
        elif isinstance(event, (wsproto.events.Ping, wsproto.events.Pong)) and event.payload:
            sealer = _sealer_for_frames() if _sealer_for_frames else None
            payload = sealer.seal(bytes(event.payload)).data if sealer else b""
            event = type(event)(payload=payload[:125])
        yield event


def _install_frame_sealing() -> None:
    cls = mitm_websocket.WebsocketConnection
    if getattr(cls, "_keyveil_sealed", False):
        return
    original = cls.events

    def events(self):
        return _sealed_events(original(self))

    cls.events = events
    cls._keyveil_sealed = True


_install_frame_sealing()


class WebSocketPhase:
    def __init__(self, addon) -> None:
        self.addon = addon
        self.outputs = addon.outputs
        self.requests = addon.requests

    @guarded
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        assert flow.websocket is not None
        message = flow.websocket.messages[-1]
        self.reseal(flow)  # earlier messages are on the wire by now
        if message.dropped:
            return
        engine = self.addon.current_engine()
        meta = flow.metadata.get(META, {})
        if message.from_client:
            host, port = meta.get("host", flow.request.host), meta.get("port", flow.request.port)
            request = self.requests._to_request(flow, host, port, None)
            with shared_scans():  # detection and the sealer read the same bytes: scanned once
                engine = self.addon.detection.websocket_message(flow, engine, request, message.content)  # detect
                sealed, data, outcome = engine.process_ws_message(request, message.content)
            if outcome.block:
                message.content = sealed
                message.drop()
                self.outputs.record(flow, "blocked", {n: 1 for n in outcome.block.names}, outcome.block.code)
                log.warning("keyveil: blocked a WebSocket message to %s: %s", self.outputs.host(flow), outcome.block.code)
                close_connections(flow)
                return
            if sealed != message.content:
                message.content = sealed
            if data != sealed:
                # Others (dumper, view) read the message after this hook: they see
                # it sealed; the late injector puts the value in just before it is sent.
                self.addon.late.pending_ws[id(message)] = data
            self.outputs.report(flow, outcome)
        else:
            result = engine.sealer.scrub(message.content)
            if result.changed:
                message.content = result.data
                self.outputs.record(flow, "scrubbed", result.counts)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        try:
            self.reseal(flow)
        except Exception as e:  # noqa: BLE001
            log.error("keyveil: could not reseal WebSocket messages (%s)", type(e).__name__)

    def reseal(self, flow: http.HTTPFlow) -> None:
        for message in self.addon.late.sent_ws.pop(flow.id, ()):
            message.content = self.addon.engine.sealer.seal(message.content).data
