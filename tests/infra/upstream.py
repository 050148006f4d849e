"""A real HTTP server on loopback that stands in for every host the tests talk to.

It listens on 127.0.0.1 twice: a TLS port (ALPN h2 and http/1.1, one trustme
certificate valid for every name in ``UPSTREAM_NAMES``) and a plain-HTTP port
(HTTP/1.1, plus HTTP/2 with prior knowledge). It runs its own asyncio loop in a
background thread, so a synchronous test can drive clients against it.

Everything it receives is recorded as it arrived on the wire, still
content-encoded, so that tests can assert what left the proxy: no leak is
proven by grepping ``all_bytes()``. It must never decode, normalise or
"fix" what it receives, or it would hide the very bytes the tests look for.

Endpoints, for any Host:

- ``/echo`` (and every path nothing else claims): JSON of the request, plus an
  ``X-Echo-Authorization`` response header copying ``Authorization``.
- ``/reflect``: the raw request body back, with the request's Content-Type and
  Content-Encoding.
- ``/respond``, ``/sse`` or any path given to ``set_response``: a canned
  response sent chunk by chunk (HTTP/1.1 chunks, HTTP/2 DATA frames) with a
  delay between chunks, optionally compressed in a streaming way.
- ``/redirect?to=URL``: 302 to URL.
- ``/ws``: WebSocket (HTTP/1.1 upgrade) that records and echoes each message.
- ``*/info/refs?service=git-upload-pack``: git smart-HTTP ref advertisement
  behind Basic auth (``set_git_credentials``).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import ssl
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import brotli
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h11
import trustme
from wsproto.connection import Connection as WsConnection
from wsproto.connection import ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.utilities import generate_accept_token

try:  # Python 3.14+
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on Python version
    from backports import zstd

UPSTREAM_NAMES: tuple[str, ...] = (
    "api.github.com",
    "github.com",
    "raw.githubusercontent.com",
    "api.anthropic.com",
    "api.openai.com",
    "chatgpt.com",
    "api.gitlab.com",
    "example.com",
    "evil.example",
    "localhost",
    "127.0.0.1",
    "*.test.keyveil",
    # Not in the original list; cheap to have for subdomain-binding tests.
    "*.example.com",
    "*.githubusercontent.com",
    "*.evil.example",
    "a.b.test.keyveil",
)

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GIT_SHA = b"1f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c"
_READ_SIZE = 65536


def make_ca() -> trustme.CA:
    """A fresh test CA; create one per test session."""
    return trustme.CA()


def issue_server_cert(ca: trustme.CA, names: Sequence[str] = UPSTREAM_NAMES) -> trustme.LeafCert:
    return ca.issue_cert(*names)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One request as the upstream received it."""

    method: str
    host: str  # Host header (HTTP/1) or :authority (HTTP/2), as sent, port included if sent
    path: str  # raw request target, query included
    headers: list[tuple[bytes, bytes]]  # as received; HTTP/2 pseudo-headers left out
    body: bytes  # as received, still content-encoded (HTTP/1 chunk framing removed)
    http_version: str  # "1.0", "1.1" or "2"
    tls: bool
    sni: str | None
    received_at: float = 0.0  # time.monotonic() when the request was complete

    def header(self, name: str) -> str | None:
        """First value of header NAME (case-insensitive), decoded as latin-1."""
        values = self.header_values(name)
        return values[0] if values else None

    def header_values(self, name: str) -> list[str]:
        key = name.lower().encode()
        return [v.decode("latin-1") for k, v in self.headers if k.lower() == key]


@dataclasses.dataclass(frozen=True)
class WsRecord:
    """One WebSocket message, in either direction."""

    direction: str  # "client" (received) or "server" (sent)
    host: str
    path: str
    data: str | bytes


@dataclasses.dataclass
class CannedResponse:
    status: int = 200
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    body_chunks: list[bytes] = dataclasses.field(default_factory=lambda: [b""])
    delay_between_chunks: float = 0.0
    content_encoding: str | None = None


@dataclasses.dataclass
class _Response:
    """A response to send: headers first, then each chunk after its delay."""

    status: int
    headers: list[tuple[bytes, bytes]]
    chunks: list[bytes]
    delay: float = 0.0
    log_key: str | None = None  # when set, chunk send times are logged under this path


class _StreamEncoder:
    """Content-encodes chunk by chunk, flushing after each so every chunk can be
    decoded as soon as it arrives (what a streaming server does)."""

    def __init__(self, encoding: str | None):
        self.encoding = (encoding or "identity").lower()
        e = self.encoding
        if e in ("gzip", "x-gzip"):
            self._z = zlib.compressobj(wbits=31)
        elif e == "deflate":
            self._z = zlib.compressobj(wbits=15)
        elif e == "br":
            self._br = brotli.Compressor()
        elif e == "zstd":
            self._zstd = zstd.ZstdCompressor()
        elif e != "identity":
            raise ValueError(f"unsupported content_encoding {encoding!r}")

    def chunk(self, data: bytes) -> bytes:
        e = self.encoding
        if e in ("gzip", "x-gzip", "deflate"):
            return self._z.compress(data) + self._z.flush(zlib.Z_SYNC_FLUSH)
        if e == "br":
            return self._br.process(data) + self._br.flush()
        if e == "zstd":
            return self._zstd.compress(data, mode=zstd.ZstdCompressor.FLUSH_BLOCK)
        return data

    def finish(self) -> bytes:
        e = self.encoding
        if e in ("gzip", "x-gzip", "deflate"):
            return self._z.flush(zlib.Z_FINISH)
        if e == "br":
            return self._br.finish()
        if e == "zstd":
            return self._zstd.flush(zstd.ZstdCompressor.FLUSH_FRAME)
        return b""


def _pkt_line(data: bytes) -> bytes:
    return b"%04x" % (len(data) + 4) + data


def git_ref_advertisement() -> bytes:
    """A minimal, valid smart-HTTP (protocol v0) advertisement for git-upload-pack."""
    caps = b"multi_ack thin-pack side-band side-band-64k ofs-delta shallow no-progress include-tag symref=HEAD:refs/heads/main agent=git/keyveil-test"
    return (
        _pkt_line(b"# service=git-upload-pack\n")
        + b"0000"
        + _pkt_line(GIT_SHA + b" HEAD\x00" + caps + b"\n")
        + _pkt_line(GIT_SHA + b" refs/heads/main\n")
        + b"0000"
    )


class Upstream:
    """TLS + plain-HTTP server on 127.0.0.1, recording every request.

    Use as a context manager or call ``start()`` / ``stop()``. Thread-safe for
    the test thread: every public accessor returns a copy.
    """

    def __init__(self, ca: trustme.CA | None = None, names: Sequence[str] = UPSTREAM_NAMES):
        self.ca = ca or make_ca()
        self._cert = issue_server_cert(self.ca, names)
        self._tmp = tempfile.TemporaryDirectory(prefix="keyveil-upstream-")
        self.ca_pem = Path(self._tmp.name) / "upstream-ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_pem))

        self.tls_port = 0
        self.plain_port = 0

        self._lock = threading.Condition()
        self._requests: list[Recorded] = []
        self._ws: list[WsRecord] = []
        self._wire = bytearray()
        self._chunk_times: dict[str, list[float]] = {}
        self._errors: list[str] = []
        self._canned: dict[str, CannedResponse] = {}
        self._git_credentials: tuple[str, str] | None = None
        self._ws_greeting: str | bytes | None = None

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task] = set()
        self._sni_by_conn: weakref.WeakKeyDictionary[ssl.SSLObject, str] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Upstream:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._listen())
            except BaseException as e:  # noqa: BLE001 - reported to the starting thread
                failure.append(e)
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=run, name="keyveil-upstream", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("upstream server did not start within 10 s")
        if failure:
            raise RuntimeError(f"upstream server failed to start: {failure[0]!r}")
        return self

    def stop(self) -> None:
        if self._loop and self._thread and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._tmp.cleanup()

    def __enter__(self) -> Upstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _listen(self) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._cert.configure_cert(ctx)
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        ctx.sni_callback = self._on_sni
        tls = await asyncio.start_server(
            lambda r, w: self._on_connection(r, w, tls=True),
            "127.0.0.1",
            0,
            ssl=ctx,
            backlog=1024,
        )
        plain = await asyncio.start_server(
            lambda r, w: self._on_connection(r, w, tls=False),
            "127.0.0.1",
            0,
            backlog=1024,
        )
        self._servers = [tls, plain]
        self.tls_port = tls.sockets[0].getsockname()[1]
        self.plain_port = plain.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        for s in self._servers:
            s.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _on_sni(self, ssl_obj: ssl.SSLObject, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        if server_name:
            self._sni_by_conn[ssl_obj] = server_name

    # ------------------------------------------------------------------ test API

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._requests)

    @property
    def ws_messages(self) -> list[WsRecord]:
        with self._lock:
            return list(self._ws)

    @property
    def errors(self) -> list[str]:
        """Server-side exceptions (a healthy test run leaves this empty)."""
        with self._lock:
            return list(self._errors)

    def clear(self) -> None:
        """Forget what was recorded (requests, messages, bytes, chunk times, errors)."""
        with self._lock:
            self._requests.clear()
            self._ws.clear()
            self._wire.clear()
            self._chunk_times.clear()
            self._errors.clear()

    def reset(self) -> None:
        """clear(), and forget canned responses, git credentials and the
        WebSocket greeting: the state a shared upstream should start each test in."""
        with self._lock:
            self.clear()
            self._canned.clear()
            self._git_credentials = None
            self._ws_greeting = None

    def all_bytes(self) -> bytes:
        """Everything received: raw HTTP/1 bytes (after TLS), decoded HTTP/2
        headers and DATA, decoded WebSocket message payloads."""
        with self._lock:
            return bytes(self._wire)

    def wait_for_requests(self, n: int = 1, timeout: float = 5.0) -> list[Recorded]:
        """Block until at least N requests are recorded; return them all."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._requests) >= n, timeout):
                raise TimeoutError(f"upstream got {len(self._requests)} requests, expected {n}")
            return list(self._requests)

    def chunk_times(self, path: str) -> list[float]:
        """time.monotonic() at which each chunk of the canned response at PATH
        was written, for the latest response sent on that path."""
        with self._lock:
            return list(self._chunk_times.get(path, []))

    def set_response(
        self,
        path: str,
        status: int = 200,
        headers: Iterable[tuple[str, str]] | dict[str, str] | None = None,
        body_chunks: Sequence[bytes] = (b"",),
        delay_between_chunks: float = 0.0,
        content_encoding: str | None = None,
    ) -> None:
        """Serve a canned response at PATH (query ignored) for any host.

        With CONTENT_ENCODING (gzip, deflate, br, zstd) each chunk is
        compressed and flushed separately and the Content-Encoding header is
        added. Without a Content-Length header the body is sent chunked.
        """
        if isinstance(headers, dict):
            headers = list(headers.items())
        with self._lock:
            self._canned[path] = CannedResponse(
                status, list(headers or []), list(body_chunks), delay_between_chunks, content_encoding
            )

    def set_sse(self, events: Sequence[bytes], delay_between_chunks: float = 0.3, path: str = "/sse") -> None:
        """Shortcut for a text/event-stream canned response, one event per chunk."""
        self.set_response(
            path,
            200,
            [("content-type", "text/event-stream"), ("cache-control", "no-cache")],
            list(events),
            delay_between_chunks,
        )

    def set_git_credentials(self, user: str, password: str) -> None:
        with self._lock:
            self._git_credentials = (user, password)

    def set_ws_greeting(self, message: str | bytes | None) -> None:
        """A message the /ws endpoint sends before reading anything."""
        with self._lock:
            self._ws_greeting = message

    def url(self, path: str = "/echo", scheme: str = "https", host: str = "127.0.0.1") -> str:
        """A direct URL (no proxy) to this server."""
        port = self.tls_port if scheme == "https" else self.plain_port
        return f"{scheme}://{host}:{port}{path}"

    # ------------------------------------------------------------------ recording

    def _record_wire(self, data: bytes) -> None:
        with self._lock:
            self._wire += data

    def _record_request(self, rec: Recorded) -> None:
        with self._lock:
            self._requests.append(rec)
            self._lock.notify_all()

    def _record_ws(self, rec: WsRecord) -> None:
        with self._lock:
            self._ws.append(rec)
            if rec.direction == "client":
                d = rec.data
                self._wire += d.encode() if isinstance(d, str) else d
            self._lock.notify_all()

    def _record_error(self, where: str, e: BaseException) -> None:
        with self._lock:
            self._errors.append(f"{where}: {e!r}")

    # ------------------------------------------------------------------ connections

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tls: bool) -> None:
        task = asyncio.current_task()
        assert task
        self._tasks.add(task)
        try:
            sni = None
            alpn = None
            if tls:
                ssl_obj = writer.get_extra_info("ssl_object")
                sni = self._sni_by_conn.pop(ssl_obj, None)
                alpn = ssl_obj.selected_alpn_protocol()
            initial = b""
            if not tls:
                # HTTP/2 with prior knowledge on the plain port.
                while len(initial) < len(H2_PREFACE) and H2_PREFACE.startswith(initial):
                    data = await reader.read(_READ_SIZE)
                    if not data:
                        break
                    initial += data
                if initial.startswith(H2_PREFACE):
                    alpn = "h2"
            if alpn == "h2":
                await _H2Server(self, reader, writer, tls, sni).run(initial)
            else:
                await _H1Server(self, reader, writer, tls, sni).run(initial)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - recorded for the test to see
            self._record_error("connection", e)
        finally:
            self._tasks.discard(task)
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------ endpoints

    def _route(self, rec: Recorded) -> _Response | str:
        """The response for REC, or "ws" for a WebSocket upgrade."""
        split = urlsplit(rec.path)
        path = split.path
        query = parse_qs(split.query)
        with self._lock:
            canned = self._canned.get(path)
            git_credentials = self._git_credentials
        if canned is not None:
            return self._canned_response(path, canned)
        if path == "/sse":
            return self._canned_response(
                path,
                CannedResponse(
                    200,
                    [("content-type", "text/event-stream")],
                    [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n"],
                    0.3,
                ),
            )
        if path == "/ws":
            if (rec.header("upgrade") or "").lower() == "websocket":
                return "ws"
            return _simple(426, b"websocket upgrade required\n", "text/plain")
        if path == "/reflect":
            headers = [(b"content-type", (rec.header("content-type") or "application/octet-stream").encode("latin-1"))]
            if ce := rec.header("content-encoding"):
                headers.append((b"content-encoding", ce.encode("latin-1")))
            headers.append((b"content-length", str(len(rec.body)).encode()))
            return _Response(200, headers, [rec.body])
        if path == "/redirect":
            to = query.get("to", ["/echo"])[0]
            return _Response(302, [(b"location", to.encode()), (b"content-length", b"0")], [b""])
        if path.endswith("/info/refs"):
            return self._git_info_refs(rec, query, git_credentials)
        return self._echo(rec)

    def _canned_response(self, path: str, canned: CannedResponse) -> _Response:
        enc = _StreamEncoder(canned.content_encoding)
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in canned.headers]
        names = {k for k, _ in headers}
        if path == "/sse" and b"content-type" not in names:
            headers.append((b"content-type", b"text/event-stream"))
        if canned.content_encoding:
            headers = [(k, v) for k, v in headers if k != b"content-encoding"]
            headers.append((b"content-encoding", canned.content_encoding.encode()))
        chunks = [enc.chunk(c) for c in canned.body_chunks]
        tail = enc.finish()
        if tail:
            if chunks:
                chunks[-1] += tail
            else:
                chunks = [tail]
        return _Response(canned.status, headers, chunks, canned.delay_between_chunks, log_key=path)

    def _git_info_refs(self, rec: Recorded, query: dict[str, list[str]], creds: tuple[str, str] | None) -> _Response:
        if query.get("service") != ["git-upload-pack"]:
            return _simple(403, b"only git-upload-pack is served\n", "text/plain")
        if creds is not None:
            expected = "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
            if rec.header("authorization") != expected:
                return _Response(
                    401,
                    [
                        (b"www-authenticate", b'Basic realm="keyveil-test"'),
                        (b"content-type", b"text/plain"),
                        (b"content-length", b"13"),
                    ],
                    [b"unauthorized\n"],
                )
        body = git_ref_advertisement()
        return _Response(
            200,
            [
                (b"content-type", b"application/x-git-upload-pack-advertisement"),
                (b"cache-control", b"no-cache"),
                (b"content-length", str(len(body)).encode()),
            ],
            [body],
        )

    def _echo(self, rec: Recorded) -> _Response:
        headers: dict[str, str] = {}
        for k, v in rec.headers:
            name = k.decode("latin-1").lower()
            value = v.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        doc = {
            "method": rec.method,
            "host": rec.host,
            "path": rec.path,
            "headers": headers,
            "header_list": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in rec.headers],
            "body": rec.body.decode("latin-1"),
            "http_version": rec.http_version,
            "tls": rec.tls,
            "sni": rec.sni,
        }
        body = json.dumps(doc).encode()
        out = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        for auth in rec.header_values("authorization"):
            out.append((b"x-echo-authorization", auth.encode("latin-1")))
        return _Response(200, out, [body])

    def _log_chunk(self, key: str | None, index: int) -> None:
        if key is None:
            return
        with self._lock:
            times = self._chunk_times.setdefault(key, [])
            if index == 0:
                times.clear()
            times.append(time.monotonic())


def _simple(status: int, body: bytes, content_type: str) -> _Response:
    return _Response(
        status,
        [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())],
        [body],
    )


class _H1Server:
    """HTTP/1.x on one connection, with h11; hands /ws upgrades to wsproto."""

    def __init__(self, up: Upstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tls: bool, sni: str | None):
        self.up, self.reader, self.writer, self.tls, self.sni = up, reader, writer, tls, sni
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=4 * 1024 * 1024)

    async def _send(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def run(self, initial: bytes) -> None:
        if initial:
            self.up._record_wire(initial)
            self.conn.receive_data(initial)
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await self.reader.read(_READ_SIZE)
                self.up._record_wire(data)
                self.conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                request, body = event, bytearray()
                if self.conn.they_are_waiting_for_100_continue:
                    await self._send(h11.InformationalResponse(status_code=100, headers=[]))
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                rec = self._recorded(request, bytes(body))
                self.up._record_request(rec)
                response = self.up._route(rec)
                if response == "ws":
                    await self._websocket(rec)
                    return
                assert isinstance(response, _Response)
                await self._respond(rec, response)
                if self.conn.our_state is h11.MUST_CLOSE:
                    return
                self.conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return

    def _recorded(self, request: h11.Request, body: bytes) -> Recorded:
        raw_headers = [(bytes(k), bytes(v)) for k, v in request.headers.raw_items()]
        host = next((v.decode("latin-1") for k, v in raw_headers if k.lower() == b"host"), "")
        return Recorded(
            method=request.method.decode(),
            host=host,
            path=request.target.decode("latin-1"),
            headers=raw_headers,
            body=body,
            http_version=request.http_version.decode(),
            tls=self.tls,
            sni=self.sni,
            received_at=time.monotonic(),
        )

    async def _respond(self, rec: Recorded, response: _Response) -> None:
        headers = list(response.headers)
        if rec.method == "HEAD":
            response = dataclasses.replace(response, chunks=[])
        await self._send(h11.Response(status_code=response.status, headers=headers))
        for i, chunk in enumerate(response.chunks):
            if i and response.delay:
                await asyncio.sleep(response.delay)
            if chunk:
                await self._send(h11.Data(data=chunk))
            else:
                await self.writer.drain()
            self.up._log_chunk(response.log_key, i)
        await self._send(h11.EndOfMessage())

    async def _websocket(self, rec: Recorded) -> None:
        key = (rec.header("sec-websocket-key") or "").encode()
        await self._send(
            h11.InformationalResponse(
                status_code=101,
                headers=[
                    (b"upgrade", b"websocket"),
                    (b"connection", b"Upgrade"),
                    (b"sec-websocket-accept", generate_accept_token(key)),
                ],
            )
        )
        trailing, _closed = self.conn.trailing_data
        ws = WsConnection(ConnectionType.SERVER, trailing_data=trailing)
        with self.up._lock:
            greeting = self.up._ws_greeting
        if greeting is not None:
            self._ws_send(ws, greeting, rec)
            await self.writer.drain()
        parts: list[str | bytes] = []
        while True:
            for event in ws.events():
                if isinstance(event, (TextMessage, BytesMessage)):
                    parts.append(event.data)
                    if event.message_finished:
                        message: str | bytes = "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)  # type: ignore[arg-type]
                        parts = []
                        self.up._record_ws(WsRecord("client", rec.host, rec.path, message))
                        self._ws_send(ws, message, rec)
                elif isinstance(event, Ping):
                    self.writer.write(ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    self.writer.write(ws.send(event.response()))
                    await self.writer.drain()
                    return
            await self.writer.drain()
            data = await self.reader.read(_READ_SIZE)
            if not data:
                return
            self.up._record_wire(data)
            ws.receive_data(data)

    def _ws_send(self, ws: WsConnection, message: str | bytes, rec: Recorded) -> None:
        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        self.writer.write(ws.send(event))
        self.up._record_ws(WsRecord("server", rec.host, rec.path, message))


class _H2Server:
    """HTTP/2 on one connection, with h2; one task per request, honouring flow control."""

    def __init__(self, up: Upstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tls: bool, sni: str | None):
        self.up, self.reader, self.writer, self.tls, self.sni = up, reader, writer, tls, sni
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=False)
        )
        self.streams: dict[int, tuple[list[tuple[bytes, bytes]], bytearray]] = {}
        self.window_open = asyncio.Event()
        self.closed = False
        self.tasks: set[asyncio.Task] = set()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.closed:
            self.writer.write(data)

    async def run(self, initial: bytes) -> None:
        self.conn.initiate_connection()
        self._flush()
        data = initial
        try:
            while True:
                if data:
                    try:
                        events = self.conn.receive_data(data)
                    except h2.exceptions.ProtocolError:
                        self._flush()
                        return
                    for event in events:
                        self._handle(event)
                    self._flush()
                    await self.writer.drain()
                data = await self.reader.read(_READ_SIZE)
                if not data:
                    return
        finally:
            self.closed = True
            self.window_open.set()
            for t in self.tasks:
                t.cancel()

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            headers = [(bytes(k), bytes(v)) for k, v in event.headers]
            self.streams[event.stream_id] = (headers, bytearray())
            self.up._record_wire(b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n")
            if event.stream_ended:
                self._start(event.stream_id)
        elif isinstance(event, h2.events.DataReceived):
            if event.stream_id in self.streams:
                self.streams[event.stream_id][1].extend(event.data)
            self.up._record_wire(event.data)
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if event.stream_ended:
                self._start(event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self._start(event.stream_id)
        elif isinstance(event, h2.events.TrailersReceived):
            self.up._record_wire(b"".join(bytes(k) + b": " + bytes(v) + b"\r\n" for k, v in event.headers))
            if event.stream_ended:
                self._start(event.stream_id)
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged, h2.events.StreamReset)):
            self.window_open.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.closed = True
            self.window_open.set()

    def _start(self, stream_id: int) -> None:
        entry = self.streams.pop(stream_id, None)
        if entry is None:
            return
        headers, body = entry
        pseudo = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k.startswith(b":")}
        regular = [(k, v) for k, v in headers if not k.startswith(b":")]
        host = pseudo.get(":authority") or next((v.decode("latin-1") for k, v in regular if k == b"host"), "")
        rec = Recorded(
            method=pseudo.get(":method", ""),
            host=host,
            path=pseudo.get(":path", ""),
            headers=regular,
            body=bytes(body),
            http_version="2",
            tls=self.tls,
            sni=self.sni,
            received_at=time.monotonic(),
        )
        self.up._record_request(rec)
        task = asyncio.get_running_loop().create_task(self._respond(stream_id, rec))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _respond(self, stream_id: int, rec: Recorded) -> None:
        try:
            response = self.up._route(rec)
            if response == "ws":  # no RFC 8441 here
                response = _simple(400, b"websocket over HTTP/2 is not served\n", "text/plain")
            assert isinstance(response, _Response)
            headers = [(b":status", str(response.status).encode())] + [
                (k, v) for k, v in response.headers if k not in (b"connection", b"transfer-encoding")
            ]
            chunks = [] if rec.method == "HEAD" else response.chunks
            if not any(chunks):
                self.conn.send_headers(stream_id, headers, end_stream=True)
                self._flush()
                for i in range(len(response.chunks)):
                    self.up._log_chunk(response.log_key, i)
                return
            self.conn.send_headers(stream_id, headers)
            self._flush()
            for i, chunk in enumerate(chunks):
                if i and response.delay:
                    await asyncio.sleep(response.delay)
                await self._send_data(stream_id, chunk)
                self.up._log_chunk(response.log_key, i)
            self.conn.end_stream(stream_id)
            self._flush()
            await self.writer.drain()
        except (h2.exceptions.StreamClosedError, ConnectionError):
            pass
        except h2.exceptions.ProtocolError as e:
            if not self.closed:
                self.up._record_error("h2 respond", e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self.up._record_error("h2 respond", e)

    async def _send_data(self, stream_id: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.closed:
                raise ConnectionError("h2 connection closed")
            window = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
            if window <= 0:
                self.window_open.clear()
                await self.window_open.wait()
                continue
            n = min(window, len(view))
            self.conn.send_data(stream_id, bytes(view[:n]))
            view = view[n:]
            self._flush()
            await self.writer.drain()

