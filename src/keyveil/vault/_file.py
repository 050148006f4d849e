"""The `file` backend: every value in one AES-256-GCM file, ``HOME/vault/vault.json``.

It must never write a value anywhere but that encrypted file, and never put
a value, the vault key or the passphrase in an exception message, a log
record or a repr: errors name paths and variables only.

Key sources. The source is chosen once, when the vault is first written,
and recorded in the vault file (later opens use it and nothing else); the
first available one wins:

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

Rotation is that of ``_versions``; ``secret rm`` forgets every version of a
name at once: the user asked for the value to be gone.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from .._errors import UsageError, VaultError, VaultUnavailable
from . import _base
from ._base import LocalVault, SecretInfo, VaultSnapshot, b64decode, check_value, checked_name, env_bytes
from ._disk import atomic_write, ensure_private_dir, locked
from ._keyring import KEYRING_SERVICE, keyring_backend, keyring_is_stub, usable_keyring
from ._versions import State, decode_state, encode_versions, infos, prune, rotate, snapshot

KEY_SOURCES = ("keyring", "passphrase", "keyfile")
PASSPHRASE_VAR = "KEYVEIL_PASSPHRASE"

_FORMAT = "keyveil-vault"
_FORMAT_VERSION = 1
_KEY_BYTES = 32
_NONCE_BYTES = 12
_SALT_BYTES = 16
_SCRYPT = {"n": 2**15, "r": 8, "p": 1}


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


class FileVault(LocalVault):
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
        return snapshot(state, _base.now())

    def info(self) -> list[SecretInfo]:
        state, _ = self._read()
        return infos(state, _base.now())

    def set(self, name: str, value: bytes) -> None:
        name, value = checked_name(name), check_value(value)
        with locked(self.dir):
            state, key = self._read()
            now = _base.now()
            if not rotate(state, name, value, now):
                return
            prune(state, now)
            self._write(state, key or self._new_key())

    def remove(self, name: str) -> None:
        name = checked_name(name)
        with locked(self.dir):
            state, key = self._read()
            if name not in state or key is None:
                raise UsageError(f"no secret named {name} in the vault {self.path}; `keyveil secret list` shows the names")
            del state[name]
            prune(state, _base.now())
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

    def _read(self) -> tuple[State, _Key | None]:
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
            nonce = b64decode(envelope.get("nonce"), _NONCE_BYTES, "the nonce")
            ciphertext = b64decode(envelope.get("ciphertext"), None, "the ciphertext")
            salt = b64decode(envelope.get("salt"), _SALT_BYTES, "the salt") if source == "passphrase" else None
        except ValueError as e:
            raise self._corrupt(str(e)) from None
        key = self._key(source, salt)
        try:
            plaintext = AESGCM(key.key).decrypt(nonce, ciphertext, _aad(source))
        except InvalidTag:
            raise VaultUnavailable(self._wrong_key(source)) from None
        try:
            state = decode_state(plaintext)
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
            passphrase = env_bytes(PASSPHRASE_VAR)
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
            backend = keyring_backend()
            text = None if keyring_is_stub(backend) else backend.get_password(KEYRING_SERVICE, self.keyring_user)
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
            return b64decode(text, _KEY_BYTES, "the key")
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
        passphrase = env_bytes(PASSPHRASE_VAR)
        if passphrase:
            salt = os.urandom(_SALT_BYTES)
            return _Key("passphrase", self._derive(passphrase, salt), salt)
        return _Key("keyfile", self._new_key_file())

    def _new_keyring_key(self) -> bytes | None:
        backend = usable_keyring()
        if backend is None:
            return None
        user = self.keyring_user
        try:
            # Never overwrite a key: a backup of the vault may still need it.
            existing = backend.get_password(KEYRING_SERVICE, user)
            if existing is not None:
                with contextlib.suppress(ValueError):
                    return b64decode(existing, _KEY_BYTES, "the key")
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

    def _write(self, state: State, key: _Key) -> None:
        plaintext = json.dumps(
            {name: encode_versions(vs) for name, vs in sorted(state.items())}, separators=(",", ":")
        ).encode()
        nonce = os.urandom(_NONCE_BYTES)  # fresh on every write: GCM breaks on reuse
        ciphertext = AESGCM(key.key).encrypt(nonce, plaintext, _aad(key.source))
        envelope: dict[str, object] = {"format": _FORMAT, "version": _FORMAT_VERSION, "key_source": key.source}
        if key.salt is not None:
            envelope["salt"] = base64.b64encode(key.salt).decode("ascii")
        envelope["nonce"] = base64.b64encode(nonce).decode("ascii")
        envelope["ciphertext"] = base64.b64encode(ciphertext).decode("ascii")
        ensure_private_dir(self.dir)
        atomic_write(self.path, json.dumps(envelope, indent=2).encode() + b"\n")
