"""The errors keyveil raises, as a short typed hierarchy.

Every message says what happened, where, and what to do next. No message may
ever hold a secret value: callers pass names, hosts and paths, never values.
"""

from __future__ import annotations


class KeyveilError(Exception):
    """Base of every error keyveil raises on purpose."""

    #: process exit code the CLI uses for this error (SPEC §10)
    exit_code = 2


class UsageError(KeyveilError):
    """The user asked for something invalid (bad name, bad flag, short value)."""

    exit_code = 1


class RulesError(UsageError):
    """The rules file is invalid. Message form: ``FILE:LINE: FIELD: what is wrong``."""


class VaultError(KeyveilError):
    """The vault refused an operation."""


class VaultUnavailable(VaultError):
    """The vault cannot be read (missing key, wrong passphrase, corrupt file)."""


class ValueRefused(UsageError):
    """A secret value was refused at registration (too short, empty, ...)."""
