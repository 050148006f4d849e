"""Detection of values nobody registered (SPEC §3a): well-known token shapes and secret-looking assignments.

The shipped table (config/detectors.yaml) is validated once, with errors of the
form ``FILE:LINE: FIELD: what is wrong``, and compiled once into a `Detector`:
a few Aho-Corasick automata over the literal prefixes of every shape and the
keywords of secret-looking names, so that finding every candidate in a buffer
is one scan whatever the number of detectors; a shape's regular expression runs
only where its prefix occurs. `Detector.find` works on any bytes buffer (the
raw body or a decoded view of it) and returns every detection it finds: there
is no cap on their number, and none on the size of the buffer.
`detected_name` turns a detected value into a stable, keyed name.

This module is pure: it imports nothing from mitmproxy and touches no file but
the table it is asked to load. It must never put a value into a message, a
repr or an exception: only kinds, offsets and lengths.
"""

from __future__ import annotations

import base64
import difflib
import functools
import hashlib
import hmac
import math
import re
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import hyperscan
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from keyveil._errors import RulesError, UsageError
from keyveil._letters import reads_as_words
from keyveil._matcher import Scanner, escaped
from keyveil._rules import (
    HostPatternField,
    Inject,
    _check_version,
    _clean_loc,
    _describe,
    _format,
    _load_yaml,
    shipped_config_dir,
)
from keyveil._rules import _message as _rules_message
from keyveil._views import decode_base64

__all__ = [
    "Detection",
    "Detector",
    "DetectorTableError",
    "DetectorTable",
    "detected_name",
    "load_detectors",
    "parse_detectors",
    "shipped_detector",
    "looks_random",
]


class DetectorTableError(UsageError):
    """The detector table is invalid. Message form: ``FILE:LINE: FIELD: what is wrong``."""


# --- the table ---------------------------------------------------------------------

KIND_MAX = 48  # "detected/" + KIND + "-" + ID stays far below the 128 of a secret name
_KIND = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*\Z")


def _kind(name: str) -> str:
    if len(name) > KIND_MAX or _KIND.match(name) is None:
        raise ValueError(
            f"{name!r} is not a detector name: use lower-case letters and digits in words "
            f"joined by '-' (e.g. github-pat), at most {KIND_MAX} characters"
        )
    return name


def _compile(text: str, what: str, flags: int = 0) -> re.Pattern[bytes]:
    if not text.isascii():
        raise ValueError(f"{what} must be ASCII")
    try:
        return re.compile(text.encode("ascii"), flags)
    except re.error as e:
        raise ValueError(f"{what} is not a valid regular expression: {e.msg} (at position {e.pos})") from None


def _shape(text: str) -> str:
    regex = _compile(text, "the shape")
    if regex.match(b"") is not None:
        raise ValueError("the shape matches empty text: it must match the token itself")
    return text


def _names(text: str) -> str:
    _compile(text, "context.names")
    return text


def _prefix(text: str) -> str:
    if len(text) < 2 or not text.isascii() or not text.isprintable():
        raise ValueError(f"{text!r} is not a usable prefix: at least 2 printable ASCII characters")
    return text


def _keyword(text: str) -> str:
    if len(text) < 3 or not (text.isascii() and text.isalpha()):
        raise ValueError(f"{text!r} is not a usable keyword: at least 3 ASCII letters")
    return text.lower()


def _text(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text


Kind = Annotated[str, AfterValidator(_kind)]
Shape = Annotated[str, AfterValidator(_shape)]
Prefix = Annotated[str, AfterValidator(_prefix)]
Keyword = Annotated[str, AfterValidator(_keyword)]
Text = Annotated[str, AfterValidator(_text)]
NamesRegex = Annotated[str, AfterValidator(_names)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Context(_Model):
    """Where a shape too common on its own counts: assigned to such a name, or after another detection."""

    names: NamesRegex | None = None
    after: Kind | None = None
    within: int = Field(default=256, gt=0, le=65536)

    @model_validator(mode="after")
    def _one(self) -> Context:
        if self.names is None and self.after is None:
            raise ValueError("give names (a regex on the variable name) or after (a KIND), or both")
        return self


class DetectorEntry(_Model):
    """One token kind of the table."""

    name: Kind
    provider: Text
    about: Text
    prefixes: list[Prefix] = []
    shape: Shape
    context: Context | None = None
    hosts: list[HostPatternField] = []
    inject: list[Inject] = []

    @model_validator(mode="after")
    def _reachable(self) -> DetectorEntry:
        if not self.prefixes and self.context is None:
            raise ValueError(
                "list prefixes (literal text every match starts with) or give a context: "
                "without either the shape could only be found by trying it at every byte"
            )
        if self.prefixes and self.context is not None:
            raise ValueError(
                "give prefixes (the shape counts on its own) or a context (it counts only beside "
                "something else), not both"
            )
        if bool(self.hosts) != bool(self.inject):
            raise ValueError("give hosts and inject together (a proposed binding), or neither (sealed only)")
        return self


class Assignments(_Model):
    """Secret-looking names with long random values: NAME=VALUE, "name": "value", name: value."""

    name: Kind = "assignment"
    keywords: list[Keyword] = Field(min_length=1)
    min_length: int = Field(ge=8, le=4096)
    min_entropy: float = Field(ge=0, le=8)


class DetectorTable(_Model):
    """The whole table, validated."""

    version: Literal[1]
    detectors: list[DetectorEntry]
    assignments: Assignments

    _check_version = field_validator("version", mode="before")(_check_version)


# --- loading -------------------------------------------------------------------------

_FIELDS: dict[str, tuple[str, ...]] = {
    "table": tuple(DetectorTable.model_fields),
    "entry": tuple(DetectorEntry.model_fields),
    "context": tuple(Context.model_fields),
    "assignments": tuple(Assignments.model_fields),
    "inject": tuple(Inject.model_fields),
}

Loc = tuple[Any, ...]


def shipped_table_path() -> Path:
    return shipped_config_dir() / "detectors.yaml"


@functools.cache
def shipped_detector() -> Detector:
    """The Detector of the shipped table, compiled once per process."""
    return load_detectors(shipped_table_path())


def load_detectors(path: Path | None = None) -> Detector:
    """Read, validate and compile the detector table at PATH (default: the shipped one)."""
    path = Path(path) if path is not None else shipped_table_path()
    try:
        text = path.read_text("utf-8")
    except UnicodeDecodeError:
        raise DetectorTableError(f"{path}:1: (file): the detector table is not UTF-8 text") from None
    except OSError as e:
        raise DetectorTableError(
            f"{path}:1: (file): cannot read the detector table ({e.strerror or e}); reinstall keyveil"
        ) from None
    return parse_detectors(text, str(path))


def parse_detectors(text: str, filename: str = "detectors.yaml") -> Detector:
    """Validate and compile the detector table TEXT; FILENAME is only used in messages."""
    try:
        data, lines = _load_yaml(text, filename, "the detector table")
    except RulesError as e:
        raise DetectorTableError(str(e)) from None
    try:
        table = DetectorTable.model_validate(data)
    except ValidationError as e:
        problems = [(_clean_loc(err["loc"]), _message(err)) for err in e.errors()]
        raise DetectorTableError(_format(problems, lines, data, filename)) from None
    problems = _cross_check(table)
    if problems:
        raise DetectorTableError(_format(problems, lines, data, filename))
    return Detector(table)


def _cross_check(table: DetectorTable) -> list[tuple[Loc, str]]:
    """What one entry alone cannot check: unique names, `after` naming a real entry."""
    problems: list[tuple[Loc, str]] = []
    first: dict[str, int] = {}
    for i, entry in enumerate(table.detectors):
        if entry.name in first:
            problems.append(
                (("detectors", i, "name"), f"{entry.name} is already the name of detectors[{first[entry.name]}]")
            )
        first.setdefault(entry.name, i)
    if table.assignments.name in first:
        problems.append(
            (("assignments", "name"), f"{table.assignments.name} is already the name of a detector")
        )
    for i, entry in enumerate(table.detectors):
        after = entry.context.after if entry.context else None
        if after is None:
            continue
        if after == entry.name:
            problems.append((("detectors", i, "context", "after"), "an entry cannot follow itself"))
        elif after not in first:
            close = difflib.get_close_matches(after, list(first), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append((("detectors", i, "context", "after"), f"no detector is named {after}{hint}"))
    return problems


def _message(err: Any) -> str:
    loc = _clean_loc(err["loc"])
    if err["type"] == "extra_forbidden":
        allowed = _FIELDS[_model_at(loc[:-1])]
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        if close:
            return f"unknown field; did you mean {close[0]!r}?"
        return "unknown field; expected one of: " + ", ".join(allowed)
    if err["type"] == "too_short" and loc == ("assignments", "keywords"):
        return "list at least one keyword"
    if err["type"] in ("greater_than_equal", "less_than_equal", "less_than"):
        bound = err["ctx"].get("ge", err["ctx"].get("le", err["ctx"].get("lt")))
        word = "at least" if err["type"] == "greater_than_equal" else "at most"
        return f"must be {word} {bound}"
    if err["type"] == "float_type":
        return f"expected a number, got {_describe(err['input'])}"
    return _rules_message(DetectorTable, err)  # types, missing fields, version: worded as for rules.yaml


def _model_at(loc: Loc) -> str:
    if not loc:
        return "table"
    if loc[0] == "assignments":
        return "assignments"
    if loc[0] == "detectors" and len(loc) >= 3:
        if loc[2] == "context":
            return "context"
        if loc[2] == "inject":
            return "inject"
    return "entry"


# --- detections ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, repr=False)
class Detection:
    """One detected value: its span in the buffer, its kind, and the value itself."""

    start: int
    end: int
    kind: str
    value: bytes

    def __repr__(self) -> str:
        # Never the value: a repr ends up in logs and tracebacks.
        return f"Detection(start={self.start}, end={self.end}, kind={self.kind!r}, value=<{len(self.value)} bytes>)"

    __str__ = __repr__


def detected_name(kind: str, value: bytes, key: bytes) -> str:
    """The secret name of a detected VALUE: ``detected/KIND-ID``.

    ID is HMAC-SHA256 under the per-home KEY of the value, truncated to 80 bits
    and written as 16 lower-case base32 characters. The same value always gets
    the same ID (so the agent's history stays stable); without the key an ID
    tells nothing about the value, not even whether a guess is right. The ID
    does not depend on KIND: one value has one ID whichever detector saw it.
    """
    _kind(kind)
    if len(key) < 16:
        raise ValueError("the detection key must be at least 16 random bytes")
    digest = hmac.new(key, b"keyveil detected value v1\x00" + bytes(value), hashlib.sha256).digest()
    return f"detected/{kind}-{base64.b32encode(digest[:10]).decode('ascii').lower()}"


# --- randomness of an assigned value ------------------------------------------------------

# Text a config or a tutorial puts where a value goes: not a value.
# Short marks must not be common in random text: `xxxx` occurs in about one random
# 40-character base62 value in 25,000, `xxxxxx` in one in 25 million; `dummy`
# counts only as a word of its own, spelt as words are (`dummy`, `DUMMY`, `Dummy`).
_PLACEHOLDER = re.compile(
    rb"x{6}|\*\*\*|\.\.\.|<[a-z_-]+>|\$\{|\$\(|\{\{|%\(|changeme|change_me|placeholder|your[_-]|example|"
    rb"redacted|notasecret|not_a_secret|(?-i:(?<![A-Za-z0-9])(?:dummy|DUMMY)|(?<![A-Z])Dummy)",
    re.IGNORECASE,
)
# Letter runs of an identifier split at case changes: `ThisIsMy` -> This, Is, My.
_LETTER_RUNS = re.compile(rb"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
_DIGIT_RUNS = re.compile(rb"[0-9]+")
_SEPARATORS = re.compile(rb"[^A-Za-z0-9]+")
_VOWELS = b"aeiouAEIOU"
_DOTTED = re.compile(rb"[A-Za-z_][A-Za-z0-9_-]*(?:\.[A-Za-z_][A-Za-z0-9_-]*)+")


_PERCENT_ESCAPE = re.compile(rb"%[0-9A-Fa-f]{2}")
_BASE64 = re.compile(rb"[A-Za-z0-9+/_-]+={0,2}")
_STRUCTURE = re.compile(rb"://|^\s*[{\[]|%[0-9A-Fa-f]{2}")


def _encoded_text(value: bytes) -> bool:
    """VALUE is text written in an encoding: percent-escapes, or base64 of a URL, a JSON document or escaped text.

    Such a value is not random: the text it encodes is (the proxy runs the
    detector on the decoded views too, where a token inside it is found).
    """
    if _PERCENT_ESCAPE.search(value):
        return True
    if len(value) < 24 or not _BASE64.fullmatch(value):
        return False
    try:
        decoded = decode_base64(value.rstrip(b"="))
    except ValueError:
        return False
    return decoded.isascii() and decoded.decode("ascii").isprintable() and _STRUCTURE.search(decoded) is not None


def entropy(value: bytes) -> float:
    """Shannon entropy of VALUE's bytes, in bits per byte."""
    n = len(value)
    if not n:
        return 0.0
    return math.log2(n) - sum(c * math.log2(c) for c in Counter(value).values()) / n


def looks_random(value: bytes, min_length: int = 16, min_entropy: float = 2.5) -> bool:
    """True when VALUE is long and random enough to be a secret assigned to a secret-looking name.

    Long enough, not a number, URL or variable, not made of words the way
    identifiers, dotted names, paths and versions are, not a placeholder, and
    varied enough (entropy). docs/detection.md ("Assignments") gives the reasons
    and the measured recall and precision of each condition.
    """
    if len(value) < min_length or value.isdigit() or value[:1] == b"$" or b"://" in value:
        return False
    if _DOTTED.fullmatch(value):  # `module.Class.attr`, `auth.example.com`: code and host names
        return False
    if _encoded_text(value):  # read in its decoded view, where the detector looks too
        return False
    runs = _LETTER_RUNS.findall(value)
    if not runs:
        return False
    letters = sum(map(len, runs))
    # Made of words: grouped like words -- letter runs of 3 or more on average (a
    # random value's runs are cut every one or two characters by digits, symbols
    # and case changes), vowels as often as in words (a random run of capitals has
    # about one in five), few digit groups per piece (`v2`, `sha256`, not
    # `k3j5h2`) -- and reading like words (`_letters.reads_as_words`). Measured on
    # random values of 40 base62 characters: one in 640 is grouped like words,
    # one in 1,100 has letter pairs that score like words, one in five million
    # does both (at 16 characters: 3.4%, 2.9%, 0.07%). The grouping alone
    # rejected one random 40-character value in 600 (issue 11).
    if (
        letters >= 3 * len(runs)
        and len(value) - len(value.translate(None, _VOWELS)) >= 0.2 * letters
        and all(len(_DIGIT_RUNS.findall(piece)) <= 2 for piece in _SEPARATORS.split(value))
        and reads_as_words(runs)
    ):
        return False
    return _PLACEHOLDER.search(value) is None and entropy(value) >= min_entropy


# --- the compiled scanner ----------------------------------------------------------------------

# A byte that may not touch a token on either side: a letter or a digit.
_WORD = bytes(1 if (48 <= b <= 57 or 65 <= b <= 90 or 97 <= b <= 122) else 0 for b in range(256))
_LOWER = bytes(1 if 97 <= b <= 122 else 0 for b in range(256))
_TOKENISH = bytes(1 if (_WORD[b] or b in b"+/=_-") else 0 for b in range(256))
_HEX = bytes(1 if (48 <= b <= 57 or 65 <= b <= 70 or 97 <= b <= 102) else 0 for b in range(256))
_BACKSLASH, _PERCENT = 0x5C, 0x25
_ESCAPE_LETTERS = frozenset(b"nrt")

# After a keyword: the rest of the name, a closing quote, an operator, an opening
# quote, the value. Values hold no whitespace and no quote; a quoted value may also
# hold the punctuation that ends a bare one (& ; , brackets).
# '=' only at the end (base64 padding): `NAME=VALUE` inside a value is two assignments.
_BARE = rb"A-Za-z0-9!#$%*+\-./:?@^_|~"
_QUOTED = _BARE + rb"&;,()\[\]{}<>"
_ASSIGN = re.compile(
    rb"(?P<rest>[A-Za-z0-9_.-]{0,64}+)"  # possessive: a failed match gives up at once
    rb"(?:\\?[\"'])?[ \t]{0,16}+"
    rb"(?::=|=>|\?=|=(?![=~])|:(?![:/])(?:[ \t]{0,4}[A-Za-z_][A-Za-z0-9_.]{0,40}[ \t]{0,4}=(?!=))?)"
    rb"[ \t]{0,16}(?:(?:[Bb]earer|[Bb]asic|[Tt]oken)(?:[ \t]{1,4}|\+))?"  # `+`: a space in a query or form
    rb"(?:(?P<q>\\?[\"'`])(?P<quoted>[" + _QUOTED + rb"]{8,}+={0,3})(?P=q)|(?P<bare>[" + _BARE + rb"]{8,}+={0,3})(?![(\[]))"  # `name = call(...)` is code
)
# What `_ASSIGN` needs right after a keyword, loosely, for Hyperscan: the rest of
# the name, a quote, blanks, and the first byte of an operator (`:`, `=`, `?=`).
# `_ASSIGN` then decides at each hit.
_KEYWORD_TAIL = rb"[A-Za-z0-9_.\-]{0,64}(?:\\?[\"'])?[ \t]{0,16}[:=?]"
_NAME_BYTES = bytes(1 if (_WORD[b] or b in b"_.-") else 0 for b in range(256))


# After a value: a line break (raw or JSON-escaped) and the next line of a wrapped base64 block.
_NEXT_LINE = re.compile(rb"(?:\r\n|\n|\\r\\n|\\n)(?P<line>[A-Za-z0-9+/_-]+={0,2})")
_PRINTABLE = bytes(range(0x20, 0x7F)) + b"\t\n\r"
#: the shortest base64 run that can hold a detection: the shortest value the shipped table finds
#: is 20 characters (an AWS access key id; `key=` and a 16-character assigned value), whose base64
#: is 27 characters unpadded (tests/test_detect.py derives it from the table). The detection views
#: decode runs from this length; behind `\\n` escapes they join a block of lines this wide or wider.
MIN_RUN = 27
# A value cut short inside or before a percent escape: `…%`, `…%4`, or `%4F` right after it.
_CUT_BY_PERCENT = re.compile(rb"%[0-9A-Fa-f]?\Z")
# A JSON escape of a character a bare value may hold (a letter, a digit, `+-/=_`).
_ESCAPED_TOKEN_CHAR = re.compile(rb"\\u00(?:[46][1-9a-fA-F]|[57][0-9aA]|3[0-9dD]|2[bBdDfF]|5[fF])|\\/")


def _a_line_of_encoded_text(data, start: int, end: int) -> bool:
    """Whether DATA[START:END] is the first line of a wrapped base64 block that decodes to text
    (`TOKEN=` before a block of 76-character lines, or of one such line and a shorter last one):
    one line is no value, and a token the text holds is found where the block is decoded. A
    block that decodes to binary (key material) is left to the randomness test: a false seal
    costs less than a miss."""
    width = end - start
    if width < 16:
        return False
    m = _NEXT_LINE.match(data, end)
    if m is None:
        return False
    # The next line is as wide, or it is the block's last line (shorter); either way it
    # ends where a line does (a line `OTHER=xyz` is an assignment, not padding). Behind
    # JSON escapes (`\\n`) the views join a block of lines of MIN_RUN characters or more;
    # a narrower one's first line, before a shorter last line, stays a detection.
    line = m.end("line") - m.start("line")
    if line > width or (m.end() < len(data) and _TOKENISH[data[m.end()]]):
        return False
    # A next line cut by a `\\u` escape of one of its own characters goes on in the JSON view
    # (`…VQ\\r\\nl9UT0\\u0074FTj…`): it is no block's last line (random-seed soak 183517992,
    # case 3520: the first line, remembered, was sealed inside 42 other runs).
    cut = _ESCAPED_TOKEN_CHAR.match(data, m.end()) is not None
    if line < width < MIN_RUN and data[m.start()] == _BACKSLASH and not cut:
        return False
    nxt = bytes(m.group("line"))
    # A narrow block is read a few lines further: two lines of 16 are too few bytes to
    # tell text with a glued prefix (`p\xdf\xcathe key is`) from binary.
    more = m
    while line == width and len(nxt) < 96 and (more := _NEXT_LINE.match(data, more.end())) is not None:
        extra = more.group("line")
        if len(extra) > width:
            break
        nxt += extra
        if len(extra) < width:
            break
    # Or past its first group, read from one of its first four characters (as the views read
    # runs): the bytes of a prefix glued to the block (`Y7TH` before `ZXhwb3J0…`, "export …")
    # are not text, and when an escape cuts the third line the two lines read are too few
    # to outweigh them (random-seed soak 2805018454, case 1246: 18 columns, CRLF escapes).
    block = bytes(data[start:end]) + nxt
    if _decodes_to_text(block) or any(_decodes_to_text(block[skip + 4 :]) for skip in range(4)):
        return True
    # A narrower next line may be the block's second line, its first one the value's
    # last characters behind a glued prefix (`token=blob+<17 columns>` in a query whose
    # `+` is a space; the sealer reads such a block the same way).
    return line < width and line >= 16 and _decodes_to_text(bytes(data[end - line : end]) + nxt)


_BASE64_VALUE = re.compile(rb"[A-Za-z0-9+/_-]{%d,}={0,2}" % MIN_RUN)


def _encoded_words(value) -> bool:
    """Whether VALUE, one line of base64 of MIN_RUN characters or more, decodes (from one of
    its first four characters) to text that holds a space or a line break
    (`ZXhwb3J0IEdJVEhVQl9UT0tFTj1…`: "export GITHUB_TOKEN=…"): words, not a secret's
    characters, so the value is no secret itself; a token the text holds is detected
    where the run is decoded (the views). Remembered as a detected value, such a line was
    sealed wherever the same words were encoded at the same place inside another run,
    which broke that run (random-seed soak 183517992: 42 cases). Base64 of one random
    string (a Kubernetes secret's data) holds neither and stays a detection."""
    if _BASE64_VALUE.fullmatch(value) is None:
        return False
    chars = bytes(value).rstrip(b"=")
    for skip in range(4):  # behind a glued prefix of up to three characters, as the views read runs
        decoded = _decoded_text(chars[skip:])
        if decoded is not None and (b" " in decoded or b"\n" in decoded):
            return True
    return False


def _decodes_to_text(chars: bytes) -> bool:
    """Whether base64 CHARS decode to text (``_decoded_text``)."""
    return _decoded_text(chars) is not None


def _decoded_text(chars: bytes) -> bytes | None:
    """What base64 CHARS decode to, when that is text: printable ASCII or UTF-8 (`é`, `€`,
    `🔑` are text; a sequence cut at the end is forgiven), a byte in 20 aside. Else None."""
    try:
        decoded = decode_base64(chars[: len(chars) // 4 * 4], strict=True)
    except ValueError:
        return None
    bad = len(decoded.translate(None, _PRINTABLE))
    if bad > len(decoded) // 20:
        text = decoded.decode("utf-8", "replace")
        bad = sum(1 for ch in text if ch == "\ufffd" or ch in _CONTROL_CHARS) - text.endswith("\ufffd")
    return decoded if bad <= len(decoded) // 20 else None


_CONTROL_CHARS = frozenset(chr(c) for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\t\n\r")


#: What tells detection's JSON view it is needed (keyveil._detected): a `\\/` or a `\\u` escape of a
#: digit or letter (each hit checked to be an escape, not an escaped backslash and text), and the
#: header of a private key whose line breaks may be escapes. Indexes from `Detector.view_base`.
#: (Not where the first base64 run may start: a bounded repeat in this scan costs more than the
#: scan base64_runs makes of its own.)
TOKEN_ESCAPE_PATTERN = rb"\\(?:/|u00(?:3[0-9]|[4-7][0-9a-fA-F]))"
VIEW_TRIGGERS: tuple[tuple[bytes, int], ...] = (
    (TOKEN_ESCAPE_PATTERN, 0),
    (escaped(b"PRIVATE KEY"), hyperscan.HS_FLAG_SINGLEMATCH),
)
TOKEN_ESCAPE, PRIVATE_KEY = 0, 1


@dataclass(frozen=True, slots=True)
class _Shape:
    rank: int
    kind: str
    literal: bytes
    regex: re.Pattern[bytes]
    group: int | str


@dataclass(frozen=True, slots=True)
class _Follower:
    rank: int
    kind: str
    regex: re.Pattern[bytes]
    group: int | str
    within: int


@dataclass(frozen=True, slots=True)
class _Named:
    rank: int
    kind: str
    names: re.Pattern[bytes]
    regex: re.Pattern[bytes]


class Detector:
    """The detector table compiled into one scanner. Build it once; call `find` per buffer."""

    def __init__(self, table: DetectorTable) -> None:
        self.table = table
        self.entries: dict[str, DetectorEntry] = {e.name: e for e in table.detectors}
        self.assignment_kind = table.assignments.name
        self._min_length = table.assignments.min_length
        self._min_entropy = table.assignments.min_entropy
        self._assignment_rank = len(table.detectors)

        literals: dict[bytes, list[_Shape]] = {}
        followers: dict[str, list[_Follower]] = {}
        self._named: list[_Named] = []
        for rank, entry in enumerate(table.detectors):
            regex = re.compile(entry.shape.encode("ascii"))
            group: int | str = "value" if "value" in regex.groupindex else 0
            for prefix in dict.fromkeys(entry.prefixes):
                literal = prefix.encode("ascii")
                literals.setdefault(literal, []).append(_Shape(rank, entry.name, literal, regex, group))
            if entry.context is not None:
                if entry.context.after is not None:
                    followers.setdefault(entry.context.after, []).append(
                        _Follower(rank, entry.name, regex, group, entry.context.within)
                    )
                if entry.context.names is not None:
                    names = re.compile(entry.context.names.encode("ascii"))
                    self._named.append(_Named(rank, entry.name, names, regex))
        self._followers = followers
        keywords = {v.encode("ascii") for k in table.assignments.keywords for v in (k, k.upper(), k.capitalize())}

        # One scan finds every prefix of a shape, and every keyword of a name that
        # an operator follows (`_KEYWORD_TAIL`: keywords alone are common words),
        # overlapping ones included; each hit is then checked where it stands.
        prefixes = sorted(literals)
        self._checks: list[tuple[_Shape, ...]] = [tuple(literals[literal]) for literal in prefixes]
        heads = [_head_expression(literal, literals[literal]) for literal in prefixes]
        self._lengths = [length for _, length in heads] + [len(word) for word in sorted(keywords)]
        self._keyword_base = len(prefixes)
        #: what one scan of a buffer looks for, as (Hyperscan expression, flags): the prefixes,
        #: the keywords, then what tells the decoded views they are needed (VIEW_TRIGGERS). The
        #: sealer compiles them with its values (`Sealer(companion=…)`): one pass for both.
        self.expressions: tuple[tuple[bytes, int], ...] = (
            *((expression, 0) for expression, _ in heads),
            *((escaped(word) + _KEYWORD_TAIL, hyperscan.HS_FLAG_SOM_LEFTMOST) for word in sorted(keywords)),
            *VIEW_TRIGGERS,
        )
        self.view_base = len(prefixes) + len(keywords)
        self._scanner = Scanner([e for e, _ in self.expressions], [f for _, f in self.expressions])
        # The value of an assignment is at least this long: the shortest the
        # randomness test or a named shape accepts.
        shortest = min([self._min_length, *(_min_width(n.regex) for n in self._named)])
        self._assign = re.compile(_ASSIGN.pattern.replace(b"{8,}+", b"{%d,}+" % max(1, shortest - 3)))

    def __repr__(self) -> str:
        return f"<Detector kinds={len(self.entries) + 1} literals={len(self._lengths)}>"

    @property
    def kinds(self) -> list[str]:
        return [*self.entries, self.assignment_kind]

    def hits(self, data: bytes | bytearray | memoryview) -> list[tuple[int, int, int]]:
        """(index in `expressions`, start, end) of every match in DATA: one scan."""
        return self._scanner.find(data)

    def find(self, data: bytes | bytearray | memoryview, hits: list[tuple[int, int, int]] | None = None) -> list[Detection]:
        """Every detected value in DATA, left to right, not overlapping. Never capped.
        HITS: ``hits(DATA)``, when a scan shared with the sealer made them already."""
        found: list[tuple[int, int, int, str]] = []  # rank, start, end, kind
        n = len(data)
        base = self._keyword_base
        views = self.view_base
        checks = self._checks
        assign = self._assign.match
        lengths = self._lengths
        for index, start, end in self._scanner.find(data) if hits is None else hits:
            if index >= views:
                continue
            if index < base:
                start = end - lengths[index]
                if not _clear_before(data, start):
                    continue
                for check in checks[index]:
                    m = check.regex.match(data, start)
                    if m is None or (m.end() < n and _WORD[data[m.end()]]):
                        continue
                    s, e = m.span(check.group)
                    found.append((check.rank, s, e, check.kind))
                continue
            m = assign(data, start + lengths[index])  # START: the keyword's (leftmost start of match)
            if m is not None:
                self._assigned(data, start, m, found)
        if not found:
            return []
        if self._followers:
            self._follow(data, found)
        return self._resolve(data, found)

    def _assigned(self, data, start: int, m: re.Match, found: list) -> None:
        group = "quoted" if m.start("quoted") >= 0 else "bare"
        s, e = m.span(group)
        if _a_line_of_encoded_text(data, s, e) or _encoded_words(data[s:e]):
            return  # base64 of text: what it holds is detected in its decoding (the views)
        if _ESCAPED_TOKEN_CHAR.match(data, e):
            return  # cut short by a JSON escape of one of its own characters (`…dG9r\u005A…`): whole in the JSON view
        if _CUT_BY_PERCENT.search(data, s, e) or _PERCENT_ESCAPE.match(data, e):
            return  # cut by a percent escape (`glpat/F3TK%4`, `…%2F` after it): whole in the percent view
        value = bytes(data[s:e])
        name = _name_at(data, start, m.end("rest"))
        for named in self._named:
            if named.regex.fullmatch(value) and named.names.search(name):
                found.append((named.rank, s, e, named.kind))
                return
        if value.rstrip(b",;") == name:
            return  # `"token_reviewer_jwt": token_reviewer_jwt,`: code passing a variable on
        if looks_random(value, self._min_length, self._min_entropy):
            found.append((self._assignment_rank, s, e, self.assignment_kind))

    def _follow(self, data, found: list) -> None:
        n = len(data)
        work = list(found)
        while work:
            _, _, end, kind = work.pop()
            for follower in self._followers.get(kind, ()):
                stop = min(n, end + follower.within)
                for m in follower.regex.finditer(data, end, min(n, stop + 4096)):
                    s, e = m.span(follower.group)
                    if m.start() >= stop:
                        break
                    # A follower has no prefix: it must stand alone, not be a piece of a
                    # longer base64 run (a session token after a key id).
                    a, b = m.start(), m.end()
                    if not (a and _TOKENISH[data[a - 1]]) and not (b < n and _TOKENISH[data[b]]):
                        hit = (follower.rank, s, e, follower.kind)
                        found.append(hit)
                        work.append(hit)
                        break

    def _resolve(self, data, found: list) -> list[Detection]:
        # The longer value wins an overlap (it holds the other), then the entry
        # earlier in the table; an assignment never hides a shape.
        last = self._assignment_rank
        found.sort(key=lambda t: (t[0] == last, -(t[2] - t[1]), t[0], t[1]))
        starts: list[int] = []
        ends: list[int] = []
        kept: list[tuple[int, int, str]] = []
        for _, s, e, kind in found:
            if e <= s:
                continue
            i = bisect_left(starts, s)
            if (i and ends[i - 1] > s) or (i < len(starts) and starts[i] < e):
                continue
            starts.insert(i, s)
            ends.insert(i, e)
            kept.append((s, e, kind))
        kept.sort()
        return [Detection(s, e, kind, bytes(data[s:e])) for s, e, kind in kept]

    def named_kind(self, name: bytes, value: bytes) -> str | None:
        """The KIND of VALUE assigned to NAME by an entry with `context.names`, if one fits."""
        for named in self._named:
            if named.regex.fullmatch(value) and named.names.search(name):
                return named.kind
        return None

    def proposal(self, kind: str) -> DetectorEntry | None:
        """The entry of KIND when it proposes a binding (hosts and inject), else None."""
        entry = self.entries.get(kind)
        return entry if entry is not None and entry.hosts else None


def _clear_before(data, start: int) -> bool:
    """No letter or digit right before START, unless it ends a `\\n`-style or `%XX` escape."""
    if start == 0:
        return True
    b = data[start - 1]
    if not _WORD[b]:
        return True
    if b in _ESCAPE_LETTERS and start >= 2 and data[start - 2] == _BACKSLASH:
        return True
    return start >= 3 and data[start - 3] == _PERCENT and _HEX[data[start - 2]] and _HEX[b]


def _name_at(data, start: int, end: int) -> bytes:
    """The name around a keyword at START whose rest ends at END: back to the first non-name byte."""
    first = start
    while first > 0 and start - first < 64 and _NAME_BYTES[data[first - 1]]:
        first -= 1
    return bytes(data[first:end])


def _min_width(regex: re.Pattern[bytes]) -> int:
    return _widths(regex)[0]


def _widths(regex: re.Pattern[bytes]) -> tuple[int, int]:
    import re._parser as sre_parse  # the stdlib's own parser: the shortest and longest match of a shape

    low, high = sre_parse.parse(regex.pattern.decode("ascii"), regex.flags).getwidth()
    return int(low), int(high)


#: A prefix this short hits often in random text (`SK`: about 260 times per MiB of base64,
#: each a call into Python and a check that fails).
_SHORT_PREFIX = 3


def _head_expression(literal: bytes, shapes: list[_Shape]) -> tuple[bytes, int]:
    """What the scan looks for to find LITERAL's shapes, and how long its match is (its end
    less that is where the shape starts): the literal, or, for a short prefix of one shape of
    fixed width without groups (`SK[0-9a-f]{32}`), the whole shape, which Hyperscan reads alike."""
    if len(literal) < _SHORT_PREFIX and len(shapes) == 1:
        pattern = shapes[0].regex.pattern
        low, high = _widths(shapes[0].regex)
        if low == high and pattern.startswith(literal) and b"(" not in pattern and b"\\" not in pattern:
            return pattern, low
    return escaped(literal), len(literal)
