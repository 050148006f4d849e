"""Values nobody registered, found in a request and remembered as ``detected/KIND-ID`` (SPEC §3a).

The detector (``_detect``) reads one buffer; a request carries a token in many
forms (a JSON string with ``\\/`` and ``\\u`` escapes, percent-encoding, base64
of Basic credentials, two of those at once). ``RequestDetector.find`` runs the
detector once over each part of a request and over every decoded view of it
that could hold a token, and names each value found with its keyed ID. Once
found, a value is sealed by the ordinary sealer like a registered one, in
every form of SPEC §3: finding it once, in any view, is enough.

The key of the IDs lives beside the vault key material (``HOME/vault/
detection-key``, mode 0600), created once per home and never rotated, so IDs
stay the same across restarts (the agent's history keeps its references).

This module is pure but for reading and creating that key file, and never puts
a value in a message, a log line or a repr: only names and kinds.
"""

from __future__ import annotations

import binascii
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote_to_bytes

from ._detect import MIN_RUN, PRIVATE_KEY, TOKEN_ESCAPE, TOKEN_ESCAPE_PATTERN, Detector, detected_name, shipped_detector
from ._errors import VaultError
from ._views import Base64View, is_escape, json_unescape, runs_of, to_standard_alphabet

#: every detected value is named under this prefix; such a name is never bound
DETECTED_PREFIX = "detected/"
KEY_BYTES = 32
#: decoded layers looked into below a part: SPEC §3 asks for two; three, as the sealer
#: (_engine.MAX_LAYERS), for a tool result that carries an API's JSON answer, its base64
#: inside (JSON in JSON, then base64)
MAX_DEPTH = 3
# The parts RequestDetector remembers as clean: this long at most, this many, this many bytes in all
# (a client sending ever new header values empties the set now and then; nothing else changes).
_CLEAN_BYTES = 4096
_CLEAN_ENTRIES = 4096
_CLEAN_HELD = 4 << 20
_SHORT_RUN = 512  # a run up to this long is decoded from each of its four offsets (a prefix may shift it)


def is_detected(name: str) -> bool:
    return name.startswith(DETECTED_PREFIX)


def detection_key(vault_dir: Path) -> bytes:
    """The per-home key of detected IDs, created (0600, never overwritten) on first use."""
    path = Path(vault_dir) / "detection-key"
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = os.urandom(KEY_BYTES)
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another keyveil process made it meanwhile: use that one
            return detection_key(vault_dir)
        except OSError as e:
            raise VaultError(f"cannot create the detection key {path}: {e.strerror}; check the vault folder's owner and mode") from None
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        return key
    except OSError as e:
        raise VaultError(f"cannot read the detection key {path}: {e.strerror}; check its owner and mode") from None
    if len(key) != KEY_BYTES:
        raise VaultError(
            f"the detection key {path} is corrupt (not {KEY_BYTES} bytes): restore it from a backup, or "
            "remove it (every detected reference then gets a new ID)"
        )
    return key


@dataclass(frozen=True, slots=True, repr=False)
class Found:
    """One value found in a request: its name, its kind, the value."""

    name: str
    kind: str
    value: bytes
    #: the bytes around it in the view it was found in (MARGIN each side): to tell
    #: whether it overlaps a registered value there
    around: bytes = b""

    def __repr__(self) -> str:
        return f"Found({self.name!r}, <{len(self.value)} bytes>)"

    __str__ = __repr__


class RequestDetector:
    """The detector, the key of IDs and the views of a request, together. Build once per home."""

    def __init__(self, detector: Detector, key: bytes) -> None:
        self.detector = detector
        self._key = key
        #: short parts (header fields, paths) in which nothing was detected: a client sends the
        #: same ones every time, and what the detector finds in a buffer depends on its bytes alone
        self._clean: set[bytes] = set()
        self._clean_held = 0

    def name(self, kind: str, value: bytes) -> str:
        return detected_name(kind, value, self._key)

    def find(
        self, parts: Iterable[bytes], known: frozenset[bytes] | set[bytes] = frozenset(), margin: int = 0,
        hits: Callable[[bytes], list[tuple[int, int, int]]] | None = None,
    ) -> list[Found]:
        """Every value found in PARTS or their decoded views and not in KNOWN, once each, in order. Never capped.

        HITS: the detector's scan of a buffer (``Detector.hits``), made by the sealer
        when it compiled the detector's expressions with its values
        (``Sealer.companion_hits``): then a buffer both read is scanned once."""
        seen: dict[bytes, Found] = {}
        hits = _once(hits or self.detector.hits)
        clean = self._clean
        for part in parts:
            if not part or (type(part) is bytes and part in clean):
                continue
            found = False
            for view in views(part, detector=self.detector, hits=hits):
                for d in self.detector.find(view, hits(view)):
                    found = True
                    if d.value not in seen and d.value not in known:
                        around = view[max(0, d.start - margin) : d.end + margin] if margin else b""
                        seen[d.value] = Found(self.name(d.kind, d.value), d.kind, d.value, around)
            if not found and type(part) is bytes and len(part) <= _CLEAN_BYTES:
                self._keep_clean(part)
        return list(seen.values())

    def _keep_clean(self, part: bytes) -> None:
        if len(self._clean) >= _CLEAN_ENTRIES or self._clean_held + len(part) > _CLEAN_HELD:
            self._clean.clear()
            self._clean_held = 0
        self._clean.add(part)
        self._clean_held += len(part)


def _once(hits: Callable[[bytes], list]) -> Callable[[bytes], list]:
    """HITS, asked once per buffer (views and detections read the same scan)."""
    kept: dict[int, tuple[bytes, list]] = {}

    def once(data: bytes) -> list:
        entry = kept.get(id(data))
        if entry is None or entry[0] is not data:
            entry = kept[id(data)] = (data, hits(data))
        return entry[1]

    return once


def views(
    data: bytes, depth: int = 0, detector: Detector | None = None, hits: Callable[[bytes], list] | None = None
) -> Iterator[bytes]:
    """DATA, then the decoded views of it that may hold a token the raw bytes hide, MAX_DEPTH layers down.

    A view is built only where an escape could cut or hide a token, so that a
    body without such escapes costs one scan (SPEC §3 forms; the sealer, once
    it knows the value, seals every form exactly):

    - JSON: where an escape can be inside a token -- ``\\/`` (a `/` of a base64
      token, a webhook path), ``\\u`` escapes of ASCII letters and digits (each an
      escape, not an escaped backslash and text: ``\\\\/`` in source code), and a
      PEM private key block whose line breaks are ``\\n``. Plain ``\\n`` and ``\\"`` between
      tokens need no view: the detector takes them as boundaries;
    - percent-encoding: each run of token characters that holds a ``%XX`` escape,
      decoded on its own (with ``+`` as a space too);
    - base64: every run long enough for a token whose decoding is text (a run
      that decodes to binary -- an image, a hash, a word -- holds no token).
    """
    yield data
    if depth >= MAX_DEPTH:
        return
    if detector is None:  # asked alone (tests): the shipped table
        detector = shipped_detector()
    hits = hits or _once(detector.hits)
    runs = runs_of(data, MIN_RUN) if len(data) >= MIN_RUN else []
    if b"\\" in data and (
        _json_view_needed(data, hits(data), detector.view_base) or _block_wrapped_in_json(data, runs)
    ):
        decoded = json_unescape(data)
        if decoded != data:
            yield from views(decoded, depth + 1, detector, hits)
    if b"%" in data:
        pieces = _percent_runs(data)
        if pieces:
            yield from views(pieces, depth + 1, detector, hits)
    if runs:
        for run in runs:
            if run.end - run.start <= _SHORT_RUN:
                if not _may_hold_a_detection(data, run):
                    continue
                offsets = (0, 1, 2, 3)
            else:
                offsets = (0,)
            chars = _head_chars(data, run)
            for align in offsets:
                if not _may_read_as_text(chars, align) or not _textual(_head(chars, align)):
                    continue
                decoded = Base64View(data, run, align).data
                if _textual(decoded):
                    yield from views(decoded, depth + 1, detector, hits)


#: the header of what the private-key shape takes (config/detectors.yaml): a certificate's is not one
_PEM_KEY = re.compile(rb"-----BEGIN [A-Z0-9 ]{0,64}PRIVATE KEY")


def _json_view_needed(data: bytes, hits: list[tuple[int, int, int]], base: int) -> bool:
    """A token escape, a private key whose line breaks are `\\n` (the regex runs only where
    its literal occurs), or base64 wrapped with `\\n` escapes (a file from the GitHub contents
    API): its lines are joined only in the JSON view, and a token lies across them. HITS: the
    detector's scan of DATA, which looks for the escapes and the key's header too (VIEW_TRIGGERS,
    from index BASE)."""
    key = False
    for index, _, end in hits:
        if index == base + TOKEN_ESCAPE:
            # `\\/` or `\\u0041` that is an escape, not `\\\\/`: an escaped backslash and then text
            # (source code, a regex, a Windows path), whose view would only halve the backslashes;
            # and that a token could hold: a token character or another escape beside it (not
            # `rstrip("\\/")` in source code).
            start = end - (2 if data[end - 1] == 0x2F else 6)
            if _inside_a_token(data, start, end) and is_escape(data, start):
                return True
        elif index == base + PRIVATE_KEY:
            key = True
    return key and b"\\n" in data and _PEM_KEY.search(data) is not None


def _inside_a_token(data: bytes, start: int, end: int) -> bool:
    """Whether the escape START..END has a token character before it, or one or another such
    escape after it (a token written in escapes: `\\u0067\\u0068p_…`)."""
    if start > 0 and _TOKEN_CHAR[data[start - 1]]:
        return True
    return end < len(data) and (_TOKEN_CHAR[data[end]] == 1 or _TOKEN_ESCAPE_AT.match(data, end) is not None)


_TOKEN_CHAR = bytes(1 if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "+/=_-.") else 0 for b in range(256))
#: VIEW_TRIGGERS' token escape, matched at one place
_TOKEN_ESCAPE_AT = re.compile(TOKEN_ESCAPE_PATTERN)


#: the next line of a block: base64 to its end (an escaped break, a quote, the end of the
#: buffer), not a line of code or prose after a long word
_BASE64_LINE = re.compile(rb"(?:[A-Za-z0-9+/_-]|\\/)+={0,2}(?:\\+[nr\"]|\"|$)")


_LINE_END = re.compile(rb"(?:\\+[nr\"]|\")$")


def _block_wrapped_in_json(data: bytes, runs) -> bool:
    """A base64 run (MIN_RUN or more characters: a line of MIME, PEM or GitHub wrapping) that a
    `\\n` or `\\r` escape (of any depth: `\\\\n`) follows, and then a line of base64: a
    block wrapped inside a JSON string, whose lines are joined only in the JSON view. The
    runs are those the base64 views look for anyway; code and prose seldom have one there.
    (The sealer's test, _views.WRAPPED_IN_JSON_PATTERNS, is broader: any 12 characters before the
    break. It knows the values; detection reads every view it builds, so it builds fewer.)"""
    n = len(data)
    for run in runs:
        i = end = run.end + run.padding
        while data[i : i + 1] == b"\\":
            i += 1
        if end < i < n - 1 and data[i] in b"nr" and (m := _BASE64_LINE.match(data, i + 1)) is not None:
            # Its lines are joined in the JSON view to be decoded there, which only a block
            # that may read as text is (the base64 views test its head, in this line and the
            # next): option names, constants, paths before a line break in source code are not.
            line = _LINE_END.sub(b"", m.group()).replace(b"\\/", b"/").rstrip(b"=")
            if any(_may_be_text(_head_chars(data, run) + to_standard_alphabet(line), a) for a in range(4)):
                return True
    return False


def _may_be_text(chars: bytes, align: int) -> bool:
    """`_may_read_as_text` of the start of a block's head: as strict once it holds a whole head
    (91 characters), else only when more than any head may hold cannot be text."""
    bad, head = _bad_bytes(chars[:91], align)
    return 10 * bad <= head if len(chars) >= 91 else bad <= _TEXT_SLACK


_PERCENT_ESCAPE = re.compile(rb"%[0-9A-Fa-f]{2}")
# Bytes a percent-encoded token is written with: unreserved characters, escapes, `+` for a space.
_URLISH = bytes(1 if (chr(b).isascii() and (chr(b).isalnum() or chr(b) in "%-._~+/=:")) else 0 for b in range(256))


_URL_RUN = re.compile(rb"[A-Za-z0-9%\-._~+/=:]*")


def _percent_runs(data: bytes) -> bytes:
    """Each run of URL characters holding a ``%XX`` escape, decoded (twice when `+` may be a space), one per line."""
    out: list[bytes] = []
    pos = 0
    while (m := _PERCENT_ESCAPE.search(data, pos)) is not None:
        start = _run_start(data, m.start(), pos)
        end = _URL_RUN.match(data, m.end()).end()
        run = data[start:end]
        out.append(unquote_to_bytes(run))
        if b"+" in run:
            out.append(unquote_to_bytes(run.replace(b"+", b" ")))
        pos = end
    return b"\n".join(out)


def _run_start(data: bytes, at: int, floor: int) -> int:
    """Where the run of URL characters ending at AT starts (not before FLOOR): read backwards in
    growing windows, so that a body with a few escapes is not classified byte by byte."""
    width = 256
    while True:
        low = max(floor, at - width)
        cut = data[low:at].translate(_URLISH).rfind(b"\x00")
        if cut != -1:
            return low + cut + 1
        if low == floor:
            return floor
        width *= 4


def _head_chars(data: bytes, run) -> bytes:
    """The first characters of a run, without line breaks, in the standard alphabet: read once, tried at each offset."""
    chars = data[run.start : min(run.end, run.start + 91)]
    if b"\n" in chars or b"\r" in chars:
        chars = chars.replace(b"\n", b"").replace(b"\r", b"")
    if b"-" in chars or b"_" in chars:
        chars = to_standard_alphabet(chars)
    return chars


def _may_hold_a_detection(data: bytes, run) -> bool:
    """False when RUN, decoded from any offset, cannot hold a detection: the shortest is MIN_RUN's
    20 printable ASCII characters, so its base64 holds six whole groups of three ASCII bytes in a
    row, which `_TEXT_GROUPS` looks for at every offset (A necessary condition, told without
    decoding: an identifier, a path or a constant in source code seldom has one.)"""
    chars = data[run.start : run.end]
    if b"\n" in chars or b"\r" in chars:
        chars = chars.replace(b"\n", b"").replace(b"\r", b"")
    if b"-" in chars or b"_" in chars:
        chars = to_standard_alphabet(chars)
    return _TEXT_GROUPS.search(chars) is not None


def _head(chars: bytes, align: int) -> bytes:
    """The first bytes a run decodes to from ALIGN: enough to tell text from binary."""
    chars = chars[align : align + 88]
    chars = chars[: len(chars) - len(chars) % 4]
    try:
        return binascii.a2b_base64(chars)
    except binascii.Error:
        return b""


_TEXT = bytes(range(0x20, 0x7F)) + b"\t\n\r"
_STANDARD = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
# What a group's characters tell of its bytes without decoding, by position: the first
# character's 6 bits are the first byte's top bits (0x80 or more from `g` on); the second
# character's low 4 bits are the second byte's top nibble (1 or 8-15: a control byte, or
# 0x80 or more); the third character's bit 1 is the third byte's top bit. Kept: the
# characters that tell nothing is wrong.
_FIRST_OK = _STANDARD[:32]
_SECOND_OK = bytes(c for v, c in enumerate(_STANDARD) if v & 15 not in (1, 8, 9, 10, 11, 12, 13, 14, 15))
_THIRD_OK = bytes(c for v, c in enumerate(_STANDARD) if not v & 2)


#: the fewest whole groups of three bytes a detection's base64 holds (its first and last bytes
#: may share a group with others): (20 - 2) // 3
_DETECTION_GROUPS = (MIN_RUN * 3 // 4 - 2) // 3
#: a group of four characters that decodes to three ASCII bytes (none a control byte from 0x10),
#: as many in a row as a detection's base64 holds
_TEXT_GROUPS = re.compile(rb"(?:[%s][%s][%s][A-Za-z0-9+/]){%d}" % (_FIRST_OK, _SECOND_OK, _THIRD_OK, _DETECTION_GROUPS))


def _may_read_as_text(chars: bytes, align: int) -> bool:
    """False when CHARS read from ALIGN cannot pass `_textual(_head(CHARS, ALIGN))`, told without
    decoding (_bad_bytes). Most runs in source code (identifiers, constants, paths) fail here at
    every offset."""
    bad, head = _bad_bytes(chars, align)
    return 10 * bad <= head


def _bad_bytes(chars: bytes, align: int) -> tuple[int, int]:
    """(bytes that cannot be text, bytes `_textual` looks at) when CHARS are read from ALIGN: a
    character that makes its byte a control byte or 0x80 or more (_FIRST_OK, _SECOND_OK, _THIRD_OK)
    counts as that byte. Only groups 2 and on are counted, whose bytes lie in what `_textual` looks
    at (bytes 4-67 of a head)."""
    groups = (len(chars) - align) >> 2
    if groups > 22:
        groups = 22
    end = align + 4 * groups
    bad = (
        len(chars[align + 8 : end : 4].translate(None, _FIRST_OK))
        + len(chars[align + 9 : end : 4].translate(None, _SECOND_OK))
        + len(chars[align + 10 : end : 4].translate(None, _THIRD_OK))
    )
    return bad, (64 if groups == 22 else max(0, 3 * groups - 4))


#: the most bytes a head `_textual` accepts may hold that are not text (a tenth of 64)
_TEXT_SLACK = 6


def _textual(data: bytes) -> bool:
    # Token text is printable ASCII; random bytes (a misaligned decode, an image)
    # are not: most of them fall outside, at C speed. A tenth may (a misaligned
    # first group, a non-ASCII letter in a comment).
    head = data[4:68]
    return len(data) >= 12 and len(head.translate(None, _TEXT)) <= len(head) // 10
