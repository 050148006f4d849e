"""The injector: references become values, only where the caller says.

The pipeline decides which names are bound to which location of a request;
this module only rewrites one location at a time and encodes the value for
its place (SPEC §4): raw in a header (never with CR, LF or NUL), percent-
encoded in a URL or form, JSON-escaped in a JSON string, standard padded
base64 when Basic credentials are re-encoded. It never decides policy and
never puts a value in an error message.
"""

from __future__ import annotations

import base64
import binascii
from collections import Counter
from collections.abc import Callable, Container, Mapping
from urllib.parse import quote, quote_plus

from ._references import (
    field_nesting,
    find_references_layered,
    json_nesting,
    json_string,
)
from ._views import decode_base64

Encoder = Callable[[bytes], bytes]


class InjectError(Exception):
    """A value cannot be written in the place its reference stands. Holds names only."""

    def __init__(self, name: str, place: str, why: str) -> None:
        super().__init__(f"cannot inject {name} into {place}: {why}")
        self.name = name
        self.place = place


def for_header(value: bytes) -> bytes:
    if any(c in value for c in b"\r\n\0"):
        raise ValueError("the value holds CR, LF or NUL, which a header cannot carry")
    return value


def for_url(value: bytes) -> bytes:
    return quote(value, safe="").encode("ascii")


def for_form(value: bytes) -> bytes:
    return quote_plus(value, safe="").encode("ascii")


for_json = json_string


def for_raw(value: bytes) -> bytes:
    return value


def inject(
    data: bytes,
    values: Mapping[str, bytes],
    names: Container[str],
    encode: Encoder,
    place: str,
    *,
    url: bool = False,
) -> tuple[bytes, Counter[str]]:
    """Replace every reference to a name in NAMES by its encoded value.

    References are recognised raw and through JSON escapes and percent-
    encoding (SPEC §3); a value replacing a reference written through a layer
    is written through the same layer. URL is kept for callers' clarity:
    every place recognises percent-encoded references. DATA comes back as
    the same object when nothing was injected.
    """
    counts: Counter[str] = Counter()
    out: list[bytes] = []
    pos = 0
    for start, end, name, writer in find_references_layered(data):
        if name not in names or name not in values:
            continue
        try:
            if writer is not None:
                encoded = writer(values[name])
            elif encode is for_json:
                # a JSON document in a JSON string: escaped once per string that encloses it
                encoded = values[name]
                for _ in range(max(1, json_nesting(data, start))):
                    encoded = for_json(encoded)
            elif encode in (for_url, for_form):
                # a JSON document in a query parameter or form field ({"k": "{{secret:…}}"})
                encoded = values[name]
                for _ in range(field_nesting(data, start)):
                    encoded = for_json(encoded)
                encoded = encode(encoded)
            else:
                encoded = encode(values[name])
            if writer is not None and encode is for_header:
                for_header(encoded)
        except ValueError as e:
            raise InjectError(name, place, str(e)) from None
        out += (data[pos:start], encoded)
        pos = end
        counts[name] += 1
    if not counts:
        return data, counts
    out.append(data[pos:])
    return b"".join(out), counts


def split_basic(header_value: bytes) -> tuple[bytes, bytes] | None:
    """(scheme word as sent, decoded credentials) of a Basic credentials value, else None.

    Read as leniently as any server would: padding may be left off and the
    URL-safe alphabet is accepted (SPEC §3: base64 in either alphabet, padded
    or not). Injection writes them back standard and padded (RFC 7617).
    """
    scheme, _, rest = header_value.strip().partition(b" ")
    text = rest.strip()
    if scheme.lower() != b"basic" or not text:
        return None
    try:
        return scheme, decode_base64(text, strict=True)
    except binascii.Error:
        return None


def inject_basic(
    header_value: bytes, values: Mapping[str, bytes], names: Container[str]
) -> tuple[bytes, Counter[str]]:
    """Inject into `Authorization: Basic` credentials and re-encode them (RFC 7617)."""
    parts = split_basic(header_value)
    if parts is None:
        return header_value, Counter()
    scheme, credentials = parts
    replaced, counts = inject(credentials, values, names, for_header, "Basic credentials")
    if not counts:
        return header_value, counts
    return scheme + b" " + base64.b64encode(replaced), counts
