"""A seeded generator of leak cases, the client that sends them, and the oracle.

Each case puts one registered value, in one of its forms (SPEC §3), in one
location of one request (header, query, path, body or WebSocket message) to
one destination (a provider, a bound host, an unbound host), over HTTP/1.1,
HTTP/2 or WebSocket, with a body kind and a content encoding. Some cases also
carry a reference in an auth header, and some carry only a reference.

The oracle knows the bindings of ``RULES`` and nothing of keyveil's code: it
computes what must happen (forwarded, or blocked with which code) and what the
upstream may see. Its detector of leaked forms is written here, independently
of ``keyveil._forms``, so a form keyveil forgets is a failure, not a blind spot.

Everything is derived from one seed (``KEYVEIL_CORPUS_SEED``, printed by the
tests), the fake values included: a failing case is reproduced by its seed and
its number (``KEYVEIL_CORPUS_CASES=12,57`` runs only those). The default seed
is drawn from ``secrets``, so every run has fresh fake values.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import secrets
import string
import threading
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from urllib.parse import quote, quote_plus

import brotli
import httpx
import websockets.exceptions
import websockets.sync.client
from mitmproxy.net import encoding

from tests import infra
from tests.conftest import KeyveilSetup, keyveil, make_home

try:  # Python 3.14+
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    from backports import zstd

SEED_ENV = "KEYVEIL_CORPUS_SEED"
CASES_ENV = "KEYVEIL_CORPUS_CASES"

PROVIDERS = ("api.anthropic.com", "api.openai.com", "chatgpt.com")
BOUND_HOSTS = ("api.github.com",)
UNBOUND_HOSTS = ("evil.example", "api.gitlab.com")
HOSTS = PROVIDERS + BOUND_HOSTS + UNBOUND_HOSTS
BASE_PATH = {
    "api.anthropic.com": "/v1/messages",
    "api.openai.com": "/v1/responses",
    "chatgpt.com": "/backend-api/conversation",
    "api.github.com": "/repos/o/r/issues",
    "evil.example": "/collect",
    "api.gitlab.com": "/api/v4/projects",
}
TRANSPORTS = ("h1", "h2", "ws")
LOCATIONS = ("header", "query", "path", "body")
ENCODINGS = ("identity", "gzip", "deflate", "br", "zstd")
BODY_KINDS = ("json", "form", "multipart", "text", "ndjson")
FORMS = (
    "raw",
    "json_ascii",
    "json_utf8",
    "json_slash",
    "json_html",
    "pct_quote",
    "pct_strict",
    "pct_plus",
    "pct_component",
    "b64",
    "basic",
    "bearer",
)
NAME_HEADER = "(name)"  # the value is the header's name, not its value
HEADERS = ("x-note", "authorization", "cookie", "x-api-key", "x-debug-token", NAME_HEADER)
REFS = ("none", "github", "anthropic")
CASE_HEADER = "x-kv-case"

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
  corpus/alnum:
    hosts: [corpus.test.keyveil]
    inject: [{header: Authorization}]
  corpus/punct:
    hosts: [corpus.test.keyveil]
    inject: [{body: true}]
  corpus/utf8:
    hosts: [corpus.test.keyveil]
    inject: [{websocket: true}]
policy:
  max_body_bytes: {max_body}
"""

#: (host, secret, header) where a value may reach the upstream: the bindings of RULES
BINDINGS = {
    ("api.github.com", "github/pat", "authorization"),
    ("api.anthropic.com", "anthropic/key", "x-api-key"),
}
REF_HEADERS = {
    "github": ("authorization", "Bearer {{secret:github/pat}}", "github/pat", "api.github.com"),
    "anthropic": ("x-api-key", "{{secret:anthropic/key}}", "anthropic/key", "api.anthropic.com"),
}

_ALNUM = string.ascii_letters + string.digits
_URLSAFE = _ALNUM + "-_"
# Bytes httpx leaves alone in a path or query: anything else would be
# re-encoded by the client, and the case would no longer send its form.
_URL_OK = re.compile(rb"[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*")
# A header name is a token (RFC 9110); clients send any token as a name.
_TOKEN = re.compile(rb"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")


def corpus_seed() -> int:
    raw = os.environ.get(SEED_ENV)
    return int(raw) if raw else secrets.randbits(32)


def selected_cases() -> set[int] | None:
    raw = os.environ.get(CASES_ENV)
    return {int(x) for x in raw.split(",") if x.strip()} if raw else None


# --- values ---------------------------------------------------------------------------------


def make_values(seed: int) -> dict[str, bytes]:
    """Fake values for one run: escaped characters in some, plain alphanumerics in others."""
    rng = Random(f"values-{seed}")

    def pick(alphabet: str, n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    return {
        "github/pat": ("ghp_" + pick(_URLSAFE, 36)).encode(),
        "anthropic/key": ("sk-ant-api03-" + pick(_URLSAFE, 40)).encode(),
        "gitlab/token": ("glpat/" + pick(_URLSAFE, 20) + "+=&").encode(),  # URL and form metacharacters
        "corpus/alnum": pick(_ALNUM, 32).encode(),
        "corpus/punct": ('kv"' + pick(_ALNUM, 10) + " <a&b> /+= " + pick(_ALNUM, 10)).encode(),
        "corpus/utf8": ("kv\u00e9-" + pick(_ALNUM, 12) + "-\u20ac\\" + pick(_ALNUM, 6)).encode(),
    }


def make_corpus_home(tmp: Path, seed: int) -> KeyveilSetup:
    """A home with RULES and the seed's values (the helper's own values are removed)."""
    setup = make_home(tmp, rules=RULES)
    for name in setup.values:
        r = keyveil(setup.env, "secret", "rm", name)
        assert r.returncode == 0, r.stderr
    setup.values = make_values(seed)
    for name, value in setup.values.items():
        r = keyveil(setup.env, "secret", "set", name, stdin=value + b"\n")
        assert r.returncode == 0, r.stderr
        setup.outputs += [r.stdout, r.stderr]
    return setup


# --- the oracle's own detector ----------------------------------------------------------------


def _upper_u_escapes(text: str) -> str:
    return re.sub(r"\\u([0-9a-f]{4})", lambda m: "\\u" + m.group(1).upper(), text)


def _html_escape(text: str, upper: bool) -> str:
    fmt = "\\u{:04X}" if upper else "\\u{:04x}"
    return "".join(fmt.format(ord(c)) if c in "<>&" else c for c in text)


def json_variants(value: bytes) -> set[bytes]:
    text = value.decode("utf-8")
    out = set()
    for ascii_only in (True, False):
        base = json.dumps(text, ensure_ascii=ascii_only)[1:-1]
        for slash in (False, True):
            s = base.replace("/", "\\/") if slash else base
            for html in (None, False, True):
                t = _html_escape(s, html) if html is not None else s
                out.add(t.encode())
                out.add(_upper_u_escapes(t).encode())
    return out


def _lower_hex(text: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), text)


def percent_variants(value: bytes) -> set[bytes]:
    out = set()
    for safe in ("", "/", "-_.!~*'()", "-_.!~*'();/?:@&=+$,#"):
        for enc in (quote(value, safe=safe), quote_plus(value, safe=safe)):
            out.add(enc.encode())
            out.add(_lower_hex(enc).encode())
    return out


def base64_variants(value: bytes) -> set[bytes]:
    """The part of base64(x + VALUE + y) that depends on VALUE alone, at each offset."""
    out = set()
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + value)
        first = 4 if offset else 0
        last = (offset + len(value)) // 3 * 4
        stable = encoded[first:last]
        out.add(stable)
        out.add(stable.translate(bytes.maketrans(b"+/", b"-_")))
    return out


class Detector:
    """Finds any form of any value in bytes: one regex over every form."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values
        self.forms: dict[bytes, str] = {}
        for name, value in values.items():
            for kind, forms in (
                ("raw", {value}),
                ("json", json_variants(value)),
                ("percent", percent_variants(value)),
                ("base64", base64_variants(value)),
            ):
                for f in forms:
                    assert len(f) >= 8, "a form this short would find noise"
                    self.forms.setdefault(f, f"{name} ({kind})")
        self._re = re.compile(b"|".join(re.escape(f) for f in sorted(self.forms, key=len, reverse=True)))

    def find(self, data: bytes) -> list[str]:
        """Which forms of which values DATA holds (names and kinds, never the bytes)."""
        return sorted({self.forms[m.group(0)] for m in self._re.finditer(data)})


def decodings(body: bytes, ce: str | None) -> list[bytes]:
    """BODY as received and every way a server may decode it (mitmproxy's, and a
    whole-stream decoder: gzip members and zstd frames after the first count too)."""
    out = [body]
    if not ce or not body:
        return out
    try:
        out.append(encoding.decode(body, ce))
    except ValueError:
        pass
    ce = ce.strip().lower()
    try:
        if ce in ("gzip", "x-gzip"):
            out.append(gzip.decompress(body))
        elif ce == "deflate":
            d = zlib.decompressobj()
            out.append(d.decompress(body) + d.unused_data)
        elif ce == "br":
            out.append(brotli.decompress(body))
        elif ce == "zstd":
            out.append(zstd.decompress(body))
    except Exception:  # noqa: BLE001 - a strict decoder may refuse what mitmproxy read
        pass
    return out


# --- cases ----------------------------------------------------------------------------------------


@dataclass
class Case:
    id: int
    host: str
    transport: str
    location: str  # header | query | path | body (the message, for ws)
    header: str  # for location header
    form: str
    detail: str
    body_kind: str
    encoding: str
    name: str | None  # the value's secret name; None for a reference-only case
    ref: str  # none | github | anthropic
    method: str = "GET"
    path: str = "/"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    message: str = ""  # ws only
    sent_form: bytes = b""

    def describe(self) -> str:
        what = f"value={self.name} form={self.form}[{self.detail}]" if self.name else "reference only"
        where = f"header {self.header}" if self.location == "header" else self.location
        return (
            f"case {self.id}: {self.transport} {self.method} {self.host} in {where}, {what}, "
            f"body={self.body_kind}/{self.encoding}, ref={self.ref}"
        )

    @property
    def provider(self) -> bool:
        return self.host in PROVIDERS

    @property
    def bound_leak(self) -> bool:
        """The value sits in a header it is bound to for this host."""
        return self.name is not None and self.location == "header" and (self.host, self.name, self.header) in BINDINGS

    @property
    def ref_injected(self) -> bool:
        return self.ref != "none" and REF_HEADERS[self.ref][3] == self.host

    def expected(self) -> tuple[int | None, str | None]:
        """(status, block code) of the HTTP request (the WebSocket handshake for ws).

        (None, None): either forwarded without the value or blocked by keyveil,
        for a value in a header name toward a provider (its reference is no
        valid header name, so keyveil may refuse rather than seal).
        """
        if self.transport == "ws" and self.location == "body":
            value_in_request = False  # it is in the message, which comes later
        else:
            value_in_request = self.name is not None
        if value_in_request and not self.provider and not self.bound_leak:
            return 403, "plaintext_egress"
        if value_in_request and self.location == "header" and self.header == NAME_HEADER:
            return None, None  # (toward a provider: the other cases returned above)
        if self.ref != "none" and not self.provider and not self.ref_injected:
            return 403, "unbound_reference"
        return (101 if self.transport == "ws" else 200), None

    @property
    def ws_message_blocked(self) -> bool:
        return self.transport == "ws" and self.location == "body" and self.name is not None and not self.provider


class _Deck:
    """Draws options so that each comes up equally often (shuffled, then refilled)."""

    def __init__(self, rng: Random, options: tuple[str, ...]) -> None:
        self.rng, self.options, self.cards = rng, options, []

    def draw(self, allowed=None) -> str:
        if not self.cards:
            self.cards = list(self.options)
            self.rng.shuffle(self.cards)
        for i in range(len(self.cards) - 1, -1, -1):
            if allowed is None or allowed(self.cards[i]):
                return self.cards.pop(i)
        choices = [o for o in self.options if allowed(o)]
        return self.rng.choice(choices)


def encode_value(value: bytes, form: str, rng: Random) -> tuple[bytes, str]:
    """VALUE written in FORM, and a short description of the variant (no value in it)."""
    text = value.decode("utf-8")
    upper = rng.random() < 0.5
    hexcase = "upper" if upper else "lower"
    if form == "raw":
        return value, "-"
    if form in ("json_ascii", "json_utf8", "json_slash", "json_html"):
        ascii_only = form == "json_ascii" or (form in ("json_slash", "json_html") and rng.random() < 0.5)
        out = json.dumps(text, ensure_ascii=ascii_only)[1:-1]
        if form == "json_slash":
            out = out.replace("/", "\\/")
        if form == "json_html":
            out = _html_escape(out, upper)
        if upper:
            out = _upper_u_escapes(out)
        return out.encode(), f"ascii={ascii_only},{hexcase}"
    if form.startswith("pct_"):
        enc = {
            "pct_quote": lambda: quote(value),
            "pct_strict": lambda: quote(value, safe=""),
            "pct_plus": lambda: quote_plus(value),
            "pct_component": lambda: quote(value, safe="-_.!~*'()"),
        }[form]()
        return (enc if upper else _lower_hex(enc)).encode(), hexcase
    if form == "b64":
        prefix = rng.randbytes(rng.randrange(0, 12))
        suffix = rng.randbytes(rng.randrange(0, 9))
        urlsafe, padded = rng.random() < 0.5, rng.random() < 0.5
        run = base64.b64encode(prefix + value + suffix)
        if urlsafe:
            run = run.translate(bytes.maketrans(b"+/", b"-_"))
        if not padded:
            run = run.rstrip(b"=")
        return run, f"offset={len(prefix) % 3},{'url' if urlsafe else 'std'},{'pad' if padded else 'nopad'}"
    if form == "basic":
        user = "".join(rng.choice(_ALNUM) for _ in range(rng.randrange(0, 10)))
        return b"Basic " + base64.b64encode(user.encode() + b":" + value), f"offset={(len(user) + 1) % 3}"
    if form == "bearer":
        return b"Bearer " + value, "-"
    raise AssertionError(form)


def _filler(rng: Random) -> bytes:
    words = ("please", "fix", "the", "build", "env", "says", "token", "here:", "see", "log")
    return " ".join(rng.choice(words) for _ in range(rng.randrange(1, 5))).encode()


def build_body(kind: str, form: bytes, rng: Random) -> tuple[bytes, str]:
    """A body of KIND holding FORM verbatim (it is not escaped again), and its content type."""
    pre, post = _filler(rng), _filler(rng)
    if kind == "json":
        return (
            b'{"model":"m","messages":[{"role":"user","content":"' + pre + b" " + form + b" " + post + b'"}],"stream":true}',
            "application/json",
        )
    if kind == "form":
        return b"grant_type=x&note=" + form + b"&b=2", "application/x-www-form-urlencoded"
    if kind == "multipart":
        boundary = "kvb" + "".join(rng.choice(_ALNUM) for _ in range(16))
        b = boundary.encode()
        body = (
            b"--" + b + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n'
            b"--" + b + b'\r\nContent-Disposition: form-data; name="file"; filename=".env"\r\n'
            b"Content-Type: text/plain\r\n\r\n" + pre + b"\nTOKEN=" + form + b"\n" + post + b"\r\n"
            b"--" + b + b"--\r\n"
        )
        return body, f"multipart/form-data; boundary={boundary}"
    if kind == "text":
        return pre + b"\n" + form + b"\n" + post, "text/plain"
    if kind == "ndjson":
        return b'{"i":0}\n{"i":1,"text":"' + pre + b" " + form + b'"}\n{"i":2}\n', "application/x-ndjson"
    raise AssertionError(kind)


def generate(seed: int, n: int, values: dict[str, bytes]) -> list[Case]:
    rng = Random(f"cases-{seed}")
    decks = {
        "host": _Deck(rng, HOSTS),
        "transport": _Deck(rng, TRANSPORTS),
        "location": _Deck(rng, LOCATIONS),
        "header": _Deck(rng, HEADERS),
        "form": _Deck(rng, FORMS),
        "body_kind": _Deck(rng, BODY_KINDS),
        "encoding": _Deck(rng, ENCODINGS),
        "name": _Deck(rng, tuple(sorted(values))),
        "ref": _Deck(rng, REFS),
    }
    cases = []
    for i in range(n):
        host = decks["host"].draw()
        transport = decks["transport"].draw()
        location = decks["location"].draw((lambda loc: loc != "path") if transport == "ws" else None)
        ref_only = rng.random() < 0.08
        ref = decks["ref"].draw((lambda r: r != "none") if ref_only else None)
        name = None if ref_only else decks["name"].draw()
        header = decks["header"].draw() if location == "header" else ""
        if not ref_only and rng.random() < 0.05:
            # a value sent in the very header it is bound to: the one place it may arrive
            host, name, header = sorted(BINDINGS)[rng.randrange(len(BINDINGS))]
            location = "header"
        if location == "header" and ref != "none" and REF_HEADERS[ref][0] == header:
            ref = "none"  # one header, one purpose
        if ref_only and ref == "none":
            ref = "github"
        value = values[name] if name else b""

        def fits(form: str) -> bool:
            sample, _ = encode_value(value, form, Random(0))
            if location in ("query", "path"):
                return _URL_OK.fullmatch(sample) is not None
            if location == "header" and header == NAME_HEADER:
                # HTTP/2 lower-cases names, which would no longer be the value's form
                # (base64 is left out: '/' and '=' are no token characters)
                return transport != "h2" and form != "b64" and _TOKEN.fullmatch(sample) is not None
            if location == "header" and transport == "ws":
                return sample.isascii()
            return True

        if name and not any(fits(f) for f in FORMS):
            header = "x-note"
        form = decks["form"].draw(fits) if name else "-"
        sent, detail = encode_value(value, form, rng) if name else (b"", "-")
        kind = decks["body_kind"].draw() if location == "body" else "json"
        enc = decks["encoding"].draw() if location == "body" and transport != "ws" else "identity"
        case = Case(i, host, transport, location, header, form, detail, kind, enc, name, ref, sent_form=sent)
        _assemble(case, rng)
        cases.append(case)
    return cases


def _assemble(case: Case, rng: Random) -> None:
    """Turn the case's dimensions into a concrete request (or WebSocket handshake + message)."""
    sent = case.sent_form
    has = case.name is not None
    path = "/ws" if case.transport == "ws" else BASE_PATH[case.host]
    query = [b"case=%d" % case.id]
    if has and case.location == "path":
        path = path + "/" + sent.decode("latin-1")
    if has and case.location == "query":
        query.append(rng.choice((b"q=", b"token=", b"input=")) + sent)
    case.path = path + "?" + b"&".join(query).decode("latin-1")
    headers = [(CASE_HEADER.encode(), str(case.id).encode())]
    if has and case.location == "header":
        if case.header == NAME_HEADER:
            headers.append((sent, b"1"))
        elif case.header == "cookie":
            v = b"theme=dark; session=" + sent
        elif case.header == "authorization" and case.form not in ("basic", "bearer"):
            v = b"Bearer " + sent
        else:
            v = sent
        if case.header != NAME_HEADER:
            headers.append((case.header.encode(), v))
    if case.ref != "none":
        h, v, _, _ = REF_HEADERS[case.ref]
        headers.append((h.encode(), v.encode()))
    if case.location == "body" and has:
        body, ctype = build_body(case.body_kind, sent, rng)
    else:
        body, ctype = (b'{"model":"m","input":"hello"}', "application/json") if rng.random() < 0.5 else (b"", "")
    if case.transport == "ws":
        case.message = (body or b"hello").decode("utf-8")
        case.method = "GET"
    else:
        if body:
            headers.append((b"content-type", ctype.encode()))
            if case.encoding != "identity":
                body = encoding.encode(body, case.encoding)
                headers.append((b"content-encoding", case.encoding.encode()))
        case.body = body
        case.method = "POST" if body else rng.choice(("GET", "DELETE", "POST"))
    case.headers = headers


# --- sending ----------------------------------------------------------------------------------------


@dataclass
class Result:
    status: int | None = None
    code: str | None = None
    response: bytes = b""  # headers and body the client received
    ws_echo: str | None = None
    ws_closed: bool = False
    ws_silent: bool = False  # neither an answer nor a close within the wait
    error: str | None = None


class Sender:
    """Sends cases through the proxy from many threads; one pair of clients per thread."""

    def __init__(self, proxy) -> None:
        self.proxy = proxy
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()

    def _client(self, http2: bool) -> httpx.Client:
        key = "h2" if http2 else "h1"
        c = getattr(self._local, key, None)
        if c is None:
            verify = infra.client_ssl_context(self.proxy.ca_cert, h2_first=http2)
            c = httpx.Client(proxy=self.proxy.url, verify=verify, http2=http2, trust_env=False, timeout=30)
            setattr(self._local, key, c)
            with self._lock:
                self._clients.append(c)
        return c

    def close(self) -> None:
        for c in self._clients:
            c.close()

    def send(self, case: Case) -> Result:
        try:
            if case.transport == "ws":
                return self._ws(case)
            return self._http(case)
        except Exception as e:  # noqa: BLE001 - judged by the oracle
            return Result(error=f"{type(e).__name__}")

    def _http(self, case: Case) -> Result:
        c = self._client(case.transport == "h2")
        r = c.request(case.method, f"https://{case.host}{case.path}", headers=case.headers, content=case.body or None)
        if case.transport == "h2" and r.http_version != "HTTP/2":
            return Result(error=f"expected HTTP/2, got {r.http_version}")
        raw_headers = b"".join(k + b": " + v + b"\n" for k, v in r.headers.raw)
        return Result(r.status_code, r.headers.get("x-keyveil-block"), raw_headers + r.content)

    def _ws(self, case: Case) -> Result:
        ctx = infra.client_ssl_context(self.proxy.ca_cert)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in case.headers]
        try:
            ws = websockets.sync.client.connect(
                f"wss://{case.host}{case.path}",
                proxy=self.proxy.url,
                ssl=ctx,
                open_timeout=15,
                close_timeout=3,
                additional_headers=headers,
            )
        except websockets.exceptions.InvalidStatus as e:
            resp = e.response
            raw = b"".join(k.encode("latin-1") + b": " + v.encode("latin-1") + b"\n" for k, v in resp.headers.raw_items())
            return Result(resp.status_code, resp.headers.get("x-keyveil-block"), raw + (resp.body or b""))
        result = Result(101)
        with ws:
            try:
                ws.send(case.message)
                # A blocked message must end the connection promptly; do not wait long for it.
                result.ws_echo = ws.recv(timeout=3 if case.ws_message_blocked else 15)
            except websockets.exceptions.ConnectionClosed:
                result.ws_closed = True
            except TimeoutError:
                result.ws_silent = True
        return result


# --- judging ------------------------------------------------------------------------------------------


def _has_reference(data: bytes, name: str) -> bool:
    ref = ("{{secret:" + name + "}}").encode()
    written = (ref, ref.replace(b"/", b"\\/"), quote(ref, safe="").encode(), _lower_hex(quote(ref, safe="")).encode())
    return any(v in data for v in written)  # as the carrier wrote the value: `\/` kept


def judge(case: Case, res: Result, recs: list, ws_msgs: list, det: Detector) -> list[str]:
    """Everything wrong with one case, as messages that hold no value (nor the case's description)."""
    bad: list[str] = []
    say = bad.append
    status, code = case.expected()
    if res.error:
        say(f"client error {res.error} (expected {status} {code or ''})")
        return bad
    if status is None:  # forwarded without the value, or blocked by keyveil: either is fine
        status, code = (res.status, res.code) if res.code else (101 if case.transport == "ws" else 200, None)
    if res.status != status or res.code != code:
        say(f"got {res.status} {res.code}, expected {status} {code}")
    if leaked := det.find(res.response):
        say(f"the client received {leaked} in a response (I3)")
    if status >= 400:
        if recs:
            say(f"blocked, yet {len(recs)} request(s) reached the upstream")
        return bad
    if len(recs) != 1:
        say(f"{len(recs)} request(s) reached the upstream, expected 1")
        return bad
    rec = recs[0]
    allowed: dict[str, str] = {}
    if case.bound_leak:
        allowed[case.header] = "bound"
    if case.ref != "none":
        allowed[REF_HEADERS[case.ref][0]] = "ref"
    if leaked := det.find(rec.path.encode("latin-1")):
        say(f"the upstream received {leaked} in the request target")
    for k, v in rec.headers:
        role = allowed.get(k.decode("latin-1").lower())
        if role == "ref":
            h, sent_ref, name, _ = REF_HEADERS[case.ref]
            want = (sent_ref.replace("{{secret:" + name + "}}", det.values[name].decode())
                    if case.ref_injected else sent_ref)
            if v.decode("latin-1") != want:
                what = "the injected value" if case.ref_injected else "the reference untouched (not bound here)"
                say(f"header {h} should carry {what}")
            continue
        if role == "bound":
            sent = dict(case.headers)[k.lower()]
            if v != sent and det.find(v):
                say(f"header {case.header} carries the bound value, but not as sent")
            continue
        if leaked := det.find(k + b": " + v):
            where = "the name of a header" if det.find(k) else f"header {k.decode('latin-1')}"
            say(f"the upstream received {leaked} in {where}")
    ce = rec.header("content-encoding")
    for body in decodings(rec.body, ce):
        if leaked := det.find(body):
            say(f"the upstream received {leaked} in the body (content-encoding {ce})")
            break
    sealed_text = (
        case.provider and case.name and case.form not in ("b64", "basic") and not case.bound_leak
        and case.header != NAME_HEADER
    )
    if sealed_text and not (case.transport == "ws" and case.location == "body"):
        where = rec.path.encode("latin-1") + b"".join(k + b": " + v + b"\n" for k, v in rec.headers)
        if not _has_reference(where + b"".join(decodings(rec.body, ce)), case.name):
            say("forwarded, but the reference that should replace the value is missing")
    if case.transport == "ws":
        if case.ws_message_blocked:
            if ws_msgs:
                say("a blocked WebSocket message reached the upstream")
            if res.ws_silent:
                say("the WebSocket message was dropped, but the connection stayed open and silent (no close, no error)")
            elif not res.ws_closed:
                say("a WebSocket message with a value was not blocked")
        else:
            if len(ws_msgs) != 1:
                say(f"{len(ws_msgs)} WebSocket message(s) reached the upstream, expected 1")
            for m in ws_msgs:
                data = m.data.encode() if isinstance(m.data, str) else m.data
                if leaked := det.find(data):
                    say(f"the upstream received {leaked} in a WebSocket message")
                elif sealed_text and case.location == "body" and not _has_reference(data, case.name):
                    say("a WebSocket message was forwarded without the reference that replaces the value")
            if res.ws_echo is None:
                say("no WebSocket echo came back")
            elif leaked := det.find(res.ws_echo.encode()):
                say(f"the client received {leaked} in a WebSocket message (I3)")
    return bad


def strip_allowed(wire: bytes, allowed_lines: Counter[bytes]) -> bytes:
    """Remove header lines the oracle allowed (a bound value in its own header), each as often as seen."""
    for line, n in allowed_lines.items():
        wire = wire.replace(line, b"", n)
    return wire


@dataclass
class Report:
    seed: int
    cases: int = 0
    failures: list[str] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)  # failures by transport, location and message
    counts: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in (
        "host", "transport", "location", "header", "form", "form variant", "body kind", "encoding",
        "value", "ref", "outcome")})

    def add(self, case: Case, res: Result) -> None:
        self.cases += 1
        c = self.counts
        c["host"][case.host] += 1
        c["transport"][case.transport] += 1
        c["location"][case.location] += 1
        if case.location == "header":
            c["header"][case.header] += 1
        c["form"][case.form] += 1
        if case.form == "b64":
            c["form variant"]["b64 " + case.detail] += 1
        elif case.form == "basic":
            c["form variant"]["basic " + case.detail] += 1
        if case.location == "body":
            c["body kind"][case.body_kind] += 1
            c["encoding"][case.encoding] += 1
        c["value"][case.name or "(reference only)"] += 1
        c["ref"][case.ref] += 1
        ws = " ws-closed" if res.ws_closed else " ws-silent" if res.ws_silent else ""
        c["outcome"][f"{res.status} {res.code or ''}".strip() + ws + (f" error {res.error}" if res.error else "")] += 1

    def render(self) -> str:
        lines = [f"leak corpus: seed {self.seed} ({SEED_ENV}={self.seed}), {self.cases} cases, {len(self.failures)} failures"]
        for dim, counter in self.counts.items():
            parts = ", ".join(f"{k}={v}" for k, v in sorted(counter.items()))
            lines.append(f"  {dim}: {parts}")
        if self.kinds:
            lines.append("  failures by kind:")
            lines += [f"    {n:5d}  {kind}" for kind, n in self.kinds.most_common()]
        return "\n".join(lines)


def run(proxy, up, values: dict[str, bytes], cases: list[Case], report: Report, workers: int = 12, batch: int = 400) -> None:
    """Send CASES through PROXY in batches, judge each, and grep everything the upstream got."""
    det = Detector(values)
    sender = Sender(proxy)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for start in range(0, len(cases), batch):
                chunk = cases[start : start + batch]
                for case in chunk:  # the oracle must be able to see what each case sends
                    if case.name and not det.find(case.sent_form):
                        report.failures.append(f"{case.describe()}: the detector misses the sent form (test bug)")
                results = list(pool.map(sender.send, chunk))
                _judge_batch(up, chunk, results, det, report)
    finally:
        sender.close()


def _judge_batch(up, chunk: list[Case], results: list[Result], det: Detector, report: Report) -> None:
    by_case: dict[int, list] = {}
    for rec in up.requests:
        cid = rec.header(CASE_HEADER)
        by_case.setdefault(int(cid) if cid and cid.isdigit() else -1, []).append(rec)
    ws_by_case: dict[int, list] = {}
    for m in up.ws_messages:
        if m.direction == "client":
            cid = re.search(r"[?&]case=(\d+)", m.path)
            ws_by_case.setdefault(int(cid.group(1)) if cid else -1, []).append(m)
    if -1 in by_case or -1 in ws_by_case:
        report.failures.append("the upstream received requests that belong to no case")
    allowed = Counter()
    for case, res in zip(chunk, results, strict=True):
        recs = by_case.get(case.id, [])
        for msg in judge(case, res, recs, ws_by_case.get(case.id, []), det):
            report.failures.append(f"{case.describe()}: {msg}")
            report.kinds[f"{case.transport} {case.location}: {re.sub(r'\b[0-9]+\b', 'N', msg)}"] += 1
        report.add(case, res)
        for rec in recs:
            names = set()
            if case.bound_leak:
                names.add(case.header)
            if case.ref_injected:
                names.add(REF_HEADERS[case.ref][0])
            for k, v in rec.headers:
                if k.decode("latin-1").lower() in names:
                    allowed[k + b": " + v + b"\r\n"] += 1
    if leaked := det.find(strip_allowed(up.all_bytes(), allowed)):
        report.failures.append(
            f"cases {chunk[0].id}..{chunk[-1].id}: the upstream's wire holds {leaked} outside any bound header"
        )
        report.kinds[f"wire: the upstream's wire holds {leaked} outside any bound header"] += 1
    errors = up.errors
    for e in errors:
        report.failures.append(f"upstream error: {e}")
        report.kinds["upstream error"] += 1
    up.clear()
