"""The `keyring` backend (every secret in its own OS keyring entry), and the
OS keyring access that the `file` backend also uses to keep its key.

It must never put a value, or the vault key, anywhere but the OS keyring,
nor in a message: errors name keyring entries and exception types only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from .._errors import UsageError, VaultError, VaultUnavailable
from .._references import check_name
from . import _base
from ._base import LocalVault, SecretInfo, VaultSnapshot, checked_name, check_value
from ._disk import locked
from ._versions import State, Version, decode_versions, encode_versions, infos, retained, rotate, snapshot

KEYRING_SERVICE = "keyveil"


def keyring_backend() -> Any:
    import keyring

    return keyring.get_keyring()


def keyring_is_stub(backend: Any) -> bool:
    from keyring.backends import fail, null

    return isinstance(backend, fail.Keyring | null.Keyring)


def usable_keyring() -> Any | None:
    """The OS keyring if one is there and keeps what it is given, else None."""
    try:
        backend = keyring_backend()
    except Exception:
        return None
    if keyring_is_stub(backend):
        return None
    user, probe = "probe:" + secrets.token_hex(8), secrets.token_hex(16)
    try:
        backend.set_password(KEYRING_SERVICE, user, probe)
        ok = backend.get_password(KEYRING_SERVICE, user) == probe
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            backend.delete_password(KEYRING_SERVICE, user)
    return backend if ok else None



class KeyringVault(LocalVault):
    """Every secret in its own OS keyring entry, plus an index of names.

    Entries (service ``keyveil``): ``secret:NAME`` holds the versions of NAME,
    ``index`` holds the names and a revision that changes on every write (the
    fingerprint). Writes go secret first, index last, so a crash leaves at
    worst an entry the index does not list yet.
    """

    backend = "keyring"

    def __init__(self, home: Path) -> None:
        self.home = Path(home)

    def __repr__(self) -> str:
        return "KeyringVault()"

    def load(self) -> VaultSnapshot:
        return snapshot(self._state(), _base.now())

    def info(self) -> list[SecretInfo]:
        return infos(self._state(), _base.now())

    def set(self, name: str, value: bytes) -> None:
        name, value = checked_name(name), check_value(value)
        with locked(self.home / "vault"):
            names = self._names()
            state = {n: self._versions(n) for n in names}
            now = _base.now()
            if not rotate(state, name, value, now):
                return
            self._write_pruned(state, now, always={name})
            self._write_index(sorted(set(names) | {name}))

    def remove(self, name: str) -> None:
        name = checked_name(name)
        with locked(self.home / "vault"):
            names = self._names()
            if name not in names:
                raise UsageError(f"no secret named {name} in the OS keyring vault; `keyveil secret list` shows the names")
            self._write_index([n for n in names if n != name])
            self._delete("secret:" + name)
            state = {n: self._versions(n) for n in names if n != name}
            self._write_pruned(state, _base.now(), always=set())

    def fingerprint(self) -> str:
        try:
            text = self._backend().get_password(KEYRING_SERVICE, "index")
        except Exception as e:
            return f"error:{type(e).__name__}"
        return "absent" if text is None else hashlib.sha256(text.encode()).hexdigest()

    # internals

    def _backend(self) -> Any:
        try:
            backend = keyring_backend()
        except Exception as e:
            raise VaultUnavailable(f"the OS keyring cannot be opened ({type(e).__name__}): {self._advice}") from None
        if keyring_is_stub(backend):
            raise VaultUnavailable(f"no usable OS keyring is available: {self._advice}")
        return backend

    _advice = "install or unlock one, or choose another vault with KEYVEIL_VAULT=file"

    def _get(self, user: str) -> str | None:
        backend = self._backend()
        try:
            return backend.get_password(KEYRING_SERVICE, user)
        except Exception as e:
            raise VaultUnavailable(
                f"the OS keyring failed to read {user!r} ({type(e).__name__}): {self._advice}"
            ) from None

    def _put(self, user: str, text: str) -> None:
        backend = self._backend()
        try:
            backend.set_password(KEYRING_SERVICE, user, text)
            kept = backend.get_password(KEYRING_SERVICE, user) == text
        except Exception as e:
            raise VaultError(f"the OS keyring failed to store {user!r} ({type(e).__name__}): {self._advice}") from None
        if not kept:
            raise VaultError(f"the OS keyring did not keep {user!r}: {self._advice}")

    def _delete(self, user: str) -> None:
        backend = self._backend()
        try:
            if backend.get_password(KEYRING_SERVICE, user) is not None:
                backend.delete_password(KEYRING_SERVICE, user)
        except Exception as e:
            raise VaultError(
                f"the OS keyring failed to delete {user!r} ({type(e).__name__}): delete the entry "
                f"(service {KEYRING_SERVICE!r}) with the keychain's own tool"
            ) from None

    def _names(self) -> list[str]:
        text = self._get("index")
        if text is None:
            return []
        try:
            index = json.loads(text)
            names = index["names"]
            if not isinstance(names, list) or not all(isinstance(n, str) and check_name(n) for n in names):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise VaultUnavailable(
                "the keyveil index in the OS keyring (service 'keyveil', user 'index') is corrupt: "
                "delete it and set the secrets again"
            ) from None
        return names

    def _versions(self, name: str) -> list[Version]:
        text = self._get("secret:" + name)
        if text is None:
            raise VaultUnavailable(
                f"the OS keyring lists {name} but holds no entry 'secret:{name}': set it again "
                f"(`keyveil secret set {name}`) or remove it (`keyveil secret rm {name}`)"
            )
        try:
            return decode_versions(name, json.loads(text)["versions"])
        except (ValueError, KeyError, TypeError):
            raise VaultUnavailable(
                f"the OS keyring entry 'secret:{name}' is corrupt: set it again (`keyveil secret set {name}`)"
            ) from None

    def _state(self) -> State:
        return {name: self._versions(name) for name in self._names()}

    def _write_pruned(self, state: State, now: datetime, always: set[str]) -> None:
        for name, versions in state.items():
            kept = [v for v in versions if retained(v, now)]
            if name in always or len(kept) != len(versions):
                self._put("secret:" + name, json.dumps({"version": 1, "versions": encode_versions(kept)}))

    def _write_index(self, names: list[str]) -> None:
        self._put("index", json.dumps({"version": 1, "names": names, "revision": secrets.token_hex(8)}))

