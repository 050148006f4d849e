"""`keyveil secret import FILE`: register the secret-looking entries of a `.env` file (SPEC §10).

The file is parsed the way dotenv loaders read it (`export` prefix, single and
double quotes, multi-line quoted values, comments). An entry is registered when
its value has the shape of a known token (config/detectors.yaml) or its name
looks like a secret and its value is not plainly a setting; it is stored as
`env/<variable name in lower case>`. Bindings are proposed from the detector
table as a rules.yaml snippet, never written into the rules file.

This module must never print, log or raise a value, nor a line of the file: only
variable names, secret names, line numbers, kinds and hosts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ._detect import Detector, shipped_detector
from ._errors import KeyveilError, UsageError
from ._home import Home
from ._references import check_name, format_reference

#: the first segment of every imported name
PREFIX = "env"

_ASSIGNMENT = re.compile(r"[ \t]*(?:export[ \t]+)?(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)[ \t]*(?P<eq>=)?[ \t]*")
_DOUBLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\", "$": "$", "`": "`"}
_SETTINGS = frozenset("true false yes no on off none null nil enabled disabled".split())
_PLACEHOLDER = re.compile(
    r"^(?:\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|<[^>]*>|x{4,}|\*{3,}|\.{3,})$|changeme|change_me|your[_-]|placeholder",
    re.IGNORECASE,
)


@dataclass(frozen=True, repr=False)
class Entry:
    """One `NAME=VALUE` of the file."""

    line: int
    variable: str
    value: str

    def __repr__(self) -> str:
        return f"Entry(line={self.line}, variable={self.variable!r}, value=<{len(self.value)} characters>)"


def parse_env(text: str) -> tuple[list[Entry], list[tuple[int, str]]]:
    """The entries of a .env TEXT, and (line, problem) for what could not be read.

    Problems never quote the file: a line that is not `NAME=VALUE` may be a value.
    """
    entries: list[Entry] = []
    problems: list[tuple[int, str]] = []
    lines = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _ASSIGNMENT.match(line)
        if m is None or m["eq"] is None:
            if m is not None and not line[m.end() :].strip():
                problems.append((number, f"{m['name']} has no '=' and no value"))
            else:
                problems.append((number, "not NAME=VALUE"))
            continue
        rest = line[m.end() :]
        quote = rest[:1]
        if quote in ("'", '"', "`"):
            value, after, used = _quoted(rest[1:], quote, lines, i)
            if value is None:
                problems.append((number, f"the quoted value of {m['name']} is never closed"))
                i = len(lines)
                continue
            i += used
            if after.strip() and not after.lstrip().startswith("#"):
                problems.append((number, f"text after the closing quote of {m['name']}"))
                continue
        else:
            value = re.split(r"[ \t]#", rest, maxsplit=1)[0].strip()
        entries.append(Entry(number, m["name"], value))
    return entries, problems


def _quoted(rest: str, quote: str, lines: list[str], next_line: int) -> tuple[str | None, str, int]:
    """The value of a quoted string that starts REST, the text after it, and the extra lines it took."""
    out: list[str] = []
    text, used = rest, 0
    while True:
        j = 0
        while j < len(text):
            c = text[j]
            if quote == '"' and c == "\\" and j + 1 < len(text):
                out.append(_DOUBLE_ESCAPES.get(text[j + 1], "\\" + text[j + 1]))
                j += 2
                continue
            if c == quote:
                return "".join(out), text[j + 1 :], used
            out.append(c)
            j += 1
        if next_line + used >= len(lines):
            return None, "", used
        out.append("\n")
        text = lines[next_line + used]
        used += 1


# --- the plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """What happens to one entry: registered (`name` set) or skipped (`reason` set)."""

    entry: Entry
    name: str | None = None
    kind: str | None = None  # the detector that recognised the value, or None (by its name)
    part: bool = False  # only the token inside the value is registered
    reason: str | None = None
    stored: bytes = field(default=b"", repr=False)  # what goes into the vault


def secret_name(variable: str) -> str | None:
    """`GITHUB_TOKEN` -> `env/github_token`; None when no valid secret name can be made of it."""
    segment = variable.lower().lstrip("_.-")
    try:
        return check_name(f"{PREFIX}/{segment}") if segment else None
    except ValueError:
        return None


def plan(entries: list[Entry], detector: Detector) -> list[Item]:
    """Decide, entry by entry, what to register. Later entries of the same variable win."""
    last = {e.variable: e.line for e in entries}
    keywords = detector.table.assignments.keywords
    items = []
    for entry in entries:
        if last[entry.variable] != entry.line:
            items.append(Item(entry, reason=f"set again on line {last[entry.variable]}, which is used"))
            continue
        items.append(_decide(entry, detector, keywords))
    return items


def _decide(entry: Entry, detector: Detector, keywords: list[str]) -> Item:
    raw = entry.value.encode("utf-8", "surrogateescape")
    name = secret_name(entry.variable)
    if name is None:
        return Item(entry, reason="its name cannot make a secret name (letters, digits, '.', '_', '-')")
    if not raw:
        return Item(entry, reason="empty")
    shapes = [d for d in detector.find(raw) if d.kind != detector.assignment_kind]
    if len(shapes) == 1:
        (hit,) = shapes
        # A token inside a longer setting (a webhook URL, a connection string, a
        # `Bearer ...` header): the token is the secret, the rest stays readable.
        return Item(entry, name=name, kind=hit.kind, part=(hit.start, hit.end) != (0, len(raw)), stored=hit.value)
    if shapes:
        return Item(entry, name=name, stored=raw)  # several tokens: the value as a whole
    kind = detector.named_kind(entry.variable.encode("utf-8", "surrogateescape"), raw)
    if kind is not None:  # a shape that counts only under such a name (AWS_SECRET_ACCESS_KEY)
        return Item(entry, name=name, kind=kind, stored=raw)
    if not any(k in entry.variable.lower() for k in keywords):
        return Item(entry, reason="does not look like a secret (no known token shape, no secret-looking name)")
    why = _not_a_value(entry.value)
    if why:
        return Item(entry, reason=why)
    return Item(entry, name=name, stored=raw)


def _not_a_value(value: str) -> str | None:
    if "{{secret:" in value:
        return "already a reference"
    if value.lower() in _SETTINGS or value.lstrip("-+").replace(".", "", 1).isdigit():
        return "a setting or a number"
    if "://" in value:
        return "a URL; if it holds a password, register that part with keyveil secret set"
    if value.startswith(("/", "./", "../", "~/")):
        return "a path"
    if _PLACEHOLDER.search(value):
        return "a placeholder"
    if len(value) < 8:
        return "shorter than 8 characters (keyveil registers longer values only)"
    return None


# --- running it -------------------------------------------------------------------------------


def run_import(home: Home, path: Path, dry_run: bool, out: Callable[[str], None] = print) -> int:
    """`keyveil secret import PATH [--dry-run]`; returns the exit code."""
    from ._vault import open_vault

    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text: save it as UTF-8 and import it again") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    entries, problems = parse_env(text)
    items = plan(entries, shipped_detector())
    vault = open_vault(home.root)
    try:
        current = vault.load().current
    except KeyveilError:
        if not dry_run:
            raise
        current = {}  # a dry run says what it would do even when the vault cannot be read

    out(f"{'plan for' if dry_run else 'importing'} {path}: {len(entries)} entries")
    rows = [*items, *(Item(Entry(line, "", ""), reason=problem) for line, problem in problems)]
    registered: list[Item] = []
    replaced = False
    for item in sorted(rows, key=lambda i: i.entry.line):
        entry = item.entry
        if item.name is None:
            out(f"  skipped        {entry.variable or '-':28} line {entry.line}: {item.reason}")
            continue
        old = current.get(item.name)
        if old == item.stored:
            action = "unchanged"
        elif old is not None:
            action, replaced = ("would replace" if dry_run else "replaced"), True
        else:
            action = "would register" if dry_run else "registered"
        if not dry_run and old != item.stored:
            try:
                vault.set(item.name, item.stored)
            except UsageError as e:  # refused (too short ...): the message names no value
                out(f"  skipped        {entry.variable:28} line {entry.line}: {e}")
                continue
        what = (item.kind or "secret-looking name") + (", the token inside the value" if item.part else "")
        out(f"  {action:14} {item.name:28} line {entry.line}: {entry.variable} ({what})")
        registered.append(item)
    if not registered:
        out("nothing to register")
        return 0
    if replaced:
        out("a replaced value stays sealed (never injected) for 30 days")
    for item in registered:
        if item.part:
            out(f"{item.entry.variable} holds more than its {item.kind}: only the token is registered, "
                f"the agent writes the rest around {format_reference(item.name)}")
    _propose(home, registered, out)
    out("")
    out(f"The agent uses them as references, e.g. {format_reference(registered[0].name)}.")
    out(f"The values are still in {path}: keep that file out of the agent's reach, or put the references there.")
    if dry_run:
        out("dry run: nothing was stored; run the same command without --dry-run to register them")
    return 0


def _propose(home: Home, items: list[Item], out: Callable[[str], None]) -> None:
    from ._rules import load_rules

    detector = shipped_detector()
    try:
        bound = set(load_rules(home.rules).names())
    except KeyveilError:
        bound = set()
    snippet: dict[str, dict] = {}
    unbound: list[str] = []
    for item in items:
        if item.name in bound:
            continue
        entry = detector.proposal(item.kind) if item.kind else None
        if entry is None:
            unbound.append(item.name)
            continue
        snippet[item.name] = {
            "hosts": [str(h) for h in entry.hosts],
            "inject": [i.model_dump(exclude_none=True) for i in entry.inject],
        }
    already = [i.name for i in items if i.name in bound]
    if already:
        out(f"already bound in {home.rules}: {', '.join(already)}")
    if snippet:
        out("")
        out(f"Proposed bindings: add these under secrets: in {home.rules}, then run keyveil rules check")
        out("")
        text = yaml.safe_dump({"secrets": snippet}, sort_keys=False, default_flow_style=None, width=120)
        for line in text.rstrip("\n").splitlines():
            out("  " + line)
    for name in unbound:
        kind = next(i.kind for i in items if i.name == name)
        if kind:
            why = f"keyveil does not inject {kind} values (they sign requests, or are never sent)"
        else:
            why = "its shape is not one keyveil knows; bind it by hand to let the agent use it"
        out(f"no binding proposed for {name}: {why}; it is sealed toward model vendors all the same")


# --- `keyveil secret adopt detected/KIND-ID NAME` (SPEC §10) ----------------------------------


def run_adopt(home: Home, detected: str, name: str, out: Callable[[str], None] = print) -> int:
    """Register the detected value DETECTED under NAME; DETECTED stays an alias of NAME.

    The value never leaves the vault: it is read there (a running proxy keeps
    every value it detects in the vault) and written back under NAME. The
    proxy treats a detected name whose value NAME also holds as an alias:
    both references resolve, and either is injected where NAME is bound.
    """
    from ._detected import DETECTED_PREFIX, is_detected
    from .vault import open_vault

    detected, name = _checked(detected), _checked(name)
    if not is_detected(detected):
        raise UsageError(
            f"{detected} is not a detected value's name: adopt takes the name from a "
            f"{{{{secret:{DETECTED_PREFIX}KIND-ID}}}} reference, e.g. `keyveil secret adopt "
            f"{DETECTED_PREFIX}github-pat-abcd1234efgh5678 github/pat`"
        )
    if is_detected(name):
        raise UsageError(f"{name} is under {DETECTED_PREFIX}, where only keyveil names values: pick another NAME, e.g. github/pat")
    vault = open_vault(home.root)
    current = vault.load().current
    value = current.get(detected)
    if value is None:
        raise UsageError(
            f"the vault holds no detected value named {detected}: `keyveil secret list` shows the "
            f"detected values a proxy on this home has kept. A proxy whose vault it cannot write "
            f"(KEYVEIL_VAULT=env) keeps them in memory only: register the value with `keyveil secret set {name}`"
        )
    before = current.get(name)
    if before == value:
        out(f"unchanged {name}: it already holds the value of {detected}")
    else:
        vault.set(name, value)
        home.bump_generation()  # a running proxy injects it from its very next request
        verb = "adopted" if before is None else "adopted (replacing the previous value, which stays sealed for 30 days)"
        out(f"{verb} {detected} as {name}; use it as {format_reference(name)}")
    out(f"{format_reference(detected)} stays an alias of {name}: the agent's history keeps working")
    kind = detected[len(DETECTED_PREFIX) :].rsplit("-", 1)[0]
    _propose(home, [_Adopted(name, None if kind == shipped_detector().assignment_kind else kind)], out)
    return 0


@dataclass
class _Adopted:
    name: str
    kind: str | None


def _checked(name: str) -> str:
    try:
        return check_name(name)
    except ValueError as e:
        raise UsageError(str(e)) from None
