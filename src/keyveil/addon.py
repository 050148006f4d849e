"""Where `mitmdump -s addons/keyveil.py` and `keyveil start` find the addon (see ``keyveil.adapter``)."""

from .adapter import Keyveil, KeyveilInjector, KeyveilUnloaded

__all__ = ["Keyveil", "KeyveilInjector", "KeyveilUnloaded"]
