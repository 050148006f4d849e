"""Bad input through a real mitmdump running keyveil: each case has a defined outcome.

Malformed JSON, invalid UTF-8, broken or stacked compression, huge headers,
a 100 MB body, duplicate keys, enormous numbers, NUL bytes, CR/LF in header
values (sent over a raw TLS socket, since clients refuse), over-long and
spaced references. Each test asserts what must happen (blocked with its code,
or forwarded with no value in any form at the upstream) and then that the
proxy still serves an ordinary request.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import ssl
import time
import uuid
import zlib

import brotli
import httpx
import pytest

from tests import infra
from tests import leak_corpus as lc
from tests.conftest import keyveil, keyveil_proxy, make_home

try:  # Python 3.14+
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    from backports import zstd

pytestmark = pytest.mark.timeout(120)

LONG_NAME = "long/" + "a" * 123  # exactly 128 characters, the longest valid name
assert len(LONG_NAME) == 128

RULES = """\
version: 1
providers:
  builtin: true
secrets:
  github/pat:
    hosts: [api.github.com]
    inject: [{header: Authorization}, {basic_auth: true}]
  anthropic/key:
    hosts: [api.anthropic.com]
    inject: [{header: x-api-key}]
  gitlab/token:
    hosts: [gitlab.test.keyveil]
    inject: [{query: private_token}, {body: true}, {path: true}]
  crlf/token:
    hosts: [api.github.com]
    inject: [{header: x-crlf-token}]
  %s:
    hosts: [api.github.com]
    inject: [{header: x-long-token}]
policy:
  max_body_bytes: {max_body}
""" % LONG_NAME

PAT_REF = b"{{secret:github/pat}}"
PROVIDER = "api.openai.com"
UNBOUND = "evil.example"


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    setup = make_home(tmp_path_factory.mktemp("bad"), rules=RULES)  # max_body_bytes: 1 MiB
    extra = {
        "crlf/token": b"crlf_" + os.urandom(8).hex().encode() + b"\r\nX-Injected: 1",
        LONG_NAME: b"long_" + os.urandom(12).hex().encode(),
    }
    for name, value in extra.items():
        r = keyveil(setup.env, "secret", "set", name, stdin=value + b"\n")
        assert r.returncode == 0, r.stderr
    setup.values.update(extra)
    return setup


@pytest.fixture(scope="module")
def proxy(kv, upstream, tmp_path_factory):
    work = tmp_path_factory.mktemp("bad-proxy")
    with keyveil_proxy(upstream, work, kv, flowfile=work / "flows.mitm", flow_detail=2) as p:
        yield p


@pytest.fixture
def det(kv):
    return lc.Detector(kv.values)


def client(proxy, http2: bool = False, timeout: float = 30) -> httpx.Client:
    verify = infra.client_ssl_context(proxy.ca_cert, h2_first=http2)
    return httpx.Client(proxy=proxy.url, verify=verify, http2=http2, trust_env=False, timeout=timeout)


def assert_no_leak(up, det) -> None:
    """No form of any value in anything the upstream received (wire, targets, headers, decoded bodies)."""
    wire = up.all_bytes()
    health = [r for r in up.requests if r.path.startswith("/health-")]
    for r in health:  # the health check's own injected header is the one allowed value
        wire = wire.replace(b"authorization: " + r.header("authorization").encode(), b"", 1)
    assert det.find(wire) == []
    for rec in up.requests:
        if rec in health:
            continue
        assert det.find(rec.path.encode("latin-1")) == []
        assert det.find(b"".join(k + b": " + v + b"\n" for k, v in rec.headers)) == []
        for body in lc.decodings(rec.body, rec.header("content-encoding")):
            assert det.find(body) == []


def assert_still_serves(proxy, up, kv) -> None:
    """An ordinary request after the bad one: injected where bound, answered 200."""
    path = f"/health-{uuid.uuid4().hex}"
    with client(proxy) as c:
        r = c.get(f"https://api.github.com{path}", headers={"authorization": "Bearer {{secret:github/pat}}"})
    assert r.status_code == 200
    (rec,) = [x for x in up.requests if x.path == path]
    assert rec.header("authorization") == "Bearer " + kv.values["github/pat"].decode()
    assert proxy.returncode is None


def assert_blocked(r: httpx.Response, code: str) -> None:
    assert (r.status_code, r.headers.get("x-keyveil-block")) == ({"undecodable_body": 502}.get(code, 403), code)
    assert r.json()["error"]["code"] == code


def post(proxy, host: str, body: bytes, headers: dict | None = None, http2: bool = False, path: str = "/v1/x"):
    with client(proxy, http2) as c:
        return c.post(f"https://{host}{path}", content=body, headers=headers or {})


# --- malformed JSON, invalid UTF-8, duplicate keys, big numbers, NUL -----------------------

MALFORMED = {
    "truncated_in_string": lambda f: b'{"model":"m","messages":[{"role":"user","content":"my token is ' + f,
    "truncated_after_string": lambda f: b'{"messages":[{"content":"' + f + b'"}',
    "trailing_comma": lambda f: b'{"a":"' + f + b'",}',
    "single_quotes": lambda f: b"{'a': '" + f + b"'}",
    "unbalanced_nesting": lambda f: b"[" * 5000 + b'"' + f + b'"',
    "unterminated_escape": lambda f: b'{"a":"' + f + b"\\",
    "only_the_value": lambda f: f,
}


def _pat_raw(kv) -> bytes:
    return kv.values["github/pat"]


def _gitlab_json_slash(kv) -> bytes:
    return json.dumps(kv.values["gitlab/token"].decode())[1:-1].replace("/", "\\/").encode()


FORMS = {"raw": (_pat_raw, "github/pat"), "json_slash": (_gitlab_json_slash, "gitlab/token")}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", MALFORMED)
def test_malformed_json_is_sealed_as_bytes_or_blocked(proxy, up, kv, det, shape, form):
    make, name = FORMS[form]
    value_form = make(kv)
    doc = MALFORMED[shape]
    headers = {"content-type": "application/json"}
    r = post(proxy, PROVIDER, doc(value_form), headers)
    assert r.status_code == 200
    (rec,) = up.requests
    # The reference is written the way the carrier wrote the value: a
    # carrier that escaped its slashes gets `{{secret:gitlab\/token}}`.
    reference = b"{{secret:" + name.encode() + b"}}"
    if form == "json_slash":
        reference = reference.replace(b"/", b"\\/")
    assert rec.body == doc(reference)
    r = post(proxy, UNBOUND, doc(value_form), headers)
    assert_blocked(r, "plaintext_egress")
    assert len(up.requests) == 1
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


INVALID_UTF8 = {
    "ff_fe_and_bad_continuation": (b"\xff\xfe", b"\xc3\x28\xa0\xa1"),
    "surrogate_and_out_of_range": (b"\xed\xa0\x80", b"\xf4\x90\x80\x80"),
    "dangling_lead_bytes": (b"\xc0", b"\xe2\x82"),
}


@pytest.mark.parametrize("ctype", ["application/json; charset=utf-8", "text/plain"])
@pytest.mark.parametrize("around", INVALID_UTF8)
def test_invalid_utf8_around_a_value(proxy, up, kv, det, around, ctype):
    pat = kv.values["github/pat"]
    before, after = INVALID_UTF8[around]
    body = b'{"content": "' + before + pat + after + b'"}'
    r = post(proxy, PROVIDER, body, {"content-type": ctype})
    assert r.status_code == 200
    assert up.requests[-1].body == body.replace(pat, PAT_REF)
    # in a header and in the URL too
    with client(proxy) as c:
        r = c.get(
            f"https://{PROVIDER}/v1/files/%FF{pat.decode()}%C0",
            headers=[(b"x-note", before + pat + after)],
        )
    assert r.status_code == 200
    rec = up.requests[-1]
    # In a URL the reference is written percent-encoded (`{` and `}` may not stand there).
    assert rec.path == "/v1/files/%FF%7B%7Bsecret%3Agithub%2Fpat%7D%7D%C0"
    assert dict(rec.headers)[b"x-note"] == before + PAT_REF + after
    assert_blocked(post(proxy, UNBOUND, body, {"content-type": ctype}), "plaintext_egress")
    assert len(up.requests) == 2
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


def test_duplicate_json_keys(proxy, up, kv, det):
    pat, tok = kv.values["github/pat"], kv.values["gitlab/token"]
    body = (
        b'{"content": "{{secret:github/pat}}", "content": "' + pat + b'", '
        b'"content": {"content": "' + tok + b'", "content": "' + pat + b'"}}'
    )
    r = post(proxy, PROVIDER, body, {"content-type": "application/json"})
    assert r.status_code == 200
    assert up.requests[0].body == body.replace(pat, PAT_REF).replace(tok, b"{{secret:gitlab/token}}")
    for host in (UNBOUND, "api.github.com"):  # the body is no bound location on api.github.com either
        assert_blocked(post(proxy, host, body, {"content-type": "application/json"}), "plaintext_egress")
    # a reference in a bound body with a duplicate key: both are injected, JSON-escaped
    body = b'{"token": "{{secret:gitlab/token}}", "token": "{{secret:gitlab/token}}"}'
    r = post(proxy, "gitlab.test.keyveil", body, {"content-type": "application/json"})
    assert r.status_code == 200
    assert up.requests[-1].body == body.replace(b"{{secret:gitlab/token}}", json.dumps(tok.decode())[1:-1].encode())
    assert len(up.requests) == 2
    assert det.find(up.requests[0].body) == []  # (the second one is bound: it holds the value on purpose)
    assert_still_serves(proxy, up, kv)


def test_a_value_in_a_field_named_like_a_signed_field_is_sealed(proxy, up, kv, det):
    """Vendor-signed fields are left alone because the vendor cannot have written a
    value it never saw; a value found in one was put there by the client (a tool
    input, a metadata field, a text body) and must be sealed like anywhere else (I1)."""
    pat = kv.values["github/pat"]
    genuine = b"EqQBCkYIBRgCKkD" + os.urandom(48).hex().encode()  # a real-looking signature, no value in it
    body = (
        b'{"messages": [{"role": "assistant", "content": ['
        b'{"type": "thinking", "thinking": "hm", "signature": "' + genuine + b'"}, '
        b'{"type": "tool_use", "id": "t1", "name": "http", "input": {"signature": "' + pat + b'"}}, '
        b'{"type": "redacted_thinking", "data": "' + genuine + b'", "note": "' + pat + b'"}]}], '
        b'"metadata": {"encrypted_content": "' + pat + b'", "thoughtSignature": "' + pat + b'"}}'
    )
    r = post(proxy, "api.anthropic.com", body, {"content-type": "application/json"}, path="/v1/messages")
    assert r.status_code == 200
    (rec,) = up.requests
    assert rec.body == body.replace(pat, PAT_REF)  # the genuine signatures are unchanged
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


@pytest.mark.parametrize("signed", [False, True])
def test_enormous_integers(proxy, up, kv, det, signed):
    pat = kv.values["github/pat"]
    digits = b"9" * 100_000
    thinking = b'{"type": "thinking", "thinking": "hm", "signature": "c2lnbmVk"}, ' if signed else b""
    body = (
        b'{"n": ' + digits + b', "m": -' + digits + b"e" + digits + b', "content": [' + thinking
        + b'{"type": "text", "text": "' + pat + b'"}]}'
    )
    started = time.monotonic()
    r = post(proxy, "api.anthropic.com", body, {"content-type": "application/json"}, path="/v1/messages")
    assert r.status_code == 200
    assert time.monotonic() - started < 10
    assert up.requests[0].body == body.replace(pat, PAT_REF)
    assert_blocked(post(proxy, UNBOUND, body, {"content-type": "application/json"}), "plaintext_egress")
    assert len(up.requests) == 1
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


@pytest.mark.parametrize(
    "ctype,shape",
    [
        ("application/json", lambda v: b'{"a": "\x00' + v + b'\x00", "b": "\\u0000' + v + b'"}'),
        ("text/plain", lambda v: b"\x00" * 16 + v + b"\x00" + v + b"\x00\x00"),
        ("application/x-www-form-urlencoded", lambda v: b"a=%00&t=" + v + b"%00&b=\x00"),
        ("application/octet-stream", lambda v: b"\x00\x01\x02" + v + b"\x00" * 1000),
    ],
    ids=["json", "text", "form", "binary"],
)
def test_nul_bytes_around_a_value(proxy, up, kv, det, ctype, shape):
    pat = kv.values["github/pat"]
    r = post(proxy, PROVIDER, shape(pat), {"content-type": ctype})
    assert r.status_code == 200
    assert up.requests[0].body == shape(PAT_REF)
    assert_blocked(post(proxy, UNBOUND, shape(pat), {"content-type": ctype}), "plaintext_egress")
    assert len(up.requests) == 1
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


# --- compression ---------------------------------------------------------------------------------


def _payload(kv) -> bytes:
    return b'{"input": "' + b"lorem ipsum " * 200 + kv.values["github/pat"] + b" and " + kv.values["gitlab/token"] + b'"}'


def _truncate(data: bytes, keep: float) -> bytes:
    return data[: int(len(data) * keep)]


def _corrupt(data: bytes) -> bytes:
    out = bytearray(data)
    for i in range(4, len(out), 7):
        out[i] ^= 0x5A
    return bytes(out)


UNDECODABLE = {
    "gzip_truncated_half": ("gzip", lambda p, kv: _truncate(gzip.compress(p), 0.5)),
    "gzip_without_trailer": ("gzip", lambda p, kv: gzip.compress(p)[:-8]),
    "gzip_with_trailing_value": ("gzip", lambda p, kv: gzip.compress(p) + b" " + kv.values["github/pat"]),
    "deflate_truncated": ("deflate", lambda p, kv: _truncate(zlib.compress(p), 0.6)),
    "deflate_with_trailing_value": ("deflate", lambda p, kv: zlib.compress(p) + b" " + kv.values["github/pat"]),
    "br_truncated": ("br", lambda p, kv: _truncate(brotli.compress(p), 0.6)),
    "br_corrupt": ("br", lambda p, kv: _corrupt(brotli.compress(p))),
    "zstd_truncated": ("zstd", lambda p, kv: _truncate(zstd.compress(p), 0.6)),
    "zstd_bad_magic": ("zstd", lambda p, kv: b"\x00\x00\x00\x00" + zstd.compress(p)[4:]),
    "zstd_with_trailing_value": ("zstd", lambda p, kv: zstd.compress(p) + b" " + kv.values["github/pat"]),
    "stacked_gzip_br": ("gzip, br", lambda p, kv: brotli.compress(gzip.compress(p))),
    "stacked_gzip_gzip": ("gzip, gzip", lambda p, kv: gzip.compress(gzip.compress(p))),
    "unknown_x_snappy": ("x-snappy", lambda p, kv: p),
}


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("case", UNDECODABLE)
def test_undecodable_body_is_blocked(proxy, up, kv, det, case, http2):
    ce, make = UNDECODABLE[case]
    body = make(_payload(kv), kv)
    for host in (PROVIDER, UNBOUND, "api.github.com"):
        r = post(proxy, host, body, {"content-type": "application/json", "content-encoding": ce}, http2)
        assert_blocked(r, "undecodable_body")
        assert kv.values["github/pat"] not in r.content
    assert up.requests == []
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


@pytest.mark.parametrize("host", [PROVIDER, UNBOUND])
def test_second_gzip_member_cannot_smuggle_a_value(proxy, up, kv, det, host):
    """gzip allows several members; servers (Python, Go, Node) decode them all."""
    pat = kv.values["github/pat"]
    body = gzip.compress(b'{"input": "hello ') + gzip.compress(b"token " + pat + b'"}')
    r = post(proxy, host, body, {"content-type": "application/json", "content-encoding": "gzip"})
    if host == PROVIDER:
        # decoded whole and sealed, or refused as undecodable: never forwarded with the value
        assert (r.status_code, r.headers.get("x-keyveil-block")) in {(200, None), (502, "undecodable_body")}
        if r.status_code == 200:
            assert gzip.decompress(up.requests[0].body) == b'{"input": "hello token {{secret:github/pat}}"}'
    else:
        assert r.status_code in (403, 502) and r.headers.get("x-keyveil-block") in ("plaintext_egress", "undecodable_body")
        assert up.requests == []
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


def _streamed_body(kv) -> bytes:
    """About 6 MiB (above max_body_bytes, 1 MiB, even compressed) with values at the start."""
    pat = kv.values["github/pat"]
    return b"start " + pat + b" " + os.urandom(3 << 20).hex().encode() + b" " + pat


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ce", ["gzip", "deflate", "br", "zstd"])
def test_truncated_large_compressed_body_is_never_forwarded_whole(proxy, up, kv, det, ce):
    """Above max_body_bytes the stream sealer decodes as it forwards: a truncated
    stream must end in an aborted request, never in a complete one."""
    compressed = encoding_of(ce)(_streamed_body(kv))
    body = _truncate(compressed, 0.8)
    assert len(body) > 1 << 20
    started = time.monotonic()
    try:
        with client(proxy, timeout=20) as c:
            try:
                r = c.post(f"https://{PROVIDER}/v1/files", content=body, headers={"content-encoding": ce})
                status = r.status_code
            except httpx.HTTPError as e:
                status = type(e).__name__  # the proxy tore the connection down: fine
        waited = time.monotonic() - started
        assert up.requests == [], f"a truncated {ce} body arrived as a complete request (client saw {status})"
        assert_no_leak(up, det)
        # the client learns promptly that its request failed (an error status or a closed connection)
        assert waited < 10, f"the client waited {waited:.0f} s and got {status}"
        assert_still_serves(proxy, up, kv)
    finally:
        time.sleep(1)  # the upstream notices the aborted connection a moment later
        errors = up.errors
        up.clear()
    assert all("incomplete chunked read" in e for e in errors)  # the aborted upload, as the upstream saw it


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ce", ["identity", "gzip", "deflate", "br", "zstd"])
def test_large_compressed_upload_arrives_whole_and_sealed(proxy, up, kv, det, ce):
    """Above max_body_bytes: decoded and sealed as it streams, forwarded uncompressed, one request."""
    payload = _streamed_body(kv)
    body = payload if ce == "identity" else encoding_of(ce)(payload)
    headers = {"content-type": "text/plain"} | ({} if ce == "identity" else {"content-encoding": ce})
    try:
        with client(proxy, timeout=60) as c:
            r = c.post(f"https://{PROVIDER}/v1/files", content=body, headers=headers)
        assert r.status_code == 200
        assert len(up.requests) == 1
        assert up.requests[0].body == payload.replace(kv.values["github/pat"], PAT_REF)
        assert_no_leak(up, det)
        assert_still_serves(proxy, up, kv)
    finally:
        errors = up.errors
        up.clear()
    assert errors == []  # e.g. no second, garbage request after a premature end of the chunked body


def encoding_of(ce: str):
    return {"gzip": gzip.compress, "deflate": zlib.compress, "br": lambda d: brotli.compress(d, quality=1),
            "zstd": zstd.compress}[ce]


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_response_chunk_held_back_whole_does_not_end_the_response(proxy, up, kv, http2):
    """A chunk that could be the start of a form is held back; an empty write must not end
    the response (over HTTP/1.1 an empty chunk is the terminating `0\r\n\r\n`)."""
    pat = kv.values["github/pat"]
    events = [b"data: one\n\n", b"abc", b"def\n\n", b"data: " + pat[:6], pat[6:] + b"\n\n", b"data: end\n\n"]
    up.set_sse(events, delay_between_chunks=0.2)
    with client(proxy, http2) as c:
        r = c.get("https://api.github.com/sse")
    assert r.status_code == 200
    assert r.content == b"data: one\n\nabcdef\n\ndata: {{secret:github/pat}}\n\ndata: end\n\n"
    assert_still_serves(proxy, up, kv)


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("ce", ["gzip", "br", "zstd"])
def test_compressed_response_split_inside_a_block_arrives_whole(proxy, up, kv, ce, http2):
    """A compressed response cut anywhere (here: inside its first block) decodes to nothing
    for a while; the response must go on, not end there."""
    pat = kv.values["github/pat"]
    text = b"your token: " + pat + b"\n" + os.urandom(20_000).hex().encode() + b"\nend\n"
    data = encoding_of(ce)(text)
    pieces = [data[:12], data[12 : len(data) // 2], data[len(data) // 2 :]]
    up.set_response("/respond", 200, {"content-type": "text/plain", "content-encoding": ce}, pieces, 0.2)
    with client(proxy, http2) as c:
        r = c.get("https://api.github.com/respond")
    assert r.status_code == 200
    assert r.content == text.replace(pat, PAT_REF)
    assert_still_serves(proxy, up, kv)


# --- headers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_huge_header_holding_a_value(proxy, up, kv, det, http2):
    pat = kv.values["github/pat"]
    big = b"a" * 30_000 + pat + b"b" * 30_000
    with client(proxy, http2) as c:
        r = c.get(f"https://{PROVIDER}/v1/models", headers=[(b"x-note", big)])
        assert r.status_code == 200
        assert dict(up.requests[0].headers)[b"x-note"] == big.replace(pat, PAT_REF)
        r = c.get(f"https://{UNBOUND}/collect", headers=[(b"x-note", big)])
        assert_blocked(r, "plaintext_egress")
    assert len(up.requests) == 1
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


@pytest.mark.parametrize("host", [PROVIDER, UNBOUND])
def test_value_as_a_header_name(proxy, up, kv, det, host):
    """A value is a valid header name (a token): `curl -H "$TOKEN: 1"` sends it."""
    pat = kv.values["github/pat"]
    with client(proxy) as c:
        r = c.get(f"https://{host}/v1/x", headers=[(pat, b"1")])
    if host == UNBOUND:
        assert_blocked(r, "plaintext_egress")
        assert up.requests == []
    else:
        assert r.status_code in (200, 403, 502)
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


def raw_request(proxy, host: str, request: bytes, timeout: float = 15) -> tuple[int | None, dict[bytes, bytes], bytes]:
    """Send REQUEST byte for byte through a CONNECT tunnel; (status, headers, body) of the answer."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, "the proxy closed the CONNECT"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200")
    ctx = ssl.create_default_context(cafile=str(proxy.ca_cert))
    with ctx.wrap_socket(sock, server_hostname=host) as tls:
        tls.sendall(request)
        out = b""
        try:
            while chunk := tls.recv(65536):
                out += chunk
        except (OSError, ssl.SSLError):
            pass
    if not out.startswith(b"HTTP/"):
        return None, {}, out
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _get(host: str, header_lines: bytes, eol: bytes = b"\r\n") -> bytes:
    return b"GET /echo HTTP/1.1" + eol + b"Host: " + host.encode() + eol + header_lines + b"Connection: close" + eol + eol


CRLF_CASES = {
    # name: (header lines holding VALUE, status toward a provider, status toward an unbound host)
    "obs_fold": (lambda v: b"X-Note: start\r\n " + v + b"\r\n", 200, 403),
    # mitmproxy passes a bare CR or a NUL on, sealed; the upstream refuses the header: 502
    "bare_cr": (lambda v: b"X-Note: a\r" + v + b"\r\n", 502, 403),
    "bare_lf_splits_a_header": (lambda v: b"X-Note: a\n" + v + b": x\r\n", None, 403),
    "nul": (lambda v: b"X-Note: a\x00" + v + b"\r\n", 502, 403),
}


@pytest.mark.parametrize("case", CRLF_CASES)
def test_cr_lf_in_header_values(proxy, up, kv, det, case):
    """Sent on a raw TLS socket: the status is whatever mitmproxy and the upstream make of
    it, but the unbound host never gets the request and no value reaches anyone."""
    lines, provider_status, unbound_status = CRLF_CASES[case]
    pat = kv.values["github/pat"]
    try:
        status, _, body = raw_request(proxy, PROVIDER, _get(PROVIDER, lines(pat)))
        assert pat not in body
        if provider_status is not None:
            assert status == provider_status
        n = len(up.requests)
        status, headers, body = raw_request(proxy, UNBOUND, _get(UNBOUND, lines(pat)))
        assert (status, headers.get(b"x-keyveil-block")) == (unbound_status, b"plaintext_egress")
        assert len(up.requests) == n and all(r.host != UNBOUND for r in up.requests)
        assert_no_leak(up, det)
        assert_still_serves(proxy, up, kv)
    finally:
        errors = up.errors
        up.clear()
    # the upstream's own refusal of the header (bare CR, NUL) is expected here, sealed
    assert all("illegal header line" in e and "{{secret:github/pat}}" in e for e in errors)


def test_obs_fold_continuation_is_sealed_in_place(proxy, up, kv, det):
    pat = kv.values["github/pat"]
    status, _, _ = raw_request(proxy, PROVIDER, _get(PROVIDER, b"X-Note: start\r\n " + pat + b"\r\n"))
    assert status == 200
    assert dict(up.requests[0].headers)[b"X-Note"] == b"start " + PAT_REF
    assert_still_serves(proxy, up, kv)


def test_value_with_cr_lf_is_never_injected_into_a_header(proxy, up, kv, det):
    with client(proxy) as c:
        r = c.get("https://api.github.com/echo", headers={"x-crlf-token": "{{secret:crlf/token}}"})
    assert_blocked(r, "plaintext_egress")
    assert "crlf/token" in r.json()["error"]["message"]
    assert up.requests == []
    assert b"X-Injected" not in up.all_bytes()
    assert_still_serves(proxy, up, kv)


# --- the streaming path ---------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_100_mb_body_toward_a_provider_is_sealed_by_the_stream_sealer(proxy, up, kv):
    pat = kv.values["github/pat"]
    size, chunk = 100 << 20, 1 << 16
    # near the start, across a chunk boundary in the middle, and as the very last bytes
    at = [1000, (size // 2 // chunk) * chunk - len(pat) // 2, size - len(pat)]
    line = b'{"role": "user", "content": "lorem ipsum dolor sit amet"}\n'
    filler = (line * (chunk // len(line) + 2))[:chunk]

    def body():
        for start in range(0, size, chunk):
            block = bytearray(filler)
            for a in at:
                for i in range(max(a, start), min(a + len(pat), start + chunk)):
                    block[i - start] = pat[i - a]
            yield bytes(block)

    up.set_response("/upload", 200, {"content-type": "application/json"}, [b'{"ok": true}'])
    with client(proxy, timeout=300) as c:
        r = c.post(
            f"https://{PROVIDER}/upload",
            content=body(),
            headers={"content-length": str(size), "content-type": "application/jsonl"},
        )
    assert r.status_code == 200
    (rec,) = up.requests
    # the stream sealer forwards chunked, without Content-Length: it did not buffer
    assert rec.header("content-length") is None and rec.header("transfer-encoding") == "chunked"
    assert len(rec.body) == size + 3 * (len(PAT_REF) - len(pat))
    assert rec.body.count(PAT_REF) == 3
    assert pat not in rec.body
    assert rec.body.endswith(PAT_REF)
    assert pat not in up.all_bytes()
    del rec
    up.clear()
    assert_still_serves(proxy, up, kv)


# --- references that are plain text ------------------------------------------------------------------


def test_over_long_reference_names_are_plain_text(proxy, up, kv, det):
    long_value = kv.values[LONG_NAME]
    with client(proxy) as c:
        # control: the 128-character name is injected
        r = c.get("https://api.github.com/a", headers={"x-long-token": "{{secret:%s}}" % LONG_NAME})
        assert r.status_code == 200
        assert up.requests[-1].header("x-long-token") == long_value.decode()
        for name in (LONG_NAME + "a", LONG_NAME + "/" + "b" * 200, "github/" + "p" * 130, "x" * 129 + "/github/pat"):
            ref = "{{secret:%s}}" % name
            for url, header in (("https://api.github.com/b", "x-long-token"), ("https://api.github.com/c", "authorization"),
                                (f"https://{UNBOUND}/d", "authorization")):
                r = c.get(url, headers={header: "Bearer " + ref if header == "authorization" else ref})
                assert r.status_code == 200, (name[:20], url)
                assert up.requests[-1].header(header) == ("Bearer " + ref if header == "authorization" else ref)
    assert long_value not in b"".join(r.body for r in up.requests[1:]) + b"".join(
        v for r in up.requests[1:] for _, v in r.headers
    )
    assert_still_serves(proxy, up, kv)


@pytest.mark.parametrize(
    "ref",
    ["{{ secret:github/pat }}", "{{secret: github/pat}}", "{{secret:github/pat }}", "{{secret:github /pat}}",
     "{{secret:\tgithub/pat}}", "{ {secret:github/pat}}", "{{secret :github/pat}}", "{{Secret:github/pat}}"],
)
def test_reference_with_whitespace_or_wrong_case_is_plain_text(proxy, up, kv, det, ref):
    with client(proxy) as c:
        for host in ("api.github.com", UNBOUND, PROVIDER):
            r = c.get(f"https://{host}/x", headers={"authorization": "Bearer " + ref})
            assert r.status_code == 200, host
            assert up.requests[-1].header("authorization") == "Bearer " + ref
        r = c.post("https://gitlab.test.keyveil/y", json={"t": ref.replace("github/pat", "gitlab/token")})
        assert r.status_code == 200
        assert json.loads(up.requests[-1].body) == {"t": ref.replace("github/pat", "gitlab/token")}
    assert_no_leak(up, det)
    assert_still_serves(proxy, up, kv)


# --- I5 over everything above (runs last in this module) -----------------------------------------------


def test_zz_no_value_in_any_output(proxy, kv, det):
    time.sleep(0.5)
    proxy.stop()
    outputs = {"console": proxy.output().encode(), "flow file": proxy.flowfile.read_bytes()}
    for p in (kv.home / "audit").glob("*.jsonl"):
        outputs[p.name] = p.read_bytes()
    leaks = {where: found for where, data in outputs.items() if (found := det.find(data))}
    # (the values injected on purpose are not in the outputs either: stored flows are sealed again)
    assert leaks == {}
