"""The `env` backend: read-only values from ``KEYVEIL_SECRET_<NAME>`` (for CI).

``/`` in NAME is written ``__``, case is kept. It never writes anything, and
no message holds a value: errors name the variable only.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from .._errors import UsageError, ValueRefused, VaultUnavailable
from .._references import check_name
from . import _base
from ._base import LocalVault, SecretInfo, VaultSnapshot, check_value, checked_name

ENV_PREFIX = "KEYVEIL_SECRET_"


def env_var(name: str) -> str:
    """The environment variable the `env` backend reads NAME from."""
    return ENV_PREFIX + checked_name(name).replace("/", "__")


class EnvVault(LocalVault):
    """Read-only: ``KEYVEIL_SECRET_<NAME>`` with ``/`` written ``__``, case kept (for CI)."""

    backend = "env"

    def __init__(self) -> None:
        self._opened = _base.now()
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

