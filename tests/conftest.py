"""Shared fixtures: a real TLS upstream, a keyveil home, a real mitmdump running keyveil.

Secret values are generated per test run; nothing real-looking is committed.
"""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import infra

RULES = """\
version: 1
providers:
  builtin: true
secrets:
  github/pat:
    hosts: [api.github.com, github.com, "*.githubusercontent.com"]
    inject: [{header: Authorization}, {basic_auth: true}]
  anthropic/key:
    hosts: [api.anthropic.com]
    inject: [{header: x-api-key}]
  gitlab/token:
    hosts: [gitlab.test.keyveil]
    inject: [{query: private_token}, {body: true}, {path: true}]
  ws/token:
    hosts: [ws.test.keyveil]
    inject: [{websocket: true}]
  http/token:
    hosts: [example.com]
    inject: [{header: Authorization}]
policy:
  max_body_bytes: {max_body}
"""

MAX_BODY = 1 << 20  # small, so the streaming path is exercised by a few MiB


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(
        KEYVEIL_HOME=str(home),
        KEYVEIL_VAULT="file",
        PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring",
        PYTHONUNBUFFERED="1",
    )
    env.pop("KEYVEIL_PASSPHRASE", None)
    return env


def keyveil(env: dict[str, str], *args: str, stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "keyveil", *args], input=stdin, capture_output=True, env=env, timeout=timeout
    )


def fake_values() -> dict[str, bytes]:
    # Some with characters that JSON and percent-encoding escape.
    return {
        "github/pat": b"ghp_" + secrets.token_urlsafe(27).encode(),
        "anthropic/key": b"sk-ant-" + secrets.token_urlsafe(30).encode(),
        "gitlab/token": b"glpat/" + secrets.token_urlsafe(15).encode() + b"+=&",
        "ws/token": b"ws_" + secrets.token_hex(16).encode(),
        "http/token": b"ht_" + secrets.token_hex(16).encode(),
    }


@dataclass
class KeyveilSetup:
    home: Path
    env: dict[str, str]
    values: dict[str, bytes]
    outputs: list[bytes] = field(default_factory=list)

    def forms(self) -> list[bytes]:
        """Every value and its base64, the way tests grep outputs for leaks."""
        out = []
        for v in self.values.values():
            out += [v, base64.b64encode(v), base64.b64encode(v).rstrip(b"=")]
        return out


def make_home(tmp: Path, rules: str = RULES, max_body: int = MAX_BODY) -> KeyveilSetup:
    home = tmp / "home"
    env = base_env(home)
    setup = KeyveilSetup(home, env, fake_values())
    r = keyveil(env, "init")
    assert r.returncode == 0, r.stderr
    (home / "config" / "rules.yaml").write_text(rules.replace("{max_body}", str(max_body)))
    for name, value in setup.values.items():
        r = keyveil(env, "secret", "set", name, stdin=value + b"\n")
        assert r.returncode == 0, r.stderr
        setup.outputs += [r.stdout, r.stderr]
    return setup


def keyveil_proxy(upstream, workdir, setup: KeyveilSetup, *, before=(), options=None, **kwargs):
    """A mitmdump running keyveil (after the scripts in BEFORE) on SETUP's home, routed to UPSTREAM."""
    return infra.routed_proxy(
        upstream,
        workdir,
        scripts=[*before, infra.KEYVEIL_ADDON],
        options={"keyveil_home": setup.home, **(options or {})},
        env=setup.env,
        **kwargs,
    )


@pytest.fixture(scope="session")
def upstream():
    with infra.Upstream(infra.make_ca()) as up:
        yield up


@pytest.fixture
def up(upstream):
    upstream.reset()
    yield upstream
    assert upstream.errors == []


@pytest.fixture(scope="module")
def kv(tmp_path_factory) -> KeyveilSetup:
    return make_home(tmp_path_factory.mktemp("kv"))


@pytest.fixture(scope="module")
def proxy(kv, upstream, tmp_path_factory):
    """mitmdump -s addons/keyveil.py, routed to the local upstream, writing a flow file."""
    work = tmp_path_factory.mktemp("proxy")
    with keyveil_proxy(upstream, work, kv, flowfile=work / "flows.mitm", flow_detail=4) as p:
        yield p
