"""Detection of values nobody registered, before a request or WebSocket message is sealed (SPEC §3a).

Toward a provider, with ``policy.detected`` seal or block, every value the
detector finds (in the request's parts and their decoded views) that keyveil
does not know yet is remembered — in memory at once, and in the vault as
``detected/KIND-ID`` — and the engine is rebuilt with it, so the ordinary
sealer seals it in every form of SPEC §3, in this request and from then on,
and scrubs it from responses and every output. Toward any other host
detection only audits (action ``detected``, names only): nothing is
remembered or changed there. Credential headers (Authorization, x-api-key …)
are not looked into: they carry the client's own credential for the host.
Nothing here ever logs or records a value.
"""

from __future__ import annotations

import logging
import threading

from mitmproxy import http

from .._detect import shipped_detector
from .._detected import RequestDetector, detection_key
from .._errors import KeyveilError
from .._pipeline import Engine, Request, is_auth_header

log = logging.getLogger("keyveil")


class DetectionPhase:
    def __init__(self, addon) -> None:
        self.addon = addon
        self.outputs = addon.outputs
        self.detector: RequestDetector | None = None
        self._store_failed = False

    def configure(self, home) -> None:
        """Compile the shipped detector and read (or create) the home's key of detected IDs."""
        self.detector = RequestDetector(shipped_detector(), detection_key(home.vault))

    @property
    def expressions(self) -> tuple[tuple[bytes, int], ...]:
        """What the detector looks for, for the engine's sealer to compile with the values: a
        request's buffers are then scanned once for both (``Sealer.companion_hits``)."""
        return self.detector.detector.expressions if self.detector is not None else ()

    def request(self, flow: http.HTTPFlow, engine: Engine, req: Request) -> Engine:
        parts = [req.path, req.query or b"", *(v for k, v in req.headers if not is_auth_header(k)), req.body or b""]
        return self._look(flow, engine, engine.rules.is_provider(req.host, req.port, req.scheme), parts)

    def websocket_message(self, flow: http.HTTPFlow, engine: Engine, req: Request, content: bytes) -> Engine:
        return self._look(flow, engine, engine.rules.is_provider(req.host, req.port, req.scheme), [content])

    def _look(self, flow: http.HTTPFlow, engine: Engine, provider: bool, parts: list[bytes]) -> Engine:
        if self.detector is None or engine.policy.detected == "off":
            return engine
        found = self.detector.find(parts, engine.known_values, engine.detection_margin, engine.detector_hits)
        # A token holding or touching a registered value (its base64, the value with
        # more around it) is that value's business: its own seal covers it.
        found = [f for f in found if not engine.overlaps_registered(f.value, f.around)]
        if not found:
            return engine
        self.outputs.record(flow, "detected", {f.name: 1 for f in found})
        if not provider:
            return engine
        for f in found:
            self.addon.detected[f.name] = f.value
        log.info("keyveil: detected %s", ", ".join(sorted(f.name for f in found)))
        self._store({f.name: f.value for f in found})
        return self.addon.rebuild_engine()

    def _store(self, found: dict[str, bytes]) -> None:
        """Keep detected values in the vault too (a restarted proxy still seals them)."""
        watcher = getattr(self.addon, "_vault", None)
        vault = getattr(watcher, "vault", None)
        if vault is None:
            return

        def write() -> None:
            for name, value in found.items():
                try:
                    vault.set(name, value)
                except (KeyveilError, OSError) as e:
                    if not self._store_failed:  # once: the values are kept in memory all the same
                        self._store_failed = True
                        log.warning(
                            "keyveil: cannot keep detected values in the %s vault (%s); they are sealed "
                            "until the proxy stops", getattr(vault, "backend", "?"), type(e).__name__,
                        )
                    return

        if getattr(vault, "remote", False):
            threading.Thread(target=write, name="keyveil-detected", daemon=True).start()
        else:
            write()
