"""The sealer: every form of every value becomes its reference, in one pass.

A ``Sealer`` is compiled once from the vault (current and previous values)
into Aho-Corasick automata over an anchor of every form (SPEC §3), so the
cost of sealing a buffer is one scan whatever the number of values; work
beyond the scan happens only where an anchor was found. ``seal`` works on a whole buffer
(requests); ``StreamSealer`` works on chunks (responses, large bodies) and
holds back at most one form's length so a value split across chunks is still
caught. This module never logs, raises or returns a value: only names.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import ahocorasick_rs

from ._forms import B64_RUN_CHARS, Form, Kind, b64decode, b64encode, forms_of, percent_reference
from ._references import format_reference

# A base64 form is checked with the group before it and the group after it.
_GROUP = 4
_MAX_NESTING = 2  # base64 inside base64 inside the body; deeper is not decoded
_ANCHOR = 8  # every form is at least this long (values ≥ 8 bytes; base64 middles ≥ 8 chars)
_ANCHOR_SEARCH = 16  # an anchor starts within the first bytes of its form
_TEDDY_MAX = 64  # literals the SIMD prefilter takes at once
_GROUPED_MAX = 512  # up to this many anchors, scan in groups the prefilter takes
# How common a byte is at the start of a window of ordinary text: 0 rare … 4 common.
_RARITY = bytes(
    4 if b in b" \n" else 3 if 97 <= b <= 122 else 2 if 65 <= b <= 90 else 1 if 48 <= b <= 57 else 0
    for b in range(256)
)
_B64_TAIL = re.compile(rb"[A-Za-z0-9+/_-]*(={0,2})")

#: Callable returning byte spans of a buffer that must not be changed
Protect = Callable[[bytes], Sequence[tuple[int, int]]]


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    form: Form
    value: bytes
    replacement: bytes  # for non-base64 forms


@dataclass(slots=True)
class SealResult:
    """The sealed buffer and how many times each name was sealed in it."""

    data: bytes
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def changed(self) -> bool:
        return bool(self.counts)


class Sealer:
    """Seals every form of every registered value into its reference.

    ``values`` maps a secret name to its values: the current one first, then
    previous ones still retained after a rotation. All are sealed the same way.
    """

    def __init__(self, values: Mapping[str, Sequence[bytes]]) -> None:
        patterns: dict[bytes, _Entry] = {}
        shared: dict[bytes, list[_Entry]] = {}
        # Current values claim their patterns before previous ones, and names
        # are taken in sorted order, so a pattern shared by two entries always
        # seals to the same reference.
        for generation in (0, 1):
            for name in sorted(values):
                vals = values[name]
                chosen = vals[:1] if generation == 0 else vals[1:]
                ref = format_reference(name).encode("ascii")
                replacements = {True: percent_reference(ref, True), False: percent_reference(ref, False)}
                for value in chosen:
                    for form in forms_of(value):
                        if form.pattern in patterns:
                            # A periodic value ("00000000") has the same base64
                            # pattern at two offsets: keep every reading.
                            if form.kind is Kind.B64 and patterns[form.pattern].form.kind is Kind.B64:
                                shared.setdefault(form.pattern, [patterns[form.pattern]]).append(
                                    _Entry(name, form, value, ref)
                                )
                            continue
                        replacement = replacements[form.upper_hex] if form.kind is Kind.PERCENT else ref
                        patterns[form.pattern] = _Entry(name, form, value, replacement)
        self._entries = list(patterns.values())
        index_of = {pattern: i for i, pattern in enumerate(patterns)}
        self._readings = {index_of[pattern]: tuple(entries) for pattern, entries in shared.items()}
        self.names = frozenset(values)
        self._build_matcher(list(patterns))
        # How much of a stream may have to wait for its next chunk, and which
        # bytes can take part in a form at all (a chunk ending in any other
        # byte can be released whole: SSE events are not delayed).
        self.has_base64 = any(e.form.kind is Kind.B64 for e in self._entries)
        self.max_region = max(map(len, patterns), default=0) + (2 * _GROUP if self.has_base64 else 0)
        alphabet = set(b"".join(patterns))
        if self.has_base64:  # the whole run around a base64 form may matter
            alphabet.update(B64_RUN_CHARS + b"=")
        self._alphabet = bytes(sorted(alphabet))
        # A byte no form contains keeps a form from spanning two joined parts;
        # if every byte is taken (absurd values), anchors are looked up part by part.
        outside = next((bytes([b]) for b in range(256) if b not in alphabet), None)
        self._separator = outside if outside is not None else b""

    def _build_matcher(self, patterns: list[bytes]) -> None:
        """A DFA over one short anchor per form finds candidates; a check confirms them.

        Every form is at least _ANCHOR bytes long. Each form is anchored at the
        _ANCHOR bytes starting at its rarest byte near the front (a symbol,
        digit or capital rather than a lower-case letter or a space), so on
        ordinary text the DFA rarely leaves its start state: it stays small in
        the cache and scans at about the same speed for ten values or ten
        thousand. A full-form automaton either builds slowly (DFA) or scans
        slowly (NFA) at that size.
        """
        anchors: dict[bytes, int] = {}
        self._by_anchor: list[list[tuple[bytes, int, int]]] = []
        for index, pattern in enumerate(patterns):
            window = pattern[: _ANCHOR_SEARCH + _ANCHOR - 1]
            classes = window.translate(_RARITY)[: len(window) - _ANCHOR + 1]
            offset = classes.rfind(min(classes))
            anchor = pattern[offset : offset + _ANCHOR]
            slot = anchors.setdefault(anchor, len(anchors))
            if slot == len(self._by_anchor):
                self._by_anchor.append([])
            self._by_anchor[slot].append((pattern, offset, index))
        # Two automata over the same anchors. The first finds whether and
        # roughly where anchors occur: non-overlapping, so its SIMD prefilter
        # applies and a body without any value is scanned at memory speed.
        # Every occurrence starts within one anchor length of one it reports;
        # the second, overlapping, looks only at those short windows.
        # The prefilter (Teddy) takes at most 64 literals: a few secrets' anchors
        # are split into groups it can take, each scanned at memory speed; past
        # a few hundred anchors one automaton is faster than many groups.
        self._detect: list[ahocorasick_rs.BytesAhoCorasick] = []
        self._candidates = None
        if anchors:
            keys = list(anchors)
            size = _TEDDY_MAX if len(keys) <= _GROUPED_MAX else len(keys)
            self._detect = [
                ahocorasick_rs.BytesAhoCorasick(keys[i : i + size], matchkind=ahocorasick_rs.MatchKind.LeftmostFirst)
                for i in range(0, len(keys), size)
            ]
            self._candidates = ahocorasick_rs.BytesAhoCorasick(
                keys, matchkind=ahocorasick_rs.MatchKind.Standard, implementation=ahocorasick_rs.Implementation.DFA
            )

    def may_hold_form(self, parts: Iterable[bytes]) -> bool:
        """False when none of PARTS can hold a form: one scan over all of them.

        Headers come in dozens of short strings; checking them together costs
        one call instead of one per string, and most requests have no form at all.
        """
        if not self._detect:
            return False
        joined = [self._separator.join(parts)] if self._separator else list(parts)
        return any(d.find_matches_as_indexes(part) for d in self._detect for part in joined)

    def readings(self, index: int) -> tuple[_Entry, ...]:
        """The entries a matched pattern may stand for (several only for base64)."""
        return self._readings.get(index) or (self._entries[index],)

    def __repr__(self) -> str:
        return f"<Sealer names={len(self.names)} forms={len(self._entries)}>"

    @property
    def form_count(self) -> int:
        return len(self._entries)

    def find(self, data: bytes) -> list[tuple[int, int, int]]:
        """(entry, start, end) of every form in DATA, leftmost-longest, not overlapping."""
        first = [at for detect in self._detect for _, at, _ in detect.find_matches_as_indexes(data)]
        if not first:
            return []
        view = memoryview(data)
        hits = set()
        for at in first:
            window = view[at : at + 2 * _ANCHOR - 1]
            hits.update((slot, at + start) for slot, start, _ in self._candidates.find_matches_as_indexes(window, overlapping=True))
        confirmed = []
        for slot, at in hits:
            for pattern, offset, index in self._by_anchor[slot]:
                start = at - offset
                if start >= 0 and data.startswith(pattern, start):
                    confirmed.append((start, -len(pattern), index))
        confirmed.sort()
        found = []
        pos = 0
        for start, negative_length, index in confirmed:
            if start >= pos:
                pos = start - negative_length
                found.append((index, start, pos))
        return found

    def seal(self, data: bytes, protect: Protect | None = None, _depth: int = 0) -> SealResult:
        """Seal a whole buffer. DATA comes back as the same object when nothing is found.

        A base64 form is sealed by decoding its run from the value's group to
        the end of the run, sealing that, and encoding it again with the same
        alphabet and padding (Basic credentials stay valid Basic credentials).
        """
        result = SealResult(data)
        # Re-encoding a base64 run can expose a form it was hiding (two values
        # in one run): then scan again, a few times at most. A plain
        # replacement cannot create a form (no value holds "{{secret:").
        for _ in range(3):
            matches = self.find(result.data)
            if not matches:
                return result
            spans = protect(result.data) if protect else ()
            new, rescan = self._replace(result.data, matches, spans, result.counts, _depth)
            result.data = new
            if not rescan:
                return result
        return result

    def _replace(
        self,
        data: bytes,
        matches: Iterable[tuple[int, int, int]],
        protected: Sequence[tuple[int, int]],
        counts: Counter[str],
        depth: int,
    ) -> tuple[bytes, bool]:
        """DATA with MATCHES replaced, and whether a base64 run was re-encoded."""
        out: list[bytes] = []
        pos = 0
        rescan = False
        for index, start, end in matches:
            if start < pos:
                continue
            entry = self._entries[index]
            if entry.form.kind is Kind.B64 and _inside(protected, start, end):
                continue  # a vendor's signature, not a value: see _pipeline.protected_spans
            if entry.form.kind is not Kind.B64:
                out += (data[pos:start], entry.replacement)
                pos = end
                counts[entry.name] += 1
                continue
            if depth >= _MAX_NESTING:
                continue
            for reading in self.readings(index):
                region = self._reseal_run(data, start, end, reading, pos, depth, counts)
                if region is not None:
                    break
            if region is not None:
                region_start, region_end, encoded = region
                out += (data[pos:region_start], encoded)
                pos = region_end
                rescan = True
        if not out:
            return data, False
        out.append(data[pos:])
        return b"".join(out), rescan

    def _reseal_run(
        self, data: bytes, start: int, end: int, entry: _Entry, floor: int, depth: int, counts: Counter[str]
    ) -> tuple[int, int, bytes] | None:
        form = entry.form
        group_start = start - (_GROUP if form.offset else 0)
        if group_start < floor or not _is_b64(data[group_start:start]):
            return None
        tail = _B64_TAIL.match(data, end)
        padding = tail.group(1)
        body = data[group_start : tail.end() - len(padding)]
        if len(body) % _GROUP == 1:  # a lone last char is not base64: leave it and what follows
            body, padding = body[:-1], b""
        try:
            decoded = b64decode(body + b"=" * (-len(body) % _GROUP))
        except ValueError:
            return None
        if decoded[form.offset : form.offset + len(entry.value)] != entry.value:
            return None
        inner = self.seal(decoded, _depth=depth + 1)
        if not inner.changed:
            return None
        counts.update(inner.counts)
        encoded = b64encode(inner.data, _alphabet_is_urlsafe(body, form.urlsafe))
        # Keep the padding style: an unpadded run stays unpadded. A run that
        # ended on a group boundary without '=' gives no hint; pad it then.
        if not padding and len(body) % _GROUP:
            encoded = encoded.rstrip(b"=")
        return group_start, group_start + len(body) + len(padding), encoded

    def seal_fields(self, fields: Sequence[tuple[bytes, bytes]]) -> tuple[tuple[tuple[bytes, bytes], ...], Counter[str]]:
        """Header fields with names and values sealed, and the counts; one scan when none holds a form."""
        counts: Counter[str] = Counter()
        if not self.may_hold_form(part for field in fields for part in field):
            return tuple(fields), counts
        sealed = []
        for name, value in fields:
            name_result, value_result = self.seal(name), self.seal(value)
            counts.update(name_result.counts)
            counts.update(value_result.counts)
            sealed.append((name_result.data, value_result.data))
        return tuple(sealed), counts

    def stream(self) -> StreamSealer:
        return StreamSealer(self)

    def scrub(self, data: bytes) -> SealResult:
        """Seal DATA exactly as a stream would (one chunk, then the end)."""
        stream = self.stream()
        out = stream.feed(data) + stream.feed(b"", final=True)
        return SealResult(data if not stream.counts else out, stream.counts)

    def holdback(self, data: bytes) -> int:
        """How many trailing bytes of DATA might begin a form that is not complete yet."""
        if self.max_region == 0:
            return 0
        tail = data[-(self.max_region - 1) :] if self.max_region > 1 else b""
        # Only the bytes after the last byte that appears in no form can be
        # the beginning of a form.
        return len(tail) - len(tail.rstrip(self._alphabet))


def _inside(spans: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    return any(s <= start and end <= e for s, e in spans)


def _alphabet_is_urlsafe(run: bytes, default: bool) -> bool:
    if b"-" in run or b"_" in run:
        return True
    if b"+" in run or b"/" in run:
        return False
    return default


class StreamSealer:
    """Seals a byte stream chunk by chunk; any chunking gives the same output.

    Releases every byte that cannot be the start of a form not yet complete,
    holding back at most ``max_region - 1`` bytes (less when the chunk ends in
    a byte no form contains, e.g. the blank line ending an SSE event).
    A base64 form in a stream is sealed within its own groups: the bytes
    after the reference are padded with spaces to keep the rest of the run
    aligned, since the bytes after the run may not have arrived yet.
    """

    def __init__(self, sealer: Sealer) -> None:
        self._sealer = sealer
        self._pending = b""
        self.counts: Counter[str] = Counter()

    def feed(self, chunk: bytes, final: bool = False) -> bytes:
        sealer = self._sealer
        data = self._pending + chunk if self._pending else chunk
        if final:
            cut = len(data)
            keep_from = cut
        else:
            hold = sealer.holdback(data)
            cut = len(data) - hold
            keep_from = cut
            if sealer.has_base64 and hold == sealer.max_region - 1:
                # A base64 form found next time needs the group before it. When
                # the held bytes follow a byte no form contains, that group
                # cannot be base64 anyway and nothing more is kept.
                keep_from = max(0, cut - _GROUP)
        out: list[bytes] = []
        pos = 0
        emit_to = keep_from
        for index, start, end in sealer.find(data):
            if start >= cut:
                break
            entry = sealer._entries[index]
            emit_to = max(emit_to, end)
            if start < pos:
                continue
            if entry.form.kind is not Kind.B64:
                out += (data[pos:start], entry.replacement)
                pos = end
                self.counts[entry.name] += 1
                continue
            for reading in sealer.readings(index):
                region = _seal_groups(data, start, end, reading, pos)
                if region is not None:
                    break
            if region is not None:
                region_start, region_end, encoded = region
                out += (data[pos:region_start], encoded)
                pos = region_end
                self.counts[reading.name] += 1
        emit_to = max(emit_to, pos)
        out.append(data[pos:emit_to])
        self._pending = data[emit_to:]
        return b"".join(out)


def _seal_groups(
    data: bytes, start: int, end: int, entry: _Entry, floor: int
) -> tuple[int, int, bytes] | None:
    """Seal a base64 form in place, touching only the groups that hold the value."""
    form = entry.form
    group_start = start - (_GROUP if form.offset else 0)
    if group_start < floor or not _is_b64(data[group_start:start]):
        return None
    region_end = end
    last = padding = b""
    if form.trailing:
        chars = _B64_TAIL.match(data, end, min(len(data), end + _GROUP)).group(0)
        body = chars.rstrip(b"=")
        if len(body) < _GROUP - form.trailing:  # the value's last bytes are not all there
            return None
        padding = chars[len(body) :]
        region_end = end + len(chars)
        last = body + b"=" * (_GROUP - len(body))
    try:
        decoded = b64decode(data[group_start:end] + last)
    except ValueError:
        return None
    value_end = form.offset + len(entry.value)
    if decoded[form.offset : value_end] != entry.value:
        return None
    sealed = decoded[: form.offset] + format_reference(entry.name).encode("ascii")
    after = decoded[value_end:]
    # Same length modulo 3 as before, so the groups after the region and the
    # padding keep their meaning.
    sealed += b" " * ((len(decoded) - len(sealed) - len(after)) % 3) + after
    encoded = b64encode(sealed, _alphabet_is_urlsafe(data[group_start:region_end], form.urlsafe))
    if not padding:
        encoded = encoded.rstrip(b"=")
    return group_start, region_end, encoded


def _is_b64(data: bytes) -> bool:
    return not data.translate(None, B64_RUN_CHARS)
