"""The mitmproxy adapter of keyveil, split by phase (request, response, WebSocket) around one scrub point."""

from ._addon import Keyveil, KeyveilInjector, KeyveilUnloaded

__all__ = ["Keyveil", "KeyveilInjector", "KeyveilUnloaded"]
