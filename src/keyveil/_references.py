"""References: the ``{{secret:NAME}}`` text that stands in for a value.

This module finds, parses and formats references exactly per SPEC §2. It
knows nothing of values: it never sees one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import ahocorasick_rs

from urllib.parse import unquote_to_bytes

from ._views import JsonView, PercentView, json_unescape

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
_MARKERS = ahocorasick_rs.BytesAhoCorasick([b"{secret:", b"Bsecret", b"bsecret"])


def may_hold_reference(data: bytes) -> bool:
    """False when DATA certainly holds no reference (the common case, checked fast)."""
    return bool(_MARKERS.find_matches_as_indexes(data))


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
    found: list[tuple[int, int, str, Writer]] = [(s, e, n, None) for s, e, n in find_references(data)]
    if _depth < _REFERENCE_LAYERS and may_hold_reference(data):
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


def _more_references(decoded: bytes, raw_count: int) -> bool:
    """Whether DECODED (which holds the raw references too) holds one more, in
    this layer or, escaped twice, in the one below it."""
    if sum(1 for _ in find_references(decoded)) > raw_count:
        return True
    if b"\\" not in decoded and b"%" not in decoded:
        return False
    return sum(1 for _ in find_references(unquote_to_bytes(json_unescape(decoded)))) > raw_count


def _writer(view, start: int, end: int, inner: Writer) -> Callable[[bytes], bytes]:
    def write(value: bytes) -> bytes:
        return view.encode(inner(value) if inner else value, start, end)

    return write
