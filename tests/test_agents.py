"""Agents (SPEC §4 `agents:`): one proxy, several agents, each with its own secrets.

Real mitmdump running keyveil on a file vault; real clients authenticating with
proxy credentials (username = agent name, password = the vault's agents/NAME).
Each agent is refused the other's secret (unbound_reference), sealing still
covers every value, audit lines name the agent, and `keyveil run --agent` gives
CMD the agent's credentials. Passwords are generated per run and grepped for.
"""

from __future__ import annotations

import base64
import json
import secrets
import sys
import time
from urllib.parse import quote

import httpx
import pytest

from keyveil._pipeline import Engine, Request
from keyveil._rules import parse_rules
from keyveil.vault import VaultSnapshot
from tests import infra
from tests.conftest import keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(90)

RULES = """\
version: 1
providers:
  builtin: true
secrets:
  github/pat:
    hosts: [api.github.com]
    inject: [{header: Authorization}]
  gitlab/token:
    hosts: [gitlab.test.keyveil]
    inject: [{header: Authorization}]
agents:
  alice:
    secrets: [github/pat]
  bob:
    secrets: [gitlab/token]
policy:
  max_body_bytes: {max_body}
"""


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    setup = make_home(tmp_path_factory.mktemp("agents"), RULES)
    setup.passwords = {}
    for agent in ("alice", "bob"):
        # characters a URL's userinfo must percent-encode
        password = f"pw-{secrets.token_urlsafe(18)}:@/%".encode()
        r = keyveil(setup.env, "secret", "set", f"agents/{agent}", stdin=password)
        assert r.returncode == 0, r.stderr
        assert b"not bound" not in r.stdout  # a proxy password is not a secret to bind
        setup.passwords[agent] = password
        setup.values[f"agents/{agent}"] = password
        setup.outputs += [r.stdout, r.stderr]
    return setup


@pytest.fixture(scope="module")
def proxy(team, upstream, tmp_path_factory):
    work = tmp_path_factory.mktemp("agents-proxy")
    with keyveil_proxy(upstream, work, team, flowfile=work / "flows.mitm") as p:
        yield p


def as_agent(proxy, team, agent: str | None, password: bytes | None = None) -> httpx.Client:
    url = proxy.url
    if agent is not None:
        secret = team.passwords[agent] if password is None else password
        url = url.replace("http://", f"http://{quote(agent, safe='')}:{quote(secret, safe='')}@")
    return httpx.Client(proxy=url, verify=infra.client_ssl_context(proxy.ca_cert), trust_env=False, timeout=20)


def audit(home) -> list[dict]:
    time.sleep(0.7)  # the audit log is flushed twice a second
    return [json.loads(line) for f in sorted((home / "audit").glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_two_agents_on_one_proxy_each_refused_the_others_secret(proxy, up, team):
    pat, tok = team.values["github/pat"], team.values["gitlab/token"]
    with as_agent(proxy, team, "alice") as alice, as_agent(proxy, team, "bob") as bob:
        r = alice.get("https://api.github.com/alice", headers={"authorization": "Bearer {{secret:github/pat}}"})
        assert r.status_code == 200
        assert up.requests[-1].header("authorization") == "Bearer " + pat.decode()
        assert up.requests[-1].header("proxy-authorization") is None
        r = bob.get("https://gitlab.test.keyveil/bob", headers={"authorization": "Bearer {{secret:gitlab/token}}"})
        assert r.status_code == 200
        assert up.requests[-1].header("authorization") == "Bearer " + tok.decode()
        n = len(up.requests)

        # Each is refused the other's secret, toward the very host it is bound to.
        for client, agent, host, name in ((alice, "alice", "gitlab.test.keyveil", "gitlab/token"), (bob, "bob", "api.github.com", "github/pat")):
            r = client.get(f"https://{host}/other", headers={"authorization": "Bearer {{secret:%s}}" % name})
            assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "unbound_reference"), r.text
            message = r.json()["error"]["message"]
            assert f"agent {agent} may not use {name}" in message and f"agents.{agent}.secrets" in message
        # Holding the other's value does not help: it is sealed, and then not bound for this agent.
        r = bob.get("https://api.github.com/raw", headers={"authorization": "Bearer " + pat.decode()})
        assert r.headers.get("x-keyveil-block") == "plaintext_egress"
        assert len(up.requests) == n
        # Sealing covers every value, whoever sends it.
        r = bob.post("https://api.anthropic.com/v1/messages", json={"a": pat.decode(), "b": tok.decode()})
        assert r.status_code == 200
        assert pat not in up.requests[-1].body and tok not in up.requests[-1].body
    records = audit(team.home)
    injected = {(a["agent"], a["host"]) for a in records if a["action"] == "injected"}
    assert {("alice", "api.github.com"), ("bob", "gitlab.test.keyveil")} <= injected
    blocked = {(a["agent"], a["code"]) for a in records if a["action"] == "blocked"}
    assert {("alice", "unbound_reference"), ("bob", "unbound_reference"), ("bob", "plaintext_egress")} <= blocked
    assert all("agent" in a for a in records)


def test_no_wrong_or_unknown_credentials_get_407(proxy, up, team):
    n = len(up.requests)
    wrong = b"pw-" + secrets.token_urlsafe(18).encode()
    for agent, password in ((None, None), ("alice", wrong), ("mallory", wrong), ("alice", team.passwords["bob"])):
        with as_agent(proxy, team, agent, password) as c:
            with pytest.raises(httpx.ProxyError, match="407"):
                c.get("https://api.github.com/x", headers={"authorization": "Bearer {{secret:github/pat}}"})
    # A plain-HTTP proxy request (absolute form) is authenticated on its own.
    r = httpx.get("http://example.com/x", proxy=proxy.url, trust_env=False, timeout=20)
    assert r.status_code == 407 and "proxy-authenticate" in r.headers
    assert "agents: in rules.yaml" in r.json()["error"]["message"] and "--agent" in r.json()["error"]["message"]
    auth = "Basic " + base64.b64encode(b"bob:" + team.passwords["bob"]).decode()
    r = httpx.get("http://gitlab.test.keyveil/x", proxy=proxy.url, trust_env=False, timeout=20, headers={"proxy-authorization": auth})
    assert r.status_code != 407
    assert len(up.requests) <= n + 1 and all(rec.header("proxy-authorization") is None for rec in up.requests[n:])
    out = proxy.output()
    assert "wrong password for agent alice" in out and "name no agent" in out
    assert "mallory" not in out  # a name that is no agent is not echoed
    for password in (*team.passwords.values(), wrong):
        for form in (password, base64.b64encode(password), quote(password, safe="").encode()):
            assert form not in out.encode()


def test_keyveil_run_as_an_agent(team):
    """`keyveil run --agent NAME` gives CMD the agent's proxy credentials: its private
    proxy accepts them (CONNECT 200) and refuses a client without them (407)."""
    script = (
        "import base64, os, socket, urllib.parse\n"
        "u = urllib.parse.urlsplit(os.environ['HTTPS_PROXY'])\n"
        "cred = base64.b64encode((urllib.parse.unquote(u.username) + ':' + urllib.parse.unquote(u.password)).encode()).decode()\n"
        "for auth in (cred, None):\n"
        "    s = socket.create_connection((u.hostname, u.port), timeout=10)\n"
        "    head = 'CONNECT 127.0.0.1:9 HTTP/1.1\\r\\nHost: 127.0.0.1:9\\r\\n'\n"
        "    head += ('Proxy-Authorization: Basic ' + cred + '\\r\\n') if auth else ''\n"
        "    s.sendall((head + '\\r\\n').encode())\n"
        "    print(s.recv(200).split(b'\\r\\n')[0].decode(), u.username)\n"
        "    s.close()\n"
    )
    r = keyveil(team.env, "run", "--agent", "alice", "--", sys.executable, "-c", script, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    assert lines[0].split()[1] == "200" and lines[0].endswith(" alice"), lines
    assert lines[1].split()[1] == "407", lines
    # Without --agent, or for an agent that is not in the rules, CMD does not run.
    r = keyveil(team.env, "run", "--", sys.executable, "-c", "print('ran')")
    assert r.returncode == 1 and b"--agent NAME" in r.stderr and b"ran" not in r.stdout
    r = keyveil(team.env, "run", "--agent", "mallory", "--", sys.executable, "-c", "print('ran')")
    assert r.returncode == 1 and b"no such agent" in r.stderr
    r = keyveil(team.env, "rules", "check")
    assert r.returncode == 0 and b"AGENT" in r.stdout and b"alice  github/pat" in r.stdout


def test_an_agent_is_unbound_in_the_pipeline_without_a_proxy():
    """The sans-IO core: no agent with agents: in the rules injects nothing (fail closed)."""
    rules = parse_rules(RULES.replace("{max_body}", "1048576"), "rules.yaml")
    pat = b"ghp_" + secrets.token_urlsafe(20).encode()
    engine = Engine(rules, VaultSnapshot({"github/pat": pat}))

    def send(agent):
        req = Request("GET", "https", "api.github.com", 443, b"/", None, [(b"authorization", b"Bearer {{secret:github/pat}}")], None, agent=agent)
        return engine.process_request(req)

    assert send("alice").injected == {"github/pat": 1}
    for agent in ("bob", None):
        out = send(agent)
        assert out.block is not None and out.block.code == "unbound_reference" and not out.injected


def test_zz_no_password_or_value_in_any_output(proxy, team):
    blobs = [proxy.output().encode(), (proxy.flowfile).read_bytes() if proxy.flowfile.exists() else b"", *team.outputs]
    blobs += [f.read_bytes() for f in (team.home / "audit").glob("*")]
    for blob in blobs:
        for form in team.forms():
            assert form not in blob
