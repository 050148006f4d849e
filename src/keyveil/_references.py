"""References: the ``{{secret:NAME}}`` text that stands in for a value.

This module finds, parses and formats references exactly per SPEC §2. It
knows nothing of values: it never sees one.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from collections.abc import Callable, Iterator
from urllib.parse import unquote_to_bytes

from ._matcher import Literals, escaped
from ._views import JsonView, PercentView, json_unescape, worked_out

NAME_MAX = 128

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME = rf"{_SEGMENT}(?:/{_SEGMENT})*"

#: the normative pattern of SPEC §2, group 1 is NAME
REFERENCE_PATTERN = rf"\{{\{{secret:({_NAME})\}}\}}"

_NAME_RE = re.compile(rf"{_NAME}\Z")
_REFERENCE_BYTES = re.compile(REFERENCE_PATTERN.encode())
_REFERENCE_STR = re.compile(REFERENCE_PATTERN)

# In a URL a client may percent-encode the braces, the colon and the slashes
# (either hex case), in any mix.
_PCT_NAME = rf"{_SEGMENT}(?:(?:/|%2[Ff]){_SEGMENT})*"
_URL_REFERENCE_BYTES = re.compile(
    rf"(?:\{{|%7[Bb])(?:\{{|%7[Bb])secret(?::|%3[Aa])({_PCT_NAME})(?:\}}|%7[Dd])(?:\}}|%7[Dd])".encode()
)


def is_valid_name(name: str) -> bool:
    """True when NAME may appear in a reference (pattern and length)."""
    return len(name) <= NAME_MAX and _NAME_RE.match(name) is not None


def check_name(name: str) -> str:
    """Return NAME, or raise ValueError saying why it is not a valid secret name."""
    if not name:
        raise ValueError("a secret name must not be empty")
    if len(name) > NAME_MAX:
        raise ValueError(f"a secret name is at most {NAME_MAX} characters")
    if _NAME_RE.match(name) is None:
        raise ValueError(
            f"invalid secret name {name!r}: use segments of letters, digits, '.', '_' "
            "or '-' joined by '/', each starting with a letter or digit (e.g. github/pat)"
        )
    return name


def format_reference(name: str) -> str:
    """The reference text for NAME."""
    return "{{secret:" + check_name(name) + "}}"


def parse_reference(text: str) -> str | None:
    """NAME if TEXT is exactly one reference, else None."""
    m = _REFERENCE_STR.fullmatch(text)
    if m is None or len(m.group(1)) > NAME_MAX:
        return None
    return m.group(1)


def find_references(data: bytes) -> Iterator[tuple[int, int, str]]:
    """Yield (start, end, NAME) of every reference in DATA, left to right."""
    for m in _REFERENCE_BYTES.finditer(data):
        name = m.group(1)
        if len(name) <= NAME_MAX:
            yield m.start(), m.end(), name.decode("ascii")


def find_url_references(data: bytes) -> Iterator[tuple[int, int, str]]:
    """Like find_references, but also recognises percent-encoded references (URLs)."""
    # The pattern starts with an alternation, which `re` would try at every
    # offset; every reference holds "secret" 2, 4 or 6 bytes in, so look there.
    pos = 0
    while (hit := data.find(b"secret", pos)) != -1:
        pos = hit + 6
        for back in (2, 4, 6):
            m = _URL_REFERENCE_BYTES.match(data, hit - back) if hit >= back else None
            if m is not None:
                name = re.sub(rb"%2[Ff]", b"/", m.group(1)).decode("ascii")
                if len(name) <= NAME_MAX:
                    yield m.start(), m.end(), name
                pos = m.end()
                break


# Every reference, raw or percent-encoded, holds one of these: a SIMD scan for
# three short literals is many times faster than a search for "secret".
_MARKERS = Literals([b"{secret:", b"Bsecret", b"bsecret"])


# What a reference written through JSON escapes or percent-encoding holds in the
# raw bytes, whichever of its characters were escaped: `secret` itself (its
# braces or colon escaped: `\\u007b\\u007bsecret\\u003a…`), or the escape of one
# of its letters (`\\u0073`, `%73`: their hex digits are digits, so the case of
# hex letters does not matter); through two layers at once, percent twice
# (`%2573`) or a percent sign JSON-escaped (`\\u002573`: `u0025`).
_HIDDEN = Literals(
    [
        b"secret",
        *(b"u00%x" % c for c in b"secrt"),
        *(b"%%%x" % c for c in b"secrt"),
        *(b"%%25%x" % c for c in b"secrt"),
        b"u0025",
    ]
)
_SECRET = 0  # the index of b"secret" in _HIDDEN

#: What _HIDDEN looks for, as (Hyperscan expression, flags), for a scan made for other readers
#: too (the sealer's, with detection: ``Sealer.companion_hits``), which hands over its matches
#: (``hidden_hits``) as ``(index in _HIDDEN, start, end)``; a request's body is then scanned once less.
HIDDEN_EXPRESSIONS: tuple[tuple[bytes, int], ...] = tuple((escaped(p), 0) for p in _HIDDEN.patterns)
HIDDEN_LENGTHS: tuple[int, ...] = tuple(len(p) for p in _HIDDEN.patterns)


def hidden_hits(data: bytes) -> list[tuple[int, int, int]]:
    """_HIDDEN's matches in DATA: from a shared scan that looked for them already, else one of its own."""
    return worked_out("hidden", data, None, _HIDDEN.find)


def may_hold_reference(data: bytes, escaped: bool = False) -> bool:
    """False when DATA certainly holds no reference written plainly or percent-encoded
    (the common case, checked fast); with ESCAPED, also none whose letters or
    punctuation a JSON escape or percent-encoding hides (`_HIDDEN`)."""
    return (_HIDDEN if escaped else _MARKERS).any(data)


#: how a value is written where a reference stood in a decoded view (None: as the place wants)
Writer = Callable[[bytes], bytes] | None

_REFERENCE_LAYERS = 2


def find_references_layered(data: bytes, _depth: int = 0) -> list[tuple[int, int, str, Writer]]:
    """Every reference in DATA, raw or written through up to two layers of JSON
    escapes and percent-encoding (SPEC §3: ``{{secret:github\\/pat}}``,
    ``%7B%7Bsecret%3Agithub%2Fpat%7D%7D``), as (start, end, NAME, writer).

    The writer encodes a value for the span the reference took (JSON-escaped,
    percent-encoded, or both); it is None for a raw reference. Spans do not
    overlap and come left to right.
    """
    # One scan for the markers finds the raw references too (each holds "secret")
    # and tells whether a decoded view can hold more.
    hits = hidden_hits(data)
    if not hits:
        return []
    found: list[tuple[int, int, str, Writer]] = _raw_references(data, hits)
    if _depth < _REFERENCE_LAYERS and _hidden_marker(found, hits):
        views = []
        # Decoded at C speed first: the view with its map is built only when it
        # holds more references than the raw bytes do (the common JSON body
        # with `\n` escapes and a plain reference needs none).
        if b"\\" in data and _more_references(json_unescape(data), len(found)):
            views.append(JsonView.build(data))
        if b"%" in data and _more_references(unquote_to_bytes(data), len(found)):
            views.append(PercentView(data, plus=False))
        for view in views:
            if view.data == data:
                continue
            for s, e, name, inner in find_references_layered(view.data, _depth + 1):
                start, end = view.span(s, e)
                if inner is None:
                    # A JSON document carried inside: the value is escaped for
                    # each string around it (the JSON view's writer does one).
                    nested = json_nesting(data, start) - 1 if isinstance(view, JsonView) else field_nesting(data, start)
                    inner = _json_strings(nested) if nested > 0 else None
                found.append((start, end, name, _writer(view, start, end, inner)))
    if len(found) > 1:
        found.sort(key=lambda f: (f[0], f[3] is not None))
        kept = []
        end = -1
        for f in found:
            if f[0] >= end:
                kept.append(f)
                end = f[1]
        found = kept
    return found


def _raw_references(data: bytes, hits: list[tuple[int, int, int]]) -> list[tuple[int, int, str, Writer]]:
    """``find_references`` (as layered spans), matched only where HITS (of _HIDDEN, in
    DATA) found "secret" two bytes after a possible start: the spans finditer gives,
    without a pass of ``re`` over the whole buffer."""
    found: list[tuple[int, int, str, Writer]] = []
    end = 0
    for index, at, _ in hits:
        if index != _SECRET or at - 2 < end:
            continue
        m = _REFERENCE_BYTES.match(data, at - 2)
        if m is not None:
            end = m.end()  # finditer goes on from there, whether the name is kept or not
            name = m.group(1)
            if len(name) <= NAME_MAX:
                found.append((m.start(), end, name.decode("ascii"), None))
    return found


def _hidden_marker(found: list, hits: list[tuple[int, int, int]]) -> bool:
    """Whether a marker (_HIDDEN, its HITS in the buffer) lies outside the raw references FOUND: only
    then can a decoded view hold another reference (a raw reference decodes to itself). The common
    body that carries its references plainly (every turn after a seal) is then not JSON-decoded as
    a whole (half a millisecond for 200 KB)."""
    starts = [f[0] for f in found]
    for _, at, _ in hits:
        i = bisect_right(starts, at) - 1
        if i < 0 or at >= found[i][1]:
            return True
    return False


def _more_references(decoded: bytes, raw_count: int) -> bool:
    """Whether DECODED (which holds the raw references too) holds one more, in
    this layer or, escaped twice, in the one below it."""
    if sum(1 for _ in find_references(decoded)) > raw_count:
        return True
    if b"\\" not in decoded and b"%" not in decoded:
        return False
    return sum(1 for _ in find_references(unquote_to_bytes(json_unescape(decoded)))) > raw_count


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_NESTING = 3  # the layers of SPEC §3, and one more


def json_nesting(doc: bytes, pos: int) -> int:
    """How many JSON strings enclose POS in DOC: 0 when DOC is no JSON
    document or POS lies outside its strings, 1 in a string, 2 in a string
    of a JSON document carried in a string, and so on."""
    depth = 0
    while depth < _JSON_NESTING and doc.lstrip()[:1] in (b"{", b"["):
        for m in _JSON_STRING.finditer(doc):
            if m.start() >= pos or pos < m.end():
                break
        else:
            return depth
        if not m.start() < pos < m.end() - 1:
            return depth
        depth += 1
        content = doc[m.start() + 1 : m.end() - 1]
        inside = pos - m.start() - 1
        before = json_unescape(content[:inside])  # POS starts a reference, never inside an escape
        doc, pos = before + json_unescape(content[inside:]), len(before)
    return depth


def field_nesting(raw: bytes, start: int) -> int:
    """json_nesting for a reference percent-encoded at START of RAW, read in
    the decoded form field or query parameter (or whole buffer) holding it."""
    first = max(raw.rfind(b"&", 0, start), raw.rfind(b"=", 0, start), raw.rfind(b"?", 0, start)) + 1
    last = raw.find(b"&", start)
    before = unquote_to_bytes(raw[first:start])
    return json_nesting(before + unquote_to_bytes(raw[start : len(raw) if last == -1 else last]), len(before))


def _json_strings(times: int) -> Callable[[bytes], bytes]:
    def write(value: bytes) -> bytes:
        for _ in range(times):
            value = json_string(value)
        return value

    return write


def json_string(value: bytes) -> bytes:
    """VALUE written inside a JSON string (UTF-8 text only, ValueError otherwise)."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the value is not UTF-8 text, which a JSON string cannot carry") from None
    return json.dumps(text, ensure_ascii=False)[1:-1].encode("utf-8")


def _writer(view, start: int, end: int, inner: Writer) -> Callable[[bytes], bytes]:
    # A value takes the place of a reference: every byte that is not plain in
    # every URL part is escaped (a `/` in a path segment stays one segment).
    strict = {"keep_plain": False} if isinstance(view, PercentView) else {}

    def write(value: bytes) -> bytes:
        return view.encode(inner(value) if inner else value, start, end, **strict)

    return write
