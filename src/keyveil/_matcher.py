"""One scan finds every one of many byte patterns: the sealer's literal matcher.

Compiled once from the patterns (the values, and for base64 views their
bit-shifted readings); ``find`` then costs one pass over a buffer whatever
the number of patterns. It knows nothing of what the patterns mean, and
never logs or returns pattern bytes: only indexes and offsets.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import ahocorasick_rs

_ANCHOR_SEARCH = 16  # an anchor starts within the first bytes of its pattern
_TEDDY_MAX = 64  # literals the SIMD prefilter takes at once
_GROUPED_MAX = 512  # up to this many anchors, scan in groups the prefilter takes
# How common a byte is at the start of a window of ordinary text: 0 rare … 4 common.
_RARITY = bytes(
    4 if b in b" \n" else 3 if 97 <= b <= 122 else 2 if 65 <= b <= 90 else 1 if 48 <= b <= 57 else 0
    for b in range(256)
)


class Matcher:
    """Leftmost-longest, non-overlapping matches of PATTERNS (each at least 4 bytes);
    a weak pattern's match gives way to a strong one it overlaps.

    A DFA over one short anchor per pattern finds candidates; a comparison
    confirms them. Each pattern is anchored at the bytes starting at its
    rarest byte near the front (a symbol, digit or capital rather than a
    lower-case letter or a space), so on ordinary text the DFA rarely leaves
    its start state and scans at about the same speed for ten patterns or ten
    thousand. A full-pattern automaton either builds slowly (DFA) or scans
    slowly (NFA) at that size.
    """

    def __init__(self, patterns: Sequence[bytes], weak: Collection[int] = ()) -> None:
        """WEAK: indexes of patterns that give way to the others: a weak match
        never hides a strong one it overlaps (the sealer's detected values)."""
        self.patterns = list(patterns)
        self._weak = frozenset(weak)
        self.anchor = min(8, min(map(len, patterns), default=8))
        anchors: dict[bytes, int] = {}
        self._by_anchor: list[list[tuple[bytes, int, int]]] = []
        size = self.anchor
        for index, pattern in enumerate(patterns):
            window = pattern[: _ANCHOR_SEARCH + size - 1]
            classes = window.translate(_RARITY)[: len(window) - size + 1]
            offset = classes.rfind(min(classes))
            anchor = pattern[offset : offset + size]
            slot = anchors.setdefault(anchor, len(anchors))
            if slot == len(self._by_anchor):
                self._by_anchor.append([])
            self._by_anchor[slot].append((pattern, offset, index))
        # Two automata over the same anchors. The first finds whether and
        # roughly where anchors occur: non-overlapping, so its SIMD prefilter
        # applies and a buffer without any is scanned at memory speed. Every
        # occurrence starts within one anchor length of one it reports; the
        # second, overlapping, looks only at those short windows.
        self._detect: list[ahocorasick_rs.BytesAhoCorasick] = []
        self._candidates = None
        if anchors:
            keys = list(anchors)
            group = _TEDDY_MAX if len(keys) <= _GROUPED_MAX else len(keys)
            # A DFA: on text where anchors' first bytes are common (base64, hex)
            # the prefilter cannot skip, and a DFA steps 2-3× faster than the NFA.
            self._detect = [
                ahocorasick_rs.BytesAhoCorasick(
                    keys[i : i + group],
                    matchkind=ahocorasick_rs.MatchKind.LeftmostFirst,
                    implementation=ahocorasick_rs.Implementation.DFA,
                )
                for i in range(0, len(keys), group)
            ]
            self._candidates = ahocorasick_rs.BytesAhoCorasick(
                keys, matchkind=ahocorasick_rs.MatchKind.Standard, implementation=ahocorasick_rs.Implementation.DFA
            )

    def __len__(self) -> int:
        return len(self.patterns)

    def any(self, data: bytes) -> bool:
        """True when DATA may hold a pattern (an anchor occurs): one fast scan."""
        return any(d.find_matches_as_indexes(data) for d in self._detect)

    def find(self, data: bytes) -> list[tuple[int, int, int]]:
        """(pattern index, start, end) of every pattern in DATA, leftmost-longest, not overlapping."""
        first = [at for detect in self._detect for _, at, _ in detect.find_matches_as_indexes(data)]
        if not first:
            return []
        view = memoryview(data)
        width = 2 * self.anchor - 1
        hits = set()
        for at in first:
            window = view[at : at + width]
            hits.update(
                (slot, at + start)
                for slot, start, _ in self._candidates.find_matches_as_indexes(window, overlapping=True)
            )
        confirmed = []
        for slot, at in hits:
            for pattern, offset, index in self._by_anchor[slot]:
                start = at - offset
                if start >= 0 and data.startswith(pattern, start):
                    confirmed.append((start, -len(pattern), index))
        confirmed.sort()
        if self._weak and any(index in self._weak for _, _, index in confirmed):
            strong = _leftmost_longest([c for c in confirmed if c[2] not in self._weak])
            taken = [(start, end) for _, start, end in strong]
            weak = [
                (start, negative_length, index)
                for start, negative_length, index in confirmed
                if index in self._weak and not any(s < start - negative_length and start < e for s, e in taken)
            ]
            return sorted(strong + _leftmost_longest(weak), key=lambda f: f[1])
        return _leftmost_longest(confirmed)


def _leftmost_longest(confirmed: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(index, start, end) of the leftmost-longest matches of CONFIRMED that do not
    overlap; CONFIRMED holds (start, -length, index), sorted."""
    found = []
    pos = 0
    for start, negative_length, index in confirmed:
        if start >= pos:
            pos = start - negative_length
            found.append((index, start, pos))
    return found

