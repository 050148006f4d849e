"""Hosts: normalisation, host patterns, and fast matching of a host against many patterns.

A binding (SPEC §4) says which hosts may receive a value, so this module decides
whether a host is bound, a provider (SPEC §5) or passthrough. It must never accept
a pattern that would match any host (``*``, ``*.com``, a bare public suffix), and
never match more than a pattern says: when in doubt a host does not match, so a
value stays sealed instead of being injected.
"""

from __future__ import annotations

import functools
import importlib.resources
import ipaddress
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

try:
    import idna
except ImportError:  # pragma: no cover - only when installed without idna
    idna = None  # type: ignore[assignment]

T = TypeVar("T")

_MAX_HOST = 253
# Letters, digits, '-' and '_' (real hosts such as `_dmarc` or `r3---sn-x` exist), at
# most 63 characters, no '-' at either end. Stricter than DNS, laxer than IDNA2008.
_ASCII_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")
_PORT = re.compile(r"[0-9]{1,5}\Z")


@functools.lru_cache(maxsize=4096)  # pure, and asked for the same few hosts on every request
def normalize_host(host: str) -> str:
    """HOST lowercased, one trailing dot stripped, IDNA-encoded; IP literals canonical.

    Raise ValueError saying why HOST is not a host name (anew each time: the
    cache keeps results, not errors).
    """
    if not host:
        raise ValueError("empty host")
    if host.startswith("[") and host.endswith("]"):
        return _normalize_ipv6(host[1:-1], host)
    if ":" in host:
        return _normalize_ipv6(host, host)
    if host.endswith("."):
        host = host[:-1]
    if not host:
        raise ValueError("empty host")
    if not host.isascii():
        host = _idna_encode(host)
    host = host.lower()
    if len(host) > _MAX_HOST:
        raise ValueError(f"host name longer than {_MAX_HOST} characters")
    labels = host.split(".")
    for label in labels:
        if not label:
            raise ValueError(f"empty label in host {host!r}")
        if _ASCII_LABEL.match(label) is None:
            raise ValueError(f"invalid label {label!r} in host {host!r}")
        if label.startswith("xn--"):
            _check_punycode(label, host)
    # A numeric last label makes URL parsers read the host as IPv4 (`127.1`,
    # `2130706433`): only the canonical dotted quad is a host we can match safely.
    if labels[-1].isdigit():
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise ValueError(f"{host!r} is not a valid IPv4 address (write it as a.b.c.d)") from None
    return host


def _normalize_ipv6(text: str, original: str) -> str:
    try:
        return ipaddress.IPv6Address(text).compressed
    except ValueError:
        raise ValueError(f"{original!r} is not a valid IPv6 address") from None


def _idna_encode(host: str) -> str:
    if idna is None:  # pragma: no cover
        raise ValueError(f"cannot encode the internationalised host {host!r}: install the idna package")
    try:
        return idna.encode(host, uts46=True).decode("ascii")
    except idna.IDNAError as e:
        raise ValueError(f"invalid internationalised host {host!r}: {e}") from None


def _check_punycode(label: str, host: str) -> None:
    if idna is None:  # pragma: no cover
        return
    try:
        idna.decode(label)
    except idna.IDNAError:
        raise ValueError(f"invalid IDNA label {label!r} in host {host!r}") from None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _cheap_normalize(host: str) -> str | None:
    """The normalised HOST, or None when it is no host (which then matches nothing).

    Cached because request hosts repeat: the per-request cost is a dict lookup.
    """
    try:
        return normalize_host(host)
    except ValueError:
        return None


# --- public suffixes ---------------------------------------------------------------

# Used only if the list bundled with publicsuffix2 cannot be read: the two-label
# suffixes under which most registrations happen. Single labels (com, uk, ...) are
# always covered by the default rule `*`.
_FALLBACK_SUFFIXES = (
    "co.uk org.uk me.uk ltd.uk plc.uk ac.uk gov.uk net.uk com.au net.au org.au edu.au "
    "gov.au co.nz org.nz net.nz co.jp ne.jp or.jp ac.jp go.jp com.br net.br org.br "
    "com.cn net.cn org.cn gov.cn com.hk com.tw com.sg com.my co.in net.in org.in co.kr "
    "or.kr co.za org.za com.mx com.ar com.tr com.ua co.il co.id com.ph com.vn com.pk com.eg "
    "com.sa com.ng co.th com.co com.pe com.es com.pl com.ru"
).split()


@dataclass(frozen=True)
class _Suffixes:
    rules: frozenset[str]
    wildcards: frozenset[str]  # `*.ck` is stored as `ck`
    exceptions: frozenset[str]  # `!www.ck` is stored as `www.ck`

    def is_listed(self, domain: str) -> bool:
        """True when DOMAIN is a public suffix by an explicit rule of the list."""
        if domain in self.rules:
            return True
        parent = domain.partition(".")[2]
        return bool(parent) and parent in self.wildcards and domain not in self.exceptions

    def is_public(self, domain: str) -> bool:
        """Like is_listed, plus the default rule `*`: every single label is a suffix."""
        return "." not in domain or self.is_listed(domain)


@functools.cache
def _suffixes() -> _Suffixes:
    """The ICANN section of the public suffix list bundled with publicsuffix2.

    Only the ICANN section: the private section lists single-operator namespaces
    such as githubusercontent.com or googleapis.com, and binding `*.` under one of
    them is a deliberate, narrow choice (SPEC §4's own example binds
    `*.githubusercontent.com`).
    """
    try:
        text = (importlib.resources.files("publicsuffix2") / "public_suffix_list.dat").read_text("utf-8")
    except (ModuleNotFoundError, OSError):  # pragma: no cover - fallback path
        return _Suffixes(frozenset(_FALLBACK_SUFFIXES), frozenset(), frozenset())
    rules: set[str] = set()
    wildcards: set[str] = set()
    exceptions: set[str] = set()
    for line in text.split("===END ICANN DOMAINS===")[0].splitlines():
        rule = line.strip().split(" ")[0]
        if not rule or rule.startswith("//"):
            continue
        target, text_rule = rules, rule
        if rule.startswith("!"):
            target, text_rule = exceptions, rule[1:]
        elif rule.startswith("*."):
            target, text_rule = wildcards, rule[2:]
        try:
            target.add(text_rule if text_rule.isascii() else _idna_encode(text_rule))
        except ValueError:
            continue  # a few Unicode rules are not valid IDNA2008; no host can hit them either
    return _Suffixes(frozenset(rules), frozenset(wildcards), frozenset(exceptions))


# --- patterns ----------------------------------------------------------------------


@dataclass(frozen=True)
class HostPattern:
    """One host pattern of a binding, provider or passthrough list.

    ``host`` is normalised and without the ``*.``; ``port`` None means the default
    port of the request's scheme (443 for https, 80 for http).
    """

    host: str
    wildcard: bool
    port: int | None
    text: str

    def matches(self, host: str, port: int, default_port: int = 443) -> bool:
        if port != (default_port if self.port is None else self.port):
            return False
        name = _cheap_normalize(host)
        if name is None:
            return False
        if self.wildcard:
            return name.endswith("." + self.host)
        return name == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        prefix = "*." if self.wildcard else ""
        suffix = f":{self.port}" if self.port is not None else ""
        return prefix + host + suffix


def parse_host_pattern(text: str) -> HostPattern:
    """Parse `host`, `host:port`, `*.domain`, `*.domain:port`, IPv4, or `[IPv6]:port`.

    Raise ValueError with the exact reason for anything else, and for any pattern
    broad enough to match hosts of unrelated owners.
    """
    if not isinstance(text, str):
        raise ValueError(f"a host pattern is text such as api.github.com, not {type(text).__name__}")
    if not text:
        raise ValueError("empty host pattern")
    if any(c.isspace() for c in text):
        raise ValueError(f"host pattern {text!r} contains whitespace")
    if "://" in text:
        raise ValueError(f"host pattern {text!r} has a scheme: write the host only, e.g. api.github.com")
    if "/" in text or "?" in text or "#" in text:
        raise ValueError(f"host pattern {text!r} has a path: write the host only, e.g. api.github.com")
    if "@" in text:
        raise ValueError(f"host pattern {text!r} has user information: write the host only")

    host, port = _split_port(text)
    wildcard = host.startswith("*.")
    if wildcard:
        host = host[2:]
    if host == "*" or (not host and wildcard):
        raise ValueError(f"host pattern {text!r} would match every host: name the hosts a value may go to")
    if "*" in host:
        raise ValueError(
            f"host pattern {text!r}: a wildcard is allowed only as a leading '*.' (e.g. *.example.com)"
        )
    try:
        name = normalize_host(host)
    except ValueError as e:
        raise ValueError(f"host pattern {text!r}: {e}") from None

    if wildcard:
        _check_wildcard_base(name, text)
    elif not _is_ip(name) and _suffixes().is_listed(name):
        raise ValueError(
            f"host pattern {text!r} is a public suffix, not a host: "
            f"name the host itself (e.g. api.example.{name})"
        )
    return HostPattern(host=name, wildcard=wildcard, port=port, text=text)


def _split_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"host pattern {text!r}: missing ']' after the IPv6 address")
        host, rest = text[: end + 1], text[end + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise ValueError(f"host pattern {text!r}: unexpected text after the IPv6 address")
        return host, _parse_port(rest[1:], text)
    if text.count(":") > 1:
        raise ValueError(f"host pattern {text!r}: write an IPv6 address in brackets, e.g. [::1]:8443")
    host, colon, port = text.partition(":")
    return host, _parse_port(port, text) if colon else None


def _parse_port(port: str, text: str) -> int:
    if _PORT.match(port) is None or not 1 <= int(port) <= 65535:
        raise ValueError(f"host pattern {text!r}: port must be a number from 1 to 65535")
    return int(port)


def _check_wildcard_base(name: str, text: str) -> None:
    if _is_ip(name) or name.rpartition(".")[2].isdigit():
        raise ValueError(f"host pattern {text!r}: a wildcard cannot apply to an IP address")
    if "." not in name:
        raise ValueError(
            f"host pattern {text!r} is too broad: it would match every host under .{name}; "
            f"bind the hosts you use (e.g. *.example.{name})"
        )
    if _suffixes().is_public(name):
        raise ValueError(
            f"host pattern {text!r} is too broad: {name} is a public suffix, so it would match "
            f"hosts of unrelated owners; bind the hosts you use (e.g. *.example.{name})"
        )


# --- sets of patterns --------------------------------------------------------------


class HostMap(Generic[T]):
    """Patterns mapped to items; a lookup costs O(labels of the host), not O(patterns).

    Exact patterns live in a dict keyed by (host, port); wildcard patterns in a dict
    keyed by (suffix, port), probed once per parent domain of the host. Port None
    in a key means "the scheme's default port".
    """

    def __init__(self, entries: Iterable[tuple[HostPattern, T]] = ()) -> None:
        self._exact: dict[tuple[str, int | None], list[T]] = {}
        self._wildcard: dict[tuple[str, int | None], list[T]] = {}
        for pattern, item in entries:
            index = self._wildcard if pattern.wildcard else self._exact
            index.setdefault((pattern.host, pattern.port), []).append(item)

    def lookup(self, host: str, port: int, default_port: int = 443) -> Iterator[T]:
        """Every item whose pattern matches HOST:PORT (an item may repeat)."""
        name = _cheap_normalize(host)
        if name is None:
            return
        ports: tuple[int | None, ...] = (port, None) if port == default_port else (port,)
        for p in ports:
            yield from self._exact.get((name, p), ())
        if not self._wildcard:
            return
        dot = name.find(".")
        while dot >= 0:
            suffix = name[dot + 1 :]
            for p in ports:
                yield from self._wildcard.get((suffix, p), ())
            dot = name.find(".", dot + 1)


class HostSet:
    """A set of host patterns, built once, matched many times."""

    def __init__(self, patterns: Iterable[HostPattern]) -> None:
        self.patterns = tuple(patterns)
        self._map: HostMap[HostPattern] = HostMap((p, p) for p in self.patterns)

    def matches(self, host: str, port: int, default_port: int = 443) -> bool:
        return next(self._map.lookup(host, port, default_port), None) is not None

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def __len__(self) -> int:
        return len(self.patterns)


def patterns_overlap(a: HostPattern, b: HostPattern) -> bool:
    """True when some host is matched by both A and B, ignoring ports."""
    if not a.wildcard and not b.wildcard:
        return a.host == b.host
    if a.wildcard and b.wildcard:
        return a.host == b.host or a.host.endswith("." + b.host) or b.host.endswith("." + a.host)
    wild, exact = (a, b) if a.wildcard else (b, a)
    return exact.host.endswith("." + wild.host)
