"""The oracle: is any registered value recoverable from these bytes? Standard library only.

It is written apart from keyveil (it imports nothing from it) and apart from
the generator in tests/stdlib_forms.py: it does not know which encodings were
used, it decodes whatever the bytes allow, recursively, and looks for each
value in every view. A view is the buffer itself or one decoding of a view:

- ``json``: every JSON escape sequence decoded in place (runs of ``\\uXXXX``
  together, so surrogate pairs join), each run through
  ``json.loads('"' + run + '"')``; everything else is left as it is. On a JSON
  document this is the concatenation of its decoded strings; it also reads
  escapes in text that only carries JSON (NDJSON, SSE, a header);
- ``json.loads``: the whole buffer through ``json.loads`` when it parses, else
  every string literal found in it that holds an escape, each through
  ``json.loads``; the decoded strings joined with NUL (separate strings);
- ``pct`` and ``pct+``: ``urllib.parse.unquote_to_bytes`` of the whole view,
  without and with ``+`` read as a space;
- ``b64@0..3``: every run of base64 characters (both alphabets; line breaks
  inside a run are removed) at least as long as the shortest value's base64,
  at each of the 4 character alignments, through ``base64.b64decode`` after
  mapping ``-_`` to ``+/`` (which is what ``urlsafe_b64decode`` does, so a
  run in either alphabet, or one mixing them, decodes); one view per
  alignment holds every run so decoded, runs kept apart by bytes no UTF-8
  text holds.

Views of views are decoded too, to ``depth`` (3 by default) decodings. A
decoder that would change nothing adds no view. The oracle reports names (and
the decodings that exposed them), never the bytes it found.

``check_round_trip`` is the second half: given a form the generator made and
the bytes keyveil turned it into, it decodes them layer by layer with the
stdlib decoder of each layer and says whether they hold exactly what the form
held, with the value replaced by the reference, in the same carrier format.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from urllib.parse import unquote_to_bytes

from tests.stdlib_forms import Form, Layer

_JSON_ESCAPES = re.compile(rb'(?:\\u[0-9a-fA-F]{4})+|\\["\\/bfnrt]')
_JSON_LITERAL = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_URL_TO_STD = bytes.maketrans(b"-_", b"+/")


_ESCAPE_CACHE: dict[bytes, bytes] = {}


def _json_unescape(view: bytes) -> bytes:
    def one(m: re.Match[bytes]) -> bytes:
        esc = m.group(0)
        out = _ESCAPE_CACHE.get(esc)
        if out is None:
            out = json.loads('"' + esc.decode("ascii") + '"').encode("utf-8", "surrogatepass")
            if len(_ESCAPE_CACHE) < 1 << 16:
                _ESCAPE_CACHE[esc] = out
        return out

    return _JSON_ESCAPES.sub(one, view)


def _json_strings(view: bytes) -> bytes | None:
    """The strings of VIEW as a JSON document, or else of each string literal holding an escape."""

    def strings(obj) -> Iterator[str]:
        if isinstance(obj, str):
            yield obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield k
                yield from strings(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from strings(v)

    found: list[str] = []
    if view.lstrip()[:1] in (b"{", b"[", b'"'):
        try:
            found = list(strings(json.loads(view)))
        except (ValueError, RecursionError):
            found = []
    if not found:
        for m in _JSON_LITERAL.finditer(view):
            literal = m.group(0)
            if b"\\" not in literal:
                continue  # it decodes to itself, which the view already holds
            try:
                found.append(json.loads(literal, strict=False))
            except ValueError:
                continue
    if not found:
        return None
    return b"\0".join(s.encode("utf-8", "surrogatepass") for s in found)


# Between decoded runs in one view: decodes to 0xFF bytes, which no UTF-8 text holds,
# so no value can straddle two runs.
_RUN_GAP = b"////"


_B64_AND_BREAKS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-\r\n")
#: every other byte becomes NUL, so that long runs are found by one C-level scan
_RUN_TABLE = bytes(b if b in _B64_AND_BREAKS else 0 for b in range(256))
_LONG_RUNS: dict[int, re.Pattern[bytes]] = {}


def _b64_runs(view: bytes, min_run: int) -> list[bytes]:
    """Runs of base64 characters (either alphabet), line breaks inside them removed, at least MIN_RUN long."""
    pattern = _LONG_RUNS.get(min_run)
    if pattern is None:
        pattern = _LONG_RUNS[min_run] = re.compile(rb"[^\x00]{%d,}" % min_run)
    runs = []
    for m in pattern.finditer(view.translate(_RUN_TABLE)):
        run = m.group(0)
        if b"\n" in run or b"\r" in run:
            run = run.replace(b"\r", b"").replace(b"\n", b"")
            if len(run) < min_run:
                continue
        runs.append(run)
    return runs


def _b64_views(view: bytes, min_run: int) -> list[tuple[str, bytes]]:
    runs = _b64_runs(view, min_run)
    if not runs:
        return []
    out = []
    for shift in range(4):
        parts = []
        for run in runs:
            part = run[shift:]
            if len(part) % 4 == 1:
                part = part[:-1]
            parts.append(part + b"A" * (-len(part) % 4))  # zero bits instead of '=': one decode for all runs
        joined = _RUN_GAP.join(parts)
        # Both alphabets in one pass: urlsafe_b64decode is b64decode after this translation.
        out.append((f"b64@{shift}", base64.b64decode(joined.translate(_URL_TO_STD))))
    return out


def decode_once(view: bytes, min_run: int = 11) -> list[tuple[str, bytes]]:
    """Every one-step decoding of VIEW that changes something, labelled."""
    out: list[tuple[str, bytes]] = []
    if b"\\" in view:
        out.append(("json", _json_unescape(view)))
        strings = _json_strings(view)
        if strings is not None:
            out.append(("json.loads", strings))
    if b"%" in view:
        out.append(("pct", unquote_to_bytes(view)))
    if b"+" in view:
        out.append(("pct+", unquote_to_bytes(view.replace(b"+", b" "))))
    out += _b64_views(view, min_run)
    return [(label, v) for label, v in out if v != view]


class Oracle:
    """Finds which of NEEDLES (name -> value or values) can be recovered from bytes."""

    def __init__(self, needles: Mapping[str, bytes | Sequence[bytes]], depth: int = 3) -> None:
        self.depth = depth
        self.needles: list[tuple[str, bytes]] = []
        for name, vs in needles.items():
            for v in [vs] if isinstance(vs, bytes) else vs:
                if len(v) < 8:
                    raise ValueError(f"a needle of {len(v)} bytes for {name} would find noise")
                self.needles.append((name, v))
        shortest = min((len(v) for _, v in self.needles), default=8)
        self.min_run = -(-shortest * 4 // 3)  # base64 shorter than this cannot hold any needle

    def views(self, data: bytes) -> Iterator[tuple[str, bytes]]:
        """(decodings applied, view) for DATA and every view of it, breadth first, each view once."""
        seen = {data}
        frontier = [("raw", data)]
        yield frontier[0]
        for _ in range(self.depth):
            nxt = []
            for path, view in frontier:
                for label, child in decode_once(view, self.min_run):
                    if child in seen:
                        continue
                    seen.add(child)
                    item = (label if path == "raw" else f"{path}>{label}", child)
                    yield item
                    nxt.append(item)
            frontier = nxt

    def explain(self, data: bytes) -> dict[str, str]:
        """name -> the first decodings (e.g. ``pct>b64@2``) through which it was recovered."""
        found: dict[str, str] = {}
        if not self.needles:
            return found
        for path, view in self.views(data):
            for name, v in self.needles:
                if name not in found and v in view:
                    found[name] = path
            if len(found) == len({n for n, _ in self.needles}):
                break
        return found

    def find(self, data: bytes) -> list[str]:
        """The names recoverable from DATA, sorted (names only, never bytes)."""
        return sorted(self.explain(data))

    def __contains__(self, data: bytes) -> bool:
        return bool(self.explain(data))


# --- the round trip of a sealed form --------------------------------------------------------------

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")
#: What may stand unescaped in each slot, from RFC 3986 (beyond unreserved characters): a
#: query or form value is pchar / "/" / "?" without '&' (it ends the value), '+' (a space)
#: and '#'; a path is pchars and '/'; a URL's userinfo is sub-delims and ':' without '@' or '/'.
_RAW_OK = {
    "query": b"!$'()*,;=:@/?",
    "form": b"!$'()*,;=:@/?",
    "path": b"!$&'()*+,;=:@/",
    "userinfo": b"!$&'()*+,;=:",
}
_STD = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
_URL = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_PCT_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_RAW_REFERENCE = re.compile(rb"\{\{secret:[A-Za-z0-9._/-]+\}\}")


class NotInFormat(ValueError):
    """A sealed layer that its own stdlib decoder rejects, or that left the layer's format."""


def decode_layer(layer: Layer, data: bytes) -> bytes:
    """DATA decoded as LAYER was encoded, refusing anything that encoder could not have written."""
    if layer.kind == "json":
        try:
            text = data.decode("utf-8")
            out = json.loads('"' + text + '"')
            return out.encode("utf-8")
        except (UnicodeError, ValueError) as e:
            raise NotInFormat(f"no longer the content of a JSON string ({type(e).__name__})") from None
    if layer.kind == "pct":
        # The slot's own characters, and the line breaks this layer left plain.
        breaks = {ord(c) for c in layer.safe if c in "\r\n"}
        allowed = _UNRESERVED | frozenset(_RAW_OK[layer.slot]) | {ord("%")} | ({ord("+")} if layer.plus else set()) | breaks
        # SPEC §2: a reference in a URL is recognised raw or percent-encoded. Where V
        # needed no escape, how many percent layers surround it cannot be told from
        # the bytes, so a reference written one layer less encoded is accepted.
        stray = sorted({chr(b) for b in _RAW_REFERENCE.sub(b"", data) if b not in allowed and b < 0x80})
        if any(b >= 0x80 for b in data):
            raise NotInFormat("non-ASCII bytes in percent-encoded text")
        if stray:
            raise NotInFormat(f"characters the {layer.slot} slot does not allow unescaped: {''.join(stray)!r}")
        if _PCT_ESCAPE.search(data):
            raise NotInFormat("a '%' that starts no escape")
        return unquote_to_bytes(data.replace(b"+", b" ") if layer.plus else data)
    if layer.kind == "b64":
        return _decode_b64_layer(layer, data)
    raise ValueError(layer.kind)


def _decode_b64_layer(layer: Layer, data: bytes) -> bytes:
    if layer.width:
        if data.endswith(layer.eol) != layer.final_eol:
            raise NotInFormat("the final line break of the base64 run changed")
        body = data[: -len(layer.eol)] if layer.final_eol else data
        lines = body.split(layer.eol)
        if any(b"\r" in ln or b"\n" in ln for ln in lines):
            raise NotInFormat("line breaks of another kind in the base64 run")
        if layer.lines >= 2 or len(lines) >= 2:
            if any(len(ln) != layer.width for ln in lines[:-1]) or not 0 < len(lines[-1]) <= layer.width:
                raise NotInFormat(f"the base64 run is no longer wrapped at {layer.width} columns")
        flat = b"".join(lines)
    else:
        if b"\r" in data or b"\n" in data:
            raise NotInFormat("line breaks in a one-line base64 run")
        flat = data
    alphabet = _URL if layer.urlsafe else _STD
    bare = flat.rstrip(b"=")
    urlsafe = layer.urlsafe
    if any(b not in alphabet for b in bare):
        # A run that never showed its alphabet may come back in either one (not both).
        other = _STD if layer.urlsafe else _URL
        if layer.marked or any(b not in other for b in bare):
            raise NotInFormat("characters outside the run's base64 alphabet")
        urlsafe = not urlsafe
    # A run whose length never showed whether it was padded may come back either way.
    if len(flat) - len(bare) > 2 or (bare != flat and len(flat) % 4):
        raise NotInFormat("padding that no base64 encoder writes")
    if layer.pad_shown and layer.padded and len(flat) % 4:
        raise NotInFormat("the base64 run lost its padding")
    if layer.pad_shown and not layer.padded and bare != flat:
        raise NotInFormat("padding added to an unpadded base64 run")
    if len(bare) % 4 == 1:
        raise NotInFormat("a base64 run of impossible length")
    padded = bare + b"=" * (-len(bare) % 4)
    try:
        return base64.urlsafe_b64decode(padded) if urlsafe else base64.b64decode(padded, validate=True)
    except binascii.Error as e:
        raise NotInFormat(f"base64 that does not decode ({e})") from None


def check_round_trip(form: Form, span: bytes, reference: bytes, *, url: bool = False) -> list[str]:
    """What is wrong with SPAN as the sealed FORM (empty: it decodes to the form with the reference).

    SPAN is what keyveil left where ``form.data`` was. Each layer, outermost
    first, must decode with its stdlib decoder, keep the text around the
    inner data byte for byte, and the innermost must be REFERENCE exactly
    (``url``: the location is a percent layer of its own, a URL or a form body, where a
    raw value or what re-encoding writes may come back percent-encoded).
    Messages hold no byte of the span.
    """
    x = span
    if url and form.layers and all(layer.kind != "pct" for layer in form.layers) and b"%" in x:
        # A URL or a form body is itself a percent layer: keyveil may escape what it writes there.
        x = unquote_to_bytes(x)
    return _peel(form, len(form.layers) - 1, x, reference, url)


def _peel(form: Form, i: int, x: bytes, reference: bytes, url: bool) -> list[str]:
    """What is wrong with X as layers 0..I of FORM sealed (see ``check_round_trip``)."""
    if i < 0:
        if x == reference or (url and unquote_to_bytes(x) == reference):
            return []
        if any(layer.kind == "pct" for layer in form.layers) and unquote_to_bytes(x) == reference:
            return []  # one percent layer more than needed around the reference: still the reference (SPEC §2)
        return [f"the innermost data is not the reference {reference.decode()} ({len(x)} bytes instead)"]
    layer = form.layers[i]
    where = f"layer {i + 1} of {len(form.layers)} ({layer.describe()})"
    try:
        y = decode_layer(layer, x)
    except NotInFormat as e:
        problems = [f"{where}: {e}"]
    else:
        if len(y) < len(layer.pre) + len(layer.post) or not (y.startswith(layer.pre) and y.endswith(layer.post)):
            problems = [f"{where}: the text around the value did not decode to what it was"]
        else:
            problems = _peel(form, i - 1, y[len(layer.pre) : len(y) - len(layer.post)], reference, url)
    if problems and layer.kind == "pct" and not layer.escaped and x.startswith(layer.pre) and x.endswith(layer.post):
        # A percent layer that escaped nothing is not in the bytes: a sealer may take them as
        # the layer below wrote them (its '+' a base64 character, not a space). Either
        # reading that decodes to the form with the reference is a round trip.
        if not _peel(form, i - 1, x[len(layer.pre) : len(x) - len(layer.post)], reference, url):
            return []
    return problems


def split_carrier(data: bytes, pre: bytes, post: bytes) -> bytes | None:
    """The bytes of DATA between PRE and POST, or None when DATA does not start and end with them."""
    if len(data) < len(pre) + len(post) or not data.startswith(pre) or not data.endswith(post):
        return None
    return data[len(pre) : len(data) - len(post)]
