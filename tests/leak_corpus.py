"""A seeded generator of leak cases, the client that sends them, and the oracle's verdict.

Each case puts one registered value, in one form (SPEC §3), in one location
of one request (header, query, path, body or WebSocket message) to one
destination (a provider, a bound host, an unbound host), over HTTP/1.1,
HTTP/2 or WebSocket, with a body kind and a content encoding. Some cases also
carry a reference in an auth header, some carry only a reference, and some
carry a decoy instead of a value: a near miss of a value (one character
changed or dropped) or a reference, in the same forms, which must reach a
non-provider host unchanged (no over-blocking).

Forms come from tests/stdlib_forms.py: standard-library encoders composed in
chains of up to two layers (``pct(b64)`` is percent-encoded base64), with
random valid choices. What the upstream receives is judged by
tests/stdlib_oracle.py, which decodes it with the standard library three
layers deep; neither knows anything of keyveil's code, so an encoding keyveil
does not decode is a failure, not a blind spot. The expected outcome of each
case comes from the bindings of ``RULES`` alone. When a provider receives a
sealed value, the form must still decode, layer by layer, to what it held
with the value replaced by its reference (SPEC §3, last paragraphs).

Everything is derived from one seed (``KEYVEIL_CORPUS_SEED``, printed by the
tests), the fake values included: a failing case is reproduced by its seed and
its number (``KEYVEIL_CORPUS_CASES=12,57`` runs only those). The default seed
is drawn from ``secrets``, so every run has fresh fake values.
"""

from __future__ import annotations

import gzip
import os
import re
import secrets
import string
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from random import Random

import brotli
import httpx
import websockets.exceptions
from mitmproxy.net import encoding

from tests import infra
from tests.infra import wsclient
from tests import stdlib_forms as sf
from tests.conftest import KeyveilSetup, keyveil, make_home
from tests.stdlib_oracle import Oracle, check_round_trip, split_carrier

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
#: Forms: every chain of stdlib_forms (``raw``, ``json``, ``b64(pct)`` ...), plus Bearer and Basic schemes.
CHAIN_OF = {sf.chain_label(c): c for c in sf.CHAINS}
FORMS = ("raw", "bearer", "basic") + tuple(label for label in CHAIN_OF if label != "raw")
NAME_HEADER = "(name)"  # the value is the header's name, not its value
HEADERS = ("x-note", "authorization", "cookie", "x-api-key", "x-debug-token", NAME_HEADER)
REFS = ("none", "github", "anthropic")
DECOYS = ("none", "near", "ref")
CASE_HEADER = "x-kv-case"
QUERY_PARAMS = (b"q=", b"token=", b"input=")

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
#: Forms a client sends a value in, in the header it is bound to
BOUND_FORMS = {"authorization": ("raw", "bearer", "basic"), "x-api-key": ("raw",)}
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


def reference(name: str) -> bytes:
    return b"{{secret:" + name.encode() + b"}}"


# --- values ---------------------------------------------------------------------------------


def make_values(seed: int) -> dict[str, bytes]:
    """Fake values for one run: token shapes, URL/JSON metacharacters, non-ASCII and astral letters."""
    rng = Random(f"values-{seed}")

    def pick(alphabet: str, n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    return {
        "github/pat": ("ghp_" + pick(_URLSAFE, 36)).encode(),
        "anthropic/key": ("sk-ant-api03-" + pick(_URLSAFE, 40)).encode(),
        "gitlab/token": ("glpat/" + pick(_URLSAFE, 20) + "+=&").encode(),  # URL and form metacharacters
        "corpus/alnum": pick(_ALNUM, 32).encode(),
        "corpus/punct": ('kv"' + pick(_ALNUM, 10) + ' <a&b> /+=%\\ ' + pick(_ALNUM, 10)).encode(),
        "corpus/utf8": ("kv\u00e9-" + pick(_ALNUM, 12) + "-\u20ac\\" + pick(_ALNUM, 6) + "\U0001f511z").encode(),
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
    form: str  # a FORMS label
    detail: str  # the form's choices, outermost first (no value in it)
    body_kind: str
    encoding: str
    name: str | None  # the value's secret name; None for a case without a value
    ref: str  # none | github | anthropic
    decoy: str = "none"  # none | near | ref: a decoy in the location instead of a value
    decoy_of: str | None = None  # the secret the decoy imitates
    generated: sf.Form | None = None  # the generator's form (layers, choices)
    method: str = "GET"
    path: str = "/"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    message: str = ""  # ws only
    sent_form: bytes = b""  # scheme prefix + the form's bytes, as put in the location
    #: what surrounds sent_form in its location element (path, header value, decoded body, message)
    carrier: tuple[bytes, bytes] = (b"", b"")
    prefix: bytes = b""  # "Bearer " / "Basic " in front of the form's bytes

    def describe(self) -> str:
        if self.name:
            what = f"value={self.name} form={self.form}[{self.detail}]"
        elif self.decoy != "none":
            what = f"decoy={self.decoy} of {self.decoy_of} form={self.form}[{self.detail}]"
        else:
            what = "reference only"
        where = f"header {self.header}" if self.location == "header" else self.location
        return (
            f"case {self.id}: {self.transport} {self.method} {self.host} in {where}, {what}, "
            f"body={self.body_kind}/{self.encoding}, ref={self.ref}"
        )

    @property
    def provider(self) -> bool:
        return self.host in PROVIDERS

    @property
    def carries(self) -> bool:
        """Something (a value or a decoy) is placed in the case's location."""
        return self.name is not None or self.decoy != "none"

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

    @property
    def sealed_in_place(self) -> bool:
        """A provider receives this case's value sealed where it was: its form must round-trip."""
        return (
            self.name is not None and self.provider and not self.bound_leak
            and not (self.location == "header" and self.header == NAME_HEADER)
        )


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


def make_case_form(value: bytes, label: str, rng: Random, location: str, body_kind: str) -> tuple[sf.Form, bytes]:
    """VALUE in the form LABEL, for LOCATION: (the generator's form, the scheme prefix put before it)."""
    if label in ("raw", "bearer"):
        return sf.make_form(value, (), rng), b"Bearer " if label == "bearer" else b""
    if label == "basic":
        user = "".join(rng.choice(_ALNUM) for _ in range(rng.randrange(0, 10))).encode()
        style = dict(urlsafe=False, padded=True, width=0)  # RFC 7617
        return sf.make_form(value, ("b64",), rng, text_slot=(user + b":", b""), b64_style=style), b"Basic "
    if location in ("query", "path"):
        outer_slot = location
    elif location == "body" and body_kind == "form":
        outer_slot = "form"
    else:
        outer_slot = None
    one_line = location in ("header", "query", "path")
    return sf.make_form(value, CHAIN_OF[label], rng, outer_slot=outer_slot, one_line=one_line), b""


def fits(sent: bytes, location: str, header: str, transport: str) -> bool:
    """SENT can travel in LOCATION as it is (no client would re-encode or refuse it)."""
    if location in ("query", "path"):
        return _URL_OK.fullmatch(sent) is not None
    if location == "header":
        if any(c in sent for c in b"\r\n\0") or sent != sent.strip():
            return False
        if header == NAME_HEADER:
            # HTTP/2 lower-cases names, which would no longer be the value's form
            return transport != "h2" and _TOKEN.fullmatch(sent) is not None
        if transport == "ws":
            return sent.isascii()
    return True


def _fitting_form(value, label, rng, location, header, transport, body_kind, tries=24):
    for _ in range(tries):
        form, prefix = make_case_form(value, label, rng, location, body_kind)
        if fits(prefix + form.data, location, header, transport):
            return form, prefix
    return None


def _filler(rng: Random) -> bytes:
    words = ("please", "fix", "the", "build", "env", "says", "token", "here:", "see", "log")
    return " ".join(rng.choice(words) for _ in range(rng.randrange(1, 5))).encode()


def build_body(kind: str, form: bytes, rng: Random) -> tuple[bytes, str, tuple[bytes, bytes]]:
    """A body of KIND holding FORM verbatim (it is not escaped again), its content type, and FORM's carrier."""
    pre, post = _filler(rng), _filler(rng)
    if kind == "json":
        before = b'{"model":"m","messages":[{"role":"user","content":"' + pre + b" "
        after = b" " + post + b'"}],"stream":true}'
        ctype = "application/json"
    elif kind == "form":
        before, after, ctype = b"grant_type=x&note=", b"&b=2", "application/x-www-form-urlencoded"
    elif kind == "multipart":
        boundary = "kvb" + "".join(rng.choice(_ALNUM) for _ in range(16))
        b = boundary.encode()
        before = (
            b"--" + b + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n'
            b"--" + b + b'\r\nContent-Disposition: form-data; name="file"; filename=".env"\r\n'
            b"Content-Type: text/plain\r\n\r\n" + pre + b"\nTOKEN="
        )
        after = b"\n" + post + b"\r\n--" + b + b"--\r\n"
        ctype = f"multipart/form-data; boundary={boundary}"
    elif kind == "text":
        before, after, ctype = pre + b"\n", b"\n" + post, "text/plain"
    elif kind == "ndjson":
        before, after, ctype = b'{"i":0}\n{"i":1,"text":"' + pre + b" ", b'"}\n{"i":2}\n', "application/x-ndjson"
    else:
        raise AssertionError(kind)
    return before + form + after, ctype, (before, after)


def generate(seed: int, n: int, values: dict[str, bytes]) -> list[Case]:
    rng = Random(f"cases-{seed}")
    oracle = Oracle(values)
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
        "decoy": _Deck(rng, DECOYS[1:]),
    }
    fit_cache: dict[tuple, bool] = {}
    cases = []
    for i in range(n):
        host = decks["host"].draw()
        transport = decks["transport"].draw()
        location = decks["location"].draw((lambda loc: loc != "path") if transport == "ws" else None)
        ref_only = rng.random() < 0.08
        ref = decks["ref"].draw((lambda r: r != "none") if ref_only else None)
        decoy = "none"
        if not ref_only and host not in PROVIDERS and rng.random() < 0.4:
            decoy = decks["decoy"].draw()
        name = None if ref_only or decoy != "none" else decks["name"].draw()
        decoy_of = decks["name"].draw() if decoy != "none" else None
        header = decks["header"].draw() if location == "header" else ""
        bound = False
        if name and rng.random() < 0.05:
            # a value sent in the very header it is bound to: the one place it may arrive
            host, name, header = sorted(BINDINGS)[rng.randrange(len(BINDINGS))]
            location, bound = "header", True
        if decoy == "ref" and location == "header":
            header = "x-note"  # a reference in an auth header is another matter (REFS)
        # however it was drawn: a value in a header it is bound to comes as a client sends it there
        bound = bound or (location == "header" and (host, name, header) in BINDINGS)
        if location == "header" and ref != "none" and REF_HEADERS[ref][0] == header:
            ref = "none"  # one header, one purpose
        if ref_only and ref == "none":
            ref = "github"
        kind = decks["body_kind"].draw() if location == "body" else "json"
        if name:
            value = values[name]
        elif decoy == "near":
            value = sf.near_miss(values[decoy_of], rng)
        elif decoy == "ref":
            value = reference(decoy_of)
        else:
            value = b""

        def can_fit(label: str) -> bool:
            if bound and label not in BOUND_FORMS[header]:
                return False
            key = (name or decoy, decoy_of, label, location, header, transport, kind)
            if key not in fit_cache:
                probe = Random(f"fit-{seed}-{key}")
                fit_cache[key] = _fitting_form(value, label, probe, location, header, transport, kind, tries=8) is not None
            return fit_cache[key]

        if value and not any(can_fit(f) for f in FORMS):
            header = "x-note"
        form_label, made, attempts = "-", None, 0
        while value and made is None:
            attempts += 1
            assert attempts < 50, f"case {i}: no form of the value fits its location (test bug)"
            form_label = decks["form"].draw(can_fit)
            made = _fitting_form(value, form_label, rng, location, header, transport, kind)
            if made and decoy != "none" and _spells_value(oracle, made[1] + made[0].data):
                made = None  # the near miss and its slot (or what stands around it) spelled a value after all: not a decoy
            if made and decoy == "ref" and location == "query" and b"&" in made[0].data:
                made = None  # its own parameters (client_secret=...) would put the reference in an auth position
        generated, prefix = made if made else (None, b"")
        sent = prefix + generated.data if generated else b""
        enc = decks["encoding"].draw() if location == "body" and transport != "ws" else "identity"
        detail = generated.describe() if generated else "-"
        case = Case(i, host, transport, location, header, form_label, detail, kind, enc, name, ref,
                    decoy=decoy, decoy_of=decoy_of, generated=generated, sent_form=sent, prefix=prefix)
        _assemble(case, rng)
        cases.append(case)
    return cases


#: What may stand right before and after a form in its location (build_body, _assemble):
#: a near miss that these complete to a value is no decoy.
_BEFORE = (b"", b"=", b" ", b"/", b"TOKEN=", b"note=", b"session=")
_AFTER = (b"", b"&", b"&b=2", b"\n", b" ", b"?", b'"', b"\r\n")


def _spells_value(oracle: Oracle, sent: bytes) -> bool:
    return any(oracle.find(before + sent + after) for before in _BEFORE for after in _AFTER)


def _assemble(case: Case, rng: Random) -> None:
    """Turn the case's dimensions into a concrete request (or WebSocket handshake + message)."""
    sent = case.sent_form
    has = case.carries
    path = "/ws" if case.transport == "ws" else BASE_PATH[case.host]
    query = [b"case=%d" % case.id]
    if has and case.location == "query":
        params = QUERY_PARAMS[::2] if case.decoy == "ref" else QUERY_PARAMS  # 'token=' is an auth position
        param = rng.choice(params)
        query.append(param + sent)
        case.carrier = ((path + "?").encode() + query[0] + b"&" + param, b"")
    qs = b"&".join(query).decode("latin-1")
    if has and case.location == "path":
        case.carrier = ((path + "/").encode(), ("?" + qs).encode())
        path = path + "/" + sent.decode("latin-1")
    case.path = path + "?" + qs
    headers = [(CASE_HEADER.encode(), str(case.id).encode())]
    if has and case.location == "header":
        if case.header == NAME_HEADER:
            headers.append((sent, b"1"))
        else:
            if case.header == "cookie":
                head = b"theme=dark; session="
            elif case.header == "authorization" and case.form not in ("basic", "bearer"):
                head = b"Bearer "
            else:
                head = b""
            headers.append((case.header.encode(), head + sent))
            case.carrier = (head, b"")
    if case.ref != "none":
        h, v, _, _ = REF_HEADERS[case.ref]
        headers.append((h.encode(), v.encode()))
    if case.location == "body" and has:
        body, ctype, case.carrier = build_body(case.body_kind, sent, rng)
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
    # the carrier now holds everything around the form's own bytes, scheme prefix included
    case.carrier = (case.carrier[0] + case.prefix, case.carrier[1])


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
            ws = wsclient.connect(
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


def _element(case: Case, rec, ws_msgs: list) -> bytes | None:
    """The bytes of the case's location as the upstream received them (a body content-decoded)."""
    if case.location == "body" and case.transport == "ws":
        return _ws_bytes(ws_msgs[0]) if len(ws_msgs) == 1 else None
    if rec is None:
        return None
    if case.location in ("query", "path"):
        return rec.path.encode("latin-1")
    if case.location == "header" and case.header == NAME_HEADER:
        names = [k for k, _ in rec.headers if k.lower() == case.sent_form.lower()]
        return names[0] if len(names) == 1 else None
    if case.location == "header":
        key = case.header.encode()
        found = [v for k, v in rec.headers if k.lower() == key]
        if case.header == "cookie":  # HTTP/2 may carry a cookie in several fields
            return b"; ".join(found) if found else None
        return found[0] if len(found) == 1 else None
    ce = rec.header("content-encoding")
    if not ce:
        return rec.body
    try:
        return encoding.decode(rec.body, ce)
    except ValueError:
        return None


def _ws_bytes(m) -> bytes:
    return m.data.encode() if isinstance(m.data, str) else m.data


def _sent_element(case: Case) -> bytes:
    """The bytes of the case's location as the client sent them."""
    if case.location == "body":
        return case.message.encode() if case.transport == "ws" else case.body
    if case.location in ("query", "path"):
        return case.path.encode("latin-1")
    if case.header == NAME_HEADER:
        return case.sent_form
    return dict((k, v) for k, v in case.headers)[case.header.encode()]


def judge(case: Case, res: Result, recs: list, ws_msgs: list, oracle: Oracle) -> list[str]:
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
        over = " (over-blocking: the request holds no value)" if case.name is None and res.code else ""
        say(f"got {res.status} {res.code}, expected {status} {code}{over}")
    # (where, bytes) to decode: judged at once, and one by one only when something is found
    exposed: list[tuple[str, bytes]] = [("the client received {} in a response (I3)", res.response)]
    if status >= 400:
        if recs:
            say(f"blocked, yet {len(recs)} request(s) reached the upstream")
            for rec in recs:  # say what they delivered
                exposed.append(("the upstream received {} in the request target", rec.path.encode("latin-1")))
                exposed += [("the upstream received {} in a header", k + b": " + v) for k, v in rec.headers]
                exposed += [("the upstream received {} in the body", b) for b in decodings(rec.body, rec.header("content-encoding"))]
        return bad + _leaks(oracle, exposed)
    if len(recs) != 1:
        say(f"{len(recs)} request(s) reached the upstream, expected 1")
        return bad + _leaks(oracle, exposed)
    rec = recs[0]
    allowed: dict[str, str] = {}
    if case.bound_leak:
        allowed[case.header] = "bound"
    if case.ref != "none":
        allowed[REF_HEADERS[case.ref][0]] = "ref"
    exposed.append(("the upstream received {} in the request target", rec.path.encode("latin-1")))
    for k, v in rec.headers:
        role = allowed.get(k.decode("latin-1").lower())
        if role == "ref":
            h, sent_ref, name, _ = REF_HEADERS[case.ref]
            want = (sent_ref.replace("{{secret:" + name + "}}", oracle_value(oracle, name).decode())
                    if case.ref_injected else sent_ref)
            if v.decode("latin-1") != want:
                what = "the injected value" if case.ref_injected else "the reference untouched (not bound here)"
                say(f"header {h} should carry {what}")
            continue
        if role == "bound":
            if v != dict(case.headers)[k.lower()]:
                say(f"header {case.header} carries its bound value, but not as sent")
            continue
        exposed.append(("the upstream received {} in the name of a header", k))
        exposed.append((f"the upstream received {{}} in header {k.decode('latin-1')}", v))
    ce = rec.header("content-encoding")
    for body in decodings(rec.body, ce):
        exposed.append((f"the upstream received {{}} in the body (content-encoding {ce})", body))
    if case.transport == "ws":
        if case.ws_message_blocked:
            if ws_msgs:
                say("a blocked WebSocket message reached the upstream")
                exposed += [("the upstream received {} in a WebSocket message", _ws_bytes(m)) for m in ws_msgs]
            if res.ws_silent:
                say("the WebSocket message was dropped, but the connection stayed open and silent (no close, no error)")
            elif not res.ws_closed:
                say("a WebSocket message with a value was not blocked")
        else:
            if len(ws_msgs) != 1:
                say(f"{len(ws_msgs)} WebSocket message(s) reached the upstream, expected 1")
            for m in ws_msgs:
                exposed.append(("the upstream received {} in a WebSocket message", _ws_bytes(m)))
            if res.ws_echo is None:
                say("no WebSocket echo came back")
            else:
                exposed.append(("the client received {} in a WebSocket message (I3)", res.ws_echo.encode()))
    bad += _leaks(oracle, exposed)
    if bad:
        return bad
    got = _element(case, rec, ws_msgs)
    if case.name is None:
        # no value: nothing may change, a decoy (near miss, encoded reference) included
        if case.transport != "ws" and case.body and rec.body != case.body:
            say(f"a body holding no value was not forwarded byte for byte ({case.decoy} decoy)")
        if case.carries and not (case.location == "body" and case.transport != "ws") and got != _sent_element(case):
            say(f"a {case.decoy} decoy holding no value was changed on its way (over-sealing)")
    if case.sealed_in_place and case.generated is not None:
        span = split_carrier(got, *case.carrier) if got is not None else None
        if span is None:
            say("the text around the sealed value changed")
        else:
            for p in check_round_trip(case.generated, span, reference(case.name), url=_percent_layer(case)):
                say(f"sealed form does not round-trip: {p}")
    return bad


def _leaks(oracle: Oracle, exposed: list[tuple[str, bytes]]) -> list[str]:
    """A message for each place that holds a recoverable value (NUL keeps places apart when decoded at once)."""
    if not oracle.find(b"\0".join(data for _, data in exposed)):
        return []
    out: list[str] = []
    for where, data in exposed:
        if (leaked := oracle.find(data)) and where.format(leaked) not in out:
            out.append(where.format(leaked))
    return out


def oracle_value(oracle: Oracle, name: str) -> bytes:
    return next(v for n, v in oracle.needles if n == name)


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
    failed_forms: Counter[str] = field(default_factory=Counter)  # failing cases by form label
    failed_layers: Counter[str] = field(default_factory=Counter)  # failing cases by layer choice
    layers: Counter[str] = field(default_factory=Counter)
    seconds: Counter[str] = field(default_factory=Counter)  # wall time spent sending, judging
    counts: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in (
        "host", "transport", "location", "header", "form", "body kind", "encoding",
        "value", "ref", "decoy", "outcome")})

    def add(self, case: Case, res: Result, failed: bool) -> None:
        self.cases += 1
        c = self.counts
        c["host"][case.host] += 1
        c["transport"][case.transport] += 1
        c["location"][case.location] += 1
        if case.location == "header":
            c["header"][case.header] += 1
        c["form"][case.form] += 1
        if case.location == "body":
            c["body kind"][case.body_kind] += 1
            c["encoding"][case.encoding] += 1
        c["value"][case.name or ("(decoy)" if case.decoy != "none" else "(reference only)")] += 1
        c["ref"][case.ref] += 1
        c["decoy"][case.decoy] += 1
        ws = " ws-closed" if res.ws_closed else " ws-silent" if res.ws_silent else ""
        c["outcome"][f"{res.status} {res.code or ''}".strip() + ws + (f" error {res.error}" if res.error else "")] += 1
        for key in _layer_keys(case):
            self.layers[key] += 1
            if failed:
                self.failed_layers[key] += 1
        if failed:
            self.failed_forms[case.form + (" (decoy)" if case.decoy != "none" else "")] += 1

    def render(self, kinds: bool = True) -> str:
        lines = [f"leak corpus: seed {self.seed} ({SEED_ENV}={self.seed}), {self.cases} cases, {len(self.failures)} failures"]
        for dim, counter in self.counts.items():
            parts = ", ".join(f"{k}={v}" for k, v in sorted(counter.items()))
            lines.append(f"  {dim}: {parts}")
        lines.append("  layer choices: " + ", ".join(f"{k}={v}" for k, v in sorted(self.layers.items())))
        if self.failed_forms:
            forms = self.counts["form"]
            lines.append(f"  failing cases: {sum(self.failed_forms.values())} of {self.cases}")
            lines.append("  failing cases by form: " + ", ".join(
                f"{k}={v}/{forms.get(k.removesuffix(' (decoy)'), v)}" for k, v in self.failed_forms.most_common()))
            lines.append("  failing cases by layer choice: " + ", ".join(
                f"{k}={v}/{self.layers[k]}" for k, v in self.failed_layers.most_common()))
        if self.seconds:
            lines.append("  wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        if kinds and self.kinds:
            lines.append("  failures by kind:")
            lines += [f"    {n:5d}  {kind}" for kind, n in self.kinds.most_common()]
        return "\n".join(lines)


def _layer_keys(case: Case) -> list[str]:
    """Coarse names of the choices a case's form made (``json:u-escapes``, ``pct:mixed-case`` ...)."""
    if case.generated is None:
        return []
    keys = []
    for layer in case.generated.layers:
        if layer.kind == "json":
            keys.append("json:u-escapes" if any(n.startswith("u") and n[1:].isdigit() for n in layer.notes) else "json:plain")
            if any(n.startswith("slash") for n in layer.notes):
                keys.append("json:slash")
        elif layer.kind == "pct":
            keys.append("pct:" + ("mixed-case" if {"per-escape", "per-digit"} & set(layer.notes) else "one-case"))
            keys.append(f"pct:{layer.slot}")
        else:
            keys.append("b64:" + ("wrapped" if layer.width else "oneline"))
            keys.append("b64:" + ("url" if layer.urlsafe else "std") + ("" if layer.padded else "-nopad"))
    return keys


def run(proxy, up, values: dict[str, bytes], cases: list[Case], report: Report, workers: int = 12, batch: int = 400) -> None:
    """Send CASES through PROXY in batches, judge each, and decode everything the upstream got."""
    oracle = Oracle(values)
    sender = Sender(proxy)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for start in range(0, len(cases), batch):
                chunk = cases[start : start + batch]
                for case in chunk:  # the oracle must be able to see what each case sends
                    if case.name and oracle.find(case.sent_form) != [case.name]:
                        report.failures.append(f"{case.describe()}: the oracle misses the sent form (test bug)")
                t0 = time.monotonic()
                results = list(pool.map(sender.send, chunk))
                t1 = time.monotonic()
                _judge_batch(up, chunk, results, oracle, report)
                report.seconds["sending"] += t1 - t0
                report.seconds["judging"] += time.monotonic() - t1
    finally:
        sender.close()


def _judge_batch(up, chunk: list[Case], results: list[Result], oracle: Oracle, report: Report) -> None:
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
        msgs = judge(case, res, recs, ws_by_case.get(case.id, []), oracle)
        for msg in msgs:
            report.failures.append(f"{case.describe()}: {msg}")
            report.kinds[f"{case.transport} {case.location}: {re.sub(r'\b[0-9]+\b', 'N', msg)}"] += 1
        report.add(case, res, bool(msgs))
        for rec in recs:
            names = set()
            if case.bound_leak:
                names.add(case.header)
            if case.ref_injected:
                names.add(REF_HEADERS[case.ref][0])
            for k, v in rec.headers:
                if k.decode("latin-1").lower() in names:
                    allowed[k + b": " + v + b"\r\n"] += 1
    t0 = time.monotonic()
    wire = oracle.find(strip_allowed(up.all_bytes(), allowed))
    report.seconds["judging the whole wire"] += time.monotonic() - t0
    if leaked := wire:
        report.failures.append(
            f"cases {chunk[0].id}..{chunk[-1].id}: the upstream's wire holds {leaked} outside any bound header"
        )
        report.kinds[f"wire: the upstream's wire holds {leaked} outside any bound header"] += 1
    errors = up.errors
    for e in errors:
        report.failures.append(f"upstream error: {e}")
        report.kinds["upstream error"] += 1
    up.clear()


#: The oracle under the name other suites (tests/test_bad_input.py) still use for it.
Detector = Oracle


# --- in-process replay (no proxy) ------------------------------------------------------------


def replay_in_process(seed: int, n: int) -> list[str]:
    """The seed's cases sealed by keyveil's Sealer directly, each location with
    the carrier flags the pipeline passes (path: url; query: url and plus, piece
    by piece then whole; form body: plus), judged by the same oracle and round
    trip. A quick scan of many seeds; the proxy run stays the verdict (it also
    judges blocking, injection, transports and outputs)."""
    from keyveil._engine import Sealer

    values = make_values(seed)
    sealer = Sealer({k: [v] for k, v in values.items()})
    oracle = Oracle(values)
    return [failure for case in generate(seed, n, values) for failure in replay_case(case, sealer, oracle)]


def replay_case(case: Case, sealer, oracle: Oracle) -> list[str]:
    """What is wrong with one case sealed in process (``replay_in_process``)."""
    from keyveil._pipeline import protected_spans

    if case.decoy != "none" and case.generated is not None:
        element = case.path.encode("latin-1") if case.location in ("path", "query") else case.sent_form
        if case.location == "body":
            element = case.message.encode() if case.transport == "ws" else case.carrier[0] + case.sent_form + case.carrier[1]
        if sealer.find_names(element):
            return [f"{case.describe()}: a decoy holding no value was found as one (over-sealing)"]
        return []
    if not case.name or case.generated is None or case.bound_leak:
        return []
    if case.location == "header" and case.header == NAME_HEADER:
        return []
    if case.location in ("path", "query"):
        path, _, query = case.path.encode("latin-1").partition(b"?")
        if case.location == "path":
            got = sealer.seal(path, url=True).data + b"?" + query
        else:
            pieces = b"&".join(sealer.seal(p, url=True, plus=True).data for p in query.split(b"&"))
            got = path + b"?" + sealer.seal(pieces, url=True, plus=True).data
    elif case.location == "header":
        head = case.carrier[0][: len(case.carrier[0]) - len(case.prefix)]
        got = sealer.seal(head + case.sent_form).data
    elif case.transport == "ws":
        got = sealer.seal(case.message.encode(), protected_spans).data
    else:
        before = case.carrier[0][: len(case.carrier[0]) - len(case.prefix)]
        body = before + case.sent_form + case.carrier[1]
        got = sealer.seal(body, protected_spans, plus=case.body_kind == "form").data
    if leaked := oracle.find(got):
        return [f"{case.describe()}: {leaked} recoverable after sealing"]
    if not case.provider:
        return []
    span = split_carrier(got, *case.carrier)
    if span is None:
        return [f"{case.describe()}: the text around the sealed value changed"]
    return [f"{case.describe()}: {p}" for p in check_round_trip(case.generated, span, reference(case.name), url=_percent_layer(case))]


def _percent_layer(case: Case) -> bool:
    """Whether the case's location is itself a percent layer, where keyveil may escape what it
    writes: a URL, and a form body (whose `+` is a space: a `+` of re-encoded base64 is `%2B`)."""
    return case.location in ("query", "path") or (case.location == "body" and case.transport != "ws" and case.body_kind == "form")


if __name__ == "__main__":  # python -m tests.leak_corpus SEED [SEED ...] (KEYVEIL_CORPUS_FAST_CASES cases each)
    import sys

    count = int(os.environ.get("KEYVEIL_CORPUS_FAST_CASES", "2000"))
    for arg in sys.argv[1:]:
        found = replay_in_process(int(arg), count)
        print(f"seed {arg}: {len(found)} failing cases of {count} (in process)")
        for line in found:
            print("  " + line)
