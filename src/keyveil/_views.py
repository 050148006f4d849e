"""Decoded views of a buffer, each with its way back to the bytes it came from.

keyveil does not list what encoders write; it decodes what it inspects
(SPEC §3). A *view* is what one layer of encoding turns a span of a buffer
into — JSON-string unescaping, percent-decoding, one base64 run decoded —
and knows how to map a span of its decoded bytes back to the exact span of
the original, and how to write a replacement there in the carrier's own
encoding (JSON-escaped, percent-encoded, or the whole base64 run encoded
again with the same alphabet, padding and line width). Views of views give
the layered forms.

The module is sans-IO and knows nothing of values or names: it never holds
a secret, only bytes it was handed, and it must never log or raise them.
"""

from __future__ import annotations

import binascii
import bisect
import codecs
import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from json.decoder import JSONDecodeError, scanstring

import pybase64

from ._letters import reads_as_words
from ._matcher import FirstMatch, byte_class

B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_"
_STD_TO_URL = bytes.maketrans(b"+/", b"-_")
_URL_TO_STD = bytes.maketrans(b"-_", b"+/")
_HEX = b"0123456789abcdefABCDEF"


def is_escape(data: bytes, at: int) -> bool:
    """Whether the backslash at AT starts a JSON escape, not ends an escaped one
    (`\\\\`): an even number of backslashes stands right before it (counted over 64 bytes)."""
    before = data[max(0, at - 64) : at]
    return (len(before) - len(before.rstrip(b"\\"))) % 2 == 0


def escape_tail(data: bytes, at: int) -> int:
    """How many characters from AT end a `%XX` or JSON escape that starts right
    before AT, which a base64 run scan reads as base64: 2 after `%20`, 1 after
    `\\n`, 5 after `\\u2190`; 0 when no escape starts there."""
    if not at:
        return 0
    if data[at - 1] == 0x25:  # %
        return 2 if _all_hex(data[at : at + 2], 2) else 0
    if data[at - 1] != 0x5C or not is_escape(data, at - 1):
        return 0
    return 5 if data[at : at + 1] == b"u" and _all_hex(data[at + 1 : at + 5], 4) else 1


def _all_hex(text: bytes, n: int) -> bool:
    return len(text) == n and not text.strip(_HEX)


def to_standard_alphabet(text: bytes) -> bytes:
    """TEXT with the URL-safe base64 characters written in the standard alphabet."""
    return text.translate(_URL_TO_STD)


def a2b_base64(text) -> bytes:
    """What ``binascii.a2b_base64`` makes of TEXT (lenient: characters outside the
    alphabet skipped), at SIMD speed when TEXT is clean base64.

    pybase64 decodes only strictly valid text (the alphabet, padding at the end
    only, whole groups), which has one decoding, so both agree on it; anything
    else raises there and goes to binascii. binascii.Error when neither can."""
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return binascii.a2b_base64(text)


def decode_base64(text: bytes, strict: bool = False) -> bytes:
    """TEXT decoded as base64 in either alphabet (mixed too), padded or not.

    binascii.Error when it is none (with STRICT, also for misplaced padding
    or characters outside the alphabet)."""
    body = text.translate(_URL_TO_STD)
    if not body.endswith(b"="):
        body += b"=" * (-len(body) % 4)
    return binascii.a2b_base64(body, strict_mode=strict)


@dataclass(frozen=True, slots=True)
class Edit:
    """Replace DATA[start:end] by REPLACEMENT; NAMES counts the values it seals."""

    start: int
    end: int
    replacement: bytes
    names: tuple[str, ...]
    depth: int = 0  # how many layers down the value was found (0: raw)
    base64: bool = False  # a base64 run is re-encoded (vendor-signed fields keep theirs)
    layer: str = "raw"  # the view it was written back through last: raw, json, percent, base64
    glued: bool = False  # found in a base64 run decoded after a prefix (not from its first character)
    doubtful: bool = False  # read through a JSON view over a backslash that starts no escape (`\ `)
    #: read with `+` as a space outside a query or form: gives way, at the layer that guessed,
    #: to a reading of the same value that takes `+` as itself (not kept when lifted)
    guessed: bool = False

    @property
    def unsure(self) -> bool:
        """A reading that gives way to a sure one of the same value (``doubtful`` or ``guessed``)."""
        return self.doubtful or self.guessed


# -- JSON string escapes ------------------------------------------------------------------

# One escape per match, left to right, so `\\u0041` is `\\` then `u0041`.
# A high surrogate followed by a low one is one character (JSON's pairs).
_JSON_ESCAPE = re.compile(
    rb"\\(?:u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|([\"\\/bfnrt]))"
)
_SHORT = {b'"': b'"', b"\\": b"\\", b"/": b"/", b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t"}


def _json_piece(m: re.Match) -> bytes:
    high, low, single, short = m.groups()
    if high is not None:
        return _code_unit_bytes(0x10000 + ((int(high, 16) - 0xD800) << 10) + (int(low, 16) - 0xDC00))
    if single is not None:
        return _code_unit_bytes(int(single, 16))
    return _SHORT[short]


def _decode_mapped(raw: bytes, escapes, piece) -> tuple[bytes, list[int], list[int]]:
    """RAW with each escape match replaced by PIECE(match), and the map back.

    Unit i of the result starts at view_starts[i]; it came from raw_starts[i]
    when that is a plain run (mapped byte for byte), or from the escape at
    -1 - raw_starts[i] (mapped as a whole)."""
    out: list[bytes] = []
    raw_starts: list[int] = []
    view_starts: list[int] = []
    size = pos = 0
    for m in escapes:
        if m.start() > pos:
            raw_starts.append(pos)
            view_starts.append(size)
            out.append(raw[pos : m.start()])
            size += m.start() - pos
        decoded = piece(m)
        raw_starts.append(-1 - m.start())
        view_starts.append(size)
        out.append(decoded)
        size += len(decoded)
        pos = m.end()
    if pos < len(raw):
        raw_starts.append(pos)
        view_starts.append(size)
        out.append(raw[pos:])
        size += len(raw) - pos
    raw_starts.append(len(raw))
    view_starts.append(size)
    return b"".join(out), raw_starts, view_starts


def _surrogates(error: UnicodeError) -> tuple[bytes, int]:
    """Encode lone surrogates: U+DC80..DCFF back to the byte they escaped, others as CESU-8."""
    out = bytearray()
    for ch in error.object[error.start : error.end]:
        code = ord(ch)
        out += bytes([code - 0xDC00]) if 0xDC80 <= code <= 0xDCFF else ch.encode("utf-8", "surrogatepass")
    return bytes(out), error.end


codecs.register_error("keyveil.surrogates", _surrogates)


def _code_unit_bytes(code: int) -> bytes:
    return chr(code).encode("utf-8", "keyveil.surrogates")


# -- one buffer, several readers ------------------------------------------------------------

#: while a request is looked at, what was worked out about each of its buffers
_SHARED: ContextVar[dict | None] = ContextVar("keyveil_shared_scans", default=None)


@contextmanager
def shared_scans() -> Iterator[None]:
    """Within this block, a buffer's base64 runs and JSON view are worked out once.

    Detection and the sealer read the same request (SPEC §3a): both look for
    base64 runs in it and both JSON-unescape it. Both results are pure
    functions of the bytes, so inside the block each is kept by the buffer's
    identity and handed to the next reader. The block holds the buffers it
    was asked about and drops them all when it ends: nothing outlives one
    request. Outside such a block nothing is kept.
    """
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _shared(kind: str, data: bytes, key=None):
    """The entry kept for DATA (KIND, KEY) in the current block, or None (no block, or not yet worked out)."""
    cache = _SHARED.get()
    if cache is None or type(data) is not bytes:  # a bytearray may change under its id
        return None
    entry = cache.get((kind, id(data), key))
    # The entry holds DATA itself: an id is only trusted while its object lives.
    return entry if entry is not None and entry[0] is data else None


def _keep(kind: str, data: bytes, key, *value) -> None:
    cache = _SHARED.get()
    if cache is not None and type(data) is bytes:
        cache[(kind, id(data), key)] = (data, *value)


def worked_out(kind: str, data: bytes, key, compute: Callable[[bytes], object]):
    """COMPUTE(DATA), worked out once per buffer (KIND, KEY) in ``shared_scans``; outside one, each time."""
    entry = _shared(kind, data, key)
    if entry is not None:
        return entry[1]
    result = compute(data)
    _keep(kind, data, key, result)
    return result


def remember(kind: str, data: bytes, key, result) -> None:
    """Keep RESULT as what ``worked_out`` would work out for DATA (KIND, KEY), in ``shared_scans``:
    a scan made for several readers hands each its part."""
    _keep(kind, data, key, result)


def already_worked_out(kind: str, data: bytes, key):
    """What ``worked_out`` kept for DATA (KIND, KEY) in the current block, or None."""
    entry = _shared(kind, data, key)
    return entry[1] if entry is not None else None


def json_unescape(data: bytes) -> bytes:
    """DATA with every JSON string escape decoded (worked out once per buffer in ``shared_scans``)."""
    return worked_out("json", data, None, _json_unescape)


def _json_unescape(data: bytes) -> bytes:
    """DATA with every JSON string escape decoded; anything else kept as it is.

    The fast path runs the C JSON string scanner over text; its result is
    the same, byte for byte, as ``JsonView``'s mapped decoding
    (tests/test_views.py checks it), which is only built when a match needs
    mapping back. Bytes that are not UTF-8 text, and text with many
    backslashes that are no JSON escape, take the mapped decoder directly.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return JsonView.build(data).data
    if text.endswith("\\"):
        return JsonView.build(data).data  # the sentinel quote would be taken as an escape
    sentinel = text + '"'
    out: list[str] = []
    pos = 0
    end = len(text)
    errors = 0
    while pos <= end:
        # A stretch without a backslash holds no escape: taken as it is, with its
        # bare quotes, in one piece (a document of many short strings would
        # otherwise cost a scanstring call per quote).
        slash = text.find("\\", pos)
        if slash == -1:
            out.append(text[pos:])
            break
        quote = text.rfind('"', pos, slash)
        if quote != -1:
            out.append(text[pos : quote + 1])
            pos = quote + 1
        try:
            piece, nxt = scanstring(sentinel, pos, False)
        except JSONDecodeError as e:
            # Each error costs a pass over the text before it (for its line
            # number): after a few, the mapped decoder is cheaper.
            errors += 1
            bad = e.pos if sentinel[e.pos] == "\\" else e.pos - 1
            if errors > _FAST_ERRORS or bad < pos or sentinel[bad] != "\\":
                return JsonView.build(data).data
            if bad > pos:
                out.append(scanstring(sentinel[pos:bad] + '"', 0, False)[0])
            out.append("\\")
            pos = bad + 1
            continue
        out.append(piece)
        if nxt > end:
            break
        out.append('"')
        pos = nxt
    return "".join(out).encode("utf-8", "keyveil.surrogates")


_FAST_ERRORS = 4


class JsonView:
    """The JSON-unescaped view of a buffer, with a map back to the original."""

    kind = "json"
    __slots__ = ("data", "_raw_starts", "_view_starts", "_raw", "_slash")

    def __init__(self, raw: bytes, data: bytes, raw_starts: list[int], view_starts: list[int]) -> None:
        self.data = data
        self._raw = raw
        # Decoded units: unit i starts at raw_starts[i] / view_starts[i]; plain
        # bytes between escapes are one unit per run (mapped 1:1 inside).
        self._raw_starts = raw_starts
        self._view_starts = view_starts
        self._slash = b"\\/" in raw

    @classmethod
    def build(cls, raw: bytes) -> JsonView:
        return cls(raw, *_decode_mapped(raw, _JSON_ESCAPE.finditer(raw), _json_piece))

    def _unit(self, at: int) -> int:
        return bisect.bisect_right(self._view_starts, at) - 1

    def _raw_start(self, unit: int) -> int:
        start = self._raw_starts[unit]
        return -1 - start if start < 0 else start

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The raw span that decodes to view bytes [START, END) (widened to whole escapes)."""
        first = self._unit(start)
        last = self._unit(end - 1)
        if self._raw_starts[first] >= 0:
            raw_start = self._raw_starts[first] + (start - self._view_starts[first])
        else:
            raw_start = self._raw_start(first)
        if self._raw_starts[last] >= 0:
            raw_end = self._raw_starts[last] + (end - self._view_starts[last])
        else:
            raw_end = self._raw_start(last + 1)
        return raw_start, raw_end

    def boundary(self, at: int) -> bool:
        """Whether view offset AT falls between two raw bytes (not inside what one escape decodes to)."""
        unit = self._unit(at)
        return self._raw_starts[unit] >= 0 or self._view_starts[unit] == at

    @property
    def raw(self) -> bytes:
        return self._raw

    def escaped(self, raw_start: int, raw_end: int) -> bool:
        """Whether the raw span holds an escape of this layer."""
        return b"\\" in self._raw[raw_start:raw_end]

    def stray(self, raw_start: int, raw_end: int) -> bool:
        """Whether the raw span holds a backslash that starts no JSON escape (the span holds whole escapes)."""
        return _stray_backslash(self._raw[raw_start:raw_end])

    def encode(self, replacement: bytes, raw_start: int, raw_end: int, habit: tuple[int, int] | None = None) -> bytes:
        """REPLACEMENT as a JSON string writes it, keeping the `\\/` habit of the span (or of HABIT, a wider one)."""
        out = replacement.replace(b"\\", b"\\\\").replace(b'"', b'\\"')
        if any(c < 0x20 for c in out):
            out = re.sub(rb"[\x00-\x1f]", _json_control, out)
        raw_start, raw_end = habit or (raw_start, raw_end)
        if self._slash and _escapes_slash(self._raw[raw_start:raw_end]):
            out = out.replace(b"/", b"\\/")
        return out


class JsonWindow:
    """The JSON view of a window of a buffer, placed in the buffer's coordinates.

    A buffer full of escapes (prose with `\\n` and `\\"`) costs a Python step
    per escape to map back; a match needs only the few kilobytes around it.
    ``json_windows`` cuts the buffer where no escape is cut (no `\\` in the
    six bytes before, none at the cut: a surrogate pair stays whole), so each
    window decodes, on its own, to its part of the whole buffer's view.
    """

    kind = "json"
    __slots__ = ("data", "_inner", "_raw", "_raw_start", "_view_start")

    def __init__(self, raw: bytes, data: bytes, raw_start: int, raw_end: int, view_start: int) -> None:
        self._raw = raw
        self.data = data  # the whole buffer's view: offsets are the buffer's
        self._inner = JsonView.build(raw[raw_start:raw_end])
        self._raw_start = raw_start
        self._view_start = view_start

    @property
    def raw(self) -> bytes:
        return self._raw

    def agrees(self) -> bool:
        """Whether the window decodes to its part of the whole view (the two decoders agree)."""
        inner = self._inner.data
        return self.data[self._view_start : self._view_start + len(inner)] == inner

    def span(self, start: int, end: int) -> tuple[int, int]:
        a, b = self._inner.span(start - self._view_start, end - self._view_start)
        return a + self._raw_start, b + self._raw_start

    def holds(self, start: int, end: int) -> bool:
        """Whether view bytes [START, END) lie in this window."""
        return self._view_start <= start and end <= self._view_start + len(self._inner.data)

    def boundary(self, at: int) -> bool:
        at -= self._view_start
        return 0 <= at <= len(self._inner.data) and (at == len(self._inner.data) or self._inner.boundary(at))

    def escaped(self, raw_start: int, raw_end: int) -> bool:
        return b"\\" in self._raw[raw_start:raw_end]

    def stray(self, raw_start: int, raw_end: int) -> bool:
        return _stray_backslash(self._raw[raw_start:raw_end])

    def encode(self, replacement: bytes, raw_start: int, raw_end: int, habit: tuple[int, int] | None = None) -> bytes:
        shift = self._raw_start
        if habit is not None:
            habit = (habit[0] - shift, habit[1] - shift)
        return self._inner.encode(replacement, raw_start - shift, raw_end - shift, habit)


_WINDOW = 2048


def _stray_backslash(span: bytes) -> bool:
    return b"\\" in span and b"\\" in _JSON_ESCAPE.sub(b"", span)


def json_windows(raw: bytes, data: bytes, spans: list[tuple[int, int]]) -> list[JsonWindow]:
    """One JsonWindow around each of SPANS (offsets in DATA, RAW's JSON view), neighbours merged.

    Windows are cut at least _WINDOW bytes apart; each span gets the windows it lies in."""
    cuts = [0]
    at = _WINDOW
    while at < len(raw):
        while at < len(raw) and (raw[at] == 0x5C or raw.find(b"\\", max(0, at - 6), at) != -1):
            at += 1
        if at < len(raw):
            cuts.append(at)
        at += _WINDOW
    cuts.append(len(raw))
    # Decoded length of each window, in order, until the last span is placed.
    view_starts = [0]
    last = max(end for _, end in spans)
    for i in range(len(cuts) - 1):
        if view_starts[-1] > last:
            break
        view_starts.append(view_starts[-1] + len(_json_unescape(raw[cuts[i] : cuts[i + 1]])))
    wanted: set[int] = set()
    for start, end in spans:
        first = bisect.bisect_right(view_starts, start) - 1
        final = min(len(view_starts) - 2, bisect.bisect_right(view_starts, max(start, end - 1)) - 1)
        wanted.update(range(first, final + 1))
    windows = []
    for index in sorted(wanted):
        if windows and windows[-1][1] == index:
            windows[-1][1] = index + 1
        else:
            windows.append([index, index + 1])
    return [JsonWindow(raw, data, cuts[a], cuts[b], view_starts[a]) for a, b in windows]


def _escapes_slash(span: bytes) -> bool:
    return any(m.group(4) == b"/" for m in _JSON_ESCAPE.finditer(span))


_CONTROL = {0x08: b"\\b", 0x0C: b"\\f", 0x0A: b"\\n", 0x0D: b"\\r", 0x09: b"\\t"}


def _json_control(m: re.Match) -> bytes:
    code = m.group(0)[0]
    return _CONTROL.get(code) or b"\\u%04x" % code


# -- percent escapes -----------------------------------------------------------------------

_PERCENT = re.compile(rb"%[0-9A-Fa-f]{2}")
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


class PercentView:
    """The percent-decoded view of a buffer (`+` as space when PLUS), with a map back."""

    kind = "percent"
    __slots__ = ("data", "_raw", "_raw_starts", "_view_starts", "plus")

    def __init__(self, raw: bytes, plus: bool) -> None:
        self._raw = raw
        self.plus = plus
        data, self._raw_starts, self._view_starts = _decode_mapped(
            raw, _PERCENT.finditer(raw), lambda m: bytes([int(m.group(0)[1:], 16)])
        )
        # `+` and space are one byte each: the map stays as it is.
        self.data = _plus_to_space(raw, data, self._raw_starts) if plus else data

    span = JsonView.span
    boundary = JsonView.boundary
    _unit = JsonView._unit
    _raw_start = JsonView._raw_start

    @property
    def raw(self) -> bytes:
        return self._raw

    def escaped(self, raw_start: int, raw_end: int) -> bool:
        span = self._raw[raw_start:raw_end]
        return _PERCENT.search(span) is not None or (self.plus and b"+" in span)

    def stray(self, raw_start: int, raw_end: int) -> bool:
        return False  # a `%` that starts no escape is a `%` (quote writes none: its own is `%25`)

    def encode(
        self, replacement: bytes, raw_start: int, raw_end: int, habit: tuple[int, int] | None = None, keep_plain: bool = True
    ) -> bytes:
        """REPLACEMENT percent-encoded in the span's own habit (or HABIT's, a wider
        span): a byte the span wrote plainly stays plain (`=` in Basic
        credentials) unless not KEEP_PLAIN (a value injected in a URL), every
        other byte but the unreserved ones is escaped, in the span's hex case."""
        raw_start, raw_end = habit or (raw_start, raw_end)
        span = self._raw[raw_start:raw_end]
        # The span's own hex case; upper (RFC 3986's) where it shows none. Not the
        # buffer's: a stream sees only part of it, and any chunking must give the
        # output of one whole seal.
        lower = b"%" in span and re.search(rb"%[0-9]?[a-f]", span) is not None
        fmt = b"%%%02x" if lower else b"%%%02X"
        # `%`, `+` and space are always escaped: `+` means a space in forms and queries.
        # A control byte the span wrote escaped somewhere is escaped (`%0a` where a
        # plain line break also stands: a text body around percent-encoded base64), and
        # so is a backslash (`%5C` where the plain ones are a JSON string's own escapes
        # around the percent layer, `\u0069%5C%2F`: one written plainly would be read
        # as an escape).
        escaped = {c for m in _PERCENT.findall(span) if (c := int(m[1:], 16)) < 0x20 or c == 0x5C}
        plain = set(_PERCENT.sub(b"", span)) - {0x25, 0x2B, 0x20} - escaped if keep_plain else set()
        keep = _UNRESERVED | plain
        return b"".join(bytes([c]) if c in keep else fmt % c for c in replacement)


def _plus_to_space(raw: bytes, data: bytes, raw_starts: list[int]) -> bytes:
    # Only plain runs can hold a raw '+'; an escaped %2B stays '+'.
    if b"+" not in raw:
        return data
    out = bytearray(data)
    view = 0
    for i, start in enumerate(raw_starts[:-1]):
        nxt = raw_starts[i + 1]
        if start >= 0:
            end = nxt if nxt >= 0 else -1 - nxt
            chunk = raw[start:end]
            at = chunk.find(b"+")
            while at != -1:
                out[view + at] = 0x20
                at = chunk.find(b"+", at + 1)
            view += end - start
        else:
            view += 1
    return bytes(out)


# -- base64 runs ---------------------------------------------------------------------------

_CLASS = bytearray(256)
for _c in B64_ALPHABET:
    _CLASS[_c] = 1
for _c in b"\r\n":
    _CLASS[_c] = 2
B64_CLASSES = bytes(_CLASS)
_CLASS[ord("+")] = 0
B64_CLASSES_PLUS = bytes(_CLASS)  # where `+` is a space (queries, forms), it ends a run


@dataclass(frozen=True, slots=True)
class Run:
    """A base64 run: START..END of the buffer, line breaks included, padding excluded."""

    start: int
    end: int
    padding: int  # '=' bytes right after END
    #: another reading of the same lines: looked at only when the first one found nothing there
    alternative: bool = False


def base64_runs(data: bytes, min_chars: int, seed: int = 48, plus: bool = False) -> Iterator[Run]:
    """Every run of at least MIN_CHARS base64 characters; wrapped blocks joined across their line breaks.

    A run is looked for in each buffer segment of alphabet bytes and line
    breaks at least SEED long (or MIN_CHARS, if fewer). Lines
    are joined into one run only as a wrapper writes them: every line but
    the last of the same width (at least ``MIN_WIDTH``), the last no longer.
    A word on the line before a block, or a token on the line after it, is
    a run of its own.
    """
    heads = _run_heads(max(1, min(min_chars, seed)), plus)
    classes = None
    pos = 0
    while True:
        # Inside the next buffer segment (alphabet bytes and line breaks) long
        # enough to hold a run (_run_heads): most text has none at all.
        hit = heads.first_end(data, pos) - 1
        if hit < 0:
            break
        if classes is None:
            classes = data.translate(B64_CLASSES_PLUS if plus else B64_CLASSES)
        start = classes.rfind(b"\x00", 0, hit) + 1
        end = classes.find(b"\x00", hit)
        if end == -1:
            end = len(data)
        pos = end
        yield from _segment_runs(data, classes, start, end, min_chars)


def _segment_runs(data: bytes, classes: bytes, start: int, end: int, min_chars: int) -> Iterator[Run]:
    """The runs of one buffer segment START..END (alphabet bytes and line breaks between others)."""
    if end - start < min_chars:
        return  # too short to hold a value even with its line breaks
    breaks = _one_block(data, classes, start, end)
    if breaks is not None:  # one line, or one block of equal lines: taken whole, its breaks counted already
        if end - start - breaks >= min_chars:
            yield Run(start, end, _padding(data, end), False)
        return
    for run_start, run_end, alternative in _short_first_lines(data, _wrapped_blocks(data, start, end)):
        chars = run_end - run_start - _count_breaks(data, run_start, run_end)
        if chars >= min_chars:
            yield Run(run_start, run_end, _padding(data, run_end), alternative)


def runs_of(data: bytes, min_chars: int, plus: bool = False) -> list[Run]:
    """``base64_runs(DATA, MIN_CHARS, plus=PLUS)`` as a list, worked out once per buffer in ``shared_scans``.

    The runs of a shorter MIN_CHARS hold those of a longer one: every buffer
    segment a longer run lies in is found by the shorter seed too, and is cut
    into runs the same way; only the final length test differs. So a reader
    asking for longer runs than an earlier one gets that one's runs filtered.
    """
    entry = _shared("runs", data, plus)
    if entry is None or entry[1] > min_chars:
        runs = list(base64_runs(data, min_chars, plus=plus))
        _keep("runs", data, plus, min_chars, runs)
        return runs
    if entry[1] == min_chars:
        return list(entry[2])
    return [r for r in entry[2] if _chars_at_least(data, r, min_chars)]


def _chars_at_least(data: bytes, run: Run, n: int) -> bool:
    """Whether RUN holds N base64 characters (line breaks not counted)."""
    length = run.end - run.start
    if length < n:
        return False
    # A run's lines are at least MIN_WIDTH wide, so its breaks are far fewer than its characters.
    return length >= 2 * n or length - _count_breaks(data, run.start, run.end) >= n


def _padding(data: bytes, end: int) -> int:
    """How many bytes of '=' padding follow a run at END (on the next line too, as
    some wrappers put it, even one '=' on each line)."""
    at = end
    n = 0
    while n < 2:
        if data[at : at + 1] == b"=":
            at += 1
            n += 1
        elif data[at : at + 2] == b"\r\n" and data[at + 2 : at + 3] == b"=":
            at += 2
        elif data[at : at + 1] == b"\n" and data[at + 1 : at + 2] == b"=":
            at += 1
        else:
            break
    return at - end if n else 0


MIN_WIDTH = 12  # the narrowest line width taken for wrapping (MIME 76, PEM 64, GitHub 60)


def _wrapped_in_json_patterns() -> tuple[bytes, ...]:
    """Where a buffer may hold base64 wrapped inside a JSON string, whose lines are joined
    only in the JSON view (for the sealer's JSON trigger, _engine._triggers): a line of
    base64 as wide as the narrowest wrapping (`\\/` and doubled backslashes count), a line
    break escape (`\\n`, `\\r`), more base64: `[A-Za-z0-9+/_\\-]{12}\\[nr](?:[A-Za-z0-9+/_=-]|\\[/n])`,
    written as one expression for each escape and each sixteen bytes that may follow
    it. Hyperscan then looks for those three bytes (`\\nQ`) as literals, instead of
    confirming every `\\n` of prose against the rest: a quarter of the time on JSON
    prose, and still quick to compile (12 expressions, 7 ms; one per byte: 44 ms)."""
    line = rb"[A-Za-z0-9+/_\\-]{%d}" % MIN_WIDTH
    following = sorted(set(B64_ALPHABET + b"="))
    groups = [byte_class(bytes(following[i : i + 16])) for i in range(0, len(following), 16)] + [rb"\\[/n]"]
    return tuple(line + rb"\\" + escape + after for escape in (b"n", b"r") for after in groups)


#: ``_wrapped_in_json_patterns()``, for the sealer's JSON trigger
WRAPPED_IN_JSON_PATTERNS = _wrapped_in_json_patterns()


@functools.cache
def _run_heads(seed: int, plus: bool) -> FirstMatch:
    """Where base64_runs may find a run: SEED bytes in a row that are alphabet bytes
    or line breaks. Every run lies in a buffer segment of such bytes at least as long
    as the run (and SEED is no longer than that): a segment without SEED of them holds
    none, and most text has no such segment at all (words, short lines)."""
    classes = B64_CLASSES_PLUS if plus else B64_CLASSES
    segment = byte_class(bytes(b for b in range(256) if classes[b]))
    return FirstMatch([b"%s{%d}" % (segment, seed)], longest=seed)


def _count_breaks(data: bytes, start: int, end: int) -> int:
    # bytes.count is a plain loop; find is memchr: a run without `\r` (most) is counted once.
    crs = data.count(b"\r", start, end) if data.find(b"\r", start, end) != -1 else 0
    return data.count(b"\n", start, end) + crs


def _one_block(data: bytes, classes: bytes, start: int, end: int) -> int | None:
    """How many line breaks START..END (alphabet bytes and line breaks; CLASSES is
    DATA's base64_runs classes) holds when it is one run as it stands, else None
    (``_wrapped_blocks`` cuts it then). One run: a single line, or — the common
    case, at C speed — one block of equal LF lines (MIME, PEM bodies), at least
    MIN_WIDTH wide, three lines or more, a last line no longer that is no word
    of text (nor a word the block could not end with: ``_ends_without``), no `\r`
    and no PEM armour. Its classes are then exactly
    (width alphabet bytes, one break) repeated, then the last line: one
    comparison checks every break's place, and counts them."""
    first = data.find(b"\n", start, end)
    if first == -1:
        return 0 if data.find(b"\r", start, end) == -1 else None
    width = first - start
    if width < MIN_WIDTH or data[end - 1] == 0x0A or data.find(b"\r", start, end) != -1:
        return None
    if data.find(b"-", start, end) != -1 and data.find(b"-----", start, end) != -1:
        return None  # `-` is rare (URL-safe base64 only): `-----` is looked for only then
    breaks, last = divmod(end - start, width + 1)
    if breaks < 2 or not last:
        return None
    # Compared a few thousand lines at a time: a pattern as long as the run
    # would be a fresh megabyte (page faults) for every image.
    lines = _lines_pattern(width)
    step = len(lines)
    body_end = end - last
    for at in range(start, body_end, step):
        if not classes.startswith(lines if at + step <= body_end else lines[: body_end - at], at):
            return None
    if classes.find(b"\x02", body_end, end) != -1 or _text_after_block(data, body_end, end):
        return None
    if _word_like(data, body_end, end) and _ends_without(data, start, (body_end - 1 - width, body_end - 1), (body_end, end)):
        return None
    return breaks


@functools.lru_cache(maxsize=16)
def _lines_pattern(width: int) -> bytes:
    """The classes of whole lines of WIDTH characters and an LF, about 16 KiB of them."""
    return (b"\x01" * width + b"\x02") * max(1, 16384 // (width + 1))


def _wrapped_blocks(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, bool]]:
    """START..END (alphabet bytes and line breaks) cut into runs, line by line: one line each, or a wrapped block.

    A shorter line after a block may be its last line or a token of its own;
    the reading taken first is yielded first, the other as an alternative.
    (One line, or one block of equal lines, is taken whole by ``_one_block`` first.)
    """
    # PEM armour (`-----BEGIN …-----`, `-----END …`) is never part of a block.
    lines = [(m.start(), m.end()) for m in _LINE_CONTENT.finditer(data, start, end)]
    lines = [(a, b) for a, b in lines if not (data.startswith(b"-----", a) or data.endswith(b"-----", a, b))]
    i = 0
    while i < len(lines):
        first_start, first_end = lines[i]
        width = first_end - first_start
        glued = _glued_first_line(data, lines, i) if i + 2 < len(lines) else 0
        if glued == 1 and data[first_start] == 0x2F and not _word_like(data, *lines[i + 2]):
            glued = 2  # a path: a prefix before base64 is what paths hold (`/upload/…`)
        if glued == 1:
            # Only one full line after it: the longer line may also be the
            # block's first line with a prefix glued to it; that reading is
            # looked at when the usual one finds nothing.
            cut = first_end - (lines[i + 1][1] - lines[i + 1][0])
            yield cut, lines[i + 2][1], True
        elif glued == 2:
            # A first line longer than the full lines after it carries a prefix
            # glued to the block (`/upload/` before percent-encoded base64 in a
            # path): the block's first line is its last WIDTH characters.
            width = lines[i + 1][1] - lines[i + 1][0]
            yield first_start, first_end - width, False
            first_start = first_end - width
        # The lines of one block are parted by one line break each, LF or CRLF
        # (a text pasted through tools that normalised some lines mixes them;
        # every decoder ignores the difference). A blank line ends a block: the
        # paragraph after it is a run of its own, never joined to this one. A
        # shorter last line that reads as a word comes after a break of a kind
        # the block uses (a word after a LF below a CRLF block is text).
        j = i
        breaks: set[bytes] = set()
        if width >= MIN_WIDTH:
            while (
                j + 1 < len(lines)
                and lines[j + 1][1] - lines[j + 1][0] == width
                and _single_break(data, lines[j][1], lines[j + 1][0])
            ):
                breaks.add(data[lines[j][1] : lines[j + 1][0]])
                j += 1
        tail = (
            j + 1 < len(lines)
            and width >= MIN_WIDTH
            and 0 < lines[j + 1][1] - lines[j + 1][0] < width
            and _single_break(data, lines[j][1], lines[j + 1][0])
            and (not breaks or data[lines[j][1] : lines[j + 1][0]] in breaks or not _word_like(data, *lines[j + 1]))
        )
        # The shorter line ends the block, unless it stands alone (_stands_alone);
        # either way the other reading is looked at when this one finds nothing.
        if tail and not _stands_alone(data, first_start, lines[j], lines[j + 1], one_line=j == i):
            yield first_start, lines[j + 1][1], False
            yield first_start, lines[j][1], True
            i = j + 2
            continue
        yield first_start, lines[j][1], False
        if tail:
            yield first_start, lines[j + 1][1], True
        elif (
            j + 1 < len(lines)
            and width >= MIN_WIDTH
            and lines[j + 1][1] - lines[j + 1][0] > width
            and _single_break(data, lines[j][1], lines[j + 1][0])
        ):
            # A last line longer than the block's: text glued after the block
            # (`…/details` in a path) may have joined it. Its first WIDTH characters
            # are the block's last line in this reading, looked at when the usual
            # one finds nothing.
            yield first_start, lines[j + 1][0] + width, True
        i = j + 1


def _short_first_lines(data: bytes, blocks: Iterator[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """BLOCKS, where a line of base64 shorter than the block right below it (one line
    break between) is read as that block's first line: a label shares the first line
    (`X-Blob: ` and 50 characters, then 64-column lines), as a wrapper of the whole
    line writes it. The line and the block, each on its own, are the other reading."""
    out = list(blocks)
    firsts = [k for k, b in enumerate(out) if not b[2]]  # the first readings, in order
    for a, b in zip(firsts[-2::-1], firsts[:0:-1]):  # from the end: indices stay valid
        line, block = out[a], out[b]
        if line[1] - line[0] >= MIN_WIDTH and data.find(b"\n", line[0], line[1]) == -1 and _continues(data, line, block):
            out[b] = (block[0], block[1], True)
            out[a] = (line[0], line[1], True)
            out.insert(a, (line[0], block[1], False))
    return out


def _continues(data: bytes, line: tuple[int, int, bool], block: tuple[int, int, bool]) -> bool:
    """Whether BLOCK (two lines or more) is wider than LINE and starts one line break after it."""
    first = data.find(b"\n", block[0], block[1])
    if first == -1:
        return False
    width = first - block[0] - (data[first - 1] == 0x0D)
    return line[1] - line[0] < width and _single_break(data, line[1], block[0])


def _glued_first_line(data: bytes, lines: list[tuple[int, int]], i: int) -> int:
    """How many full lines of a narrower block follow line I, when I may be
    that block's first line with a prefix glued to it: 2 (two or more), 1
    (one, then a shorter last line, or a longer one: text glued after the
    block), or 0 (not that shape)."""
    first = lines[i][1] - lines[i][0]
    width = lines[i + 1][1] - lines[i + 1][0]
    if not MIN_WIDTH <= width < first:
        return 0
    # One line break each, LF or CRLF, mixed or not (as in a block's body).
    if not (_single_break(data, lines[i][1], lines[i + 1][0]) and _single_break(data, lines[i + 1][1], lines[i + 2][0])):
        return 0
    last = lines[i + 2][1] - lines[i + 2][0]
    # A last line longer than the block's may have text glued to it (`…/details`):
    # that is a last line too, of one full line.
    return 2 if last == width else 1


_LINE_CONTENT = re.compile(rb"[^\r\n]+")
_LOWER = re.compile(rb"[a-z]+")
_WORD = re.compile(rb"[A-Z]?[a-z]+|[A-Z]+")  # `ok`, `Thanks`, `OK`; not `ZcuuuJc`


def _word_like(data: bytes, start: int, end: int) -> bool:
    """Three or more lower-case letters, no padding after them: a word rather than a last line."""
    return end - start >= 3 and _LOWER.fullmatch(data, start, end) is not None and data[end : end + 1] != b"="


def _text_after_block(data: bytes, start: int, end: int) -> bool:
    """Whether the line START..END after a block is a word of text: four or more
    lower-case letters, and prose goes on after it (a space or a punctuation
    mark, not a line break, quote or padding)."""
    return end - start >= 4 and _word_like(data, start, end) and _prose_after(data, end)


def _prose_after(data: bytes, at: int) -> bool:
    """Whether prose goes on at AT, after a line: a space or a punctuation mark (not a line break, quote or padding)."""
    return data[at : at + 1] in (b" ", b":", b",", b".", b";", b"!", b"?")


def _ends_without(data: bytes, start: int, last: tuple[int, int], word: tuple[int, int]) -> bool:
    """Whether the block START..LAST (its last line) ends a base64 text as it stands, while
    with WORD, the line after it, it could not (``_ends_an_encoding``: `…\\nfix the` after
    whole groups; no encoder ends with `x` three past a group): the word is text."""
    chars = last[1] - start - _count_breaks(data, start, last[1])
    return _ends_an_encoding(data, last[0], last[1], chars) and not _ends_an_encoding(data, word[0], word[1], chars + word[1] - word[0])


def _opens_text(data: bytes, start: int, end: int) -> bool:
    """Whether the line START..END after a block opens text rather than ending the
    block: a MIME boundary (`--boundary42`, which base64 rarely starts with and
    multipart bodies put right after a base64 part), or a name before a colon
    (`User-Agent: curl`, `Note:`), which no encoder writes after a last line. The
    other reading is looked at when this one finds nothing."""
    return data.startswith(b"--", start) or data[end : end + 1] == b":"


def _text_goes_on(data: bytes, start: int, end: int) -> bool:
    """Whether the line START..END after one line of base64 is a word that text goes
    on after on the same line: a word's letters (`ok`, `Hi`, `OK`: no capital
    inside), then a space (`ok here again`). Asked only after a line that ends an
    encoding better without it (``_alone_ends_better``); else, and after two full
    lines or more, a short line then ` end` is the block's last line (a blob in a
    sentence). The other reading is looked at when this one finds
    nothing. (Only the byte after the line is asked: a stream has released nothing
    past it.)"""
    return _WORD.fullmatch(data, start, end) is not None and data[end : end + 1] == b" "


def _stands_alone(data: bytes, start: int, last: tuple[int, int], line: tuple[int, int], one_line: bool) -> bool:
    """Whether LINE, shorter than the block START..LAST (its last full line) and right
    below it, is text rather than the block's last line. After two or more full lines
    it is, when it is a word that text goes on after (`…\\ntoken please`); after one
    (ONE_LINE), too, when it reads as a word at all (only lower-case letters, no padding
    after it), which base64 rarely is and text often is, unless a common wrapper's
    line may end with it (``_wrappers_last_line``). Either way, a word the block could
    not end with (``_ends_without``), and a line that opens text (``_opens_text``)."""
    if _word_like(data, *line):
        if ((one_line and _line_ends_an_encoding(data, *last)) or _text_after_block(data, *line)) and not (
            _wrappers_last_line(data, last, line)
        ):
            return True
        if _ends_without(data, start, last, line):
            return True
    return _opens_text(data, *line) or (one_line and _text_goes_on(data, *line) and _alone_ends_better(data, last, line))


def _alone_ends_better(data: bytes, line: tuple[int, int], word: tuple[int, int]) -> bool:
    """Whether LINE ends a base64 text better without the WORD on the line after it: it
    ends one part way into a group (a wrapper's full line is a multiple of four
    characters: 76, 64, 60), or it ends one on a group's end while LINE and WORD
    together could not (`…fJF6` then `ok`: no encoder ends with `k` two past a group)."""
    return ((line[1] - line[0]) % 4 != 0 and _ends_an_encoding(data, *line)) or _ends_without(data, line[0], line, word)


#: the line widths of the common wrappers: GitHub's contents API, PEM, MIME
_WRAPPER_WIDTHS = frozenset((60, 64, 76))


def _wrappers_last_line(data: bytes, line: tuple[int, int], word: tuple[int, int]) -> bool:
    """Whether WORD, a short line of lower-case letters after one LINE of base64 as wide
    as a common wrapper writes, reads as that block's last line: the two together may
    end a base64 text, and its letters do not read like a word (``reads_as_words``:
    `uzk`, `eow`; not `log`, `see`, `says`).

    One in 15 three-character last lines is lower-case letters, one in 37 of four. A
    word of three letters may end the text with the line in one case of four (the
    bits test), so the letters are asked at the table's usual bar (about 18% of
    random ones pass for words; 8% of common short words fail: `two`, `you`). A
    word of four always may (whole groups): the letters alone decide, at a lower bar
    (random ones pass 26% of the time; 1 in 120 common words fails: `boy`)."""
    width, letters = line[1] - line[0], word[1] - word[0]
    return (
        width in _WRAPPER_WIDTHS
        and _ends_an_encoding(data, word[0], word[1], width + letters)
        and not reads_as_words([data[word[0] : word[1]]], at_least=-0.25 if letters == 3 else -1.5)
    )


def _line_ends_an_encoding(data: bytes, start: int, end: int) -> bool:
    """``_ends_an_encoding`` of the line START..END as it stands, or from after the tail of
    an escape glued to its start (`%2cdG9r…`: the run scan reads `2c` as base64)."""
    if _ends_an_encoding(data, start, end):
        return True
    tail = escape_tail(data, start)
    return bool(tail) and _ends_an_encoding(data, start + tail, end)


def _ends_an_encoding(data: bytes, start: int, end: int, chars: int | None = None) -> bool:
    """Whether the line START..END (the last of CHARS characters, if given) may end a
    base64 text: an encoder leaves the bits of a last character that hold no byte zero
    (`…AAB` cannot end one: `B` holds a 1 in them), so a line that leaves them set
    goes on on the next line."""
    chars = (end - start if chars is None else chars) % 4
    if chars == 0:
        return True
    if chars == 1:
        return False  # no base64 text is one character past a group
    return _SEXTET[data[end - 1]] & (0x0F if chars == 2 else 0x03) == 0


# Each base64 character's six bits, in either alphabet (`-_` are `+/`).
_SEXTET = bytes(B64_ALPHABET.find(bytes([b]).translate(_URL_TO_STD)) if b in B64_ALPHABET else 0 for b in range(256))


def _single_break(data: bytes, end: int, start: int) -> bool:
    return data[end:start] in (b"\n", b"\r\n")


class Base64View:
    """One base64 run decoded from character ALIGN on (0-3); the run is re-encoded as a whole."""

    kind = "base64"
    __slots__ = ("data", "run", "align", "_chars", "_urlsafe", "_width", "_first", "_newline", "_raw", "_rest")

    def __init__(self, raw: bytes, run: Run, align: int) -> None:
        self._raw = raw
        self.run = run
        self.align = align
        first_break = raw.find(b"\n", run.start, run.end)  # no copy of the run: found in place
        padding = raw[run.end : run.end + run.padding]
        if first_break == -1 and (b"\n" in padding or b"\r" in padding):
            # One line, its padding (or the rest of it) on the next: the line was as wide as the wrapping.
            cut = padding.find(b"\r") if b"\r" in padding else padding.find(b"\n")
            self._newline = b"\r\n" if b"\r" in padding else b"\n"
            self._width = run.end - run.start + cut
        elif first_break == -1:
            self._width = 0
            self._newline = b"\n"
        else:
            self._newline = b"\r\n" if first_break > run.start and raw[first_break - 1] == 0x0D else b"\n"
            self._width = first_break - run.start - (len(self._newline) - 1)
        # A first line shorter than the next (a label shared it) keeps its width.
        self._first = 0
        second_break = raw.find(b"\n", first_break + 1, run.end) if first_break != -1 else -1
        if second_break != -1:
            second = second_break - first_break - 1 - (raw[second_break - 1] == 0x0D)
            if second > self._width:
                self._first, self._width = self._width, second
        # The characters without line breaks (_chars) and a lone last one that
        # decodes to nothing (_rest) are worked out when reencode needs them.
        self._chars = None
        self._rest = b""
        self._urlsafe = raw.find(b"-", run.start, run.end) != -1 or raw.find(b"_", run.start, run.end) != -1
        if align == 0 and not self._urlsafe:
            self.data = self._decode_whole(first_break == -1 and raw.find(b"\r", run.start, run.end) == -1)
        else:
            self.data = None
        if self.data is None:
            self._split_chars()
            body = self._chars[align:]
            usable_body = body[: len(body) - len(self._rest)]
            if self._urlsafe:
                usable_body = usable_body.translate(_URL_TO_STD)
            try:
                self.data = a2b_base64(usable_body + b"=" * (-len(usable_body) % 4))
            except binascii.Error:  # pragma: no cover - every byte is from the alphabet
                self.data = b""

    def _decode_whole(self, one_line: bool) -> bytes | None:
        """The run decoded from its first character, at C speed, or None when this
        way cannot say (then the characters are joined and decoded as for any
        alignment). The standard decoder skips line breaks and stops at the
        padding that completes the last group, so the run as it stands, with its
        own padding or with `==`, decodes to what its characters padded as
        needed do; it fails only when the padding is short, or on a lone last
        character (which the characters' path keeps aside). ONE_LINE: the run
        holds no line break, so its length is its number of characters."""
        run = self.run
        if one_line and (run.end - run.start) % 4 == 1:
            return None  # a lone last character
        with memoryview(self._raw) as view:
            try:
                if not one_line:
                    # Line breaks dropped in one pass, then the clean text at SIMD speed.
                    text = bytes(view[run.start : run.end + run.padding]).translate(None, b"\r\n")
                    return a2b_base64(text if run.padding or len(text) % 4 == 0 else text + b"==")
                if run.padding:
                    # The run and its own padding: no copy.
                    return a2b_base64(view[run.start : run.end + run.padding])
                if (run.end - run.start) % 4 == 0:
                    return a2b_base64(view[run.start : run.end])  # whole groups: no padding, no copy
                return a2b_base64(b"".join((view[run.start : run.end], b"==")))
            except binascii.Error:
                return None

    def _split_chars(self) -> None:
        """Set _chars (the run's characters, line breaks left out) and _rest."""
        if self._chars is not None:
            return
        text = self._raw[self.run.start : self.run.end]
        chars = text.replace(b"\r", b"").replace(b"\n", b"")
        self._chars = chars
        body = max(0, len(chars) - self.align)
        self._rest = chars[len(chars) - 1 :] if body % 4 == 1 else b""  # a lone last character, which decodes to nothing: kept as it is

    def _alphabet(self, kept: bytes, rewritten: bytes) -> bool:
        """Whether the rewritten characters are written URL-safe: as the ones they
        replace show it, else as the nearest kept character that shows it (not a
        path's `-` far before the payload when the payload shows `/`)."""
        if b"-" in rewritten or b"_" in rewritten:
            return True
        if b"+" in rewritten or b"/" in rewritten:
            return False
        url = max(kept.rfind(b"-"), kept.rfind(b"_"))
        std = max(kept.rfind(b"+"), kept.rfind(b"/"))
        return url > std

    def reencode(self, decoded: bytes, first_changed: int = 0) -> Edit:
        """The edit that writes DECODED in place of this run from its alignment on.

        The groups before FIRST_CHANGED (a decoded offset) keep their characters
        as they were (a path before the payload, in whatever alphabet)."""
        self._split_chars()
        kept = first_changed // 3
        body = self._chars[self.align :]
        head = body[: 4 * kept]
        decoded = decoded[3 * kept :]
        encoded = binascii.b2a_base64(decoded, newline=False)
        urlsafe = self._alphabet(self._chars[: self.align] + head, body[4 * kept :])
        if not (self.run.padding > 0 or (len(body) % 4 == 0 and not urlsafe)):
            encoded = encoded.rstrip(b"=")
        if urlsafe:
            encoded = encoded.translate(_STD_TO_URL)
        text = self._chars[: self.align] + head + encoded + self._rest
        if self._width:
            width, first = self._width, self._first
            lines = [text[:first]] if first else []
            lines += [text[i : i + width] for i in range(first, len(text), width)]
            text = self._newline.join(lines)
        # The run's own '=' padding is replaced along with it.
        return Edit(self.run.start, self.run.end + self.run.padding, text, ())

