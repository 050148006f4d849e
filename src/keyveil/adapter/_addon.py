"""The mitmproxy adapter: options, loading, and the hooks of each phase.

``Keyveil`` owns what the phases share — the compiled engine (recompiled
when the vault or the rules change), the audit log, the one scrub point for
outputs (``Outputs``) — and hands each mitmproxy hook to its phase:
``RequestPhase``, ``ResponsePhase``, ``WebSocketPhase``. Two more addons
close mitmproxy's fail-open doors: ``KeyveilInjector`` (last in the chain,
writes the injected request just before it is sent, so every other addon
sees it sealed) and ``KeyveilUnloaded`` (stands in when a hot reload failed,
blocking every flow). Nothing here decides policy or logs a value.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mitmproxy import ctx, exceptions, http

from .._audit import AuditLog
from .._engine import StreamSealer
from .._errors import KeyveilError, VaultUnavailable
from .._home import Home, default_home
from .._pipeline import Block, Engine
from .._rules import load_rules
from ..vault import VaultWatcher, open_vault
from . import _websockets
from ._destinations import Destinations
from ._guard import Blocked, close_connections
from ._outputs import Outputs, unsealed_block_response
from ._detection import DetectionPhase
from ._requests import RequestPhase
from ._responses import ResponsePhase
from ._websockets import WebSocketPhase

log = logging.getLogger("keyveil")


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
            flow.response = unsealed_block_response(Block("internal_error", "keyveil could not inject the values"), "")

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
        flow.response = unsealed_block_response(block, "")

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        flow.websocket.messages[-1].drop()
        close_connections(flow)


class Keyveil:
    def __init__(self) -> None:
        self.late = KeyveilInjector()
        self.sealed: dict[str, tuple] = {}  # flow id → the sealed version to store once sent
        self._streams: dict[tuple[str, str], StreamSealer] = {}
        self.embedded = False  # set by `keyveil start`, which maps errors to exit codes itself
        self._running = False
        self.engine: Engine | None = None
        self.load_error: KeyveilError | None = None
        self.home: Home | None = None
        self.audit: AuditLog | None = None
        # The watcher keeps the vault's snapshot current (a remote store is read
        # off the event loop); the engine is rebuilt when the snapshot changes.
        self._vault: VaultWatcher | None = None
        self._snapshot = None
        self._generation: tuple | None = None
        self.outputs = Outputs(self)
        # detect: values nobody registered, remembered while the proxy runs (name -> value)
        self.detected: dict[str, bytes] = {}
        self.detection = DetectionPhase(self)
        self.requests = RequestPhase(self)
        self.responses = ResponsePhase(self)
        self.websockets = WebSocketPhase(self)
        _websockets.use_sealer(lambda: self.engine.sealer if self.engine is not None else None)
        # Where a sandbox of `keyveil run --isolate` may go (_destinations): a
        # child addon, so its hooks run right after these, on flows not yet refused.
        self.addons = [Destinations(self)]

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
        self._generation = home.generation_stamp()
        watcher = VaultWatcher(open_vault(home.root))
        snapshot = watcher.start()  # VaultUnavailable here stops the proxy (exit 2)
        _warn_if_exposed(rules_path, home)
        self.detection.configure(home)  # detect: the key of detected IDs, beside the vault key
        self.engine = Engine(rules, snapshot, self.detected, self.detection.expressions)
        if self._vault is not None:
            self._vault.close()
        self._vault, self._snapshot = watcher, snapshot
        self.home = home
        if self.audit is None or self.audit.directory != home.audit:
            self.audit = AuditLog(home.audit)
        log.info("keyveil: %d secrets, rules %s", len(self.engine.names), rules_path)

    def running(self) -> None:
        self._running = True
        stand_in = ctx.master.addons.get("keyveilunloaded")
        if stand_in is not None:
            ctx.master.addons.remove(stand_in)
        if ctx.master.addons.get("keyveilinjector") is None:
            ctx.master.addons.add(self.late)
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
        from ._requests import write

        for flow_id in list(self.sealed):
            saved = self.sealed.pop(flow_id)
            write(*saved)
            flow = saved[0]
            if flow.response is not None and self.engine is not None:  # headers not yet scrubbed
                flow.response.headers.fields = self.engine.sealer.seal_fields(flow.response.headers.fields)[0]
        if ctx.master.addons.get("keyveilinjector") is self.late:
            ctx.master.addons.remove(self.late)
        if not ctx.master.should_exit.is_set() and ctx.master.addons.get("keyveilunloaded") is None:
            log.error("keyveil: unloaded while the proxy runs; every request is blocked until it is back")
            ctx.master.addons.add(KeyveilUnloaded())
        if self.audit:
            self.audit.close()
        if self._vault is not None:
            self._vault.close()

    def current_engine(self) -> Engine:
        """The engine, recompiled when the vault's snapshot changed.

        `keyveil secret set|rm` bump a generation file in the vault folder
        once the vault is written; a stat per flow sees it and the vault is
        read again at once, so the very next request after the command
        returned is sealed with the new values. Changes made behind keyveil's
        back are seen within the backend's poll interval (docs/teams.md).
        """
        assert self.engine is not None
        if self._vault is not None:
            generation = self.home.generation_stamp() if self.home is not None else None
            force = generation != self._generation
            try:
                snapshot = self._vault.snapshot(time.monotonic(), force=force)
            except VaultUnavailable as e:
                # Until the vault is readable again, every flow is blocked.
                raise Blocked(Block("vault_unavailable", f"the vault cannot be read: {e}")) from None
            if force:
                self._generation = generation
            if snapshot is not self._snapshot:
                self.engine = Engine(self.engine.rules, snapshot, self.detected, self.detection.expressions)
                self._snapshot = snapshot
        return self.engine

    def rebuild_engine(self) -> Engine:
        """detect: the engine again, now with the values detected since it was built."""
        assert self.engine is not None and self._snapshot is not None
        self.engine = Engine(self.engine.rules, self._snapshot, self.detected, self.detection.expressions)
        return self.engine

    # -- shared by the phases -------------------------------------------------------

    def stream_callable(self, flow: http.HTTPFlow, decoder, stream: StreamSealer, direction: str):
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
                self.end_stream(flow, direction)
                return [out] if out else []
            except Exception as e:
                # Raising tears the connection down: the rest never leaves unsealed.
                log.error("keyveil: %s stream of %s aborted (%s)", direction, self.outputs.host(flow), type(e).__name__)
                code = "undecodable_body" if isinstance(e, ValueError) else "internal_error"
                self.outputs.record(flow, "blocked", {}, code)
                close_connections(flow)  # else the client waits for an answer that never comes
                # mitmproxy logs what a stream raises: a type name, never data.
                raise RuntimeError(f"keyveil aborted the {direction} stream ({code})") from None

        return seal_chunk

    def end_stream(self, flow: http.HTTPFlow, direction: str) -> None:
        stream = self._streams.pop((flow.id, direction), None)
        if stream is not None and stream.counts:
            self.outputs.record(flow, "sealed" if direction == "request" else "scrubbed", stream.counts)

    def reseal_request(self, flow: http.HTTPFlow) -> None:
        """Once the request is on the wire, the stored flow goes back to references."""
        from ._requests import write

        self.late.pending.pop(flow.id, None)
        self.requests.forget(flow)
        saved = self.sealed.pop(flow.id, None)
        if saved is not None:
            write(*saved)

    def forget(self, flow: http.HTTPFlow) -> None:
        """A blocked flow: nothing of it is injected or written back."""
        self.late.pending.pop(flow.id, None)
        self.sealed.pop(flow.id, None)
        self.requests.forget(flow)

    # -- hooks, by phase -------------------------------------------------------------------

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self.requests.http_connect(flow)

    def tls_clienthello(self, data) -> None:
        self.requests.tls_clienthello(data)

    def client_disconnected(self, client) -> None:
        self.requests.client_disconnected(client)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self.requests.requestheaders(flow)

    def request(self, flow: http.HTTPFlow) -> None:
        self.requests.request(flow)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self.responses.responseheaders(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self.responses.response(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.responses.error(flow)

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        self.websockets.websocket_message(flow)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self.websockets.websocket_end(flow)


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
