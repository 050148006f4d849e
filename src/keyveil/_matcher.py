"""One scan finds every one of many byte patterns: the sealer's literal matcher.

Compiled once from the patterns (the values, and for base64 views their
bit-shifted readings); ``find`` then costs one pass over a buffer whatever
the number of patterns. It knows nothing of what the patterns mean, and
never logs or returns pattern bytes: only indexes and offsets.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

import hyperscan


class Scanner:
    """Every match of each of EXPRESSIONS (Hyperscan regular expressions over bytes,
    with FLAGS each) in a buffer, overlapping ones included: one scan.

    A match's start is Hyperscan's: 0 unless its expression has
    ``HS_FLAG_SOM_LEFTMOST``. Each match costs a call into Python: expressions
    that match often in ordinary text belong in a narrower form."""

    def __init__(self, expressions: Sequence[bytes], flags: Sequence[int] | None = None) -> None:
        self._database = _compiled(expressions, list(flags) if flags is not None else 0) if expressions else None
        self._scratch = _Scratches(self._database)

    def any(self, data: bytes) -> bool:
        """True when DATA holds a match: one scan, stopped at the first match."""
        return self._database is not None and _occurs(self._database, self._scratch, data)

    def find(self, data: bytes) -> list[tuple[int, int, int]]:
        """(expression index, start, end) of every match, in the order of their ends."""
        if self._database is None or not data:
            return []
        found: list[tuple[int, int, int]] = []
        append = found.append

        def on_match(index: int, start: int, end: int, _flags: int, _context: object) -> None:
            append((index, start, end))

        self._database.scan(data, match_event_handler=on_match, scratch=self._scratch.get())
        return found


class Literals:
    """Every occurrence of each of PATTERNS (bytes) in a buffer, overlapping ones
    included: one Hyperscan scan (its SIMD literal matchers) whatever their number.

    COMPANION: (expression, flags) pairs another reader of the same buffers
    looks for (the detector's shapes and keywords): compiled into the same
    database, so that both readers' matches come from one pass (``find_with``)."""

    def __init__(self, patterns: Sequence[bytes], companion: Sequence[tuple[bytes, int]] = ()) -> None:
        self.patterns = list(patterns)
        self._lengths = [len(p) for p in self.patterns]
        # Hyperscan limits an expression's size (about 16,000 positions; 4,890 random
        # bytes): a longer pattern is looked for by its first _LITERAL_MAX bytes, and
        # each occurrence of those is confirmed whole.
        self._long = any(n > _LITERAL_MAX for n in self._lengths)
        self._companion = len(companion)
        self._scanner = Scanner(
            [*(escaped(p[:_LITERAL_MAX]) for p in self.patterns), *(e for e, _ in companion)],
            [0] * len(self.patterns) + [f for _, f in companion],
        )

    def __len__(self) -> int:
        return len(self.patterns)

    def any(self, data: bytes) -> bool:
        """True when DATA may hold a pattern (it holds one, or the head of a long one): one
        scan, stopped at the first match."""
        if self._companion:
            return bool(self.find(data))
        return self._scanner.any(data)

    def find(self, data: bytes) -> list[tuple[int, int, int]]:
        """(pattern index, start, end) of every occurrence, in the order of their ends."""
        return self.find_with(data)[0]

    def find_with(self, data: bytes) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """What ``find`` returns, and the companion's matches: (its expression index, start, end)."""
        hits = self._scanner.find(data)
        companion: list[tuple[int, int, int]] = []
        if self._companion:
            base = len(self.patterns)
            companion = [(index - base, start, end) for index, start, end in hits if index >= base]
            hits = [hit for hit in hits if hit[0] < base]
        lengths = self._lengths
        if not self._long:
            return [(index, end - lengths[index], end) for index, _, end in hits], companion
        found = []
        for index, _, end in hits:
            length = lengths[index]
            start = end - min(length, _LITERAL_MAX)
            if length <= _LITERAL_MAX or data.startswith(self.patterns[index], start):
                found.append((index, start, start + length))
        return found, companion


_LITERAL_MAX = 1024


class Matcher:
    """Leftmost-longest, non-overlapping matches of PATTERNS (each at least 4 bytes);
    a weak pattern's match gives way to a strong one it overlaps.

    Every occurrence of every pattern comes from one scan (``Literals``); which
    of them are taken is decided here, from all of them. COMPANION: as for
    ``Literals``; ``find_with`` returns its matches too.
    """

    def __init__(
        self, patterns: Sequence[bytes], weak: Collection[int] = (), companion: Sequence[tuple[bytes, int]] = ()
    ) -> None:
        """WEAK: indexes of patterns that give way to the others: a weak match
        never hides a strong one it overlaps (the sealer's detected values)."""
        self._literals = Literals(patterns, companion)
        self.patterns = self._literals.patterns
        self._weak = frozenset(weak)

    def __len__(self) -> int:
        return len(self.patterns)

    def any(self, data: bytes) -> bool:
        """True when DATA may hold a pattern (``Literals.any``)."""
        return self._literals.any(data)

    def find(self, data: bytes) -> list[tuple[int, int, int]]:
        """(pattern index, start, end) of every pattern in DATA, leftmost-longest, not overlapping."""
        return self._chosen(self._literals.find(data))

    def find_with(self, data: bytes) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """What ``find`` returns, and the companion's matches (``Literals.find_with``): one scan."""
        occurrences, companion = self._literals.find_with(data)
        return self._chosen(occurrences), companion

    def _chosen(self, occurrences: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        if not occurrences:
            return []
        confirmed = sorted((start, start - end, index) for index, start, end in occurrences)
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


class FirstMatch:
    """Where the first match of any of EXPRESSIONS (Hyperscan regular expressions
    over bytes, none matching more than LONGEST bytes) ends in a buffer."""

    def __init__(self, expressions: Sequence[bytes], longest: int) -> None:
        self._database = _compiled(expressions, hyperscan.HS_FLAG_SINGLEMATCH)
        self._scratch = _Scratches(self._database)
        self._longest = longest

    def first_end(self, data: bytes, pos: int = 0) -> int:
        """Where the match in DATA[POS:] that ends first ends, or -1.

        Looked for in windows of _WINDOW bytes, each overlapping the one before
        by LONGEST. A scan reads the whole block it is given (matches of several
        expressions are not promised in order, so the first one reported does
        not stop it): a buffer read from one hit to the next in one block would
        cost a pass over its rest at each hit."""
        view = memoryview(data)
        ends: list[int] = []

        def on_match(_index: int, _start: int, end: int, _flags: int, _context: object) -> None:
            ends.append(end)  # each expression once (single-match): at most one per expression

        scratch = self._scratch.get()
        while pos < len(data):
            window = view[pos : pos + _WINDOW]
            self._database.scan(window, match_event_handler=on_match, scratch=scratch)
            if ends:
                return pos + min(ends)
            if pos + _WINDOW >= len(data):
                break
            pos += max(1, _WINDOW - self._longest)
        return -1


_WINDOW = 1 << 15


def _compiled(expressions: Sequence[bytes], flags: int | list[int]) -> hyperscan.Database:
    """A block-mode database of EXPRESSIONS, each one's index its id."""
    database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    database.compile(expressions=list(expressions), ids=list(range(len(expressions))), elements=len(expressions), flags=flags)
    return database


def _occurs(database: hyperscan.Database, scratch: _Scratches, data: bytes) -> bool:
    if not data:
        return False
    try:
        database.scan(data, match_event_handler=_stop, scratch=scratch.get())
    except hyperscan.ScanTerminated:
        return True
    return False


def byte_class(members: bytes) -> bytes:
    """A Hyperscan character class matching exactly the bytes of MEMBERS."""
    return b"[" + escaped(bytes(sorted(set(members)))) + b"]"


class _Scratches:
    """A Hyperscan scratch space per thread: a scan's scratch must not be in use by another scan."""

    def __init__(self, database: hyperscan.Database | None) -> None:
        self._database = database
        self._local = threading.local()

    def get(self) -> hyperscan.Scratch | None:
        if self._database is None:
            return None
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = hyperscan.Scratch(self._database)
        return scratch


_PLAIN = frozenset(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_ESCAPES = [bytes([b]) if b in _PLAIN else b"\\x%02x" % b for b in range(256)]


def escaped(pattern: bytes) -> bytes:
    """PATTERN as a Hyperscan regular expression matching exactly its bytes: every byte
    but letters and digits written ``\\xHH``. (Hyperscan's pure-literal compiler takes
    C strings: a NUL would end the pattern early.)"""
    return b"".join([_ESCAPES[b] for b in pattern])


def _stop(*_) -> bool:
    return True


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
