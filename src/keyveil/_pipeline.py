"""The request pipeline of SPEC §6 on a sans-IO request: seal, inject, enforce.

``Engine`` is compiled once from the rules and a vault snapshot; each request
goes through ``process_request`` and comes out as an ``Outcome``: the request
parts to forward (possibly unchanged), what was sealed and injected, or a
``Block`` with its code and an actionable message. This module knows nothing
of mitmproxy or sockets, and no message it writes ever holds a value.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import unquote_plus, unquote_to_bytes

from ._detected import is_detected
from ._engine import SealResult, Sealer
from ._inject import (
    InjectError,
    for_form,
    for_header,
    for_json,
    for_raw,
    for_url,
    inject,
    inject_basic,
    split_basic,
)
from ._matcher import Literals
from ._references import find_references_layered, format_reference, may_hold_reference
from ._rules import CompiledRules
from ._views import decode_base64
from .vault import VaultSnapshot

# Block codes (SPEC §6) and their HTTP status.
STATUS = {
    "plaintext_egress": 403,
    "unbound_reference": 403,
    "insecure_scheme": 403,
    "host_mismatch": 421,
    "undecodable_body": 502,
    "vault_unavailable": 502,
    "internal_error": 502,
    "body_too_large": 413,
}

_AUTH_HEADERS = {b"authorization", b"proxy-authorization", b"cookie", b"x-api-key", b"api-key"}
#: A detected value beginning or ending with this many bytes of a registered value is that value's business.
_EDGE_PIECE = 8
_AUTHISH = re.compile(rb"token|key|secret|auth|passw|credential", re.IGNORECASE)

# Vendor-written opaque fields (SPEC §6), found by name in the raw body; only
# those at their place in the vendor's request schema are left as they are.
_SIGNED_FIELD = re.compile(
    rb'"(signature|data|encrypted_content|thoughtSignature|thought_signature)"\s*:\s*"((?:[^"\\]|\\.)*)"'
)
_SIGNED_MARKERS = (b'"signature"', b"redacted_thinking", b'"encrypted_content"', b"houghtSignature", b"hought_signature")


@dataclass
class Request:
    """The parts of an HTTP request the pipeline reads and rewrites."""

    method: str
    scheme: str
    host: str  # the destination (CONNECT target / absolute-form host), normalised
    port: int
    path: bytes  # raw, without the query
    query: bytes | None  # raw, without '?'
    headers: list[tuple[bytes, bytes]]
    body: bytes | None  # decoded; None when absent or streamed
    content_type: str = ""
    agent: str | None = None  # keyveil agents: the authenticated agent (rules `agents:`), else None

    @property
    def path_text(self) -> str:
        return self.path.decode("latin-1")


@dataclass(frozen=True)
class Block:
    code: str
    message: str
    names: tuple[str, ...] = ()

    @property
    def status(self) -> int:
        return STATUS[self.code]


@dataclass
class Outcome:
    request: Request
    sealed: Counter[str] = field(default_factory=Counter)
    injected: Counter[str] = field(default_factory=Counter)
    unknown: set[str] = field(default_factory=set)
    block: Block | None = None
    provider: bool = False
    #: the request after sealing and before injection: what may be shown or stored
    sealed_request: Request | None = None
    # detect: detected values forwarded as they came (toward a host that is not a
    # provider, or in the credential headers of a provider request), by name
    passed: Counter[str] = field(default_factory=Counter)


@dataclass
class _References:
    auth: set[str] = field(default_factory=set)
    anywhere: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)
    valueless: set[str] = field(default_factory=set)

    def merge(self, other: _References) -> None:
        """Add OTHER's names to these (OTHER is left as it is: it may be a memo's)."""
        if other.auth or other.anywhere or other.unknown or other.valueless:
            self.auth |= other.auth
            self.anywhere |= other.anywhere
            self.unknown |= other.unknown
            self.valueless |= other.valueless


def protected_spans(data: bytes) -> list[tuple[int, int]]:
    """Spans of the vendor-signed fields of a provider request body (SPEC §6).

    Only the fields the vendors sign, at their place in the vendor's request
    schema: Anthropic ``messages[].content[]`` blocks of type ``thinking``
    (``signature``) and ``redacted_thinking`` (``data``); OpenAI Responses
    ``input[]`` items of type ``reasoning`` (``encrypted_content``); Gemini
    ``contents[].parts[].thoughtSignature``. The vendor wrote them and cannot
    have put a value it never saw there, so their base64 is never rewritten;
    a field of the same name anywhere else (a user's JSON, a tool result) is
    sealed like any other text.
    """
    if not any(m in data for m in _SIGNED_MARKERS):
        return []
    try:
        doc = json.loads(data)
    except ValueError:
        return []  # not one JSON document: no vendor schema, nothing shielded
    signed = _signed_values(doc)
    if not signed:
        return []
    spans = []
    for m in _SIGNED_FIELD.finditer(data):
        try:
            text = json.loads(b'"' + m.group(2) + b'"')
        except ValueError:
            continue
        if (m.group(1).decode(), text) in signed:
            spans.append(m.span(2))
    return spans


def _signed_values(doc) -> set[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    if not isinstance(doc, dict):
        return out

    def take(obj, key: str) -> None:
        value = obj.get(key)
        if isinstance(value, str):
            out.add((key, value))

    for message in doc.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and block.get("type") == "thinking":
                take(block, "signature")
            elif isinstance(block, dict) and block.get("type") == "redacted_thinking":
                take(block, "data")
    items = doc.get("input")
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict) and item.get("type") == "reasoning":
            take(item, "encrypted_content")
    for content in doc.get("contents") or ():
        parts = content.get("parts") if isinstance(content, dict) else None
        for part in parts if isinstance(parts, list) else ():
            if isinstance(part, dict):
                take(part, "thoughtSignature")
                take(part, "thought_signature")
    return out


def body_encoder(content_type: str):
    ct = content_type.split(";", 1)[0].strip().lower()
    if ct == "application/json" or ct.endswith("+json") or ct == "application/x-ndjson":
        return for_json
    if ct == "application/x-www-form-urlencoded":
        return for_form
    return for_raw


def is_auth_header(name: bytes) -> bool:
    lname = name.lower()
    return lname in _AUTH_HEADERS or _AUTHISH.search(lname) is not None


_MEMO_BYTES = 4096  # longer buffers (bodies, long cookies) are sealed each time
_MEMO_ENTRIES = 4096
_MEMO_HELD = 4 << 20  # bytes of keys one memo holds at most (a client sending ever new headers)
_UNCHANGED = object()  # a memo entry: the sealer found nothing


class _Memo(dict):
    """A dictionary emptied when it holds _MEMO_ENTRIES entries or _MEMO_HELD bytes of keys."""

    held = 0

    def remember(self, key, hit, size: int) -> None:
        if len(self) >= _MEMO_ENTRIES or self.held + size > _MEMO_HELD:
            self.clear()
            self.held = 0
        self[key] = hit
        self.held += size


class SealMemo:
    """What the sealer made of the short buffers that come again request after
    request: header fields, paths, query pieces, host names, methods.

    A client sends the same headers every time, and a seal looks at each of
    their views; a hit is a dictionary lookup. One memo per engine: the
    engine's sealer never changes (a vault, detection or rules change builds a
    new engine, and with it an empty memo), so no result outlives the values it
    was made with. It holds in memory what the flows hold, is emptied when
    full (4,096 entries or 4 MiB of keys), and is never written anywhere. Bodies are not kept: they seldom come
    twice, and a benchmark repeating one would measure the memo.
    """

    def __init__(self, sealer: Sealer) -> None:
        self.sealer = sealer
        self._seals = _Memo()  # (data, url, plus) -> (sealed data, counts) or _UNCHANGED
        self._fields = _Memo()  # (name, value) -> ((sealed name, sealed value), counts) or _UNCHANGED
        self._names = _Memo()  # data -> the names it holds

    def seal(self, data: bytes, url: bool = False, plus: bool = False) -> SealResult:
        """``Sealer.seal(DATA, url=URL, plus=PLUS)``; DATA comes back as the same object when nothing is found."""
        if type(data) is not bytes or len(data) > _MEMO_BYTES:
            return self.sealer.seal(data, url=url, plus=plus)
        key = (data, url, plus)
        hit = self._seals.get(key)
        if hit is None:
            result = self.sealer.seal(data, url=url, plus=plus)
            hit = (result.data, tuple(result.counts.items())) if result.counts else _UNCHANGED
            self._seals.remember(key, hit, len(data))
        if hit is _UNCHANGED:
            return SealResult(data)
        return SealResult(hit[0], Counter(dict(hit[1])))

    def seal_fields(self, fields) -> tuple[tuple[tuple[bytes, bytes], ...], Counter[str]]:
        """``Sealer.seal_fields``: header fields with names and values sealed, and the counts.

        Each field is looked up on its own (a request's Content-Length changes,
        its other headers do not); one not seen before has its name and value
        sealed, as ``Sealer.seal_fields`` seals each field once any holds a value."""
        fields = tuple(fields)
        counts: Counter[str] = Counter()
        sealed = None
        for i, f in enumerate(fields):
            hit = self._fields.get(f)
            if hit is None:
                hit = _sealed_field(self.sealer, *f)
                if type(f[0]) is bytes and type(f[1]) is bytes and len(f[0]) + len(f[1]) <= _MEMO_BYTES:
                    self._fields.remember(f, hit, len(f[0]) + len(f[1]))
            if hit is not _UNCHANGED:
                if sealed is None:
                    sealed = list(fields[:i])
                sealed.append(hit[0])
                counts.update(dict(hit[1]))
            elif sealed is not None:
                sealed.append(f)
        return (fields if sealed is None else tuple(sealed)), counts

    def find_names(self, data: bytes) -> Counter[str]:
        """``Sealer.find_names``: which values DATA holds, in any form."""
        if type(data) is not bytes or len(data) > _MEMO_BYTES:
            return self.sealer.find_names(data)
        hit = self._names.get(data)
        if hit is None:
            hit = tuple(self.sealer.find_names(data).items())
            self._names.remember(data, hit, len(data))
        return Counter(dict(hit))


def _sealed_field(sealer: Sealer, name: bytes, value: bytes) -> tuple:
    name_result, value_result = sealer.seal(name), sealer.seal(value)
    if not name_result.counts and not value_result.counts:
        return _UNCHANGED
    counts = name_result.counts + value_result.counts
    return (name_result.data, value_result.data), tuple(counts.items())


class Engine:
    """Rules and values compiled together; one per vault or rules change."""

    def __init__(
        self, rules: CompiledRules, snapshot: VaultSnapshot, detected: dict[str, bytes] | None = None,
        detector_expressions: Sequence[tuple[bytes, int]] = (),
    ) -> None:
        """DETECTOR_EXPRESSIONS: what detection scans for (``Detector.expressions``), compiled
        into the sealer's scan when detection is on: a request is then scanned once for both."""
        self.rules = rules
        self.policy = rules.rules.policy
        self._snapshot = snapshot
        self.values = dict(snapshot.current)
        # keyveil.vault: entries the store would not let keyveil read (name -> value-free reason)
        self.unavailable = dict(getattr(snapshot, "unavailable", None) or {})
        # detect: values nobody registered (SPEC §3a), named detected/KIND-ID, from
        # the vault and from the running proxy's memory (DETECTED). One whose value
        # is also registered under another name (`secret adopt`) is an alias of that
        # name: its reference is injected where that name is bound, and the value
        # seals to that name. Every other one is sealed and scrubbed, never injected.
        self._registered_sealer: Sealer | None = None
        self._registered_blob = b""
        for name, value in (detected or {}).items():
            self.values.setdefault(name, value)
        # A detected value that holds a registered value in some form (base64 of it,
        # the value with more around it) is left out: sealed as one detected span it
        # would hide that value from the sealer, and be forwarded as it came where a
        # detected value is (below). The registered value's own seal covers it.
        registered = {v: n for n, v in sorted(self.values.items(), reverse=True) if not is_detected(n)}
        shadowing = [
            n for n, v in self.values.items() if is_detected(n) and v not in registered and self.covered(v, snapshot)
        ]
        for name in shadowing:
            del self.values[name]
        self.aliases = {n: registered[v] for n, v in self.values.items() if is_detected(n) and v in registered}
        self.detected_names = frozenset(n for n in self.values if is_detected(n) and n not in self.aliases)
        every = {name: [value] for name, value in self.values.items() if name not in self.aliases}
        for name, previous in snapshot.previous.items():
            if name not in self.aliases:
                every.setdefault(name, []).extend(previous)
        companion = detector_expressions if self.policy.detected != "off" else ()
        self.sealer = Sealer(every, companion=companion)
        #: the detector's scan of a buffer, made with the sealer's (None: detection scans alone)
        self.detector_hits = self.sealer.companion_hits if companion else None
        #: the sealer's results for short buffers that repeat (headers, paths): one memo per engine
        self.memo = SealMemo(self.sealer)
        self._header_references = _Memo()  # header field (name, value) -> the references it holds
        self.names = frozenset(every) | frozenset(self.aliases)
        self.bound_names = frozenset(rules.names())
        #: every value the sealer knows (detection skips these: they are sealed already)
        self.known_values = frozenset(v for vs in every.values() for v in vs)

    # -- requests -------------------------------------------------------------

    def process_request(self, req: Request) -> Outcome:
        out = Outcome(req)
        out.provider = self.rules.is_provider(req.host, req.port, req.scheme)
        original = req
        req = _copy(req, headers=list(req.headers))
        bindings = self._with_aliases(
            self._for_agent(req, self.rules.bindings(req.host, req.port, req.scheme, req.method, req.path_text))
        )
        bound: dict[str, set[str]] = defaultdict(set)
        for name, injects in bindings.items():
            for inj in injects:
                bound[inj.location].add(name)

        # 2. seal, location by location, remembering where each name was found
        found: list[tuple[str, str]] = []  # (location, name)
        times: Counter[tuple[str, str]] = Counter()  # detect: how often, per location and name

        def seal(location: str, data: bytes, protect=None, url: bool = False, plus: bool = False) -> bytes:
            if location == "body":
                result = self.sealer.seal(data, protect, url=url, plus=plus)
            else:
                result = self.memo.seal(data, url=url, plus=plus)
            for name, n in result.counts.items():
                found.append((location, name))
                times[location, name] += n
                out.sealed[name] += n
            return result.data

        req.path = seal("path", req.path, url=True)
        if req.query is not None:
            query = b"&".join(seal(_query_location(p), p, url=True, plus=True) for p in req.query.split(b"&"))
            # A raw value holding '&' spans two pieces: seal the whole string too.
            req.query = seal("query", query, url=True, plus=True)
        if self.memo.seal_fields(req.headers)[1]:  # some header holds a value
            headers = []
            for k, v in req.headers:
                if seal("header-name", k) is not k:
                    continue  # a value used as a header name: the header cannot be sealed, only dropped
                headers.append((k, seal(_header_location(k, v), v)))
            req.headers = headers
        if req.body is not None:
            protect = protected_spans if out.provider else None
            # A form body reads `+` as a space; references stay plain there
            # (clients often label JSON as a form: `curl -d`).
            form = body_encoder(req.content_type) is for_form
            req.body = seal("body", req.body, protect, plus=form)

        # detect: policy.detected block: a detected value toward a provider is not sent
        if out.provider and self.policy.detected == "block":
            caught = sorted({n for loc, n in found if n in self.detected_names and not _credential(loc)})
            if caught:
                out.block = Block("plaintext_egress", self._detected_message(req, caught[0]), (caught[0],))
                return out

        # 4a. a value found where it is not bound (non-provider hosts only; a detected value is never bound)
        stray = [(loc, name) for loc, name in found if name not in bound.get(loc, ()) and name not in self.detected_names]
        if stray and not out.provider:
            action = self.policy.plaintext_elsewhere
            if action == "block":
                loc, name = stray[0]
                out.block = Block("plaintext_egress", self._plaintext_message(req, name, loc), (name,))
                return out
            if action == "allow":
                req = self._restore(req, original, {loc for loc, _ in stray})

        # 3. inject where bound
        out.sealed_request = _copy(req, headers=list(req.headers))
        # detect: a detected value goes on the wire as it came toward a host that is
        # not a provider (detection only audits there), and in the credential headers
        # of any request (the client's own credential for that host); what is shown
        # and stored (sealed_request) keeps it sealed.
        req = self._pass_detected(req, original, found, times, out)
        try:
            self._inject(req, bound, out)
        except InjectError as e:
            out.block = Block("plaintext_egress", f"{e}; keyveil does not forward it", (e.name,))
            return out
        # What is left of references after injection, in one pass over the request.
        refs = self._references(req)
        out.unknown = refs.unknown
        missing = {n for names in bound.values() for n in names if n not in self.values}
        missing_used = missing & refs.valueless
        if missing_used:
            name = sorted(missing_used)[0]
            reason = self.unavailable.get(name)
            out.block = Block(
                "vault_unavailable",
                f"{name} is bound to {req.host} but the vault would not give keyveil its value: {reason}"
                if reason
                else f"{name} is bound to {req.host} but the vault holds no value for it: "
                f"run `keyveil secret set {name}`",
                (name,),
            )
            return out

        # 4b. a reference that would be injected but for the scheme
        insecure = refs.anywhere and set(self._for_agent(req, self.rules.blocked_by_scheme(
            req.host, req.port, req.scheme, req.method, req.path_text
        ))) & refs.anywhere
        if insecure:
            name = sorted(insecure)[0]
            out.block = Block(
                "insecure_scheme",
                f"{name} is bound to {req.host} but this request is plain http://: keyveil never "
                f"injects over http; use https://, or set allow_http: true on {name} in rules.yaml",
                (name,),
            )
            return out

        # 4c. a reference left where a credential goes, toward a host it is not bound to
        if not out.provider and self.policy.unbound_reference != "pass":
            left = refs.anywhere if self.policy.unbound_reference == "block" else refs.auth
            if left:
                name = sorted(left)[0]
                # The message quotes the path as sealed, never after injection.
                out.block = Block("unbound_reference", self._unbound_message(out.sealed_request, name), (name,))
                return out

        out.request = req
        return out

    # keyveil agents (rules `agents:`): an agent's references are injected only for
    # the secrets it lists; any other is unbound for it. Sealing is not affected.

    # detect: aliases (`secret adopt`) and detected values forwarded as they came

    def _registered(self, snapshot: VaultSnapshot | None = None) -> Sealer:
        """A sealer of the registered values alone (built on first use)."""
        if self._registered_sealer is None:
            source = snapshot if snapshot is not None else self._snapshot
            every = {n: [v] for n, v in source.current.items() if not is_detected(n)}
            for n, previous in source.previous.items():
                if not is_detected(n):
                    every.setdefault(n, []).extend(previous)
            self._registered_sealer = Sealer(every)
            # every registered value, each between NULs (no value holds one), to tell a
            # piece of one, or a piece at its start or end
            self._registered_blob = b"\0" + b"\0".join(v for vs in every.values() for v in vs) + b"\0"
        return self._registered_sealer

    def covered(self, value: bytes, snapshot: VaultSnapshot | None = None) -> bool:
        """True when VALUE holds a registered value in some form, is one, is a piece
        of one, or begins or ends with a piece of one (`user:` and the first half
        of a value, read from one line of a wrapped base64 block): detection skips
        it, the registered value's own seal covers it."""
        sealer = self._registered(snapshot)
        blob = self._registered_blob
        if value in blob or sealer.find_names(value):
            return True
        # A piece at an edge: a suffix of VALUE that starts a value, or a prefix that ends one.
        widest = min(len(value) - 1, sealer.longest)
        return any(b"\0" + value[-n:] in blob or value[:n] + b"\0" in blob for n in range(_EDGE_PIECE, widest + 1))

    @property
    def detection_margin(self) -> int:
        """Bytes around a detection that may hold a form of a registered value touching it."""
        return 6 * self._registered().longest + 16  # a \u escape per character is the widest form

    def overlaps_registered(self, value: bytes, around: bytes) -> bool:
        """True when VALUE, found in AROUND, shares bytes with a form of a registered value there.

        Such a detection is not remembered: sealed as one span, it would take part
        of the registered value with it and leave the rest as it was."""
        if self.covered(value):
            return True
        result = self._registered().seal(around)
        return result.changed and value not in result.data

    def _unchanged_by_registered(self, original: Request, location: str) -> bool:
        """A location forwarded as it came must hold no registered value in any form."""
        if location == "path":
            parts = [original.path]
        elif location == "body":
            parts = [original.body or b""]
        elif location == "query" or location.startswith("query:"):
            parts = [original.query or b""]
        else:
            header = location.partition(":")[2].encode("latin-1") if location.startswith("header:") else b"authorization"
            parts = [v for k, v in original.headers if k.lower() == header]
        return not any(self._registered().find_names(p) for p in parts if p)

    def _with_aliases(self, bindings: dict) -> dict:
        """BINDINGS with each alias of a bound name bound the same way."""
        if not self.aliases:
            return bindings
        extra = {alias: bindings[name] for alias, name in self.aliases.items() if name in bindings}
        return {**bindings, **extra} if extra else bindings

    def _pass_detected(self, req: Request, original: Request, found, times: Counter, out: Outcome) -> Request:
        if not self.detected_names:
            return req
        passable = {
            loc for loc, name in found
            if name in self.detected_names and (not out.provider or _credential(loc))
        }
        # A location that also held a registered value stays sealed.
        passable -= {loc for loc, name in found if name not in self.detected_names}
        passable.discard("header-name")
        passable = {loc for loc in passable if self._unchanged_by_registered(original, loc)}
        if not passable:
            return req
        for (loc, name), n in times.items():
            if loc in passable:
                out.passed[name] += n
                out.sealed[name] -= n
        out.sealed = +out.sealed
        return self._restore(req, original, passable)

    def _detected_message(self, req: Request, name: str) -> str:
        return (
            f"the request to {req.host} carries a value nobody registered that looks like a secret "
            f"({format_reference(name)}), and policy.detected is block. If it is a secret, register it: "
            f"`keyveil secret adopt {name} NAME`; to send it sealed as {format_reference(name)} instead, "
            "set policy.detected: seal in rules.yaml"
        )

    def _for_agent(self, req: Request, names):
        """NAMES (a set, or a dict keyed by name) without the secrets REQ's agent may not use."""
        if self.rules.agents is None:
            return names
        allowed = self.rules.agent_secrets(req.agent or "")  # no agent with agents: none (fail closed)
        if isinstance(names, dict):
            return {n: v for n, v in names.items() if n in allowed}
        return {n for n in names if n in allowed}

    def _agent_note(self, req: Request, name: str) -> str:
        if self.rules.agents is None or name in self.rules.agent_secrets(req.agent or ""):
            return ""
        return (
            f"; agent {req.agent} may not use {name}: add it to agents.{req.agent}.secrets "
            "in rules.yaml if it should"
        )

    def _inject(self, req: Request, bound: dict[str, set[str]], out: Outcome) -> None:
        values = self.values
        for location, names in bound.items():
            if location == "path":
                req.path, n = inject(req.path, values, names, for_url, "the URL path", url=True)
            elif location.startswith("query:") and req.query is not None:
                param = location[len("query:") :]
                pieces = []
                n = Counter()
                for piece in req.query.split(b"&"):
                    if _query_location(piece) == location:
                        key, eq, val = piece.partition(b"=")
                        val, c = inject(val, values, names, for_url, f"query parameter {param}", url=True)
                        piece = key + eq + val
                        n += c
                    pieces.append(piece)
                req.query = b"&".join(pieces)
            elif location.startswith("header:"):
                header = location[len("header:") :]
                n = _rewrite_headers(
                    req, header, lambda v: inject(v, values, names, for_header, f"header {header}")  # noqa: B023
                )
            elif location == "basic_auth":
                n = _rewrite_headers(req, "authorization", lambda v: inject_basic(v, values, names))  # noqa: B023
            elif location == "body" and req.body is not None:
                req.body, n = inject(req.body, values, names, body_encoder(req.content_type), "the body")
            else:
                continue
            out.injected.update(n)

    def _references(self, req: Request) -> _References:
        """The references in REQ: known names in auth positions, known names
        anywhere, and unknown names (plain text, reported in the audit log)."""
        refs = _References()

        def scan(data: bytes, auth: bool, url: bool = False, into: _References = refs) -> None:
            # One marker scan: nothing more where DATA holds none (most headers).
            for _, _, name, _ in find_references_layered(data):
                if name not in self.names:
                    # in the rules but not in the vault, or not known at all (plain text)
                    (into.valueless if name in self.bound_names else into.unknown).add(name)
                    continue
                into.anywhere.add(name)
                if auth:
                    into.auth.add(name)

        # Where a reference left over blocks the request, it is looked for through
        # two layers of base64 (SPEC §3); elsewhere (it is only reported) through one.
        everywhere = self.policy.unbound_reference == "block"

        def scan_credential(data: bytes, auth: bool, into: _References = refs) -> None:
            scan(data, auth, into=into)
            # A reference can hide in base64 (SPEC §3), which no marker shows:
            # headers and query parameters are short, so each token is decoded.
            for decoded in _base64_tokens(data, layers=2 if auth or everywhere else 1):
                scan(decoded, auth, into=into)

        # A client sends the same headers every time: what each holds is kept for
        # this engine (its names, bindings and policy never change).
        memo = self._header_references
        for field in req.headers:
            found = memo.get(field)
            if found is None:
                found = _References()
                scan_credential(field[1], is_auth_header(field[0]), found)
                if len(field[0]) + len(field[1]) <= _MEMO_BYTES:
                    memo.remember(field, found, len(field[0]) + len(field[1]))
            refs.merge(found)
        if req.query is not None:
            for piece in req.query.split(b"&"):
                key = unquote_plus(piece.partition(b"=")[0].decode("latin-1"))
                scan_credential(piece, _AUTHISH.search(key.encode("latin-1")) is not None)
        scan(req.path, False, url=True)
        if req.body is not None:
            scan(req.body, False)
        return refs

    def _restore(self, req: Request, original: Request, locations: set[str]) -> Request:
        """policy plaintext_elsewhere: allow — forward these locations as they came."""
        if "path" in locations:
            req.path = original.path
        if "body" in locations:
            req.body = original.body
        if "query" in locations or any(loc.startswith("query:") for loc in locations):
            req.query = original.query
        if "header-name" in locations or len(req.headers) != len(original.headers):
            req.headers = list(original.headers)
        else:
            req.headers = [
                orig if _header_location(*orig) in locations else new
                for orig, new in zip(original.headers, req.headers, strict=True)
            ]
        return req

    # -- messages -------------------------------------------------------------

    def _plaintext_message(self, req: Request, name: str, location: str) -> str:
        where = _describe(location)
        hint = self.rules.bound_elsewhere_hint(name)
        return (
            f"the request to {req.host} carries the value of {name} in {where}, and {name} is "
            f"not bound there (bound to: {hint}). Use the reference {format_reference(name)} "
            f"instead of the value, or add {req.host} to hosts of {name} in rules.yaml "
            f"with an inject location for {where}" + self._agent_note(req, name)
        )

    def _unbound_message(self, req: Request, name: str) -> str:
        if name in self.detected_names:  # detect: a detected value is never injected until adopted
            return (
                f"{format_reference(name)} is sent to {req.host} where a credential goes, but it names a "
                f"value keyveil detected, which is never injected. To use it, register it: `keyveil secret "
                f"adopt {name} NAME`, and bind NAME to {req.host} in rules.yaml"
            )
        hint = self.rules.bound_elsewhere_hint(name)
        if self._agent_note(req, name) and name in self.rules.bindings(req.host, req.port, req.scheme, req.method, req.path_text):
            return (
                f"{format_reference(name)} is sent to {req.host} where a credential goes, but agent "
                f"{req.agent} may not use {name}; if it should, add {name} to agents.{req.agent}.secrets "
                "in rules.yaml"
            )
        return (
            f"{format_reference(name)} is sent to {req.host} where a credential goes, but {name} is "
            f"not bound to {req.host} {req.method} {req.path_text} (bound to: {hint}). If "
            f"{req.host} should receive it, add {req.host} to hosts of {name} in rules.yaml"
            + self._agent_note(req, name)
        )

    # -- WebSocket messages and responses -----------------------------------

    def process_ws_message(self, req: Request, content: bytes) -> tuple[bytes, bytes, Outcome]:
        """Seal, inject and enforce one client → server WebSocket message.

        Returns the sealed message (what may be shown and stored), the message
        to send (sealed, then injected where bound), and the outcome.
        """
        msg = replace(req, headers=[], query=None, path=b"", body=None)
        out = Outcome(msg, provider=self.rules.is_provider(req.host, req.port, req.scheme))
        bindings = self._with_aliases(
            self._for_agent(req, self.rules.bindings(req.host, req.port, req.scheme, "GET", req.path_text))
        )
        names = {n for n, injects in bindings.items() if any(i.location == "websocket" for i in injects)}
        result = self.sealer.seal(content, protected_spans if out.provider else None)
        out.sealed = result.counts
        detected = [n for n in result.counts if n in self.detected_names]  # detect: SPEC §3a
        if detected and out.provider and self.policy.detected == "block":
            out.block = Block("plaintext_egress", self._detected_message(req, detected[0]), (detected[0],))
            return result.data, content, out
        if detected and not out.provider and len(detected) == len(result.counts):
            out.passed, out.sealed = result.counts, Counter()
            return result.data, content, out  # toward a host that is not a provider: as it came
        stray = [n for n in result.counts if n not in names and n not in self.detected_names]
        if stray and not out.provider:
            action = self.policy.plaintext_elsewhere
            if action == "block":
                out.block = Block("plaintext_egress", self._plaintext_message(req, stray[0], "websocket"), (stray[0],))
                return result.data, content, out
            if action == "allow":
                return result.data, content, out
        sealed = result.data
        encoder = for_json if sealed[:1] in (b"{", b"[") else for_raw
        try:
            data, out.injected = inject(sealed, self.values, names, encoder, "the WebSocket message")
        except InjectError as e:
            out.block = Block("plaintext_egress", str(e), (e.name,))
            return sealed, content, out
        if not out.provider and self.policy.unbound_reference == "block":
            left = {n for _, _, n, _ in find_references_layered(data) if n in self.names}
            if left:
                name = sorted(left)[0]
                out.block = Block("unbound_reference", self._unbound_message(req, name), (name,))
        return sealed, data, out


def _copy(req: Request, **changes) -> Request:
    """``dataclasses.replace(REQ, **CHANGES)`` at less than half its cost (a Request has no __post_init__)."""
    new = object.__new__(Request)
    new.__dict__.update(req.__dict__)
    new.__dict__.update(changes)
    return new


def _rewrite_headers(req: Request, name: str, rewrite) -> Counter[str]:
    """Apply REWRITE (value → (value, counts)) to every header called NAME."""
    counts: Counter[str] = Counter()
    wanted = name.encode("latin-1")
    for i, (k, v) in enumerate(req.headers):
        if k.lower() == wanted:
            v, c = rewrite(v)
            req.headers[i] = (k, v)
            counts += c
    return counts


_BASE64_TOKEN = re.compile(rb"[A-Za-z0-9+/_-]{16,}={0,2}")
# Every reference marker holds "secret" (references._MARKERS), and base64 of any
# bytes holding "secret", in either alphabet, decoded from any character, holds
# the encoding of one of its three-byte groups "sec", "cre" or "ecr": a buffer
# without any of the three is decoded no further (most headers: one SIMD scan).
_SECRET_IN_BASE64 = Literals([b"c2Vj", b"Y3Jl", b"ZWNy"])


def _base64_tokens(data: bytes, layers: int = 1) -> Iterator[bytes]:
    """Every run of DATA that reads as base64 (either alphabet, padded or not,
    percent-encoded or not), decoded from each of its first four characters
    (a prefix such as ``tok_`` may be glued to it) where that holds a
    reference: a ``{{secret:…}}`` is 12 bytes at least, 16 base64 characters.
    LAYERS 2: also base64 inside what a run decodes to (base64 of base64)."""
    if b"%" in data:
        data = unquote_to_bytes(data)
    if layers == 1 and not _SECRET_IN_BASE64.any(data):
        return  # the outer text of base64 of base64 need not show it: no shortcut there
    for m in _BASE64_TOKEN.finditer(data):
        run = m.group().rstrip(b"=")
        for skip in range(4):
            part = run[skip:]
            if len(part) % 4 == 1:
                part = part[:-1]  # a lone last character holds no whole byte
            decoded = decode_base64(part)
            if may_hold_reference(decoded, escaped=True):  # `{{s\u0065cret:…}}` too
                yield decoded
            elif layers > 1 and len(decoded) >= 16:
                yield from _base64_tokens(decoded, layers - 1)


def _credential(location: str) -> bool:
    """A location where a client puts its own credential for the host (detect: left as it came)."""
    return location == "basic_auth" or (location.startswith("header:") and is_auth_header(location[7:].encode("latin-1")))


def _header_location(name: bytes, value: bytes) -> str:
    lname = name.lower()
    if lname == b"authorization" and split_basic(value) is not None:
        return "basic_auth"
    return "header:" + lname.decode("latin-1")


def _query_location(piece: bytes) -> str:
    key = piece.partition(b"=")[0]
    return "query:" + unquote_plus(key.decode("latin-1"))


def _describe(location: str) -> str:
    kind, _, detail = location.partition(":")
    return {
        "header": f"header {detail}",
        "header-name": "a header name",
        "query": f"query parameter {detail}" if detail else "the query string",
        "basic_auth": "Basic credentials",
        "path": "the URL path",
        "body": "the body",
        "websocket": "a WebSocket message",
    }[kind]
