"""The vault: where secret values live, and how they are rotated.

This module stores, rotates and loads values for the `file` (AES-256-GCM),
`keyring` (OS keychain) and `env` (read-only, for CI) backends, and hands the
proxy a `VaultSnapshot` of current and recently rotated values. It must never
write a value anywhere but the encrypted vault file or the OS keyring, and
never put a value (nor a vault key or passphrase) in an exception message, a
log record or a repr: errors name secrets, paths and variables only.

Key sources of the `file` backend. The source is chosen once, when the vault
is first written, and recorded in the vault file (later opens use it and
nothing else); the first available one wins:

- ``keyring``: a random 256-bit key kept in the OS keyring (service
  ``keyveil``, user ``vault-key:<resolved KEYVEIL_HOME>``). A copy of the
  vault file or of the whole home (backup, sync, a stray commit) is useless
  without that keyring, which the OS encrypts at rest with the login secret.
  It does not protect against programs running as the same OS user while the
  keyring is unlocked: they can ask the keyring for the key too.
- ``passphrase``: the key is derived from ``KEYVEIL_PASSPHRASE`` with scrypt
  (n=2**15, r=8, p=1, random 16-byte salt); nothing on disk decrypts the
  vault. Protects a copied vault file or home as well as the passphrase is
  strong (scrypt only slows guessing). It does not protect against the same
  OS user reading the environment of the process that holds the passphrase;
  an agent must never inherit ``KEYVEIL_PASSPHRASE``.
- ``keyfile``: a random 256-bit key in ``vault/key`` (mode 0600) beside the
  vault. Protects a vault file that is copied or backed up *without* the
  key file. It does not protect against anyone who can read the home as the
  same OS user, an agent included: run the agent as another user for that.

Rotation: setting a new value for a name retires the old one; retired values
stay in the vault, sealed and scrubbed but never injected, for `RETENTION`
after they were retired, and are pruned on the next write after that.
``secret rm`` forgets every version of a name at once: the user asked for the
value to be gone.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from ._errors import UsageError, ValueRefused, VaultError, VaultUnavailable
from ._references import check_name

MIN_VALUE_LENGTH = 8
RETENTION = timedelta(days=30)

BACKENDS = ("file", "keyring", "env")
KEY_SOURCES = ("keyring", "passphrase", "keyfile")
KEYRING_SERVICE = "keyveil"
ENV_PREFIX = "KEYVEIL_SECRET_"
PASSPHRASE_VAR = "KEYVEIL_PASSPHRASE"

_FORMAT = "keyveil-vault"
_FORMAT_VERSION = 1
_KEY_BYTES = 32
_NONCE_BYTES = 12
_SALT_BYTES = 16
_SCRYPT = {"n": 2**15, "r": 8, "p": 1}
_REFERENCE_OPENER = b"{{secret:"


def _now() -> datetime:
    """The clock. Tests replace this function to travel in time."""
    return datetime.now(UTC)


# --- value objects -----------------------------------------------------------


@dataclass(frozen=True, repr=False)
class VaultSnapshot:
    """Every value the proxy must know, as loaded at one moment."""

    #: name -> current value (the only one ever injected)
    current: dict[str, bytes] = field(default_factory=dict)
    #: name -> values retired less than RETENTION ago, newest first (sealed
    #: and scrubbed, never injected)
    previous: dict[str, tuple[bytes, ...]] = field(default_factory=dict)

    def __repr__(self) -> str:
        # Names and counts only: a repr ends up in logs and tracebacks.
        names = sorted(self.current)
        previous = {n: len(v) for n, v in sorted(self.previous.items()) if v}
        return f"VaultSnapshot(current={names!r}, previous={previous!r})"

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
    """What the CLI and the proxy need from any backend."""

    backend: str

    def load(self) -> VaultSnapshot: ...

    def set(self, name: str, value: bytes) -> None: ...

    def remove(self, name: str) -> None: ...

    def info(self) -> list[SecretInfo]: ...

    def fingerprint(self) -> str: ...


@dataclass(frozen=True, repr=False)
class _Version:
    value: bytes
    created: datetime
    retired: datetime | None = None

    def __repr__(self) -> str:
        return f"_Version(created={self.created.isoformat()}, retired={self.retired and self.retired.isoformat()})"


_State = dict[str, list[_Version]]


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


def _check_name(name: str) -> str:
    try:
        return check_name(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def env_var(name: str) -> str:
    """The environment variable the `env` backend reads NAME from."""
    return ENV_PREFIX + _check_name(name).replace("/", "__")


# --- versions: rotation, retention, (de)serialisation ------------------------


def _retained(version: _Version, now: datetime) -> bool:
    return version.retired is None or now - version.retired < RETENTION


def _rotate(state: _State, name: str, value: bytes, now: datetime) -> bool:
    """Make VALUE the current value of NAME. False when it already was."""
    versions = state.get(name, [])
    kept: list[_Version] = []
    for v in versions:
        if v.retired is None:
            if hmac.compare_digest(v.value, value):
                return False
            kept.append(_Version(v.value, v.created, now))
        elif not hmac.compare_digest(v.value, value):
            # A value set again is current, not also previous.
            kept.append(v)
    kept.append(_Version(value, now))
    state[name] = kept
    return True


def _prune(state: _State, now: datetime) -> bool:
    """Drop previous values retired RETENTION ago or more. True when any was dropped."""
    changed = False
    for name, versions in state.items():
        kept = [v for v in versions if _retained(v, now)]
        if len(kept) != len(versions):
            state[name] = kept
            changed = True
    return changed


def _current(versions: list[_Version]) -> _Version:
    return next(v for v in versions if v.retired is None)


def _previous(versions: list[_Version], now: datetime) -> list[_Version]:
    old = [v for v in versions if v.retired is not None and _retained(v, now)]
    return sorted(old, key=lambda v: v.retired or now, reverse=True)


def _snapshot(state: _State, now: datetime) -> VaultSnapshot:
    current = {name: _current(vs).value for name, vs in state.items()}
    previous = {name: tuple(v.value for v in _previous(vs, now)) for name, vs in state.items()}
    return VaultSnapshot(current, {n: p for n, p in previous.items() if p})


def _infos(state: _State, now: datetime) -> list[SecretInfo]:
    return [
        SecretInfo(name, 1 + len(_previous(vs, now)), _current(vs).created)
        for name, vs in sorted(state.items())
    ]


def _encode_versions(versions: list[_Version]) -> list[dict[str, Any]]:
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


def _decode_versions(name: str, raw: object) -> list[_Version]:
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
            _Version(value, _parse_time(entry.get("created")), None if retired is None else _parse_time(retired))
        )
    if sum(v.retired is None for v in versions) != 1:
        raise ValueError(f"{name}: not exactly one current value")
    return versions


def _decode_state(data: bytes) -> _State:
    """Parse the decrypted vault; ValueError with a value-free reason."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the decrypted content is not JSON") from None
    if not isinstance(raw, dict):
        raise ValueError("the decrypted content is not a JSON object")
    state: _State = {}
    for name, versions in raw.items():
        try:
            check_name(name)
        except ValueError:
            raise ValueError("it holds an invalid secret name") from None
        state[name] = _decode_versions(name, versions)
    return state


# --- small helpers -----------------------------------------------------------


def _env_bytes(var: str) -> bytes | None:
    if os.supports_bytes_environ:
        return os.environb.get(os.fsencode(var))
    text = os.environ.get(var)
    return None if text is None else text.encode("utf-8")


def _b64decode(text: object, length: int | None, what: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{what} is missing")
    try:
        data = base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError(f"{what} is not valid base64") from None
    if length is not None and len(data) != length:
        raise ValueError(f"{what} has the wrong length")
    return data


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialise read-modify-write of the vault between keyveil processes."""
    _ensure_private_dir(directory)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; last writer wins
        yield
        return
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _ensure_private_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
    except OSError as e:
        raise VaultError(f"cannot create the vault directory {directory}: {e.strerror}") from None


def _atomic_write(path: Path, data: bytes) -> None:
    """Replace PATH with DATA (mode 0600) so that a reader sees the old or the new file, whole."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise VaultError(f"cannot write the vault {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.chmod(tmp, 0o600)  # mkstemp's mode already, but not on every platform
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise VaultError(f"cannot write the vault {path}: {e.strerror}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        with contextlib.suppress(OSError):
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)


def _keyring_backend() -> Any:
    import keyring

    return keyring.get_keyring()


def _keyring_is_stub(backend: Any) -> bool:
    from keyring.backends import fail, null

    return isinstance(backend, fail.Keyring | null.Keyring)


def _usable_keyring() -> Any | None:
    """The OS keyring if one is there and keeps what it is given, else None."""
    try:
        backend = _keyring_backend()
    except Exception:
        return None
    if _keyring_is_stub(backend):
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


# --- file backend ------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class _Key:
    source: str
    key: bytes
    salt: bytes | None = None


def _aad(key_source: str) -> bytes:
    # Binds the envelope's header: a vault relabelled to another key source
    # or format version fails to decrypt instead of being misread.
    return f"{_FORMAT}\x00{_FORMAT_VERSION}\x00{key_source}".encode()


def _derive(passphrase: bytes, salt: bytes) -> bytes:
    return Scrypt(salt=salt, length=_KEY_BYTES, **_SCRYPT).derive(passphrase)


class FileVault:
    """AES-256-GCM vault file in ``HOME/vault/vault.json``."""

    backend = "file"

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.dir = self.home / "vault"
        self.path = self.dir / "vault.json"
        self.key_path = self.dir / "key"
        # scrypt costs ~0.1 s: derive once per (salt, passphrase) per process.
        self._derived: dict[bytes, bytes] = {}

    def __repr__(self) -> str:
        return f"FileVault({str(self.path)!r})"

    @property
    def keyring_user(self) -> str:
        return f"vault-key:{self.home.resolve()}"

    # public API

    def load(self) -> VaultSnapshot:
        state, _ = self._read()
        return _snapshot(state, _now())

    def info(self) -> list[SecretInfo]:
        state, _ = self._read()
        return _infos(state, _now())

    def set(self, name: str, value: bytes) -> None:
        name, value = _check_name(name), check_value(value)
        with _locked(self.dir):
            state, key = self._read()
            now = _now()
            if not _rotate(state, name, value, now):
                return
            _prune(state, now)
            self._write(state, key or self._new_key())

    def remove(self, name: str) -> None:
        name = _check_name(name)
        with _locked(self.dir):
            state, key = self._read()
            if name not in state or key is None:
                raise UsageError(f"no secret named {name} in the vault {self.path}; `keyveil secret list` shows the names")
            del state[name]
            _prune(state, _now())
            self._write(state, key)

    def fingerprint(self) -> str:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return "absent"
        except OSError as e:
            return f"error:{e.errno}"
        return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"

    # reading

    def _corrupt(self, why: str) -> VaultUnavailable:
        return VaultUnavailable(
            f"the vault {self.path} is corrupt ({why}): restore it from a backup, "
            "or move it away and set the secrets again"
        )

    def _read(self) -> tuple[_State, _Key | None]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, None
        except OSError as e:
            raise VaultUnavailable(f"cannot read the vault {self.path}: {e.strerror}; check its owner and mode") from None
        try:
            envelope = json.loads(raw)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
            raise self._corrupt("not JSON") from None
        if not isinstance(envelope, dict) or envelope.get("format") != _FORMAT:
            raise self._corrupt("not a keyveil vault file")
        version = envelope.get("version")
        if version != _FORMAT_VERSION:
            raise VaultUnavailable(
                f"the vault {self.path} has format version {version!r}, this keyveil reads "
                f"version {_FORMAT_VERSION}: use the keyveil that wrote it, or upgrade"
            )
        source = envelope.get("key_source")
        if source not in KEY_SOURCES:
            raise self._corrupt(f"unknown key_source {source!r}")
        try:
            nonce = _b64decode(envelope.get("nonce"), _NONCE_BYTES, "the nonce")
            ciphertext = _b64decode(envelope.get("ciphertext"), None, "the ciphertext")
            salt = _b64decode(envelope.get("salt"), _SALT_BYTES, "the salt") if source == "passphrase" else None
        except ValueError as e:
            raise self._corrupt(str(e)) from None
        key = self._key(source, salt)
        try:
            plaintext = AESGCM(key.key).decrypt(nonce, ciphertext, _aad(source))
        except InvalidTag:
            raise VaultUnavailable(self._wrong_key(source)) from None
        try:
            state = _decode_state(plaintext)
        except ValueError as e:
            raise self._corrupt(str(e)) from None
        return state, key

    def _wrong_key(self, source: str) -> str:
        if source == "passphrase":
            return (
                f"cannot decrypt the vault {self.path}: {PASSPHRASE_VAR} is not the passphrase "
                f"the vault was created with; set {PASSPHRASE_VAR} to that passphrase"
            )
        where = "the OS keyring" if source == "keyring" else f"the key file {self.key_path}"
        return (
            f"cannot decrypt the vault {self.path} with the key from {where}: the vault file "
            "or its key was changed or replaced; restore both from the same backup"
        )

    def _key(self, source: str, salt: bytes | None) -> _Key:
        if source == "keyring":
            return _Key(source, self._keyring_key())
        if source == "passphrase":
            assert salt is not None
            passphrase = _env_bytes(PASSPHRASE_VAR)
            if not passphrase:
                raise VaultUnavailable(
                    f"the vault {self.path} is encrypted with a passphrase: set {PASSPHRASE_VAR} "
                    "to the passphrase the vault was created with"
                )
            return _Key(source, self._derive(passphrase, salt), salt)
        return _Key(source, self._key_file())

    def _derive(self, passphrase: bytes, salt: bytes) -> bytes:
        # Cache by a digest, so the passphrase itself is not kept as a dict key.
        tag = hashlib.sha256(salt + b"\x00" + passphrase).digest()
        if tag not in self._derived:
            self._derived[tag] = _derive(passphrase, salt)
        return self._derived[tag]

    def _keyring_key(self) -> bytes:
        problem = None
        try:
            backend = _keyring_backend()
            text = None if _keyring_is_stub(backend) else backend.get_password(KEYRING_SERVICE, self.keyring_user)
        except Exception as e:
            text, problem = None, f"the keyring failed ({type(e).__name__})"
        if text is None:
            problem = problem or "no usable OS keyring holds its key"
            raise VaultUnavailable(
                f"the vault {self.path} was created with its key in the OS keyring "
                f"(service {KEYRING_SERVICE!r}, user {self.keyring_user!r}), but {problem}: unlock "
                "the keyring, or run keyveil as the same OS user, with the same KEYVEIL_HOME, "
                "where that keyring is available"
            )
        try:
            return _b64decode(text, _KEY_BYTES, "the key")
        except ValueError:
            raise VaultUnavailable(
                f"the key of the vault {self.path} in the OS keyring (user {self.keyring_user!r}) "
                "is malformed: restore it, or move the vault away and set the secrets again"
            ) from None

    def _key_file(self) -> bytes:
        try:
            key = self.key_path.read_bytes()
        except FileNotFoundError:
            raise VaultUnavailable(
                f"the key file {self.key_path} of the vault {self.path} is missing: restore it "
                "(it was created with the vault), or move the vault away and set the secrets again"
            ) from None
        except OSError as e:
            raise VaultUnavailable(f"cannot read the key file {self.key_path}: {e.strerror}") from None
        if len(key) != _KEY_BYTES:
            raise VaultUnavailable(
                f"the key file {self.key_path} is corrupt (not {_KEY_BYTES} bytes): restore it from "
                "the backup of the vault"
            )
        return key

    # creating and writing

    def _new_key(self) -> _Key:
        """Pick the key source of a new vault (order of SPEC §9) and get its key."""
        key = self._new_keyring_key()
        if key is not None:
            return _Key("keyring", key)
        passphrase = _env_bytes(PASSPHRASE_VAR)
        if passphrase:
            salt = os.urandom(_SALT_BYTES)
            return _Key("passphrase", self._derive(passphrase, salt), salt)
        return _Key("keyfile", self._new_key_file())

    def _new_keyring_key(self) -> bytes | None:
        backend = _usable_keyring()
        if backend is None:
            return None
        user = self.keyring_user
        try:
            # Never overwrite a key: a backup of the vault may still need it.
            existing = backend.get_password(KEYRING_SERVICE, user)
            if existing is not None:
                with contextlib.suppress(ValueError):
                    return _b64decode(existing, _KEY_BYTES, "the key")
                return None
            key = AESGCM.generate_key(bit_length=256)
            text = base64.b64encode(key).decode("ascii")
            backend.set_password(KEYRING_SERVICE, user, text)
            if backend.get_password(KEYRING_SERVICE, user) != text:
                return None
        except Exception:
            return None
        return key

    def _new_key_file(self) -> bytes:
        # Never overwrite a key file: a backup of the vault may still need it.
        if self.key_path.exists():
            return self._key_file()
        key = AESGCM.generate_key(bit_length=256)
        try:
            fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
            with os.fdopen(fd, "wb") as f:
                os.chmod(self.key_path, 0o600)
                f.write(key)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise VaultError(f"cannot create the key file {self.key_path}: {e.strerror}") from None
        return key

    def _write(self, state: _State, key: _Key) -> None:
        plaintext = json.dumps(
            {name: _encode_versions(vs) for name, vs in sorted(state.items())}, separators=(",", ":")
        ).encode()
        nonce = os.urandom(_NONCE_BYTES)  # fresh on every write: GCM breaks on reuse
        ciphertext = AESGCM(key.key).encrypt(nonce, plaintext, _aad(key.source))
        envelope: dict[str, object] = {"format": _FORMAT, "version": _FORMAT_VERSION, "key_source": key.source}
        if key.salt is not None:
            envelope["salt"] = base64.b64encode(key.salt).decode("ascii")
        envelope["nonce"] = base64.b64encode(nonce).decode("ascii")
        envelope["ciphertext"] = base64.b64encode(ciphertext).decode("ascii")
        _ensure_private_dir(self.dir)
        _atomic_write(self.path, json.dumps(envelope, indent=2).encode() + b"\n")


# --- keyring backend ---------------------------------------------------------


class KeyringVault:
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
        return _snapshot(self._state(), _now())

    def info(self) -> list[SecretInfo]:
        return _infos(self._state(), _now())

    def set(self, name: str, value: bytes) -> None:
        name, value = _check_name(name), check_value(value)
        with _locked(self.home / "vault"):
            names = self._names()
            state = {n: self._versions(n) for n in names}
            now = _now()
            if not _rotate(state, name, value, now):
                return
            self._write_pruned(state, now, always={name})
            self._write_index(sorted(set(names) | {name}))

    def remove(self, name: str) -> None:
        name = _check_name(name)
        with _locked(self.home / "vault"):
            names = self._names()
            if name not in names:
                raise UsageError(f"no secret named {name} in the OS keyring vault; `keyveil secret list` shows the names")
            self._write_index([n for n in names if n != name])
            self._delete("secret:" + name)
            state = {n: self._versions(n) for n in names if n != name}
            self._write_pruned(state, _now(), always=set())

    def fingerprint(self) -> str:
        try:
            text = self._backend().get_password(KEYRING_SERVICE, "index")
        except Exception as e:
            return f"error:{type(e).__name__}"
        return "absent" if text is None else hashlib.sha256(text.encode()).hexdigest()

    # internals

    def _backend(self) -> Any:
        try:
            backend = _keyring_backend()
        except Exception as e:
            raise VaultUnavailable(f"the OS keyring cannot be opened ({type(e).__name__}): {self._advice}") from None
        if _keyring_is_stub(backend):
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

    def _versions(self, name: str) -> list[_Version]:
        text = self._get("secret:" + name)
        if text is None:
            raise VaultUnavailable(
                f"the OS keyring lists {name} but holds no entry 'secret:{name}': set it again "
                f"(`keyveil secret set {name}`) or remove it (`keyveil secret rm {name}`)"
            )
        try:
            return _decode_versions(name, json.loads(text)["versions"])
        except (ValueError, KeyError, TypeError):
            raise VaultUnavailable(
                f"the OS keyring entry 'secret:{name}' is corrupt: set it again (`keyveil secret set {name}`)"
            ) from None

    def _state(self) -> _State:
        return {name: self._versions(name) for name in self._names()}

    def _write_pruned(self, state: _State, now: datetime, always: set[str]) -> None:
        for name, versions in state.items():
            kept = [v for v in versions if _retained(v, now)]
            if name in always or len(kept) != len(versions):
                self._put("secret:" + name, json.dumps({"version": 1, "versions": _encode_versions(kept)}))

    def _write_index(self, names: list[str]) -> None:
        self._put("index", json.dumps({"version": 1, "names": names, "revision": secrets.token_hex(8)}))


# --- env backend -------------------------------------------------------------


class EnvVault:
    """Read-only: ``KEYVEIL_SECRET_<NAME>`` with ``/`` written ``__``, case kept (for CI)."""

    backend = "env"

    def __init__(self) -> None:
        self._opened = _now()
        # Keyed per process: the fingerprint must not be a digest of values
        # that someone could test guesses against.
        self._fingerprint_key = os.urandom(32)

    def __repr__(self) -> str:
        return "EnvVault()"

    def _variables(self) -> list[tuple[str, bytes]]:
        if os.supports_bytes_environ:
            items = [(os.fsdecode(k), v) for k, v in os.environb.items()]
        else:
            items = [(k, v.encode("utf-8")) for k, v in os.environ.items()]
        return sorted((k, v) for k, v in items if k.startswith(ENV_PREFIX))

    def load(self) -> VaultSnapshot:
        current: dict[str, bytes] = {}
        for var, value in self._variables():
            name = var[len(ENV_PREFIX) :].replace("__", "/")
            try:
                check_name(name)
            except ValueError as e:
                raise VaultUnavailable(
                    f"environment variable {var} does not name a valid secret ({e}); write NAME's "
                    "'/' as '__', e.g. KEYVEIL_SECRET_github__pat for github/pat"
                ) from None
            if name in current:
                raise VaultUnavailable(f"two environment variables name the secret {name}: keep only {env_var(name)}")
            try:
                current[name] = check_value(value)
            except ValueRefused as e:
                raise VaultUnavailable(f"environment variable {var}: {e}") from None
        return VaultSnapshot(current, {})

    def info(self) -> list[SecretInfo]:
        # The environment has no history: "updated" is when the vault was opened.
        return [SecretInfo(name, 1, self._opened) for name in sorted(self.load().current)]

    def set(self, name: str, value: bytes) -> None:
        raise UsageError(
            f"the env vault is read-only: export {env_var(name)} in the environment of the proxy "
            "instead, or choose another vault with KEYVEIL_VAULT=file"
        )

    def remove(self, name: str) -> None:
        raise UsageError(
            f"the env vault is read-only: unset {env_var(name)} in the environment of the proxy instead"
        )

    def fingerprint(self) -> str:
        mac = hmac.new(self._fingerprint_key, digestmod=hashlib.sha256)
        for var, value in self._variables():
            mac.update(var.encode("utf-8", "surrogateescape") + b"\x00" + value + b"\x00")
        return mac.hexdigest()


# --- entry point -------------------------------------------------------------


def open_vault(home: Path, backend: str | None = None) -> Vault:
    """The vault of HOME; BACKEND defaults to ``$KEYVEIL_VAULT`` or ``file``. Opening touches nothing."""
    if backend is None:
        backend = os.environ.get("KEYVEIL_VAULT") or "file"
    if backend == "file":
        return FileVault(Path(home))
    if backend == "keyring":
        return KeyringVault(Path(home))
    if backend == "env":
        return EnvVault()
    raise UsageError(f"unknown vault backend {backend!r} (KEYVEIL_VAULT): use one of {', '.join(BACKENDS)}")
