"""Values nobody registered, end to end (issue 11 points 2, 3 and 6; SPEC §3a, §10).

A real mitmdump runs keyveil in front of a real TLS upstream that plays every
host (the mock Anthropic endpoint, api.github.com, others); clients are httpx
and curl; `keyveil secret adopt` runs as a subprocess. Token-shaped values are
built per test from random pieces (tests/tokens.py). Every output — the
upstream's bytes, the responses, the audit log, the flow file, the proxy's
console — is searched for every value, raw and base64.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from urllib.parse import quote

import httpx
import pytest

from tests import infra
from tests.conftest import keyveil, keyveil_proxy, make_home
from tests.tokens import ALNUM, B64URL, rnd, samples, seeded_tokens  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(120)

RULES = """\
version: 1
providers:
  builtin: true
secrets:
  github/token:
    hosts: [api.github.com]
    inject: [{header: Authorization}]
policy:
  detected: {policy}
"""
DETECTED = re.compile(rb"\{\{secret:(detected/[a-z0-9-]+-[a-z2-7]{16})\}\}")


def _setup(tmp_path, policy: str = "seal"):
    setup = make_home(tmp_path, RULES.replace("{policy}", policy))
    setup.values = {}  # nothing registered: every value here is one keyveil must find itself
    return setup


@pytest.fixture
def kvd(tmp_path, upstream):
    upstream.reset()
    setup = _setup(tmp_path)
    work = tmp_path / "proxy"
    work.mkdir()
    with keyveil_proxy(upstream, work, setup, flowfile=work / "flows.mitm", flow_detail=4) as proxy:
        yield setup, proxy, upstream, work
    assert upstream.errors == []


def _client(proxy) -> httpx.Client:
    return httpx.Client(proxy=proxy.url, verify=infra.client_ssl_context(proxy.ca_cert), trust_env=False, timeout=20)


def _curl(proxy, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["curl", "-sS", "-i", "--max-time", "20", "--cacert", str(proxy.ca_cert), "-x", proxy.url, *args],
        capture_output=True, timeout=30, env=proxy.client_env(),
    )  # fmt: skip


def _env_file() -> tuple[str, dict[str, str]]:
    """What `cat .env` prints in a project: tokens of several kinds, and a random password."""
    values = {
        "github": samples("github-pat")[0][1],
        "openai": samples("openai-project-key")[0][1],
        "aws_id": "AKIA" + rnd(16, "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"),
        "aws_secret": rnd(40, ALNUM + "/+"),
        "stripe": samples("stripe-secret-key")[0][1],
        "password": rnd(32, ALNUM),
    }
    text = (
        "# local settings\n"
        f"GITHUB_TOKEN={values['github']}\n"
        f"OPENAI_API_KEY={values['openai']}\n"
        f"AWS_ACCESS_KEY_ID={values['aws_id']}\n"
        f"AWS_SECRET_ACCESS_KEY={values['aws_secret']}\n"
        f'STRIPE_SECRET_KEY="{values["stripe"]}"\n'
        f"DB_PASSWORD={values['password']}\n"
        "DEBUG=true\nPORT=8080\n"
    )
    return text, values


def _messages(tool_output: str, ascii_only: bool = False) -> bytes:
    """An Anthropic Messages request whose last turn is a tool result (the harness ran `cat .env`)."""
    doc = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "messages": [
            {"role": "user", "content": "what is configured in this project?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "cat .env"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": tool_output}]},
        ],
    }  # fmt: skip
    text = json.dumps(doc, ensure_ascii=ascii_only)
    return text.replace("/", "\\/").encode() if ascii_only else text.encode()


def _forms(value: str) -> list[bytes]:
    v = value.encode()
    return [v, base64.b64encode(v).rstrip(b"="), quote(value, safe="").encode(), json.dumps(value)[1:-1].replace("/", "\\/").encode()]


def _outputs(setup, proxy, work) -> dict[str, bytes]:
    proxy.stop()
    return {
        "audit": b"".join(p.read_bytes() for p in (setup.home / "audit").glob("*.jsonl")),
        "flow file": (work / "flows.mitm").read_bytes(),
        "console": proxy.stdout_path.read_bytes() + proxy.stderr_path.read_bytes(),
    }


def _audit(setup) -> list[dict]:
    return [json.loads(line) for p in (setup.home / "audit").glob("*.jsonl") for line in p.read_text().splitlines()]


def _assert_nowhere(values, *blobs: bytes, where: str = "") -> None:
    for value in values:
        for form in _forms(value):
            for blob in blobs:
                assert form not in blob, f"a detected value reached {where or 'an output'}"


# --- point 6: a harness-like flow through a real proxy ------------------------------------


def test_cat_env_in_a_tool_result_reaches_the_provider_sealed_and_comes_back_as_the_same_reference(kvd):
    setup, proxy, up, work = kvd
    env_text, values = _env_file()
    harness_key = "sk-ant-api03-" + rnd(93, B64URL) + "AA"  # the harness's own credential, not registered
    with _client(proxy) as c:
        turns = []
        for ascii_only in (False, True):  # the second turn JSON-escapes '/' (and would \u-escape non-ASCII)
            r = c.post(
                "https://api.anthropic.com/v1/messages",
                content=_messages(env_text, ascii_only),
                headers={"content-type": "application/json", "x-api-key": harness_key, "anthropic-version": "2023-06-01"},
            )
            assert r.status_code == 200, r.text
            turns.append(r.content)
    first, second = up.requests
    # Sealed on the way to the provider, in every form, every kind
    _assert_nowhere(values.values(), first.body, second.body, where="the provider")
    refs_first = DETECTED.findall(first.body)
    kinds = {ref.decode().split("/", 1)[1].rsplit("-", 1)[0] for ref in refs_first}
    assert {"github-pat", "openai-project-key", "aws-access-key", "aws-secret-key", "stripe-secret-key", "assignment"} <= kinds
    # Stable references: the next turn carries the same ones (the history stays the same)
    assert sorted(set(DETECTED.findall(second.body.replace(b"\\/", b"/")))) == sorted(set(refs_first))
    # The rest of the body is untouched, and the carrier still valid JSON
    doc = json.loads(first.body)
    assert doc["messages"][2]["content"][0]["content"].startswith("# local settings\nGITHUB_TOKEN={{secret:detected/github-pat-")
    assert "DEBUG=true\nPORT=8080\n" in doc["messages"][2]["content"][0]["content"]
    # The harness's own credential header went as it came (keyveil does not break the harness's login)
    assert first.header("x-api-key") == harness_key
    # The provider's echo comes back as the same references, never a value
    for body in turns:
        _assert_nowhere(values.values(), body, where="the client")
        assert set(DETECTED.findall(body.replace(b"\\/", b"/"))) >= set(refs_first)
    # Audit: `detected` with the kind in the name, `sealed`; never a value; the flow file and console too
    outputs = _outputs(setup, proxy, work)
    _assert_nowhere(values.values(), *outputs.values(), where="an output")
    audit = _audit(setup)
    detected = [a for a in audit if a["action"] == "detected"]
    assert detected and {n for a in detected for n in a["names"]} == {r.decode() for r in refs_first}
    assert any(a["action"] == "sealed" and a["host"] == "api.anthropic.com" for a in audit)
    # Remembered in the vault, marked as detected
    listed = keyveil(setup.env, "secret", "list")
    assert listed.returncode == 0
    for ref in refs_first:
        assert ref in listed.stdout


def test_a_detected_value_is_sealed_in_every_form_from_then_on_and_scrubbed(kvd):
    setup, proxy, up, _ = kvd
    token = samples("gitlab-pat")[0][1]
    with _client(proxy) as c:
        r = c.post("https://api.anthropic.com/v1/messages", json={"messages": [{"role": "user", "content": f"token {token}"}]})
        assert r.status_code == 200
        (ref,) = set(DETECTED.findall(up.requests[0].body))
        up.clear()
        # Forms the detector alone would not take for a token: glued to other letters, in
        # base64 at an odd offset, percent-encoded in a query: the sealer knows the value now.
        glued = f"xyz{token}abc"
        b64 = base64.b64encode(b"k:" + token.encode()).decode()
        r = c.post(
            "https://api.openai.com/v1/responses?note=" + quote(token, safe=""),
            json={"input": [glued, b64, token]},
        )
        assert r.status_code == 200
        (rec,) = up.requests
        wire = rec.path.encode() + rec.body
        _assert_nowhere([token], wire, where="the provider")
        assert ref in wire or quote(ref.decode(), safe="").encode() in wire
        # Toward a host that is not a provider it goes as it came ...
        up.clear()
        r = c.post("https://reflect.test.keyveil/reflect", content=f"deploy {token}".encode(), headers={"content-type": "text/plain"})
        assert up.requests[0].body == f"deploy {token}".encode()
        # ... and what comes back is scrubbed: the value returns as its reference
        assert token.encode() not in r.content and b"{{secret:" + ref + b"}}" in r.content
    proxy.stop()
    audit = _audit(setup)
    assert any(a["action"] == "detected" and a["host"] == "reflect.test.keyveil" for a in audit)
    assert any(a["action"] == "scrubbed" and ref.decode() in a["names"] for a in audit)


def test_toward_other_hosts_detection_only_audits(kvd):
    setup, proxy, up, _ = kvd
    token = samples("npm-token")[0][1]
    with _client(proxy) as c:
        r = c.put("https://registry.test.keyveil/-/package", content=f'{{"token": "{token}"}}'.encode())
        assert r.status_code == 200
    assert up.requests[0].body == f'{{"token": "{token}"}}'.encode()
    proxy.stop()
    detected = [a for a in _audit(setup) if a["action"] == "detected"]
    assert [a["host"] for a in detected] == ["registry.test.keyveil"]
    assert detected[0]["names"][0].startswith("detected/npm-token-")
    assert token.encode() not in keyveil(setup.env, "secret", "list").stdout
    # Not remembered: nothing of it is in the vault
    assert detected[0]["names"][0].encode() not in keyveil(setup.env, "secret", "list").stdout


def test_one_real_token_among_1000_decoys_is_sealed(kvd):
    _, proxy, up, _ = kvd
    decoys = [("ghp_" + rnd(35), "AKIA" + rnd(15), "sk-" + rnd(47), "glpat-" + rnd(10), "api_key=my_application_key")[i % 5] for i in range(1000)]
    real = samples("github-pat")[0][1]
    decoys.insert(613, real)
    with _client(proxy) as c:
        r = c.post("https://api.anthropic.com/v1/messages", json={"messages": [{"role": "user", "content": " ".join(decoys)}]})
        assert r.status_code == 200
    body = up.requests[0].body
    assert real.encode() not in body
    assert [k.split(b"/")[1].rsplit(b"-", 1)[0] for k in DETECTED.findall(body)] == [b"github-pat"]
    assert body.count(b"ghp_") == 200  # every decoy went as it was


# --- point 3: adopt, then use it ------------------------------------------------------------


def test_after_adopt_and_a_binding_curl_with_the_detected_reference_gets_the_value_injected(kvd):
    setup, proxy, up, work = kvd
    env_text, values = _env_file()
    token = values["github"]
    with _client(proxy) as c:
        r = c.post("https://api.anthropic.com/v1/messages", content=_messages(env_text), headers={"content-type": "application/json"})
        assert r.status_code == 200
    ref = next(m for m in DETECTED.findall(up.requests[0].body) if m.startswith(b"detected/github-pat-")).decode()
    up.clear()
    # Before adopt: never injected; the block says how to use it
    r = _curl(proxy, "-H", f"Authorization: token {{{{secret:{ref}}}}}", "https://api.github.com/user")
    assert b"x-keyveil-block: unbound_reference" in r.stdout.lower() and up.requests == []
    assert f"keyveil secret adopt {ref}".encode() in r.stdout
    # Adopt it under the name rules.yaml binds to api.github.com
    adopted = keyveil(setup.env, "secret", "adopt", ref, "github/token")
    assert adopted.returncode == 0, adopted.stderr
    assert b"adopted " + ref.encode() + b" as github/token" in adopted.stdout
    assert b"alias" in adopted.stdout
    _assert_nowhere([token], adopted.stdout, adopted.stderr, where="adopt's output")
    # Either reference is injected where github/token is bound
    for reference in (ref, "github/token"):
        r = _curl(proxy, "-H", f"Authorization: token {{{{secret:{reference}}}}}", "https://api.github.com/user")
        assert r.returncode == 0, r.stderr
        assert up.requests[-1].header("authorization") == f"token {token}", reference
        assert token.encode() not in r.stdout  # the echo comes back sealed
    # The old reference in the agent's history toward the provider is still plain text, the value still sealed
    up.clear()
    with _client(proxy) as c:
        r = c.post("https://api.anthropic.com/v1/messages", content=_messages(env_text), headers={"content-type": "application/json"})
    assert token.encode() not in up.requests[0].body and b"{{secret:github/token}}" in up.requests[0].body
    outputs = _outputs(setup, proxy, work)
    _assert_nowhere(values.values(), *outputs.values(), where="an output")


def test_adopt_explains_what_it_needs(tmp_path):
    setup = _setup(tmp_path)
    for args, message in (
        (("github/pat", "x/y"), b"is not a detected value's name"),
        (("detected/github-pat-aaaaaaaaaaaaaaaa", "detected/x"), b"pick another NAME"),
        (("detected/github-pat-aaaaaaaaaaaaaaaa", "github/pat"), b"holds no detected value named"),
    ):
        r = keyveil(setup.env, "secret", "adopt", *args)
        assert r.returncode == 1 and message in r.stderr, r.stderr


# --- policy.detected --------------------------------------------------------------------------


def test_policy_detected_block_refuses_the_request(tmp_path, upstream):
    upstream.reset()
    setup = _setup(tmp_path, "block")
    token = samples("github-pat")[0][1]
    with keyveil_proxy(upstream, tmp_path, setup) as proxy, _client(proxy) as c:
        r = c.post("https://api.anthropic.com/v1/messages", json={"messages": [{"role": "user", "content": token}]})
        assert r.status_code == 403 and r.headers["x-keyveil-block"] == "plaintext_egress"
        message = r.json()["error"]["message"]
        assert "keyveil secret adopt detected/github-pat-" in message and "policy.detected" in message
        assert token not in r.text and upstream.requests == []
        # A request without one goes through
        assert c.post("https://api.anthropic.com/v1/messages", json={"messages": []}).status_code == 200


def test_policy_detected_off_sends_it_as_it_came(tmp_path, upstream):
    upstream.reset()
    setup = _setup(tmp_path, "off")
    token = samples("github-pat")[0][1]
    with keyveil_proxy(upstream, tmp_path, setup) as proxy, _client(proxy) as c:
        assert c.post("https://api.anthropic.com/v1/messages", json={"content": token}).status_code == 200
    assert token.encode() in upstream.requests[0].body
    assert not [a for a in _audit(setup) if a["action"] == "detected"]


def test_detected_ids_survive_a_restart(tmp_path, upstream):
    upstream.reset()
    setup = _setup(tmp_path)
    token = samples("slack-bot-token")[0][1]
    refs = []
    for _ in range(2):
        with keyveil_proxy(upstream, tmp_path, setup) as proxy, _client(proxy) as c:
            assert c.post("https://api.anthropic.com/v1/messages", json={"content": token}).status_code == 200
        refs.append(DETECTED.findall(upstream.requests[-1].body))
    assert refs[0] == refs[1] and len(refs[0]) == 1
    key = setup.home / "vault" / "detection-key"
    assert key.stat().st_mode & 0o777 == 0o600
