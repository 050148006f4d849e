"""The sealer: every registered value, however its carrier encoded it, becomes its reference.

Decode, then match (SPEC §3). A ``Sealer`` is compiled once from the vault
(current and previous values) into one literal matcher over the values, and
looks for them in the raw bytes and in the decoded views those bytes call
for: JSON-unescaped where a relevant ``\\`` escape occurs, percent-decoded
where a relevant ``%`` escape occurs (and ``+`` as space when a value has a
space), every base64 run long enough to hold a value — and views of those
views, up to ``MAX_LAYERS`` deep, in any order. A match in a view maps back
to the exact original span, which is replaced by the reference written in
the carrier's encoding (``_views``). A buffer with none of those triggers
costs one scan of the matcher and a few memchr-speed checks.

``seal`` works on a whole buffer (requests); ``StreamSealer`` works on chunks
(responses, large bodies). This module never logs, raises or returns a
value: only names.
"""

from __future__ import annotations

import binascii
import functools
import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from json import dumps as _json_dumps
from typing import NamedTuple
from urllib.parse import quote, unquote_to_bytes

import hyperscan

from ._errors import KeyveilError
from ._letters import reads_as_words
from ._matcher import Matcher, Scanner, escaped
from ._references import HIDDEN_EXPRESSIONS, HIDDEN_LENGTHS, format_reference
from ._views import (
    _STD_TO_URL as _TO_URL,
    _URL_TO_STD as _TO_STD,
    B64_ALPHABET,
    WRAPPED_IN_JSON_PATTERNS,
    Base64View,
    Edit,
    JsonView,
    PercentView,
    Run,
    _count_breaks,
    a2b_base64,
    already_worked_out,
    remember,
    base64_runs,
    decode_base64,
    escape_tail,
    json_unescape,
    json_windows,
    runs_of,
    worked_out,
)

#: how many layers of encoding are decoded, in any order (SPEC §3 asks for two)
MAX_LAYERS = 3
#: a base64 run up to this many characters is decoded from each of its four
#: character offsets (a prefix like ``/upload/`` can shift it); see _offsets
SHORT_RUN = 512
#: a stream holds back at most this much of a base64 run still being written;
#: past it, the run is sealed group by group (see StreamSealer)
STREAM_RUN_BOUND = 1 << 20
_MAX_ROUNDS = 8
_WHOLE_VIEW = 16384  # a JSON buffer up to this size is mapped back whole; a longer one in windows
_PLAIN_BREAKS = bytes.maketrans(b"\r\n", b"\0\0")
_PERCENT_BREAK = re.compile(rb"%0[aAdD]")
# One line break written half escaped (`%0D` then a plain LF, a plain CR then `%0A`):
# a client that escapes "the rest" leaves one of the two as it is.
_HALF_BREAK = re.compile(rb"%0[dD]\n|\r%0[aA]")
_PERCENT_PLUS = re.compile(rb"%2[bB]")  # seal, then look again: a base64 run may hide a second value
# Bytes that take part in the encodings themselves: base64, escapes, line breaks.
_SYNTAX = frozenset(B64_ALPHABET + b"=\\%+/\r\n")

#: Callable returning byte spans of a buffer whose base64 runs must not be changed
Protect = Callable[[bytes], Sequence[tuple[int, int]]]


class SealError(KeyveilError):
    """The sealer could not reach a buffer free of values: the flow must be blocked."""

    exit_code = 2


@dataclass(slots=True)
class SealResult:
    """The sealed buffer and how many times each name was sealed in it."""

    data: bytes
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def changed(self) -> bool:
        return bool(self.counts)


class Sealer:
    """Seals every registered value, in every form of SPEC §3, into its reference.

    ``values`` maps a secret name to its values: the current one first, then
    previous ones still retained after a rotation. All are sealed the same way.
    """

    def __init__(self, values: Mapping[str, Sequence[bytes]], companion: Sequence[tuple[bytes, int]] = ()) -> None:
        """COMPANION: the expressions detection looks for (``_detect.Detector.expressions``),
        compiled with the values: the buffers both read are scanned once (``companion_hits``)."""
        owner: dict[bytes, str] = {}
        # Current values claim their bytes before previous ones, and names
        # are taken in sorted order, so a value shared by two entries always
        # seals to the same reference.
        for generation in (0, 1):
            for name in sorted(values):
                chosen = values[name][:1] if generation == 0 else values[name][1:]
                for value in chosen:
                    if value:
                        owner.setdefault(bytes(value), name)
        self._values = list(owner)
        self._names = [owner[v] for v in self._values]
        self._references = [format_reference(n).encode("ascii") for n in self._names]
        self.names = frozenset(values)
        weak = [i for i, n in enumerate(self._names) if n.startswith(DETECTED_PREFIX)]
        self._raw = Matcher(self._values, weak=weak)
        self._json_trigger, self._percent_trigger = _triggers(self._values)
        # The buffers detection reads (a request's parts, its decoded views) are scanned
        # once for both, with the companion, and for the escapes that call for the JSON
        # and percent views (each expression reported once); the sealer's other buffers
        # (its own views, decoded runs) with the values alone, which scans them faster.
        # The markers of references (_references.HIDDEN_EXPRESSIONS) are in that scan too:
        # the references of a request are looked for in the same buffers.
        self._companion = len(companion)
        self._json_markers = len(self._json_trigger.expressions)
        self._percent_base = self._companion + self._json_markers
        self._hidden_base = self._percent_base + len(self._percent_trigger.expressions)
        markers = [
            (e, hyperscan.HS_FLAG_SINGLEMATCH) for e in (*self._json_trigger.expressions, *self._percent_trigger.expressions)
        ]
        self._joint = (
            Matcher(self._values, weak=weak, companion=[*companion, *markers, *HIDDEN_EXPRESSIONS]) if companion else None
        )
        shortest = min(map(len, self._values), default=0)
        # No encoding of SPEC §3 is shorter than what it encodes: a buffer shorter
        # than every value holds none, in any form (host names, methods, most headers).
        self._shortest = shortest
        self.longest = max(map(len, self._values), default=0)
        self._min_run = -(-4 * shortest // 3) if shortest else 0
        self._plus = any(b" " in v for v in self._values)
        self._separator = next((bytes([b]) for b in (0, 1, 2, 3) if not any(bytes([b]) in v for v in self._values)), b"")
        # Bytes that can be inside some form of some value: a stream releases
        # every byte up to the last one outside this set at once.
        inside = set(_SYNTAX)
        for v in self._values:
            inside.update(v)
        self._inside = bytes(sorted(inside))
        self._edge_breaks = not any(b"\n" in v or b"\r" in v for v in self._values)

    def __repr__(self) -> str:
        return f"<Sealer names={len(self.names)} values={len(self._values)}>"

    @property
    def form_count(self) -> int:
        """How many byte patterns the matcher holds: one per value, whatever its encodings."""
        return len(self._raw)

    # -- finding ------------------------------------------------------------------

    def _find(
        self, data: bytes, depth: int, text: bool = True, plus: bool = False,
        spaced: Callable[[], bytes] | None = None, layout: bytes | None = None, percent_above: bool = False,
    ) -> list[Edit]:
        """Edits that seal DATA, overlaps resolved, looking DEPTH layers down already.

        PLUS: DATA is a query string or a form body, where `+` is a space.
        SPACED: gives DATA with each `+` the layer above wrote as a plain `+`
        (not `%2B`) made a space; None when every `+` of DATA was written plainly.
        LAYOUT: DATA with each line break the layer above wrote plainly (not
        `%0A`) made a NUL, where it wrote others escaped: a base64 block it
        escaped ends at a plain one. None: every line break is alike.
        PERCENT_ABOVE: DATA is a percent view's, which escapes what is written back."""
        if len(data) < self._shortest:
            return []
        edits = [
            Edit(start, end, self._references[index], (self._names[index],), depth)
            for index, start, end in self._occurrences(data)
        ]
        if depth < MAX_LAYERS and self._values:
            edits += self._in_views(data, depth, text, plus, spaced, layout, percent_above)
        return _resolve(edits)

    def _in_views(
        self, data: bytes, depth: int, text: bool = True, plus: bool = False,
        spaced: Callable[[], bytes] | None = None, layout: bytes | None = None, percent_above: bool = False,
    ) -> list[Edit]:
        edits: list[Edit] = []
        # Escapes are text: a base64 run that decodes to binary (an image)
        # is looked at for raw values and further base64 only.
        json = text and b"\\" in data and self._escapes_matter(data, "json")
        if json:
            # The JSON view holds every base64 run of DATA too, joined across
            # `\n` and `\/`: runs are looked for there, once.
            edits += self._in_json(data, depth)
        percent = text and b"%" in data and self._escapes_matter(data, "percent")
        # The escapes whose views are built: a base64 run they cut or touch is
        # whole in those views, and looked at there only.
        views = b"\\" if json else b""
        spaced_view = False  # a view that reads `+` as a space where DATA is no query or form
        if plus and (percent or b"+" in data):
            # A query or form: `+` is a space; a layer inside may have kept a
            # literal `+` of the value (quote with `+` safe): both readings.
            found_plus = self._in_percent(data, depth, plus=True)
            if not found_plus and percent:
                found_plus = self._in_percent(data, depth, plus=False)
            views += b"%+"
            edits += found_plus
        else:
            if percent:
                edits += self._in_percent(data, depth, plus=False)
                views += b"%"
            spaced_view = text and self._plus and b"+" in data
            if spaced_view:
                # Outside a query or form `+` as a space is a guess: where a reading that
                # takes `+` as itself found the value too (the percent view, the JSON view,
                # the run), that reading stands (`…Cu+AFA%3D%3D` in a path, `…xHh+M\\r\\n`
                # in a JSON string: the guess cut the run at its `+`).
                edits += [replace(e, guessed=True) for e in self._in_percent(data, depth, plus=True)]
                views += b"%+"
        if self._min_run and len(data) >= self._min_run:
            # A run that an escape cuts (`\/`, `\n`, `%2B`) is whole only in the
            # view that decodes the escape: it is looked at there, not here.
            found: list[Edit] = []
            lines = data if layout is None else layout
            runs = [(run, plus) for run in runs_of(lines, self._min_run, plus=plus)]
            first_readings: set[tuple[int, int]] = set()
            if plus:
                # `+` is a space here, but a client may have left base64's `+` unescaped:
                # the runs read with `+` as a base64 character are looked at too
                # (and written back as the client wrote them).
                whole = runs_of(lines, self._min_run)
                first_readings = {(r.start, r.end) for r in whole if not r.alternative}
                runs += [(Run(r.start, r.end, r.padding, True), False) for r in whole]
            if layout is not None:
                # A block whose every line break the layer above left plain is one block
                # all the same, when another break was escaped (`note.%0A` before it):
                # its lines are looked at together where the layout's runs found nothing.
                known = {(r.start, r.end) for r, _ in runs}
                runs += [
                    (Run(r.start, r.end, r.padding, True), plus)
                    for r in runs_of(data, self._min_run, plus=plus)
                    if (r.start, r.end) not in known
                ]
            def written_plainly(at: int) -> bool:
                """Whether the percent layer above wrote the `+` at AT plainly: a space, to a writer that escapes the rest."""
                return spaced is None or spaced()[at] == 0x20

            plain_plus = written_plainly if percent_above else None  # no such layer: a `+` is base64's
            for run, escape_plus in runs:
                # A run an escape cuts or touches is whole in the view that decodes the
                # escape, where it was looked at already; unless the decoding changed
                # the run itself (`100%12…`: its first two characters read as an escape;
                # `…%253D`: a `=` glued to it one layer down). So it is looked at here
                # too, where no view found a value.
                touched = bool(views) and _touches(data, run.start, run.end + run.padding, views)
                overlap = [e for e in (*edits, *found) if e.start < run.end + run.padding and run.start < e.end]
                # In a form or query, the reading with `+` as a space may have cut a wrapped
                # block at a `+` of its own (`…Iy\r\nZmIq6d+w`): see _plus_is_base64.
                # So may the view that reads `+` as a space outside a query or form (`…xHh+M`
                # in a JSON string, a URL path): its reading is a guess, the run's is not.
                # (Not a run another view's escapes cut: `\\n` of a JSON string ends a line
                # of its block, which that view reads whole.)
                in_form = plus and not escape_plus and (run.start, run.end) in first_readings
                own_plus = (
                    (in_form or (spaced_view and not run.alternative))
                    and not _touches(data, run.start, run.end + run.padding, views.replace(b"+", b""))
                    and _plus_is_base64(data, run)
                )
                if touched and overlap:
                    # Unless the view decoded it after a prefix only (`6 ipc…` where `6+ip` read
                    # as it stands is the payload's first group), or cut it at its own `+`: then
                    # the reading that decodes from the run's own first character takes its place.
                    if not (own_plus or all(e.glued for e in overlap)):
                        continue
                    run_edits, align = self._run_edits(data, run, depth, plain_plus)
                    if not run_edits or align:
                        continue
                    found = [e for e in found if e not in overlap] + run_edits
                    edits = [e for e in edits if e not in overlap]
                    continue
                if run.alternative and overlap:
                    # Another reading of these bytes found a value: it stands, unless
                    # this is a form's run read with `+` as base64 and the other one
                    # was decoded after a prefix (`+Gh0…`: a base64 `+` left
                    # unescaped) or cut short of this run's padding (`…Ucyt+Cc=`). Outside a
                    # query or form, the reading with `+` as a space is a guess that gives way
                    # to these lines read with `+` as base64's, when that is whole groups and
                    # `+` stands part way into one (_plus_is_base64: `6ABda+Ble…` and a last
                    # line `egri` that ends the value: random-seed soak 325343615, case 10805).
                    guess_gives_way = (
                        not plus and spaced_view and all(e.guessed for e in overlap) and _plus_is_base64(data, run)
                    )
                    if not guess_gives_way and (escape_plus or not plus):
                        continue
                    if not guess_gives_way and not (
                        own_plus or all(e.glued for e in overlap) or (run.padding and all(e.end < run.end for e in overlap))
                    ):
                        continue
                run_edits, align = self._run_edits(data, run, depth, plain_plus)
                if align == _after_escape(data, run):
                    align = 0  # read from after the tail of an escape (`\n` in JSON): from its own first character
                if run.alternative and overlap:
                    if not run_edits or align:
                        continue
                    found = [e for e in found if e not in overlap]
                    edits = [e for e in edits if e not in overlap]
                elif run.alternative and not run_edits and plus and not escape_plus:
                    continue
                # A `+` in a run decoded after a prefix, or among URL-safe characters
                # (which base64 never mixes with `+`), may be a space. (The run's
                # characters are copied only when it was sealed: a long image is not.)
                # So may a plain `+` in a run where the layer above wrote another `+` as
                # `%2B` (SPACED): a writer that escapes base64's `+` writes a space as `+`;
                # unless the run, read from its own first character, ends in padding: then
                # it is one text to its end (a writer that escapes some of the characters it
                # may leave, `…8J%2BUkXr+MQ%3D%3D`: random-seed soak 596597952, case 15292).
                chars = data[run.start : run.end] if not plus and run_edits else b""
                if chars and b"+" in chars and (
                    align or b"-" in chars or b"_" in chars or (_both_plusses(spaced, run) and not run.padding)
                ):
                    pieces = self._in_plus_pieces(data, run, depth, spaced)
                    if pieces and not align and _cut_into_a_group(data, run, pieces):
                        pieces = []
                    if pieces:
                        # Read with `+` as a space: a `+` the new run holds is written `%2B`
                        # (by the percent view above, where there is one).
                        run_edits, align = (pieces if percent_above else [_plus_edit(e) for e in pieces]), 0
                if escape_plus:  # a run written back into a query or form: its `+` is not a space
                    run_edits = [_plus_edit(e) for e in run_edits]
                if align:
                    # Decoded after a glued prefix: a reading that decodes from its
                    # own first character takes its place.
                    run_edits = [replace(e, glued=True) for e in run_edits]
                found += run_edits
            edits += found
        return edits

    def _in_plus_pieces(self, data: bytes, run: Run, depth: int, spaced: Callable[[], bytes] | None) -> list[Edit]:
        """A run holding `+` that decodes to a value only after a glued prefix may
        be text percent-encoded with `+` for a space (`blob+<base64>+end` in a
        header): when a piece between `+` decodes to a value from its own first
        character, the pieces are the runs, and what lies outside them keeps its bytes.
        Only a `+` written plainly one layer up separates pieces (SPACED), never a `%2B`."""
        # To the end of the bytes a run can be made of, not of RUN: a word glued before a
        # block (`blob+QWds…`) made its first line longer than the others, so RUN ended a
        # line early; read with `+` as a space, the block is whole (random-seed soak
        # 77234259, case 2509).
        end = _segment_end(data, run.end + run.padding)
        if spaced is None:
            pieces = base64_runs(data[run.start : end], self._min_run, plus=True)
        else:
            spaced_data = spaced()
            if b" " not in spaced_data[run.start : run.end]:
                return []
            pieces = base64_runs(spaced_data[run.start : end], self._min_run)
        pieces = [Run(r.start + run.start, r.end + run.start, r.padding, r.alternative) for r in pieces]
        edits: list[Edit] = []
        aligned = False
        for piece in pieces:
            if piece.alternative and any(e.start < piece.end and piece.start < e.end for e in edits):
                continue
            piece_edits, align = self._run_edits(data, piece, depth)
            aligned = aligned or (bool(piece_edits) and align == 0)
            edits += piece_edits
        return edits if aligned else []

    def _in_json(self, data: bytes, depth: int) -> list[Edit]:
        # Decoded at C speed first; the map back is built only when there is
        # something to map.
        decoded = json_unescape(data)
        sub = self._find(decoded, depth + 1)
        if not sub:
            return []
        if len(data) <= _WHOLE_VIEW:
            view = JsonView.build(data)
            if view.data != decoded:
                raise SealError("keyveil's two JSON decoders disagree on a buffer; it is blocked")
            return self._lift_edits(view, sub, depth)
        # A long buffer: mapped back only in windows around what was found.
        windows = json_windows(data, decoded, [(e.start, e.end) for e in sub])
        if not all(w.agrees() for w in windows):
            raise SealError("keyveil's two JSON decoders disagree on a buffer; it is blocked")
        out: list[Edit] = []
        for e in sub:
            window = next((w for w in windows if w.holds(e.start, e.end)), None)
            if window is None:
                raise SealError("keyveil could not map a sealed span back to its buffer; it is blocked")
            out += self._lift_edits(window, [e], depth)
        return out

    def _in_percent(self, data: bytes, depth: int, plus: bool) -> list[Edit]:
        # As for JSON: the standard library decodes first, the map is built on a find.
        decoded = unquote_to_bytes(data.replace(b"+", b" ") if plus else data)
        # Which line breaks were written plainly, where others were escaped (`%0A`).
        layout = None
        breaks = (b"\n" in data or b"\r" in data) and _PERCENT_BREAK.search(data) is not None
        if breaks:
            cut = _plain_breaks_cut(data)
            layout = unquote_to_bytes(cut.replace(b"+", b" ") if plus else cut)
        # Which `+` of DECODED were written plainly (a space, read with `+` for
        # space) and which as `%2B`: worked out only when a run asks.
        spaced = None
        if not plus and b"+" in data and _PERCENT_PLUS.search(data) is not None:
            source = cut if breaks else data
            spaced = functools.cache(lambda: unquote_to_bytes(source.replace(b"+", b" ")))  # once, however many runs ask
        sub = self._find(decoded, depth + 1, spaced=spaced, layout=layout, percent_above=True)
        if not sub:
            return []
        view = PercentView(data, plus=plus)
        if view.data != decoded:
            raise SealError("keyveil's two percent decoders disagree on a buffer; it is blocked")
        return self._lift_edits(view, sub, depth)

    @staticmethod
    def _lift_edits(view, sub: list[Edit], depth: int) -> list[Edit]:
        out = []
        for e in sub:
            start, end = view.span(e.start, e.end)
            if e.base64 and end - start == e.end - e.start and not view.escaped(start, end) and not _touches(view.raw, start, end):
                continue  # a run no escape cuts or touches: the layer below seals it (one answer, however chunked)
            # Only the bytes that change are written again: the rest of the
            # span keeps its bytes as they were (a `+` that was a space stays
            # one, `%0d%0a` keeps its case), in the span's own habits.
            v_start, v_end, replacement = _trimmed(view, e)
            t_start, t_end = view.span(v_start, v_end)
            encoded = view.encode(replacement, t_start, t_end, habit=(start, end))
            doubtful = e.doubtful or view.stray(start, end)
            out.append(Edit(t_start, t_end, encoded, e.names, e.depth, e.base64, view.kind, e.glued, doubtful))
        return out

    def _run_edits(
        self, data: bytes, run: Run, depth: int, plain_plus: Callable[[int], bool] | None = None
    ) -> tuple[list[Edit], int]:
        """The edit that seals a base64 run (none or one), and the character offset it was decoded from.

        The first offset whose decoding holds a value is taken, unless all it holds
        is detected values: a registered value read at a later offset wins (SPEC §3a:
        detection never gets in a registered value's way). In a percent layer's view
        (PLAIN_PLUS: whether the layer wrote the `+` at an offset plainly), a run that
        ends in a plain `+` and a word is read without them first (``_before_a_spaced_word``)."""
        cut = _before_a_spaced_word(data, run, plain_plus) if plain_plus is not None else None
        if cut is not None:
            found = self._run_edits(data, cut, depth)
            if found[0]:
                return found
        first: tuple[list[Edit], int] | None = None
        for align in _offsets(data, run):
            view = Base64View(data, run, align)
            if not view.data:
                continue
            sub = self._find(view.data, depth + 1, _is_text(view.data))
            if sub:
                edit = view.reencode(_apply(view.data, sub), min(e.start for e in sub))
                names = tuple(n for e in sub for n in e.names)
                doubtful = any(e.doubtful for e in sub)
                found = [Edit(edit.start, edit.end, edit.replacement, names, depth + 1, True, "base64", doubtful=doubtful)], align
                if not all(_is_detected(e) for e in sub):
                    return found
                first = first or found
        return first or ([], 0)

    def _occurrences(self, data: bytes) -> list[tuple[int, int, int]]:
        """The values' matches in DATA: from the scan made for detection when it read DATA too."""
        if self._joint is not None:
            scan = already_worked_out("sealer", data, self)
            if scan is not None:
                return scan.occurrences
        return self._raw.find(data)

    def _escapes_matter(self, data: bytes, which: str) -> bool:
        """Whether DATA holds an escape that calls for its view (WHICH: "json" or "percent";
        _triggers): from the scan made with detection when it read DATA too, else scanned for now."""
        if self._joint is not None:
            scan = already_worked_out("sealer", data, self)
            if scan is not None:
                return getattr(scan, which)
        return (self._json_trigger if which == "json" else self._percent_trigger).search(data)

    def companion_hits(self, data: bytes) -> list[tuple[int, int, int]]:
        """The companion's matches in DATA (index, start, end), from one scan with the values; the
        values' matches and the escape triggers' answers are kept (in shared_scans, keyed by the
        sealer itself: its numbering) for the seal that follows. Without a companion: none."""
        if self._joint is None:
            return []
        return worked_out("sealer", data, self, self._joint_scan).companion

    def _joint_scan(self, data: bytes) -> _JointScan:
        """What one scan of DATA with the values, the companion, the escape triggers and the
        references' markers finds; the markers' matches are handed to ``_references.hidden_hits``."""
        occurrences, hits = self._joint.find_with(data)
        base = self._companion
        if not any(index >= base for index, _, _ in hits):
            remember("hidden", data, None, [])
            return _JointScan(occurrences, hits, False, False)
        percent_base, hidden_base = self._percent_base, self._hidden_base
        remember("hidden", data, None, [
            (index - hidden_base, end - HIDDEN_LENGTHS[index - hidden_base], end)
            for index, _, end in hits
            if index >= hidden_base
        ])
        return _JointScan(
            occurrences,
            [hit for hit in hits if hit[0] < base],
            any(base <= index < percent_base for index, _, _ in hits),
            any(percent_base <= index < hidden_base for index, _, _ in hits),
        )

    def find_names(self, data: bytes) -> Counter[str]:
        """Which values DATA holds, in any form, without changing it."""
        edits = self._find(data, 0)
        return Counter(n for e in edits for n in e.names)

    # -- sealing --------------------------------------------------------------------

    def seal(self, data: bytes, protect: Protect | None = None, url: bool = False, plus: bool = False) -> SealResult:
        """Seal a whole buffer. DATA comes back as the same object when nothing is found.

        With URL (a path, a query string, a form body), a value written
        plainly is replaced by the percent-encoded reference: `{` and `}` may
        not stand unescaped there. With PLUS (a query string, a form body), a
        `+` is read as a space, never as a base64 character.

        After each round of edits the buffer is looked at again: re-encoding
        a base64 run can leave a second value in it at another offset. A
        buffer still holding a value after a few rounds raises SealError.
        """
        result = SealResult(data)
        if not self._values:
            return result
        written: list[tuple[int, int]] = []  # what registered values' edits wrote, in today's offsets
        for _ in range(_MAX_ROUNDS):
            edits = self._find(result.data, 0, plus=plus)
            if protect and edits:
                spans = protect(result.data)
                if spans:
                    # Vendor-signed fields keep their base64 as written; a
                    # value written there plainly is still sealed.
                    edits = [e for e in edits if not (e.base64 and _inside(spans, e.start, e.end))]
            if written and edits:
                # A re-encoded run keeps its unchanged leading lines: a detected
                # value never takes one of them from the registered value's run.
                edits = [e for e in edits if not (_is_detected(e) and _overlaps(written, e.start, e.end))]
            if not edits:
                return result
            if url:
                edits = [_url_edit(e) if e.layer in ("raw", "json") else e for e in edits]
            written = _written(written, edits)
            result.data = _apply(result.data, edits)
            result.counts.update(n for e in edits for n in e.names)
        if self._find(result.data, 0, plus=plus):
            raise SealError("a buffer still held a value after sealing; it is blocked")
        return result

    def seal_fields(self, fields: Sequence[tuple[bytes, bytes]]) -> tuple[tuple[tuple[bytes, bytes], ...], Counter[str]]:
        """Header fields with names and values sealed, and the counts; one look when none holds a value."""
        counts: Counter[str] = Counter()
        if not self.may_hold_value(part for f in fields for part in f):
            return tuple(fields), counts
        sealed = []
        for name, value in fields:
            name_result, value_result = self.seal(name), self.seal(value)
            counts.update(name_result.counts)
            counts.update(value_result.counts)
            sealed.append((name_result.data, value_result.data))
        return tuple(sealed), counts

    def may_hold_value(self, parts: Iterable[bytes]) -> bool:
        """False when none of PARTS holds a value in any form: one look at all of them."""
        if not self._values:
            return False
        parts = list(parts)
        if self._separator:
            return bool(self._find(self._separator.join(parts), 0))
        return any(self._find(p, 0) for p in parts)


    def stream(self) -> StreamSealer:
        return StreamSealer(self)

    def scrub(self, data: bytes) -> SealResult:
        """Seal DATA exactly as a stream would (one chunk, then the end)."""
        stream = self.stream()
        out = stream.feed(data) + stream.feed(b"", final=True)
        return SealResult(data if not stream.counts else out, stream.counts)

    def holdback(self, data: bytes) -> int:
        """How many trailing bytes of DATA might belong to a form not complete yet."""
        if not self._values:
            return 0
        tail = data[-STREAM_RUN_BOUND:]
        held = len(tail) - len(tail.rstrip(self._inside))
        if held and self._edge_breaks:
            # A form never starts with a line break (no value holds one): the
            # blank line ending an SSE event is released at once.
            start = len(data) - held
            while held and data[start] in b"\r\n":
                start += 1
                held -= 1
        return held


class StreamSealer:
    """Seals a byte stream chunk by chunk; any chunking gives the same output.

    Each chunk is released up to the last byte that cannot belong to a form
    (``Sealer.holdback``): the rest waits for the next chunk, so a value split
    across chunks is still caught in every form, and an SSE event is not
    delayed. A base64 run still being written is held until it ends, up to
    ``STREAM_RUN_BOUND`` bytes, so that it is re-encoded exactly. Past that
    bound the run is transcoded group by group: decoded, sealed, encoded
    again with the same alphabet and line width; a sealed value's reference
    is then followed by 0-2 spaces so that the groups after it keep their
    place, and only values at the run's own offset are sealed there.
    """

    def __init__(self, sealer: Sealer) -> None:
        self._sealer = sealer
        self._pending = bytearray()
        self._run: _RunTranscoder | None = None
        self.counts: Counter[str] = Counter()

    def feed(self, chunk: bytes, final: bool = False) -> bytes:
        out: list[bytes] = []
        if self._run is not None:
            chunk = self._run.feed(chunk, out)
            if chunk is None:  # the run goes on
                if final:
                    out.append(self._run.close())
                    self._run = None
                return b"".join(out)
            out.append(self._run.close())
            self._run = None
        sealer = self._sealer
        if (
            not final
            and self._pending
            and len(self._pending) + len(chunk) < STREAM_RUN_BOUND
            and not chunk.translate(None, sealer._inside)
        ):
            # Nothing in CHUNK can end what is held (a long base64 run still
            # being written): keep it without looking at the held part again.
            self._pending += chunk
            return b""
        data = bytes(self._pending) + chunk if self._pending else chunk
        if final:
            cut = len(data)
        else:
            held = sealer.holdback(data)
            cut = len(data) - held
            if held >= STREAM_RUN_BOUND:
                cut = self._start_run(data, cut, out)
                if self._run is not None:
                    self._pending = bytearray()
                    return b"".join(out)
        result = sealer.seal(data[:cut])
        self.counts.update(result.counts)
        out.append(result.data)
        self._pending = bytearray(data[cut:])
        return b"".join(out)

    def _start_run(self, data: bytes, cut: int, out: list[bytes]) -> int:
        """Switch the trailing base64 run of DATA to group-by-group transcoding; the new cut."""
        # The run may start before the held part (holdback looks at most a
        # bound back), never before anything already released.
        start = len(data.rstrip(_RUN_BYTES))
        if len(data) - start < STREAM_RUN_BOUND // 2:
            # Not one long run: no other form is anywhere near this long.
            return len(data) - STREAM_RUN_BOUND // 2
        start += escape_tail(data, start)  # `%20` or `\n` before it: the run starts after the escape
        head = self._sealer.seal(data[:start])
        self.counts.update(head.counts)
        out.append(head.data)
        self._run = _RunTranscoder(self._sealer, data[start : start + 4096], self.counts)
        rest = self._run.feed(data[start:], out)
        assert rest is None  # the held part ends in run bytes
        return len(data)


_RUN_BYTES = B64_ALPHABET + b"\r\n"
_SEGMENT = re.compile(rb"[A-Za-z0-9+/_\-\r\n=]*")


def _segment_end(data: bytes, at: int) -> int:
    """Where the bytes from AT on stop being base64's alphabet, line breaks or padding
    (read in place: no copy of the rest of a long body)."""
    return _SEGMENT.match(data, at).end()


class _RunTranscoder:
    """A long base64 run in a stream: decoded in whole groups, sealed, encoded again.

    Only values at the run's own offset are sealed inside it, each reference
    padded with 0-2 spaces to its value's length modulo 3 so that every
    group after it encodes to the characters it had. A value written plainly
    in the run's text is sealed as text: the run ends before it and a new one
    starts after it.
    """

    def __init__(self, sealer: Sealer, sample: bytes, counts: Counter[str]) -> None:
        self._sealer = sealer
        self.counts = counts  # the stream's own: a stream cut short still reports what it sealed
        self._urlsafe = b"-" in sample or b"_" in sample
        first = sample.find(b"\n")
        self._newline = b"\r\n" if first > 0 and sample[first - 1] == 0x0D else b"\n"
        self._width = (first - (len(self._newline) - 1)) if first > 0 else 0
        self._column = 0
        self._text = b""  # run bytes not yet looked at for plain values
        self._chars = b""  # base64 characters not yet decoded (less than one group)
        self._decoded = b""  # decoded bytes held back: a value may start there

    def feed(self, chunk: bytes, out: list[bytes]) -> bytes | None:
        """Transcode the run bytes CHUNK starts with into OUT; the bytes after the run, or None."""
        rest = chunk.lstrip(_RUN_BYTES)
        end = len(chunk) - len(rest)
        self._text += chunk[:end]
        self._drain(out, final=False)
        return rest if end < len(chunk) else None

    def _drain(self, out: list[bytes], final: bool) -> None:
        sealer = self._sealer
        while True:
            hits = sealer._raw.find(self._text)
            if not hits:
                break
            index, start, end = hits[0]
            self._transcode(self._text[:start], out)
            out.append(self._finish_run())
            out.append(sealer._references[index])
            self.counts[sealer._names[index]] += 1
            self._column += len(sealer._references[index])
            self._text = self._text[end:]
        keep = 0 if final else min(len(self._text), max(0, sealer.longest - 1))
        self._transcode(self._text[: len(self._text) - keep], out)
        self._text = self._text[len(self._text) - keep :]

    def _transcode(self, text: bytes, out: list[bytes]) -> None:
        chars = self._chars + text.replace(b"\r", b"").replace(b"\n", b"")
        whole = len(chars) // 4 * 4
        self._chars = chars[whole:]
        if whole:
            group = chars[:whole].translate(_TO_STD) if self._urlsafe else chars[:whole]
            self._decoded += a2b_base64(group)
            out.append(self._emit(final=False))

    def _emit(self, final: bool) -> bytes:
        data = self._decoded
        edits = self._sealer._find(data, MAX_LAYERS)  # raw values only
        limit = len(data) if final else max(0, len(data) - self._sealer.longest - 1)
        if not final:
            # Cut at a group boundary outside every edit: replacements keep
            # their value's length modulo 3, so output stays group-aligned.
            limit -= limit % 3
            for e in reversed(edits):
                if e.start < limit < e.end:
                    limit = e.start - e.start % 3
        out = bytearray()
        pos = 0
        for e in edits:
            if e.end > limit:
                break
            out += data[pos : e.start] + e.replacement + b" " * ((e.end - e.start - len(e.replacement)) % 3)
            pos = e.end
            self.counts.update(e.names)
        out += data[pos:limit]
        self._decoded = data[limit:]
        return self._encode(bytes(out))

    def _encode(self, decoded: bytes) -> bytes:
        text = binascii.b2a_base64(decoded, newline=False).rstrip(b"=")
        if self._urlsafe:
            text = text.translate(_TO_URL)
        return self._wrap(text)

    def _wrap(self, text: bytes) -> bytes:
        if not self._width:
            return text
        lines = bytearray()
        while text:
            room = self._width - self._column
            if room <= 0:
                lines += self._newline
                self._column = 0
                continue
            lines += text[:room]
            self._column += len(text[:room])
            text = text[room:]
        return bytes(lines)

    def _finish_run(self) -> bytes:
        """What is held of the current run, and its last partial group (the run ends here)."""
        chars, self._chars = self._chars, b""
        lone = b""
        if len(chars) % 4 == 1:
            chars, lone = chars[:-1], chars[-1:]  # decodes to nothing: kept as it is
        if chars:
            text = chars.translate(_TO_STD) if self._urlsafe else chars
            self._decoded += a2b_base64(text + b"=" * (-len(text) % 4))
        # A partial last group of 2 or 3 characters encodes again to as many.
        tail = self._emit(final=True) if self._decoded else b""
        return tail + (self._wrap(lone) if lone else b"")

    def close(self) -> bytes:
        """The end of the stream or of the run: everything still held."""
        out: list[bytes] = []
        self._drain(out, final=True)
        out.append(self._finish_run())
        return b"".join(out)


# -- helpers ------------------------------------------------------------------------------


def _both_plusses(spaced: Callable[[], bytes] | None, run: Run) -> bool:
    """Whether RUN holds a `+` the layer above wrote plainly and one it wrote as `%2B`."""
    if spaced is None:
        return False
    chars = spaced()[run.start : run.end]
    return b" " in chars and b"+" in chars


def _plus_is_base64(data: bytes, run: Run) -> bool:
    """Whether the `+` of RUN, a run read with `+` as a base64 character in a form or
    query, are base64's: RUN ends on a group's end (padding counted), and its first `+`
    stands part way into a group (no encoder ends a text there and writes on), or
    inside a line of a block that goes on below (a space does not stand inside a
    wrapped line), or at the start of a line. A first `+` on a block's last line, after
    whole groups, may be either: the reading with `+` as a space stands.

    An unpadded RUN of a length base64 can have, whose first `+` stands part way into
    a group: its `+` are base64's when that `+` stands one character into the group
    (read as a space, it would end the text before it where no base64 can end:
    `…5T+o`), or when what follows the group ends in text (``_ends_in_text``: a text
    encoded whole, `…tbU+CmhlcmUg…`, "…\\nhere"). After base64 that ends part way into
    a group, ` more words` written with `+` decode to no text there."""
    at = data.find(b"+", run.start, run.end)
    if at == -1:
        return False
    chars = _chars(data, run.start, run.end) + run.padding
    offset = _chars(data, run.start, at)  # the `+`'s, in characters of the run
    into = offset % 4
    if chars % 4:
        if run.padding or chars % 4 == 1 or not into:
            return False
        if into == 1:
            return True
        text = data[run.start : run.end].replace(b"\r", b"").replace(b"\n", b"")
        after = text[offset - into + 4 :]  # the groups after the `+`'s
        try:
            return _ends_in_text(a2b_base64(after + b"=" * (-len(after) % 4)))
        except binascii.Error:
            return False
    if into:
        return True
    return data.find(b"\n", at, run.end) != -1 or data[at - 1 : at] == b"\n"


def _ends_in_text(decoded: bytes) -> bool:
    """Whether DECODED ends in UTF-8 text: its last twelve bytes (but for up to three,
    where a character starts) printable characters and line breaks. Words written with
    `+` for a space, read as base64, decode to no such thing."""
    if len(decoded) < 12:
        return False
    for skip in range(4):
        try:
            text = decoded[len(decoded) - 12 + skip :].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return all(c.isprintable() or c in "\t\n\r" for c in text)
    return False


_SPACED_WORD = re.compile(rb"\+([a-z]{2,})")


def _before_a_spaced_word(data: bytes, run: Run, plain_plus: Callable[[int], bool]) -> Run | None:
    """RUN without the `+` and the word it ends in (`…JF6+end`, `…kX\n+end`), when the
    percent layer above wrote that `+` plainly while it escapes others (PLAIN_PLUS): the
    ` end` of quote_plus, not base64's `+` (which quote writes `%2B`). None otherwise."""
    if run.padding:
        return None
    at = data.rfind(b"+", max(run.start, run.end - 16), run.end)
    m = _SPACED_WORD.fullmatch(data, at, run.end) if at > run.start else None
    if m is None or not plain_plus(at) or not reads_as_words([m.group(1)], at_least=-1.5):
        return None
    end = at
    while end > run.start and data[end - 1] in b"\r\n":
        end -= 1
    return Run(run.start, end, 0, run.alternative)


def _cut_into_a_group(data: bytes, run: Run, pieces: list[Edit]) -> bool:
    """Whether RUN, read from its own first character, is whole groups while PIECES (read
    between its plain `+`) end part way into one: its `+` is base64's (`…ei+t` written by a
    writer that escapes some `+` it may leave: random-seed soak 77234259, case 16076), not a
    space before a word, which would leave the run in whole groups too."""
    return _chars(data, run.start, run.end) % 4 == 0 and any(_chars(data, run.start, e.end) % 4 for e in pieces)


def _chars(data: bytes, start: int, end: int) -> int:
    """How many characters DATA[START:END] holds, line breaks not counted."""
    return end - start - _count_breaks(data, start, end)


def _url_edit(edit: Edit) -> Edit:
    reference = quote(edit.replacement, safe="").encode("ascii")
    return replace(edit, replacement=reference, layer="percent")


def _plus_edit(edit: Edit) -> Edit:
    return replace(edit, replacement=edit.replacement.replace(b"+", b"%2B"))


def _trimmed(view, edit: Edit) -> tuple[int, int, bytes]:
    """EDIT's view span and replacement without the bytes they share at either end
    (cut only where the view maps back between raw bytes, never inside an escape)."""
    old = view.data[edit.start : edit.end]
    new = edit.replacement
    limit = min(len(old), len(new)) - 1  # at least one byte of the span is replaced
    head = _common_prefix(old, new, limit)
    while head and not view.boundary(edit.start + head):
        head -= 1
    tail = _common_prefix(old[::-1], new[::-1], limit - head)
    while tail and not view.boundary(edit.end - tail):
        tail -= 1
    return edit.start + head, edit.end - tail, new[head : len(new) - tail]


def _common_prefix(a: bytes, b: bytes, limit: int) -> int:
    """How many leading bytes A and B share, at most LIMIT (slice comparisons: C speed on long runs)."""
    low, high = 0, max(0, limit)
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _touches(data: bytes, start: int, end: int, escapes: bytes = b"\\%+") -> bool:
    """Whether an escape (`\\…`, `%XX`, a `+` for a space; those in ESCAPES) sits right before or after DATA[START:END]."""
    before, after = data[start - 1 : start], data[end : end + 1]
    return bool(before and before in escapes) or bool(after and after in escapes) or (
        b"%" in escapes and start >= 3 and data[start - 3 : start - 2] == b"%"
    )


def _is_text(data: bytes) -> bool:
    """Whether a decoded base64 payload reads as text (escapes may hide a value
    there) rather than binary (an image): UTF-8 but for a few bytes (random
    bytes before the text), and mostly printable."""
    if len(data) <= 64 or data.isascii():
        return True
    if len(data) > 4 * _TEXT_SAMPLE and not any(
        _is_text(data[at : at + _TEXT_SAMPLE]) for at in (0, len(data) // 2, len(data) - _TEXT_SAMPLE)
    ):
        return False  # a long payload whose start, middle and end are binary (an image): not read whole
    if data.decode("utf-8", "replace").count("\ufffd") > 8:
        return False
    return len(data.translate(None, _TEXT_BYTES)) <= len(data) // 4


_TEXT_SAMPLE = 4096


_TEXT_BYTES = bytes(range(0x20, 0x7F)) + b"\t\n\r" + bytes(range(0x80, 0x100))


def _plain_breaks_cut(data: bytes) -> bytes:
    """DATA with each line break written plainly as NUL, where other breaks are
    escaped: a block whose breaks were escaped ends at a plain one. A break half
    escaped (`%0D` and a plain LF) is one break, escaped: it is kept."""
    cut = data.translate(_PLAIN_BREAKS)
    halves = list(_HALF_BREAK.finditer(data))
    if not halves:
        return cut
    kept = bytearray(cut)
    for m in halves:
        plain = m.start() if data[m.start()] == 0x0D else m.end() - 1
        kept[plain] = data[plain]
    return bytes(kept)


def _offsets(data: bytes, run: Run) -> list[int]:
    """The character offsets a base64 run is decoded from.

    A payload may sit after other base64 characters (``/upload/`` in a path,
    ``user-`` before a token): a short run is decoded from each of its four
    offsets. A long one is decoded from its start, from after the tail of an
    escape it is glued to (``%0A`` before it: ``0A`` is base64), and from where
    its first line ends when that line is shorter than the next (``KEY-----``
    before the body of a PEM block).
    """
    if run.end - run.start <= SHORT_RUN or data[run.start : run.start + 1] == b"/":
        return [0, 1, 2, 3]  # short, or after a path (`/upload/…`): any offset
    offsets = [0]
    first = data.find(b"\n", run.start, run.end)
    if first != -1:
        second = data.find(b"\n", first + 1, run.end)
        head = first - run.start - (data[first - 1] == 0x0D)
        if second == -1 or head < second - first - 1 - (data[second - 1] == 0x0D):
            if head % 4:
                offsets.append(head % 4)
    # Glued to the tail of an escape the run scan takes for base64 characters:
    # the hex digits of `%0A` or `%20`, the letter of `\n`, the `u2190` of `\u2190`.
    glued = _after_escape(data, run)
    if glued and glued not in offsets:
        offsets.append(glued)
    # Glued to other base64 characters (`id-`, `token`, the `n` of a backslash and
    # `n` in source code): a text payload reads as text from its own start only.
    offsets += [k for k in _text_offsets(data, run) if k not in offsets]
    return offsets


def _text_offsets(data: bytes, run: Run) -> list[int]:
    """The offsets 1-3 from which the head of a long RUN decodes to text, where its start does not:
    a payload of text behind 1-3 glued base64 characters. Binary (an image) reads as binary from
    every offset: none."""
    head = data[run.start : run.start + 2 * _HEAD_CHARS].translate(None, b"\r\n")[:_HEAD_CHARS]
    readings = []
    for k in range(4):
        try:
            # The first groups may be the prefix's own characters (`blob+` is five):
            # what a reading holds is told after them.
            readings.append(decode_base64(head[k : k + (len(head) - k) // 4 * 4])[_PREFIX_BYTES:])
        except binascii.Error:  # characters outside the alphabet (`\\/`) in the head
            readings.append(b"")
    if not readings[0] or _reads_as_text(readings[0]):
        return []
    return [k for k in (1, 2, 3) if readings[k] and _reads_as_text(readings[k])]


_HEAD_CHARS = 128  # 96 bytes: enough to tell text from random bytes
_PREFIX_BYTES = 12  # four groups: a glued prefix of up to 16 characters


def _reads_as_text(head: bytes) -> bool:
    """Printable ASCII or UTF-8 but for a stray byte or two (the first group may hold a byte of a prefix).
    Stricter than _is_text, which asks whether a whole payload's escapes may matter and lets a
    quarter of it be control bytes: here one reading of a head is told from another."""
    if len(head.translate(None, _TEXT_BYTES)) > len(head) // 16:
        return False
    return head.decode("utf-8", "replace").count("\ufffd") <= 2


def _after_escape(data: bytes, run: Run) -> int:
    """The offset of RUN that starts after the tail of an escape glued to it (0: none)."""
    return escape_tail(data, run.start) % 4


def _triggers(values: list[bytes]) -> tuple[_AnyOf, _AnyOf]:
    """Tests for the escapes that can matter: ones that decode to a byte of
    some value or of an encoding's own syntax. Any other escape (a CJK
    character, an ANSI colour code, a quote) cannot be part of a form, so a
    buffer holding only those needs no decoded view.

    Each test is one Hyperscan scan of all its patterns, stopped at the first
    match: a buffer full of irrelevant escapes (ensure_ascii JSON of CJK
    text, prose with a `\\n` every few words) costs one pass in C. Each is
    compiled when first asked (``_AnyOf``): the buffers detection reads are
    asked in the scan made for detection and the sealer (``Sealer._joint_scan``)."""
    relevant = set(_SYNTAX)
    values_bytes: set[int] = set()
    wide: set[int] = set()
    for v in values:
        relevant.update(v)
        values_bytes.update(v)
        try:
            wide.update(ord(c) for c in v.decode("utf-8") if ord(c) > 0x7F)
        except UnicodeDecodeError:
            wide.add(-1)  # a value that is not UTF-8: every \\u escape may matter
    patterns: list[bytes] = []
    # `\\u0041` in every mix of case, written out: Hyperscan finds six-byte literals at
    # memory speed, where a pattern starting `\\u` confirms every `\\u` of the text.
    literals: list[bytes] = []
    if -1 in wide:
        patterns.append(rb"\\u[0-9a-fA-F]{4}")
    else:
        literals += _u_escapes({c for c in relevant if c < 0x80} | {c for c in wide if c <= 0xFF})
        higher = sorted(c for c in wide if 0xFF < c <= 0xFFFF)
        if len(higher) > 16:
            patterns.append(rb"\\u[0-9a-fA-F]{4}")
        else:
            literals += _u_escapes(higher)
        if any(c > 0xFFFF for c in wide):
            patterns += [rb"\\ud[89abAB]", rb"\\uD[89abAB]"]  # a surrogate pair: any character beyond U+FFFF
    short_literals, short_patterns = _short_escapes(values)
    patterns += short_patterns
    literals += short_literals
    # `\\/` is in the base64 alphabet; `\\\\` matters when a value holds a
    # backslash, or when it escapes a further escape (JSON inside a JSON string).
    patterns.append(rb"\\/")
    patterns.append(rb"\\\\" if ord("\\") in values_bytes else rb"\\\\(?:\\|/|u[0-9a-fA-F]{4})")
    # Base64 wrapped inside a JSON string, whatever the values (_views.WRAPPED_IN_JSON_PATTERNS): in
    # the same scan, which stops at the first match of either.
    patterns += WRAPPED_IN_JSON_PATTERNS
    percent_trigger = _AnyOf([("%" + _hex_alternatives("", relevant)).encode()])
    return _AnyOf(patterns, literals), percent_trigger


def _u_escapes(codes: Iterable[int]) -> list[bytes]:
    """`\\u` escapes of CODES (each below U+10000), in every mix of hex-digit case."""
    return [
        b"\\u" + "".join(digits).encode()
        for c in codes
        for digits in itertools.product(*(sorted({d, d.upper()}) for d in f"{c:04x}"))
    ]


class _JointScan(NamedTuple):
    """What one scan of a buffer detection reads finds (``Sealer._joint_scan``), kept in shared_scans."""

    occurrences: list[tuple[int, int, int]]  # the values' (index, start, end), chosen as Matcher.find chooses
    companion: list[tuple[int, int, int]]  # the companion's (the detector's expressions)
    json: bool  # an escape that calls for the JSON view (_triggers)
    percent: bool  # one that calls for the percent view

_SHORT_ESCAPES = {ord('"'): b'\\"', 8: b"\\b", 12: b"\\f", 10: b"\\n", 13: b"\\r", 9: b"\\t"}


def _short_escapes(values: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """What makes a short escape (`\\"`, `\\n` …) of a byte values hold matter:
    (literals, patterns). Prose in JSON is full of `\\"` and `\\n`: such an
    escape matters only where it stands next to what stands next to that byte
    in a value as an encoder writes it (three characters of it on one side,
    as ``json.dumps`` writes them): those are literals. A value whose
    neighbours an encoder escapes in other ways (`\\u0041\\"`) is caught by
    the `\\u` and `\\\\` patterns; escapes side by side in a value make the
    escape matter wherever it stands (a pattern)."""
    literals: set[bytes] = set()
    anywhere: set[bytes] = set()
    for v in values:
        try:
            written = _json_dumps(v.decode("utf-8"), ensure_ascii=False)[1:-1].encode("utf-8")
        except UnicodeDecodeError:
            anywhere.update(_SHORT_ESCAPES[c] for c in set(v) if c in _SHORT_ESCAPES)
            continue
        for escape in {_SHORT_ESCAPES[c] for c in set(v) if c in _SHORT_ESCAPES}:
            at = written.find(escape)
            while at != -1:
                head, tail = written[max(0, at - 3) : at], written[at + 2 : at + 5]
                # As written once, and in a JSON string inside one or two more (a
                # control byte's escape with its backslash escaped again: `\\t`,
                # `\\\\t`; the neighbours hold no `\\` or `"`, so they stay as they are).
                if len(head) == 3 and b"\\" not in head:
                    literals.update(head + layered for layered in _layered(escape))
                elif len(tail) == 3 and b"\\" not in tail:
                    literals.update(layered + tail for layered in _layered(escape))
                else:
                    anywhere.update(_layered(escape))
                at = written.find(escape, at + 2)
    return sorted(literals), [re.escape(e) for e in sorted(anywhere)]


def _layered(escape: bytes) -> tuple[bytes, ...]:
    """A short escape of a control byte (`\\n`) as one, two and three JSON string layers
    write it. (`\\"` two layers down is `\\\\\\"`, which the `\\\\` pattern catches.)"""
    if escape == b'\\"':
        return (escape,)
    return escape, b"\\" + escape, b"\\\\\\" + escape


class _AnyOf:
    """Whether any of several patterns, or any of several literals, occurs in a
    buffer: one Hyperscan scan, stopped at the first match. Compiled when first
    asked: a sealer whose buffers are all scanned with detection's (the proxy's
    top-level buffers) may never ask, and the JSON trigger takes tens of
    milliseconds to compile."""

    __slots__ = ("_scanner", "expressions", "literals", "patterns")

    def __init__(self, patterns: list[bytes], literals: Sequence[bytes] = ()) -> None:
        self.patterns, self.literals = tuple(patterns), tuple(literals)
        #: what the scan looks for, as Hyperscan expressions
        self.expressions = (*self.patterns, *(escaped(lit) for lit in self.literals))
        self._scanner: Scanner | None = None

    def search(self, data: bytes) -> bool:
        if self._scanner is None:
            self._scanner = Scanner(self.expressions)
        return self._scanner.any(data)


def _cased(hex_digits: str) -> str:
    return "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in hex_digits)


def _hex_alternatives(prefix: str, codes: set[int]) -> str:
    """A regex for PREFIX + two hex digits naming a byte in CODES, either case: one class per high digit."""
    by_high: dict[int, str] = {}
    for c in sorted(codes):
        by_high[c >> 4] = by_high.get(c >> 4, "") + "".join(sorted({f"{c & 15:x}", f"{c & 15:X}"}))
    parts = [f"{_cased(f'{high:x}')}[{lows}]" for high, lows in sorted(by_high.items())]
    return prefix + "(?:" + "|".join(parts) + ")"


DETECTED_PREFIX = "detected/"  # the names of values nobody registered (SPEC §3a)


def _resolve(edits: list[Edit]) -> list[Edit]:
    """Sorted, non-overlapping edits. A registered value wins over a detected one. A value found in text wins over a base64
    run that overlaps it (a raw value glued to a run is sealed as text first;
    the run is looked at again in the next round); else, of two on the same
    span, the shallower; else the first, the longest."""
    if len(edits) < 2:
        return edits
    registered, detected = [], []
    for e in edits:
        (detected if _is_detected(e) else registered).append(e)
    if detected and registered:
        # A registered value always wins over a detected one it overlaps (SPEC §3a:
        # detection never gets in a registered value's way, in any layer).
        taken = _resolve(registered)
        spans = [(e.start, e.end) for e in taken]
        rest = [e for e in detected if not any(s < e.end and e.start < t for s, t in spans)]
        return sorted(taken + _resolve(rest), key=lambda e: e.start)
    if any(e.glued for e in edits):
        # A run decoded after a glued prefix gives way to a reading of the same bytes
        # from a run's own first character (`6+ip…` as it stands, not `ip…` after a
        # `+` read as a space): that is where the payload starts.
        own = [(e.start, e.end) for e in edits if not e.glued]
        edits = [e for e in edits if not e.glued or not _overlaps(own, e.start, e.end)]
    if any(e.unsure for e in edits):
        # Of two readings of the same value's bytes, one whose JSON view read past a
        # backslash that starts no escape (`%5C%20`, percent-decoded, read as JSON)
        # took the layers in the wrong order: the other one writes the reference back
        # in the order the client wrote them. So does one that guessed `+` for a space.
        # (Only to one read through no more layers: a sure reading from deeper down holds a guess of its
        # own, made at a layer below, which lifting does not mark: random-seed soak 183517992, case 11104.)
        sure = [e for e in edits if not e.unsure]
        edits = [e for e in edits if not e.unsure or not any(
            o.names == e.names and o.start < e.end and e.start < o.end and o.depth <= e.depth for o in sure)]
    if len({e.depth for e in edits if e.layer != "raw"}) > 1:
        # Of two readings of the same value's bytes through views, the one through fewer
        # layers: a percent view read over a JSON string's escapes, then JSON, then
        # percent again, writes the reference percent-encoded once more than the
        # JSON-then-percent reading (`%257B`), and their spans differ by what each leaves
        # unchanged. (Not a raw match: one that ends inside an escape, `…\\` of `…\\\\`,
        # gives way to the view that reads the escape whole, as the longer.)
        edits = _shallowest(edits)
    edits.sort(key=lambda e: (e.start, -e.end, e.depth))
    runs = [e for e in edits if e.base64]
    if runs and len(runs) < len(edits):
        # Text first (raw, JSON- or percent-escaped); a base64 run it overlaps waits for the next round.
        taken = _non_overlapping([e for e in edits if not e.base64])
        spans = [(e.start, e.end) for e in taken]
        rest = [e for e in runs if not any(s < e.end and e.start < t for s, t in spans)]
        return sorted(taken + _non_overlapping(rest), key=lambda e: e.start)
    return _non_overlapping(edits)


def _shallowest(edits: list[Edit]) -> list[Edit]:
    """EDITS without those that overlap an edit of the same values, of the same kind,
    found through fewer layers (raw matches aside)."""
    edits = sorted(edits, key=lambda e: e.start)
    deeper: set[int] = set()
    for i, e in enumerate(edits):
        for j in range(i + 1, len(edits)):
            o = edits[j]
            if o.start >= e.end:
                break
            if o.names == e.names and o.base64 == e.base64 and o.depth != e.depth and "raw" not in (o.layer, e.layer):
                deeper.add(i if e.depth > o.depth else j)
    return [e for i, e in enumerate(edits) if i not in deeper]


def _non_overlapping(edits: list[Edit]) -> list[Edit]:
    out: list[Edit] = []
    end = -1
    for e in edits:
        if e.start >= end:
            out.append(e)
            end = e.end
    return out


def _apply(data: bytes, edits: Sequence[Edit]) -> bytes:
    out: list[bytes] = []
    pos = 0
    for e in edits:
        out += (data[pos : e.start], e.replacement)
        pos = e.end
    out.append(data[pos:])
    return b"".join(out)


def _is_detected(edit: Edit) -> bool:
    return all(n.startswith(DETECTED_PREFIX) for n in edit.names)


def _overlaps(spans: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    return any(s < end and start < t for s, t in spans)


def _written(spans: list[tuple[int, int]], edits: Sequence[Edit]) -> list[tuple[int, int]]:
    """SPANS moved to where they stand once EDITS (sorted) are applied, and the
    spans the registered values' edits write."""
    deltas = [(e.start, len(e.replacement) - (e.end - e.start)) for e in edits]

    def moved(pos: int) -> int:
        return pos + sum(d for start, d in deltas if start < pos)

    out = [(moved(s), moved(t)) for s, t in spans]
    shift = 0
    for e, (_, d) in zip(edits, deltas):
        if not _is_detected(e):
            out.append((e.start + shift, e.start + shift + len(e.replacement)))
        shift += d
    return out


def _inside(spans: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    return any(s <= start and end <= e for s, e in spans)
