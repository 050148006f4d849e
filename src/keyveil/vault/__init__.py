"""The vault: where secret values live, how they are rotated, and how a
running proxy keeps its view of them current.

One module per backend behind one small interface (``Vault``: ``load``,
``set``, ``remove``, ``info``, ``fingerprint``):

- ``file`` (default, ``_file``): AES-256-GCM file in ``HOME/vault/``;
- ``keyring`` (``_keyring``): the OS keychain;
- ``env`` (``_env``): read-only ``KEYVEIL_SECRET_<NAME>``, for CI;
- ``openbao`` (``_openbao``): OpenBao or HashiCorp Vault, KV version 2.

Every backend hands the proxy a ``VaultSnapshot`` (current values, recently
rotated values, entries that could not be read); ``VaultWatcher`` keeps it
current while the proxy runs. No backend ever puts a value in a message, a
log line or a repr.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._errors import UsageError
from ._base import MIN_VALUE_LENGTH, RETENTION, SecretInfo, Vault, VaultSnapshot, check_value
from ._env import ENV_PREFIX, EnvVault, env_var
from ._file import KEY_SOURCES, PASSPHRASE_VAR, FileVault
from ._keyring import KEYRING_SERVICE, KeyringVault
from ._openbao import OpenBaoSettings, OpenBaoVault
from ._watcher import VaultWatcher

BACKENDS = ("file", "keyring", "env", "openbao")


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
    if backend == "openbao":
        return OpenBaoVault.from_env()
    raise UsageError(f"unknown vault backend {backend!r} (KEYVEIL_VAULT): use one of {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "ENV_PREFIX",
    "KEYRING_SERVICE",
    "KEY_SOURCES",
    "MIN_VALUE_LENGTH",
    "PASSPHRASE_VAR",
    "RETENTION",
    "EnvVault",
    "FileVault",
    "KeyringVault",
    "OpenBaoSettings",
    "OpenBaoVault",
    "SecretInfo",
    "Vault",
    "VaultSnapshot",
    "VaultWatcher",
    "check_value",
    "env_var",
    "open_vault",
]
