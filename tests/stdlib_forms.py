"""Forms of a value (SPEC §3) made by composing the standard library's own encoders.

This is the generator the property tests and the leak corpus draw from. It
knows nothing of keyveil: it calls ``json.dumps``, ``urllib.parse.quote`` /
``quote_plus`` and ``base64`` and then makes the random, still valid, choices
those encoders leave open (which characters to escape, in which hex case,
where to break lines). Every layer checks itself with the matching stdlib
decoder as it is made, so a form it hands out always decodes to what it holds.

What it produces, for a value V (SPEC §3):

- raw V, in a plain text slot (``token: V``, ``export GITHUB_TOKEN=V``,
  ``user:V``, ``https://user:V@github.com``, words around it);
- ``json``: the content of a JSON string from ``json.dumps`` with and without
  ``ensure_ascii``, then any subset of its characters re-escaped as ``\\uXXXX``
  (surrogate pairs beyond U+FFFF), each escape in lower, upper or mixed hex,
  ``\\/`` for any subset of ``/``, short escapes (``\\n`` ...) sometimes written
  as ``\\u00XX``; it sits in a JSON document, an SSE ``data:`` line, an NDJSON
  line or a bare JSON string;
- ``pct``: ``quote`` or ``quote_plus`` with a random ``safe`` set chosen from
  what the slot allows (query, form body, path, userinfo of a
  ``.git-credentials`` URL), random extra characters escaped too, each escape
  in random hex case; ``+`` or ``%20`` for a space in queries and forms;
- ``b64``: standard or URL-safe alphabet, padded or not, on one line, as
  ``base64.encodebytes`` writes it (MIME, 76 columns), PEM-style 64 columns,
  60 columns or a random width of 12-99, ``\\n`` or ``\\r\\n``, with or without a final
  line break; the payload holds V at a random offset (0–5 random bytes, then
  text such as ``user:`` before it), inside Basic credentials, a PEM block, a
  ``data:`` URL;
- ``pct`` of data holding line breaks (a wrapped base64 block) sometimes
  leaves them plain, all of them or only the CRs or only the LFs
  (``%0D`` then a plain LF);
- a ``b64`` layer's payload sometimes holds 400-1,600 bytes of text lines
  around V (a file): its run is far longer than a value alone makes, and an
  escape of the layer above (``Basic%20``, ``-----\n`` in JSON, ``%0A``)
  is glued to a long run;
- any chain of up to two layers in either order, each layer wrapping the
  previous one's slot (a JSON document, a form field, a ``.git-credentials``
  line, a PEM block ...) before encoding it: base64 in a JSON string with
  ``\\/``, percent-encoded base64, base64 of a JSON document holding V
  escaped, a JSON string inside a JSON string, ``%25`` double encoding, ...

What it does NOT produce (so a green run says nothing about these):

- base64 wrapped narrower than 12 columns (SPEC §3 asks for wrapping as MIME
  and PEM write it; keyveil joins lines of 12 characters or more);
- SPEC §3's "not recognised" list: V split into pieces, hashed, encrypted,
  hex-encoded, or compressed inside another encoding (gzip inside base64);
- more than two layers (the oracle decodes three, so a two-layer form in a
  carrier that adds its own encoding is still judged);
- other encodings of the same characters: base32/base85, quoted-printable,
  HTML/XML entities, C/Python escapes other than JSON's (``\\x41``), UTF-16 or
  other non-UTF-8 text, IDNA/punycode, URL-encoded forms with ``%u`` escapes,
  JSON5/YAML/TOML quoting, shell quoting, MIME encoded-words (``=?utf-8?b?``);
- a line break escaped at some places and left plain at others within one
  ``pct`` layer (each of CR and LF is either always escaped or never);
- text glued to a long payload's run inside one layer (``fix<run>build``): the
  lines of text around V meet the slot at line breaks only;
- carrier text that continues a run where the slot ends: a base64 character
  right after it (``<block>/details`` in a path), an escape that decodes to
  one two layers down (``<run>%253D``), a literal ``%`` before a run that
  starts with two hex digits (``100%12…``); the session-7 attack found leaks
  there, pinned by tests in tests/test_decode_then_match.py instead;
- a wrapped block whose first line is shorter than the lines after it (a
  label sharing the first line), and one whose line breaks mix LF and CRLF
  behind a glued prefix; the session-9 attack found leaks there, pinned by
  tests in tests/test_decode_then_match.py;
- a short word on the line after a one-line run with text going on after it
  (``<run>\nok here``), or a whole group glued before a block (``Zm9v<block>``);
- base64 characters that are not the payload's glued before a run over 512
  characters (``id-<run>``, the ``n`` after a literal backslash in source
  code), a path prefix and a suffix glued to both ends of a block at once,
  or a header name (``User-Agent:``) or a MIME boundary on the line after a
  run; the session-8 attack found leaks or broken round trips there, pinned
  by tests in tests/test_decode_then_match.py;
- JSON escapes of characters a JSON encoder cannot produce from V (invalid
  UTF-8, lone surrogates), overlong or invalid percent escapes, base64 with
  whitespace other than line breaks inside a run, or with non-zero pad bits;
- a value with control characters (values are printable text of 8–48
  characters, never containing ``{``, ``}`` or ``|``): the session-9 attack
  found a value holding a TAB or a line break leaking from JSON inside JSON,
  pinned by tests in tests/test_decode_then_match.py;
- header folding, HTTP/2 header compression tricks, chunk extensions: the
  transports of the leak corpus carry the forms, they do not add encodings.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from random import Random
from urllib.parse import quote, quote_plus, unquote_to_bytes

from hypothesis import strategies as st

KINDS = ("json", "pct", "b64")

#: Every chain of at most two layers, innermost first.
CHAINS: tuple[tuple[str, ...], ...] = ((),) + tuple((k,) for k in KINDS) + tuple((a, b) for a in KINDS for b in KINDS)

# --- slots: the text around an encoded piece, by the kind of that piece ------------------------

_WORDS = ("please", "fix", "the", "build", "env", "says", "here", "see", "log", "deploy", "again", "ok")

#: Around raw V (plain text). The b64 layer also puts 0-5 random bytes first.
TEXT_SLOTS = (
    ("", ""),
    ("token: ", ""),
    ("export GITHUB_TOKEN=", "\n"),
    ("user:", ""),  # RFC 7617 user-pass, the plaintext of Basic credentials
    ("x-access-token:", ""),
    ("https://user:", "@github.com\n"),  # a .git-credentials line, V unencoded
    ("Bearer ", ""),
    ("the key is ", ", keep it safe"),
    ("{words} ", " {words}"),
)
#: Around the content of a JSON string: a JSON document holding it.
JSON_SLOTS = (
    ('{"password":"', '"}'),
    ('{"model":"m","messages":[{"role":"user","content":"', '"}],"stream":true}'),
    ('data: {"type":"content_block_delta","delta":{"text":"', '"}}\n\n'),
    ('{"i":1,"text":"', '"}\n'),
    ('"', '"'),
    ('{"auths":{"ghcr.io":{"auth":"', '"}}}'),
)
#: Around percent-encoded data, by where it sits.
PCT_SLOTS = {
    "query": (("https://api.example.com/v1/items?page=2&access_token=", "&sort=asc"), ("q=", ""), ("?token=", "#top")),
    "form": (("grant_type=client_credentials&client_secret=", "&scope=repo"), ("note=", "")),
    "path": (("/repos/o/r/contents/", "?ref=main"), ("https://example.com/files/", "")),
    "userinfo": (("https://user:", "@github.com\n"), ("https://x-access-token:", "@github.com/o/r.git")),
}
#: Characters ``quote`` may leave unescaped in each slot (beyond letters, digits and ``_.-~``).
PCT_SAFE = {
    "query": "/:@!$'()*,;?=",
    "form": "/:@!$'()*,;=",
    "path": "/:@!$&'()*+,;=",
    "userinfo": "!$&'()*+,;=",
}
PLUS_SLOTS = ("query", "form")  # where a raw '+' means a space
#: Around a base64 run.
B64_SLOTS = (
    ("Basic ", ""),
    ("data:application/octet-stream;base64,", ""),
    ("-----BEGIN PRIVATE KEY-----\n", "\n-----END PRIVATE KEY-----\n"),
    ("", ""),
    ("blob ", " end"),
)

#: All literal text of the slots: a generated value must not occur in it.
TEMPLATE_TEXT = "\0".join(
    [w for w in _WORDS]
    + [s for pair in TEXT_SLOTS + JSON_SLOTS + B64_SLOTS for s in pair]
    + [s for pairs in PCT_SLOTS.values() for pair in pairs for s in pair]
)


# --- the value objects ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """One encoding step: ``encode(pre + inner + post)``, with the choices it made.

    ``pre``/``post`` are the plaintext around the inner data inside this
    layer (the slot of the layer below, or a text slot around V itself).
    """

    kind: str  # json | pct | b64
    pre: bytes
    post: bytes
    # json
    ensure_ascii: bool = False
    # pct
    slot: str = ""  # query | form | path | userinfo: where the output sits
    safe: str = ""
    # b64
    urlsafe: bool = False
    padded: bool = True
    width: int = 0  # 0: one line
    eol: bytes = b"\n"
    final_eol: bool = False
    lines: int = 1  # how many lines the output had (to judge a re-wrapped run)
    marked: bool = True  # the output shows its alphabet (holds one of '+/' or '-_')
    pad_shown: bool = True  # the output shows whether it is padded ('=' at the end, or a length not a multiple of 4)
    # pct
    escaped: bool = True  # the output differs from its input (an escape, or '+' for a space): the layer shows
    #: the random choices, for messages and reports (never a value byte)
    notes: tuple[str, ...] = ()

    @property
    def plus(self) -> bool:
        return self.kind == "pct" and self.slot in PLUS_SLOTS

    def describe(self) -> str:
        if self.kind == "json":
            opts = ["ascii" if self.ensure_ascii else "utf8", *self.notes]
        elif self.kind == "pct":
            opts = [self.slot, "plus" if self.plus else "noplus", *self.notes]
        else:
            opts = [
                "url" if self.urlsafe else "std",
                "pad" if self.padded else "nopad",
                f"w{self.width}" + ("crlf" if self.eol == b"\r\n" else "") if self.width else "oneline",
                f"off{len(self.pre) % 3}",
                *self.notes,
            ]
        return f"{self.kind}[{','.join(opts)}]"


@dataclass(frozen=True)
class Form:
    """VALUE written through LAYERS (innermost first); ``data`` is the outermost encoding.

    ``carrier`` is a slot suited to the outermost kind (a JSON document for
    ``json``, a query for ``pct`` ...) in which a buffer may place ``data``.
    """

    value: bytes
    layers: tuple[Layer, ...]
    data: bytes
    carrier: tuple[bytes, bytes] = (b"", b"")
    name: str | None = None

    @property
    def chain(self) -> tuple[str, ...]:
        return tuple(layer.kind for layer in self.layers)

    @property
    def label(self) -> str:
        """The chain, outermost first: ``b64(json)`` is base64 of a JSON document."""
        return chain_label(self.chain)

    def describe(self) -> str:
        """Every choice made, outermost first; holds no byte of the value."""
        return " < ".join(layer.describe() for layer in reversed(self.layers)) or "raw"

    def in_carrier(self) -> bytes:
        return self.carrier[0] + self.data + self.carrier[1]


def chain_label(chain: Sequence[str]) -> str:
    label = "raw" if not chain else ""
    for kind in chain:
        label = f"{kind}({label})" if label else kind
    return label


# --- the three encoders, each a stdlib encoder plus the choices it leaves open --------------------


def _hex_case(hex2: str, rng: Random, mode: str) -> str:
    if mode == "lower":
        return hex2.lower()
    if mode == "upper":
        return hex2.upper()
    if mode == "per-escape":
        return hex2.upper() if rng.random() < 0.5 else hex2.lower()
    return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in hex2)  # per digit


_JSON_TOKEN = re.compile(r"\\u[0-9a-fA-F]{4}|\\.|.", re.S)
_SHORT = {"\\b": 0x08, "\\f": 0x0C, "\\n": 0x0A, "\\r": 0x0D, "\\t": 0x09, '\\"': 0x22, "\\\\": 0x5C, "\\/": 0x2F}


def _u_escape(ch: str, rng: Random, mode: str) -> str:
    """CH as \\uXXXX (a surrogate pair beyond U+FFFF), in the hex case MODE asks."""
    code = ord(ch)
    units = [code] if code < 0x10000 else [0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)]
    return "".join("\\u" + _hex_case(f"{u:04x}"[:2], rng, mode) + _hex_case(f"{u:04x}"[2:], rng, mode) for u in units)


def json_escape(text: str, rng: Random) -> tuple[str, bool, tuple[str, ...]]:
    """The content of a JSON string holding TEXT: json.dumps, then random valid re-escapes."""
    ensure_ascii = rng.random() < 0.5
    p_u = rng.choice((0.0, 0.0, 0.05, 0.25, 0.6, 1.0))  # plain character -> \uXXXX
    p_slash = rng.choice((0.0, 0.5, 1.0))  # '/' -> '\/'
    p_short = rng.choice((0.0, 0.0, 0.5))  # '\n' -> '\u000a' (and the other short escapes)
    mode = rng.choice(("lower", "upper", "per-escape", "per-digit"))
    base = json.dumps(text, ensure_ascii=ensure_ascii)[1:-1]
    out = []
    n_u = n_slash = 0
    for tok in _JSON_TOKEN.findall(base):
        if tok.startswith("\\u"):
            out.append("\\u" + _hex_case(tok[2:4], rng, mode) + _hex_case(tok[4:], rng, mode))
            n_u += 1
        elif tok.startswith("\\"):
            if rng.random() < p_short:
                out.append(_u_escape(chr(_SHORT[tok]), rng, mode))
                n_u += 1
            else:
                out.append(tok)
        elif tok == "/" and rng.random() < p_slash:
            out.append("\\/")
            n_slash += 1
        elif rng.random() < p_u:
            out.append(_u_escape(tok, rng, mode))
            n_u += 1
        else:
            out.append(tok)
    encoded = "".join(out)
    assert json.loads('"' + encoded + '"') == text, "json layer does not decode to its input (generator bug)"
    notes = [f"u{n_u}", mode] if n_u else []
    if n_slash:
        notes.append(f"slash{n_slash}")
    if p_short and any(t in base for t in _SHORT):
        notes.append("short-as-u")
    return encoded, ensure_ascii, tuple(notes)


def percent_encode(data: bytes, rng: Random, slot: str) -> tuple[str, str, tuple[str, ...]]:
    """DATA percent-encoded for SLOT: quote/quote_plus with a random safe set, extra escapes, hex case."""
    allowed = PCT_SAFE[slot]
    safe = "".join(c for c in allowed if rng.random() < 0.5)
    side = _side(rng)
    if (b"\n" in data or b"\r" in data) and side.random() < 0.3:
        # Line breaks left as they are, all or one of CR and LF (`%0D` then a plain LF):
        # what a client that escapes "the rest" writes, e.g. a wrapped base64 block in a text.
        safe += side.choice(("\n", "\r", "\r\n"))
    plus = slot in PLUS_SLOTS
    enc = quote_plus(data, safe=safe) if plus and rng.random() < 0.8 else quote(data, safe=safe)
    p_extra = rng.choice((0.0, 0.0, 0.1, 0.5, 1.0))  # escape characters quote left alone
    mode = rng.choice(("upper", "lower", "per-escape", "per-digit"))
    # A line break left plain is left plain everywhere (or escaped everywhere): an
    # encoder decides per character, and one block's breaks are all alike.
    breaks = {c: side.random() < p_extra for c in "\r\n"}
    out = []
    i = n_extra = 0
    while i < len(enc):
        c = enc[i]
        if c == "%":
            out.append("%" + _hex_case(enc[i + 1 : i + 3], rng, mode))
            i += 3
            continue
        if breaks[c] if c in breaks else rng.random() < p_extra:  # a plain break: one quote left, in SAFE
            byte = 0x20 if (c == "+" and plus) else ord(c)  # a '+' from quote_plus is a space
            out.append("%" + _hex_case(f"{byte:02x}", rng, mode))
            n_extra += 1
        else:
            out.append(c)
        i += 1
    encoded = "".join(out)
    decoded = unquote_to_bytes(encoded.replace("+", " ") if plus else encoded)
    assert decoded == data, "pct layer does not decode to its input (generator bug)"
    shown = safe.replace("\r", "\\r").replace("\n", "\\n")  # a report line stays one line
    notes = [mode] + ([f"extra{n_extra}"] if n_extra else []) + ([f"safe={shown}"] if safe else [])
    return encoded, safe, tuple(notes)


def base64_encode(data: bytes, urlsafe: bool, padded: bool, width: int, eol: bytes, final_eol: bool, mime: bool) -> bytes:
    """DATA in base64, with the stdlib encoder the style calls for, then wrapped."""
    if mime:  # exactly what MIME encoders (and GitHub's contents API) write
        out = base64.encodebytes(data)
        assert not urlsafe and padded and width == 76 and eol == b"\n" and final_eol
    else:
        run = base64.urlsafe_b64encode(data) if urlsafe else base64.b64encode(data)
        if not padded:
            run = run.rstrip(b"=")
        if width:
            out = eol.join(run[i : i + width] for i in range(0, len(run), width)) or b""
            if final_eol:
                out += eol
        else:
            out = run
    flat = out.replace(b"\r", b"").replace(b"\n", b"")
    flat += b"=" * (-len(flat) % 4)
    decoded = base64.urlsafe_b64decode(flat) if urlsafe else base64.b64decode(flat, validate=True)
    assert decoded == data, "b64 layer does not decode to its input (generator bug)"
    return out


# --- composing layers -------------------------------------------------------------------------------


def _words(rng: Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(1, 4)))


def _side(rng: Random) -> Random:
    """A second stream of choices, seeded from RNG's state without drawing from it (its
    position, the last word of the state, and the words at its start): the choices
    added later (plain line breaks, long payloads) leave every earlier choice, and so
    every case of a seed, as it was."""
    state = rng.getstate()
    if not isinstance(state, tuple):  # hypothesis's random: no fixed corpus to keep, a draw will do
        return Random(rng.getrandbits(64))
    words = state[1]
    return Random(f"side-{words[0]}-{words[1]}-{words[-1]}")


def _long_text(rng: Random, size: int) -> bytes:
    """About SIZE bytes of lines of words (a file's worth of text around a value)."""
    lines, n = [], 0
    while n < size:
        line = _words(rng) + " " + _words(rng)
        lines.append(line)
        n += len(line) + 1
    return ("\n".join(lines) + "\n").encode()


def _text_slot(rng: Random) -> tuple[bytes, bytes]:
    pre, post = rng.choice(TEXT_SLOTS)
    return pre.replace("{words}", _words(rng)).encode(), post.replace("{words}", _words(rng)).encode()


def slot_for(layer: Layer, rng: Random) -> tuple[bytes, bytes]:
    """A slot for the output of LAYER to sit in."""
    if layer.kind == "json":
        pre, post = rng.choice(JSON_SLOTS)
    elif layer.kind == "pct":
        pre, post = rng.choice(PCT_SLOTS[layer.slot])
    else:
        # a PEM block holds standard padded base64 only
        pre, post = rng.choice(B64_SLOTS if layer.padded and not layer.urlsafe else B64_SLOTS[:2] + B64_SLOTS[3:])
    return pre.encode(), post.encode()


def make_form(
    value: bytes,
    chain: Sequence[str],
    rng: Random,
    *,
    name: str | None = None,
    outer_slot: str | None = None,
    one_line: bool = False,
    text_slot: tuple[bytes, bytes] | None = None,
    b64_style: dict | None = None,
) -> Form:
    """VALUE through CHAIN (innermost first), every choice drawn from RNG.

    ``outer_slot`` fixes where an outermost ``pct`` layer sits (query, form,
    path, userinfo) and, for ``query``/``path``, makes an outermost ``b64``
    URL-safe; ``one_line`` keeps line breaks out of ``data`` (headers, URLs);
    ``text_slot`` fixes the plaintext around V; ``b64_style`` fixes the
    outermost base64 layer's options (e.g. standard padded for Basic).
    """
    layers: list[Layer] = []
    inner = value
    below: Layer | None = None
    for depth, kind in enumerate(chain):
        outermost = depth == len(chain) - 1
        if below is None:
            pre, post = text_slot if text_slot is not None else _text_slot(rng)
            if kind == "b64" and text_slot is None:
                pre = rng.randbytes(rng.randrange(0, 6)) + pre
                post = post + rng.randbytes(rng.randrange(0, 5))
        else:
            pre, post = slot_for(below, rng)
        side = _side(rng) if kind == "b64" else None
        long = side is not None and side.random() < 0.15
        if long:
            # A long payload (a file, a document): the run is longer than any a value alone
            # makes, so a carrier's escape glued to it (`Basic%20`, `-----\n` in JSON) meets
            # a long run; the value sits near its start, its middle or its end.
            lines = _long_text(side, side.randrange(400, 1600)).splitlines(keepends=True)
            cut = side.randrange(len(lines) + 1)  # whole lines: the slot's text meets a line break
            pre = b"".join(lines[:cut]) + pre
            post = post + (b"\n" + b"".join(lines[cut:]) if cut < len(lines) else b"")
        payload = pre + inner + post
        if kind == "json":
            enc, ensure_ascii, notes = json_escape(payload.decode("utf-8"), rng)
            layer = Layer("json", pre, post, ensure_ascii=ensure_ascii, notes=notes)
            inner = enc.encode("utf-8")
        elif kind == "pct":
            if outermost and outer_slot in PCT_SLOTS:
                slot = outer_slot
            else:
                slot = rng.choice(tuple(PCT_SLOTS))
            enc, safe, notes = percent_encode(payload, rng, slot)
            layer = Layer("pct", pre, post, slot=slot, safe=safe, notes=notes, escaped=enc.encode("ascii") != payload)
            inner = enc.encode("ascii")
        elif kind == "b64":
            style = dict(b64_style or {}) if outermost else {}
            mime = False
            if not style:
                choice = rng.choice(("oneline", "oneline", "mime", "pem", "w60", "random"))
                if outermost and (one_line or outer_slot in ("query", "path")):
                    choice = "oneline"
                urlsafe = rng.random() < 0.5
                padded = rng.random() < 0.6
                eol = rng.choice((b"\n", b"\r\n"))
                final_eol = rng.random() < 0.5
                width = 0
                if choice == "mime":
                    mime, urlsafe, padded, width, eol, final_eol = True, False, True, 76, b"\n", True
                elif choice == "pem":
                    urlsafe, padded, width = False, True, 64
                elif choice == "w60":
                    width = 60
                elif choice == "random":
                    # SPEC §3: wrapped "as MIME and PEM write it"; keyveil joins lines of 12 or more.
                    width = rng.randrange(12, 100)
                style = dict(urlsafe=urlsafe, padded=padded, width=width, eol=eol, final_eol=final_eol)
            if outermost and outer_slot in ("query", "path"):
                style["urlsafe"] = True
            style.setdefault("eol", b"\n")
            style.setdefault("final_eol", False)
            style.setdefault("width", 0)
            enc = base64_encode(payload, mime=mime, **style)
            n_lines = enc.rstrip(b"\r\n").count(b"\n") + 1
            marked = any(c in enc for c in (b"-_" if style["urlsafe"] else b"+/"))
            flat_len = len(enc.replace(b"\r", b"").replace(b"\n", b""))
            pad_shown = b"=" in enc if style["padded"] else flat_len % 4 != 0
            layer = Layer("b64", pre, post, lines=n_lines, marked=marked, pad_shown=pad_shown,
                          notes=(("mime",) if mime else ()) + (("long",) if long else ()), **style)
            inner = enc
        else:
            raise ValueError(f"unknown layer kind {kind!r}")
        layers.append(layer)
        below = layer
    carrier = slot_for(below, rng) if below else _text_slot(rng)
    return Form(value, tuple(layers), inner, carrier, name)


def with_carrier(form: Form, pre: bytes, post: bytes) -> Form:
    return replace(form, carrier=(pre, post))


def rewrite(form: Form, inner: bytes) -> bytes:
    """FORM's data with its value replaced by INNER, re-encoded layer by layer with each layer's
    fixed options and no random escapes: one thing a correct sealer may write (others are valid too)."""
    x = inner
    for layer in form.layers:
        payload = layer.pre + x + layer.post
        if layer.kind == "json":
            x = json.dumps(payload.decode("utf-8"), ensure_ascii=layer.ensure_ascii)[1:-1].encode("utf-8")
        elif layer.kind == "pct":
            x = (quote_plus if layer.plus else quote)(payload, safe=layer.safe).encode("ascii")
        else:
            x = base64_encode(payload, layer.urlsafe, layer.padded, layer.width, layer.eol, layer.final_eol, False)
    return x


# --- values -----------------------------------------------------------------------------------------

#: Characters of generated values: URL, form and JSON metacharacters, non-ASCII letters, astral ones.
ASCII_VALUE_ALPHABET = (
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    "-_.~/+=&%\"\\ :@!*'()<>,;?#$"
)
VALUE_ALPHABET = (
    ASCII_VALUE_ALPHABET + "\u00e9\u00fc\u00df\u00f1\u00f8\u00c5\u0416\u03bb\u4e2d"
    "\U0001f511\U0001d4b3"
)
TOKEN_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def value_ok(value: bytes) -> bool:
    """A usable generated value: >= 8 characters, not degenerate, in no slot's literal text."""
    text = value.decode("utf-8")
    return len(text) >= 8 and len(set(text)) >= 5 and text not in TEMPLATE_TEXT and not text.isspace()


def random_value(rng: Random, kind: str | None = None) -> bytes:
    """A fake value: token-shaped, metacharacter-rich, or with non-ASCII and astral characters."""
    kind = kind or rng.choice(("token", "rich", "unicode"))
    while True:
        if kind == "token":
            text = rng.choice(("tk_", "sk-", "")) + "".join(rng.choice(TOKEN_ALPHABET) for _ in range(rng.randrange(16, 40)))
        elif kind == "rich":
            chars = [rng.choice(ASCII_VALUE_ALPHABET) for _ in range(rng.randrange(8, 32))]
            for must in rng.sample('/+=&%"\\ ', 3):  # at least three metacharacters
                chars.insert(rng.randrange(len(chars) + 1), must)
            text = "".join(chars)
        else:
            chars = [rng.choice(VALUE_ALPHABET) for _ in range(rng.randrange(8, 24))]
            chars.insert(rng.randrange(len(chars) + 1), rng.choice("\U0001f511\U0001d4b3"))
            chars.insert(rng.randrange(len(chars) + 1), rng.choice("\u00e9\u0416\u4e2d"))
            text = "".join(chars)
        value = text.encode("utf-8")
        if value_ok(value):
            return value


def near_miss(value: bytes, rng: Random) -> bytes:
    """A value that is not VALUE but shares most of it: one character changed, or one dropped."""
    text = value.decode("utf-8")
    i = rng.randrange(len(text))
    if rng.random() < 0.5 and len(text) > 8:
        return (text[:i] + text[i + 1 :]).encode()
    repl = rng.choice([c for c in TOKEN_ALPHABET if c != text[i]])
    return (text[:i] + repl + text[i + 1 :]).encode()


# --- hypothesis strategies --------------------------------------------------------------------------


def values_strategy(min_size: int = 8, max_size: int = 40) -> st.SearchStrategy[bytes]:
    token = st.text(alphabet=TOKEN_ALPHABET, min_size=min_size, max_size=max_size)
    rich = st.text(alphabet=VALUE_ALPHABET, min_size=min_size, max_size=max_size)
    return st.one_of(token, rich).map(lambda s: s.encode("utf-8")).filter(value_ok)


chains_strategy = st.sampled_from(CHAINS)


@st.composite
def forms_strategy(draw, value: bytes, name: str | None = None, chain: Sequence[str] | None = None) -> Form:
    """A Form of VALUE; the chain is drawn explicitly (hypothesis reports it), the choices from a Random."""
    chain = draw(chains_strategy) if chain is None else chain
    rng = draw(st.randoms(use_true_random=False))
    return make_form(value, chain, rng, name=name)


@dataclass
class Buffer:
    """Forms joined with separators; ``pieces`` are the clean text between them."""

    data: bytes
    forms: list[Form] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)


SEPARATOR = b" |kv| "  # no encoder here writes '|', and no value holds it


def join_forms(forms: Sequence[Form], noise: Sequence[bytes]) -> Buffer:
    """noise[0] sep form0-in-carrier sep noise[1] sep form1 ...: the checker splits on SEPARATOR."""
    parts = [noise[0] if noise else b""]
    for i, f in enumerate(forms):
        parts += [f.in_carrier(), noise[i + 1] if i + 1 < len(noise) else b""]
    return Buffer(SEPARATOR.join(parts), list(forms), list(parts[::2]))


noise_strategy = st.lists(st.sampled_from(_WORDS), max_size=6).map(lambda ws: " ".join(ws).encode())


__all__ = [
    "CHAINS",
    "KINDS",
    "Buffer",
    "Form",
    "Layer",
    "SEPARATOR",
    "chain_label",
    "chains_strategy",
    "forms_strategy",
    "join_forms",
    "make_form",
    "near_miss",
    "noise_strategy",
    "random_value",
    "value_ok",
    "values_strategy",
]
