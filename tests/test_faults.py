"""Faults: an unreadable vault, a vault that breaks while the proxy runs, and the
network failing on either side (I4 fail closed, I5 quiet).

Real mitmdump running keyveil. Upstream faults come from a tiny TLS server in
this file that misbehaves on purpose (resets mid-stream, truncates a gzip
body), certified by the same test CA as the shared upstream, and from hosts
routed to a closed port or to a name that does not resolve. For each fault:
no value reaches the client, the upstream, the console, the flow file or the
audit log; the proxy serves the next request; and the decisions keyveil made
are in the audit log.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import secrets
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests import infra
from tests.infra import wsclient
from tests.conftest import base_env, keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(120)


# --- helpers -----------------------------------------------------------------------------------


def forms(value: bytes) -> list[bytes]:
    b64 = base64.b64encode(value)
    return [value, b64, b64.rstrip(b"="), base64.urlsafe_b64encode(value).rstrip(b"=")]


def assert_no_value(data: bytes, values, where: str = "") -> None:
    for value in values:
        for f in forms(value):
            assert f not in data, f"a value (or its base64) is in {where}"


def audit(home: Path) -> list[dict]:
    records = []
    for path in sorted((home / "audit").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line being written right now
                pass
    return records


def wait_audit(home: Path, start: int, want, timeout: float = 5.0) -> list[dict]:
    """The audit records after the first START, once WANT(records) holds or TIMEOUT
    has passed (keyveil flushes the audit log in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        records = audit(home)[start:]
        if want(records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def client(proxy, http2: bool = False, timeout: float = 20) -> httpx.Client:
    verify = infra.client_ssl_context(proxy.ca_cert, h2_first=http2)
    return httpx.Client(proxy=proxy.url, verify=verify, http2=http2, trust_env=False, timeout=timeout)


def tunnel(proxy, host: str, port: int = 443) -> ssl.SSLSocket:
    """A raw TLS connection to HOST through the proxy: the test writes the HTTP itself."""
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=20)
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = s.recv(4096)
        assert chunk, "the proxy closed the tunnel"
        reply += chunk
    assert reply.split()[1] == b"200", reply
    ctx = infra.client_ssl_context(proxy.ca_cert)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx.wrap_socket(s, server_hostname=host)


def read_response(sock) -> bytes:
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except (ConnectionError, ssl.SSLError, TimeoutError):
            break
        if not data:
            break
        out += data
    return out


def rst_close(sock: socket.socket) -> None:
    """Close with a TCP RST: what a crashed or reset peer looks like."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def until(condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the proxy did not notice the vault change"
        time.sleep(0.2)


def healthy(proxy, up, kv) -> None:
    """The proxy serves the next request: an injected one, echo scrubbed."""
    before = len(up.requests)
    with client(proxy) as c:
        r = c.get("https://api.github.com/echo", headers={"authorization": "Bearer {{secret:github/pat}}"})
    assert r.status_code == 200, r.text
    assert r.json()["headers"]["authorization"] == "Bearer {{secret:github/pat}}"
    assert up.requests[before].header("authorization") == "Bearer " + kv.values["github/pat"].decode()
    assert_no_value(r.content, kv.values.values(), "the response")


# --- a server that misbehaves on purpose ---------------------------------------------------------


class FaultServer:
    """TLS HTTP/1.1 on 127.0.0.1; what it does depends on the request path.

    Records every byte it receives (after TLS) in ``received``.
    """

    def __init__(self, ca, names: tuple[str, ...]) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ca.issue_cert(*names).configure_cert(self.ctx)
        self.ctx.set_alpn_protocols(["http/1.1"])
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.received = bytearray()
        self.paths: list[str] = []
        self.chunks: list[bytes] = []
        self.errors: list[str] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set_chunks(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def clear(self) -> None:
        with self.lock:
            self.received.clear()
            self.paths.clear()

    def close(self) -> None:
        self._stop = True
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            raw.settimeout(20)
            conn = self.ctx.wrap_socket(raw, server_side=True)
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(65536)
                if not data:
                    return
                head += data
            with self.lock:
                self.received += head
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            path = request_line.split()[1]
            with self.lock:
                self.paths.append(path)
            getattr(self, "_" + path.strip("/").split("?")[0].replace("-", "_"), self._ok)(conn, raw)
        except Exception as e:  # noqa: BLE001 - reported to the test
            if not isinstance(e, (ConnectionError, ssl.SSLError, TimeoutError)):
                self.errors.append(repr(e))

    def _ok(self, conn, raw) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        conn.unwrap()
        conn.close()

    def _reset_mid_stream(self, conn, raw) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for chunk in self.chunks:
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            time.sleep(0.2)
        rst_close(raw)

    def _reset_before_response(self, conn, raw) -> None:
        rst_close(raw)

    def _cut_content_length(self, conn, raw) -> None:
        body = b"".join(self.chunks)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % (2 * len(body)))
        conn.sendall(body)
        time.sleep(0.2)
        rst_close(raw)

    def _truncated_gzip(self, conn, raw) -> None:
        # read-until-close framing; the gzip stream stops half-way, then a clean close
        z = gzip.compress(b"".join(self.chunks), mtime=0)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-encoding: gzip\r\nconnection: close\r\n\r\n")
        conn.sendall(z[: len(z) // 2])
        time.sleep(0.2)
        conn.unwrap()
        conn.close()


FAULT_ROUTE = '''
"""Test-only: route fault hosts to their fault, everything else to the shared upstream."""
import json
from mitmproxy import ctx


class FaultRoute:
    def load(self, loader):
        loader.add_option("fault_table", str, "{}", "JSON: host -> [address, port]")
        loader.add_option("fault_tls_port", int, 0, "the shared upstream's TLS port")
        loader.add_option("fault_plain_port", int, 0, "the shared upstream's plain port")

    def server_connect(self, data):
        server = data.server
        if server.address is None or server.via is not None:
            return
        host, port = server.address[0], server.address[1]
        tls = server.tls or port == 443
        if tls and server.sni is None:
            server.sni = host
        table = json.loads(ctx.options.fault_table)
        if host in table:
            server.address = tuple(table[host])
        else:
            server.address = ("127.0.0.1", ctx.options.fault_tls_port if tls else ctx.options.fault_plain_port)


addons = [FaultRoute()]
'''

RESET_HOST = "reset.githubusercontent.com"  # bound to github/pat by "*.githubusercontent.com"
DOWN_HOST = "down.githubusercontent.com"  # routed to a port where nothing listens
NX_HOST = "nx.githubusercontent.com"  # routed to a name that does not resolve


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fault_server(upstream):
    server = FaultServer(upstream.ca, (RESET_HOST, "*.githubusercontent.com"))
    yield server
    server.close()
    assert server.errors == []


@pytest.fixture(scope="module")
def fkv(tmp_path_factory):
    return make_home(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def fproxy(fkv, upstream, fault_server, tmp_path_factory):
    work = tmp_path_factory.mktemp("faults-proxy")
    route = work / "fault_route.py"
    route.write_text(FAULT_ROUTE)
    table = {RESET_HOST: ["127.0.0.1", fault_server.port], DOWN_HOST: ["127.0.0.1", closed_port()], NX_HOST: ["nx.invalid", 443]}
    p = infra.ProxyProcess(
        [infra.KEYVEIL_ADDON, route],
        [
            ("keyveil_home", fkv.home),
            ("fault_table", json.dumps(table)),
            ("fault_tls_port", upstream.tls_port),
            ("fault_plain_port", upstream.plain_port),
            ("ssl_verify_upstream_trusted_ca", upstream.ca_pem),
        ],
        workdir=work,
        flowfile=work / "flows.mitm",
        flow_detail=4,  # the console shows whole requests: I5 must hold there too
        env=fkv.env,
    )
    with p:
        yield p


@pytest.fixture
def fup(upstream, fault_server):
    upstream.reset()
    fault_server.clear()
    yield upstream


# --- the vault at start-up -------------------------------------------------------------------------


def passphrase_home(tmp: Path, passphrase: str) -> tuple[Path, dict[str, str], bytes]:
    home = tmp / "home"
    env = base_env(home)
    assert keyveil(env, "init").returncode == 0
    value = b"ghp_" + secrets.token_urlsafe(27).encode()
    r = keyveil({**env, "KEYVEIL_PASSPHRASE": passphrase}, "secret", "set", "github/pat", stdin=value)
    assert r.returncode == 0, r.stderr
    assert json.loads((home / "vault" / "vault.json").read_text())["key_source"] == "passphrase"
    return home, env, value


def free_port() -> int:
    return closed_port()


def test_wrong_or_missing_passphrase_stops_mitmdump_and_start_with_exit_2(upstream, tmp_path):
    right, wrong = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    home, env, value = passphrase_home(tmp_path, right)
    outputs = []
    for passphrase in (wrong, None):
        penv = {**env, "KEYVEIL_PASSPHRASE": passphrase} if passphrase else env
        p = infra.routed_proxy(upstream, tmp_path / f"w-{bool(passphrase)}", scripts=[infra.KEYVEIL_ADDON], options={"keyveil_home": home}, env=penv)
        assert p.wait_exit() == 2, p.output()
        out = p.output()
        assert "KEYVEIL_PASSPHRASE" in out and "vault" in out
        assert "Traceback" not in out
        r = subprocess.run(
            [sys.executable, "-m", "keyveil", "start", "--listen", f"127.0.0.1:{free_port()}"],
            env=penv, capture_output=True, timeout=60,
        )
        assert r.returncode == 2, r.stderr
        assert b"KEYVEIL_PASSPHRASE" in r.stderr
        outputs += [out.encode(), r.stdout, r.stderr]
    # control: the right passphrase starts it
    with infra.routed_proxy(upstream, tmp_path / "w-right", scripts=[infra.KEYVEIL_ADDON], options={"keyveil_home": home}, env={**env, "KEYVEIL_PASSPHRASE": right}) as p:
        assert p.returncode is None
    outputs.append(p.output().encode())
    for out in outputs:
        assert_no_value(out, [value, right.encode(), wrong.encode()], "the proxy output")


def test_missing_key_file_stops_mitmdump_and_start_with_exit_2(upstream, tmp_path):
    kv = make_home(tmp_path)
    key = kv.home / "vault" / "key"
    assert key.exists()
    key.unlink()
    p = keyveil_proxy(upstream, tmp_path / "w", kv)
    assert p.wait_exit() == 2, p.output()
    assert str(key) in p.output() and "missing" in p.output()
    r = subprocess.run(
        [sys.executable, "-m", "keyveil", "start", "--listen", f"127.0.0.1:{free_port()}"],
        env=kv.env, capture_output=True, timeout=60,
    )
    assert r.returncode == 2
    assert str(key).encode() in r.stderr
    assert "Traceback" not in p.output() and b"Traceback" not in r.stderr


# --- the vault breaks while the proxy runs ------------------------------------------------------------


CORRUPT = b'{"format": "keyveil-vault", "version": 1, "key_source": "keyfile", "nonce": "!!"}\n'


def test_vault_corrupted_while_running_blocks_then_recovers(upstream, tmp_path):
    """Once the proxy has seen that the vault is unreadable, every flow is blocked
    (502 vault_unavailable) and nothing reaches the upstream, until it is restored."""
    upstream.reset()
    kv = make_home(tmp_path)
    pat = kv.values["github/pat"]
    vault = kv.home / "vault" / "vault.json"
    good = vault.read_bytes()
    with keyveil_proxy(upstream, tmp_path / "w", kv, flowfile=tmp_path / "flows.mitm") as p:
        with client(p) as c:
            r = c.get("https://api.github.com/echo", headers={"authorization": "Bearer {{secret:github/pat}}"})
            assert r.status_code == 200
            n_audit = len(audit(kv.home))

            vault.write_bytes(CORRUPT)
            # the proxy may look at the vault only every so often: wait until it has seen the change
            until(lambda: c.get("https://evil.example/probe").headers.get("x-keyveil-block") == "vault_unavailable")
            n_up = len(upstream.requests)
            blocked = [
                c.get("https://api.github.com/echo", headers={"authorization": "Bearer {{secret:github/pat}}"}),
                c.post("https://api.anthropic.com/v1/messages", json={"content": "token " + pat.decode()}),
                c.get("https://api.gitlab.com/echo", headers={"authorization": "Bearer " + pat.decode()}),
            ]
            for r in blocked:
                assert (r.status_code, r.headers.get("x-keyveil-block")) == (502, "vault_unavailable"), r.text
                assert str(vault) in r.json()["error"]["message"]
                assert_no_value(r.content, kv.values.values(), "a block response")
            assert len(upstream.requests) == n_up, [r.host for r in upstream.requests[n_up:]]
            records = wait_audit(kv.home, n_audit, lambda rs: sum(a["code"] == "vault_unavailable" for a in rs) >= 4)
            codes = [(a["host"], a["code"]) for a in records if a["action"] == "blocked"]
            for host in ("api.github.com", "api.anthropic.com", "api.gitlab.com"):
                assert (host, "vault_unavailable") in codes

            vault.write_bytes(good)  # restored: a later flow reloads it
            until(lambda: c.get("https://api.github.com/echo", headers={"authorization": "Bearer {{secret:github/pat}}"}).status_code == 200)
            assert upstream.requests[-1].header("authorization") == "Bearer " + pat.decode()
            r = c.post("https://api.anthropic.com/v1/messages", json={"content": "token " + pat.decode()})
            assert r.status_code == 200
            assert pat not in upstream.requests[-1].body
        out = p.output().encode()
    for data in (out, (tmp_path / "flows.mitm").read_bytes(), *(f.read_bytes() for f in (kv.home / "audit").glob("*"))):
        assert_no_value(data, kv.values.values(), "an output")


def test_websocket_message_is_not_sent_when_the_vault_becomes_unreadable(upstream, tmp_path):
    upstream.reset()
    kv = make_home(tmp_path)
    pat, tok = kv.values["github/pat"], kv.values["ws/token"]
    vault = kv.home / "vault" / "vault.json"
    with keyveil_proxy(upstream, tmp_path / "w", kv) as p:
        ws_ssl = infra.client_ssl_context(p.ca_cert)
        with wsclient.connect("wss://ws.test.keyveil/ws", proxy=p.url, ssl=ws_ssl, open_timeout=10) as ws:
            ws.send('{"auth": "{{secret:ws/token}}"}')
            assert "{{secret:ws/token}}" in ws.recv(timeout=5)
            n_audit = len(audit(kv.home))
            vault.write_bytes(CORRUPT)
            time.sleep(1.5)  # past any re-check interval: this message is the flow that finds out
            ws.send('{"auth": "{{secret:ws/token}}", "note": "' + pat.decode() + '"}')
            try:
                ws.recv(timeout=3)
            except Exception:  # noqa: BLE001 - the connection is killed, or the message dropped
                pass
    sent = [m.data for m in upstream.ws_messages if m.direction == "client"]
    assert sent == ['{"auth": "' + tok.decode() + '"}'], "a message went out while the vault was unreadable"
    records = wait_audit(kv.home, n_audit, lambda rs: any(a["code"] == "vault_unavailable" for a in rs))
    assert ("ws.test.keyveil", "vault_unavailable") in [(a["host"], a["code"]) for a in records]


# --- the upstream fails ------------------------------------------------------------------------------


def test_upstream_reset_mid_stream(fproxy, fup, fault_server, fkv):
    pat = fkv.values["github/pat"]
    fault_server.set_chunks([b"data: first\n\n", b"data: token " + pat + b"\n\n", b"data: cut " + pat[:12]])
    n_audit = len(audit(fkv.home))
    got = b""
    with client(fproxy) as c:
        with pytest.raises(httpx.TransportError):
            with c.stream("GET", f"https://{RESET_HOST}/reset-mid-stream", headers={"authorization": "Bearer {{secret:github/pat}}"}) as r:
                assert r.status_code == 200
                for chunk in r.iter_raw():
                    got += chunk
    assert got.startswith(b"data: first\n\ndata: token {{secret:github/pat}}\n\n"), got
    assert_no_value(got, fkv.values.values(), "the partial response")
    # the value was injected toward its bound host, and only there
    assert b"authorization: Bearer " + pat in bytes(fault_server.received)
    healthy(fproxy, fup, fkv)
    records = wait_audit(fkv.home, n_audit, lambda rs: any(a["action"] == "injected" for a in rs))
    assert [a["action"] for a in records if a["host"] == RESET_HOST and a["action"] == "injected"] == ["injected"]


def test_scrub_of_a_response_cut_by_the_upstream_is_audited(fproxy, fup, fault_server, fkv):
    """SPEC §8: one audit line per decision. The value in the first chunks was
    scrubbed (the client got the reference), even though the stream never ended."""
    pat = fkv.values["github/pat"]
    fault_server.set_chunks([b"data: token " + pat + b"\n\n", b"data: more\n\n"])
    n_audit = len(audit(fkv.home))
    got = b""
    with client(fproxy) as c:
        with pytest.raises(httpx.TransportError):
            with c.stream("GET", f"https://{RESET_HOST}/reset-mid-stream") as r:
                for chunk in r.iter_raw():
                    got += chunk
    assert b"{{secret:github/pat}}" in got
    records = wait_audit(fkv.home, n_audit, lambda rs: any(a["action"] == "scrubbed" for a in rs))
    assert "scrubbed" in [a["action"] for a in records if a["host"] == RESET_HOST], records


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("padding", [5000, 70_000], ids=["read-whole", "streamed"])
def test_upstream_cut_inside_a_content_length_body_is_an_error_for_the_client(fproxy, fup, fault_server, fkv, http2, padding):
    """The upstream promised N bytes and sent half: the client must see an error,
    not a shorter body that looks whole. A body small enough to be read whole
    (READ_WHOLE_BYTES) becomes mitmproxy's 502; a streamed one is cut off."""
    from keyveil.adapter._responses import READ_WHOLE_BYTES

    pat = fkv.values["github/pat"]
    fault_server.set_chunks([b"report: token " + pat + b" " + b"r" * padding])
    got = b""
    with client(fproxy, http2) as c:
        if 2 * padding < READ_WHOLE_BYTES:
            r = c.get(f"https://{RESET_HOST}/cut-content-length")
            assert r.status_code == 502, r.status_code
            assert b"complete message body" in r.content
            got = r.content
        else:
            with pytest.raises(httpx.TransportError):
                with c.stream("GET", f"https://{RESET_HOST}/cut-content-length") as r:
                    for chunk in r.iter_raw():
                        got += chunk
            assert got.startswith(b"report: token {{secret:github/pat}}")  # the run of r is held back: it might go on
    assert_no_value(got, fkv.values.values(), "the partial response")
    healthy(fproxy, fup, fkv)


def test_upstream_reset_before_the_response(fproxy, fup, fault_server, fkv):
    pat = fkv.values["github/pat"]
    with client(fproxy) as c:
        r = c.post(f"https://{RESET_HOST}/reset-before-response", headers={"authorization": "Bearer {{secret:github/pat}}"}, content=b"x")
    assert r.status_code == 502  # mitmproxy's own error response
    assert_no_value(r.content + str(r.headers).encode(), fkv.values.values(), "the error response")
    assert b"Bearer " + pat in bytes(fault_server.received)
    healthy(fproxy, fup, fkv)


def test_truncated_compressed_response_is_cut_and_audited(fproxy, fup, fault_server, fkv):
    pat = fkv.values["github/pat"]
    fault_server.set_chunks([b"start " + pat + b" " + os.urandom(4000).hex().encode()])
    n_audit = len(audit(fkv.home))
    got = b""
    t0 = time.monotonic()
    with client(fproxy, timeout=30) as c:
        with pytest.raises(httpx.TransportError):  # the client must see the body is incomplete
            with c.stream("GET", f"https://{RESET_HOST}/truncated-gzip") as r:
                for chunk in r.iter_raw():
                    got += chunk
    # ... promptly: the proxy ends the response, it does not leave the client waiting
    assert time.monotonic() - t0 < 10, f"the client waited {time.monotonic() - t0:.0f} s for the end of an aborted response"
    assert_no_value(got, fkv.values.values(), "the partial response")
    records = wait_audit(fkv.home, n_audit, lambda rs: any(a["code"] == "undecodable_body" for a in rs))
    assert ("blocked", "undecodable_body") in [(a["action"], a["code"]) for a in records if a["host"] == RESET_HOST], records
    healthy(fproxy, fup, fkv)


@pytest.mark.parametrize("host", [DOWN_HOST, NX_HOST], ids=["nothing-listening", "dns-failure"])
def test_unreachable_upstream(fproxy, fup, fkv, host):
    n_audit = len(audit(fkv.home))
    with client(fproxy, timeout=40) as c:
        r = c.get(f"https://{host}/echo", headers={"authorization": "Bearer {{secret:github/pat}}"})
    assert r.status_code == 502
    assert_no_value(r.content + str(r.headers).encode(), fkv.values.values(), "the error response")
    healthy(fproxy, fup, fkv)
    records = wait_audit(fkv.home, n_audit, lambda rs: any(a["host"] == host for a in rs))
    time.sleep(0.6)  # and nothing more comes
    records = [a for a in audit(fkv.home)[n_audit:] if a["host"] == host]
    # keyveil's decision (inject) is recorded; the connect error itself is not an audit action
    assert [a["action"] for a in records] == ["injected"], records


# --- the client fails ----------------------------------------------------------------------------------


def test_client_disconnect_mid_upload(fproxy, fup, fkv):
    pat = fkv.values["github/pat"]
    t = tunnel(fproxy, "api.anthropic.com")
    body_start = b'{"messages": [{"content": "' + pat + b" " + b"y" * 50_000
    t.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\ncontent-type: application/json\r\ncontent-length: 200000\r\n\r\n" + body_start)
    time.sleep(0.3)
    rst_close(t)
    time.sleep(0.5)
    assert fup.requests == []
    assert_no_value(fup.all_bytes(), fkv.values.values(), "the upstream")
    healthy(fproxy, fup, fkv)


def test_client_disconnect_mid_streamed_upload(fproxy, fup, fkv):
    """A body over max_body_bytes is streamed through the sealer: cut half-way, what went out is sealed."""
    pat = fkv.values["github/pat"]
    n_audit = len(audit(fkv.home))
    t = tunnel(fproxy, "api.anthropic.com")
    t.sendall(b"POST /v1/files HTTP/1.1\r\nHost: api.anthropic.com\r\ncontent-length: 3145728\r\n\r\n")
    sent = 0
    for i in range(24):  # 1.5 MiB of 3, a value in every 64 KiB piece, some split across writes
        piece = bytearray(b"z" * 65536)
        at = (i * 7919) % (65536 - len(pat))
        piece[at : at + len(pat)] = pat
        t.sendall(bytes(piece[:40000]))
        t.sendall(bytes(piece[40000:]))
        sent += len(piece)
    time.sleep(1.0)
    rst_close(t)
    time.sleep(1.0)
    wire = fup.all_bytes()
    assert_no_value(wire, fkv.values.values(), "the upstream")
    assert b"{{secret:github/pat}}" in wire, "nothing was streamed upstream before the cut"
    healthy(fproxy, fup, fkv)
    records = wait_audit(fkv.home, n_audit, lambda rs: any(a["action"] == "sealed" for a in rs))
    # the values that went out were sealed: a decision, so an audit line
    assert "sealed" in [a["action"] for a in records if a["host"] == "api.anthropic.com"], records


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_slow_client_trickle_upload(fproxy, fup, fkv, framing):
    pat = fkv.values["github/pat"]
    body = b'{"messages": [{"content": "my token is ' + pat + b' ok"}]}'
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]
    t = tunnel(fproxy, "api.anthropic.com")
    head = b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\ncontent-type: application/json\r\nconnection: close\r\n"
    head += b"content-length: %d\r\n\r\n" % len(body) if framing == "content-length" else b"transfer-encoding: chunked\r\n\r\n"
    t.sendall(head)
    quick: list[float] = []

    def other_client():
        t0 = time.monotonic()
        healthy(fproxy, fup, fkv)
        quick.append(time.monotonic() - t0)

    other = threading.Thread(target=other_client)
    for i, piece in enumerate(pieces):
        t.sendall(piece if framing == "content-length" else b"%x\r\n%s\r\n" % (len(piece), piece))
        if i == 2:
            other.start()
        time.sleep(0.1)
    if framing == "chunked":
        t.sendall(b"0\r\n\r\n")
    response = read_response(t)
    t.close()
    other.join(30)
    assert response.split(b" ", 2)[1] == b"200", response[:300]
    assert quick and quick[0] < 5, "a slow upload held up another client"
    (rec,) = [r for r in fup.requests if r.path == "/v1/messages"]
    assert pat not in rec.body and b"{{secret:github/pat}}" in rec.body
    assert_no_value(response, fkv.values.values(), "the response")


# --- nothing leaked anywhere (runs last in this module) ------------------------------------------------


def test_zz_no_value_in_any_output_after_the_faults(fproxy, fkv, fault_server):
    time.sleep(0.5)
    fproxy.stop()
    outputs = {"console": fproxy.output().encode(), "flow file": fproxy.flowfile.read_bytes()}
    outputs.update({str(p): p.read_bytes() for p in (fkv.home / "audit").glob("*.jsonl")})
    assert len(outputs["flow file"]) > 1000 and b"keyveil" in outputs["console"]
    for where, data in outputs.items():
        assert_no_value(data, fkv.values.values(), where)
