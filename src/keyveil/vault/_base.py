"""What every vault backend shares: the snapshot it hands the proxy, the
checks on names and values, and the clock.

Nothing here stores anything. No message raised here holds a value: errors
name secrets, variables and limits only.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

from .._errors import UsageError, ValueRefused
from .._references import check_name

MIN_VALUE_LENGTH = 8
#: how long a rotated-out value keeps being sealed and scrubbed (SPEC §3)
RETENTION = timedelta(days=30)

_REFERENCE_OPENER = b"{{secret:"


def now() -> datetime:
    """The clock of every backend. Tests replace this function to travel in time."""
    return datetime.now(UTC)


@dataclass(frozen=True, repr=False)
class VaultSnapshot:
    """Every value the proxy must know, as loaded at one moment."""

    #: name -> current value (the only one ever injected)
    current: dict[str, bytes] = field(default_factory=dict)
    #: name -> values retired less than RETENTION ago, newest first (sealed
    #: and scrubbed, never injected)
    previous: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    #: name -> why its value could not be read (a remote store that denies
    #: one entry); a flow that needs it is blocked, every other flow goes on.
    #: The reason names the entry and what to do, never a value.
    unavailable: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        # Names and counts only: a repr ends up in logs and tracebacks.
        names = sorted(self.current)
        previous = {n: len(v) for n, v in sorted(self.previous.items()) if v}
        text = f"VaultSnapshot(current={names!r}, previous={previous!r}"
        if self.unavailable:
            text += f", unavailable={sorted(self.unavailable)!r}"
        return text + ")"

    __str__ = __repr__


@dataclass(frozen=True)
class SecretInfo:
    """What `secret list` shows of one secret: never its value."""

    name: str
    #: current value + retained previous values
    versions: int
    #: when the current value was set
    updated: datetime


class Vault(Protocol):
    """What the CLI and the proxy need from any backend.

    ``fingerprint`` is the cheap change check a running proxy makes every
    ``poll_seconds``; ``load`` runs only when it changed. ``remote`` backends
    are read from a background thread, never from the proxy's event loop,
    and a running proxy keeps their last good snapshot for ``grace_seconds``
    when they stop answering (local backends: 0, an unreadable vault blocks
    at once).
    """

    backend: str
    poll_seconds: float
    grace_seconds: float
    remote: bool

    def load(self) -> VaultSnapshot: ...

    def set(self, name: str, value: bytes) -> None: ...

    def remove(self, name: str) -> None: ...

    def info(self) -> list[SecretInfo]: ...

    def fingerprint(self) -> str: ...


class LocalVault:
    """Defaults of the backends that read this machine only (file, keyring, env)."""

    #: how stale the running proxy's view of the vault may be
    poll_seconds = 1.0
    grace_seconds = 0.0
    remote = False


# --- checks ------------------------------------------------------------------


def check_value(value: bytes) -> bytes:
    """Return VALUE as bytes, or raise ValueRefused saying why it cannot be registered."""
    if not isinstance(value, bytes | bytearray):
        raise TypeError("a secret value must be bytes")
    value = bytes(value)
    if not value:
        raise ValueRefused("the value is empty: nothing was stored")
    # SPEC §3 counts characters; a byte that is not UTF-8 counts as one.
    if len(value.decode("utf-8", "surrogateescape")) < MIN_VALUE_LENGTH:
        raise ValueRefused(
            f"the value is shorter than {MIN_VALUE_LENGTH} characters: values that short "
            "would be found by chance in ordinary text; use the full secret"
        )
    if _REFERENCE_OPENER in value:
        raise ValueRefused(
            "the value contains '{{secret:', which keyveil reads as the start of a "
            "reference; such a value cannot be registered"
        )
    return value


def checked_name(name: str) -> str:
    """NAME if it is a valid secret name, else UsageError saying why."""
    try:
        return check_name(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


# --- small helpers -----------------------------------------------------------


def env_bytes(var: str) -> bytes | None:
    if os.supports_bytes_environ:
        return os.environb.get(os.fsencode(var))
    text = os.environ.get(var)
    return None if text is None else text.encode("utf-8")


def b64decode(text: object, length: int | None, what: str) -> bytes:
    """Strict base64; ValueError naming WHAT (never the data) when it is not."""
    if not isinstance(text, str):
        raise ValueError(f"{what} is missing")
    try:
        data = base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError(f"{what} is not valid base64") from None
    if length is not None and len(data) != length:
        raise ValueError(f"{what} has the wrong length")
    return data
