"""Transition shim: the vault is now the package ``keyveil.vault``.

Kept so that code written against ``keyveil._vault`` still imports; new code
imports from ``keyveil.vault``. Remove once no branch imports it.
"""

from __future__ import annotations

from .vault import *  # noqa: F403
from .vault import __all__  # noqa: F401
