"""Agents (SPEC §4 `agents:`): which agent is talking to the proxy.

With `agents:` in rules.yaml every client authenticates to the proxy with
HTTP proxy authentication (Basic): the username is the agent's name, the
password is the vault's value of ``agents/NAME`` (never in rules.yaml).
The pipeline then injects, for that agent, only the secrets it lists.

Pure functions over the rules and the vault's current values; nothing here
touches mitmproxy. No message ever holds a password, nor a username that
is not an agent of the rules file (it could be anything a client sent).
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Mapping
from urllib.parse import quote

from ._errors import UsageError
from ._rules import CompiledRules

PASSWORD_PREFIX = "agents/"
REALM = "keyveil"


def password_name(agent: str) -> str:
    """The vault name that holds AGENT's proxy password."""
    return PASSWORD_PREFIX + agent


class AuthRequired(Exception):
    """The client did not prove it is an agent; the message says what to do."""


def authenticate(rules: CompiledRules, values: Mapping[str, bytes], header: str | None) -> str:
    """The agent a ``Proxy-Authorization`` header proves, or AuthRequired."""
    agents = rules.agents or {}
    how = "`keyveil run --agent NAME -- CMD` sets them, or use http://NAME:PASSWORD@ as the proxy URL"
    if not header:
        raise AuthRequired(
            f"this keyveil proxy serves named agents (agents: in rules.yaml): authenticate as one of "
            f"them with proxy credentials; {how}"
        )
    scheme, _, encoded = header.strip().partition(" ")
    try:
        if scheme.lower() != "basic":
            raise ValueError
        user, sep, password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
        if not sep:
            raise ValueError
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise AuthRequired(f"keyveil takes Basic proxy credentials (agent name and password); {how}") from None
    if user not in agents:
        raise AuthRequired(f"the proxy credentials name no agent of rules.yaml (agents: {', '.join(sorted(agents)) or 'none'})")
    expected = values.get(password_name(user))
    if expected is None:
        raise AuthRequired(
            f"agent {user} has no password in the vault: run `keyveil secret set {password_name(user)}`"
        )
    if not hmac.compare_digest(password.encode("utf-8"), expected):
        raise AuthRequired(f"wrong password for agent {user} (the vault's {password_name(user)})")
    return user


def agent_password(rules: CompiledRules, values: Mapping[str, bytes], agent: str) -> bytes:
    """AGENT's proxy password, for `keyveil run --agent`; UsageError saying why there is none."""
    if rules.agents is None:
        raise UsageError("--agent: the rules file names no agents (agents: in rules.yaml, SPEC §4)")
    if agent not in rules.agents:
        raise UsageError(f"--agent {agent}: no such agent in rules.yaml (agents: {', '.join(sorted(rules.agents)) or 'none'})")
    password = values.get(password_name(agent))
    if password is None:
        raise UsageError(f"agent {agent} has no password in the vault: run `keyveil secret set {password_name(agent)}`")
    return password


def with_credentials(proxy_url: str, agent: str, password: bytes) -> str:
    """PROXY_URL with the agent's credentials in it (percent-encoded userinfo)."""
    scheme, _, rest = proxy_url.partition("://")
    return f"{scheme}://{quote(agent, safe='')}:{quote(password, safe='')}@{rest}"
