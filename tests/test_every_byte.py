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
            time.sleep(0.2)
            conn.close()
        except (OSError, ssl.SSLError):
            pass

    def all_bytes(self) -> bytes:
        return b"".join(self.received)

    def close(self) -> None:
        self._sock.close()
        self._plain.close()


def tunnel(proxy, host: str, home: Path) -> ssl.SSLSocket:
    """A TLS connection to HOST through the proxy's CONNECT, trusting keyveil's CA."""
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    raw.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += raw.recv(4096)
    assert b" 200" in answer.split(b"\r\n")[0], answer[:100]
    ctx = infra.client_ssl_context(proxy.ca_cert)
    return ctx.wrap_socket(raw, server_hostname=host)


def exchange(proxy, host: str, home: Path, request: bytes) -> bytes:
    s = tunnel(proxy, host, home)
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
