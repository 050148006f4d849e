"""Rotation history of the local backends (file, keyring): versions of a
value with the time each was set and retired, and their (de)serialisation.

Setting a new value for a name retires the old one; a retired value stays,
sealed and scrubbed but never injected, for ``RETENTION`` after it was
retired and is pruned on the next write after that. Nothing here reads or
writes storage, and no error raised here holds a value.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .._references import check_name
from ._base import RETENTION, SecretInfo, VaultSnapshot


@dataclass(frozen=True, repr=False)
class Version:
    value: bytes
    created: datetime
    retired: datetime | None = None

    def __repr__(self) -> str:
        return f"Version(created={self.created.isoformat()}, retired={self.retired and self.retired.isoformat()})"


State = dict[str, list[Version]]


def retained(version: Version, now: datetime) -> bool:
    return version.retired is None or now - version.retired < RETENTION


def rotate(state: State, name: str, value: bytes, now: datetime) -> bool:
    """Make VALUE the current value of NAME. False when it already was."""
    versions = state.get(name, [])
    kept: list[Version] = []
    for v in versions:
        if v.retired is None:
            if hmac.compare_digest(v.value, value):
                return False
            kept.append(Version(v.value, v.created, now))
        elif not hmac.compare_digest(v.value, value):
            # A value set again is current, not also previous.
            kept.append(v)
    kept.append(Version(value, now))
    state[name] = kept
    return True


def prune(state: State, now: datetime) -> bool:
    """Drop previous values retired RETENTION ago or more. True when any was dropped."""
    changed = False
    for name, versions in state.items():
        kept = [v for v in versions if retained(v, now)]
        if len(kept) != len(versions):
            state[name] = kept
            changed = True
    return changed


def _current(versions: list[Version]) -> Version:
    return next(v for v in versions if v.retired is None)


def _previous(versions: list[Version], now: datetime) -> list[Version]:
    old = [v for v in versions if v.retired is not None and retained(v, now)]
    return sorted(old, key=lambda v: v.retired or now, reverse=True)


def snapshot(state: State, now: datetime) -> VaultSnapshot:
    current = {name: _current(vs).value for name, vs in state.items()}
    previous = {name: tuple(v.value for v in _previous(vs, now)) for name, vs in state.items()}
    return VaultSnapshot(current, {n: p for n, p in previous.items() if p})


def infos(state: State, now: datetime) -> list[SecretInfo]:
    return [
        SecretInfo(name, 1 + len(_previous(vs, now)), _current(vs).created)
        for name, vs in sorted(state.items())
    ]


def encode_versions(versions: list[Version]) -> list[dict[str, Any]]:
    return [
        {
            "value": base64.b64encode(v.value).decode("ascii"),
            "created": v.created.isoformat(),
            "retired": v.retired.isoformat() if v.retired else None,
        }
        for v in versions
    ]


def _parse_time(text: object) -> datetime:
    if not isinstance(text, str):
        raise ValueError("a timestamp is not a string")
    t = datetime.fromisoformat(text)
    if t.tzinfo is None:
        raise ValueError("a timestamp has no time zone")
    return t


def decode_versions(name: str, raw: object) -> list[Version]:
    """Parse the stored versions of NAME; ValueError with a value-free reason."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{name}: no versions")
    versions = []
    for entry in raw:
        if not isinstance(entry, dict) or not isinstance(entry.get("value"), str):
            raise ValueError(f"{name}: a version has no value")
        try:
            value = base64.b64decode(entry["value"], validate=True)
        except binascii.Error:
            raise ValueError(f"{name}: a value is not valid base64") from None
        retired = entry.get("retired")
        versions.append(
            Version(value, _parse_time(entry.get("created")), None if retired is None else _parse_time(retired))
        )
    if sum(v.retired is None for v in versions) != 1:
        raise ValueError(f"{name}: not exactly one current value")
    return versions


def decode_state(data: bytes) -> State:
    """Parse a decrypted vault; ValueError with a value-free reason."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the decrypted content is not JSON") from None
    if not isinstance(raw, dict):
        raise ValueError("the decrypted content is not a JSON object")
    state: State = {}
    for name, versions in raw.items():
        try:
            check_name(name)
        except ValueError:
            raise ValueError("it holds an invalid secret name") from None
        state[name] = decode_versions(name, versions)
    return state
