"""The forms of a value: the byte strings under which a value may travel.

SPEC §3 lists them: raw, as a JSON string encoder may write it, percent-
encoded, and base64 at any offset inside a longer base64 run. This module
turns one value into the exact byte patterns the matcher searches for, and
says for each how its reference must be written in its place. It is pure
and runs only when the vault or the rules change, never per request.
"""

from __future__ import annotations

import base64
import enum
import itertools
import re
from dataclasses import dataclass
from urllib.parse import quote, quote_plus

B64_STD = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
B64_URL = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
#: every byte that may sit inside a base64 run of either alphabet (not '=')
B64_RUN_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_"


class Kind(enum.Enum):
    RAW = "raw"
    JSON = "json"
    PERCENT = "percent"
    B64 = "base64"


@dataclass(frozen=True, slots=True)
class Form:
    """One byte pattern of one value.

    For base64 forms the pattern is the part of the encoding that depends on
    the value alone: ``offset`` bytes of the group before it are unknown (0,
    1 or 2) and ``trailing`` bytes after it complete its last group.
    """

    pattern: bytes
    kind: Kind
    urlsafe: bool = False
    offset: int = 0
    trailing: int = 0
    upper_hex: bool = True


# Characters a JSON encoder may choose to write as \uXXXX: Go/Gson escape the
# HTML-sensitive ones, Gson also '=' and "'".
_HTML_SAFE = frozenset("<>&")
_HTML_SAFE_GSON = frozenset("<>&='")
_JSON_PLAIN = re.compile(r"[A-Za-z0-9 !#$%()*+,.:;?@\[\]^_`{|}~-]*")
_PERCENT_PLAIN = re.compile(rb"[A-Za-z0-9._-]*")
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _json_escape(
    text: str, *, slash: bool, html: frozenset[str], ascii_only: bool, upper: bool, short: bool
) -> str:
    hexfmt = "\\u{:04X}" if upper else "\\u{:04x}"
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _SHORT_ESCAPES and (short or ch in '"\\'):
            out.append(_SHORT_ESCAPES[ch])
        elif code < 0x20 or ch in html or ch in "\u2028\u2029" and html:
            out.append(hexfmt.format(code))
        elif ch == "/" and slash:
            out.append("\\/")
        elif code > 0x7E and ascii_only:
            if code > 0xFFFF:
                code -= 0x10000
                out.append(hexfmt.format(0xD800 + (code >> 10)) + hexfmt.format(0xDC00 + (code & 0x3FF)))
            else:
                out.append(hexfmt.format(code))
        else:
            out.append(ch)
    return "".join(out)


def json_forms(value: bytes) -> set[bytes]:
    """Every way a mainstream JSON encoder writes VALUE inside a string literal."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return set()
    if _JSON_PLAIN.fullmatch(text):
        return {value}  # nothing any encoder would escape: the raw form covers it
    if text.isascii():  # the usual case: one C-speed translate per encoder style
        return {text.translate(table).encode("ascii") for table in _JSON_ASCII_TABLES}
    forms = set()
    for slash, html, ascii_only, upper, short in itertools.product(
        (False, True), (frozenset(), _HTML_SAFE, _HTML_SAFE_GSON), (False, True), (False, True), (True, False)
    ):
        forms.add(
            _json_escape(text, slash=slash, html=html, ascii_only=ascii_only, upper=upper, short=short).encode(
                "utf-8"
            )
        )
    return forms


_JSON_ASCII_TABLES = tuple(
    {
        c: _json_escape(chr(c), slash=slash, html=html, ascii_only=True, upper=upper, short=short)
        for c in range(128)
    }
    for slash, html, upper, short in itertools.product(
        (False, True), (frozenset(), _HTML_SAFE, _HTML_SAFE_GSON), (False, True), (True, False)
    )
)


# The sets of characters common encoders leave alone, besides letters and digits.
_PERCENT_SAFE = (
    "-._~",  # RFC 3986 unreserved (Python quote(safe=""), Go QueryEscape)
    "-._~/",  # Python quote() default
    "-_.!~*'()",  # JavaScript encodeURIComponent
    "-_.!~*'();/?:@&=+$,#",  # JavaScript encodeURI
    "-._*",  # HTML form encoding (application/x-www-form-urlencoded)
)


def percent_forms(value: bytes) -> dict[bytes, bool]:
    """Percent-encodings of VALUE by common encoders → whether the hex is upper case."""
    if _PERCENT_PLAIN.fullmatch(value):
        return {value: True}
    text = value.decode("latin-1")  # one char per byte, so a table per encoder applies
    forms: dict[bytes, bool] = {}
    for table, upper in _PERCENT_TABLES:
        forms.setdefault(text.translate(table).encode("ascii"), upper)
    return forms


def _percent_table(safe: str, plus: bool, upper: bool) -> dict[int, str]:
    table = {}
    for b in range(256):
        encoded = (quote_plus if plus else quote)(bytes([b]), safe=safe)
        table[b] = encoded if upper else _lower_hex(encoded)
    return table


def _lower_hex(text: str) -> str:
    parts = text.split("%")
    return parts[0] + "".join("%" + p[:2].lower() + p[2:] for p in parts[1:])


_PERCENT_TABLES = tuple(
    (_percent_table(safe, plus, upper), upper)
    for upper in (True, False)
    for safe in _PERCENT_SAFE
    for plus in (False, True)
)


_REFERENCE_TABLES = {upper: _percent_table("-._~", False, upper) for upper in (True, False)}


def base64_forms(value: bytes) -> list[Form]:
    """The value-only part of base64(VALUE) at each byte offset, both alphabets."""
    forms = []
    for offset in (0, 1, 2):
        encoded = base64.b64encode(b"\0" * offset + value + b"\0\0")
        trailing = (3 - (offset + len(value)) % 3) % 3
        groups = (offset + len(value) + trailing) // 3
        first = 1 if offset else 0
        last = groups - (1 if trailing else 0)  # exclusive
        stable = encoded[first * 4 : last * 4]
        for urlsafe in (False, True):
            pattern = stable.translate(_STD_TO_URL) if urlsafe else stable
            forms.append(Form(pattern, Kind.B64, urlsafe=urlsafe, offset=offset, trailing=trailing))
    return forms


_STD_TO_URL = bytes.maketrans(b"+/", b"-_")
_URL_TO_STD = bytes.maketrans(b"-_", b"+/")


def forms_of(value: bytes) -> list[Form]:
    """All forms of VALUE, strongest kind first (raw, JSON, percent, base64).

    Each pattern comes once, except that a base64 pattern comes once per byte
    offset it stands for: a periodic value ("00000000") has the same pattern
    at two offsets, and only decoding tells which one is there.
    """
    plain: set[bytes] = set()
    base64_seen: set[tuple[bytes, int]] = set()
    out: list[Form] = []

    def add(form: Form) -> None:
        if not form.pattern or form.pattern in plain:
            return
        if form.kind is Kind.B64:
            if (form.pattern, form.offset) in base64_seen:
                return
            base64_seen.add((form.pattern, form.offset))
        else:
            plain.add(form.pattern)
        out.append(form)

    add(Form(value, Kind.RAW))
    for pattern in sorted(json_forms(value)):
        add(Form(pattern, Kind.JSON))
    for pattern, upper in sorted(percent_forms(value).items()):
        add(Form(pattern, Kind.PERCENT, upper_hex=upper))
    for form in base64_forms(value):
        add(form)
    return out


def percent_reference(reference: bytes, upper: bool) -> bytes:
    """REFERENCE percent-encoded the way it replaces a percent-encoded value."""
    table = _REFERENCE_TABLES[upper]  # quote(reference, safe=""), in that hex case
    return reference.decode("ascii").translate(table).encode("ascii")


def b64encode(data: bytes, urlsafe: bool) -> bytes:
    encoded = base64.b64encode(data)
    return encoded.translate(_STD_TO_URL) if urlsafe else encoded


def b64decode(data: bytes) -> bytes:
    """Strict decode of a run in either alphabet (mixed runs decode too). Raises ValueError."""
    import binascii

    try:
        return binascii.a2b_base64(data.translate(_URL_TO_STD), strict_mode=True)
    except binascii.Error as e:
        raise ValueError(str(e)) from None
