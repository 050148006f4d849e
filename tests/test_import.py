"""`keyveil secret import FILE [--dry-run]` and `keyveil --version`, run for real in subprocesses (SPEC §10).

Each test has its own KEYVEIL_HOME and HOME, the file vault with its key file
(no OS keyring), and a .env file of fake values built per run. Every output is
searched for every value, whole and in part.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from keyveil._rules import parse_rules
from keyveil._vault import open_vault
from tests.tokens import ALNUM, DIGITS, UPPER, rnd, samples

REPO = Path(__file__).resolve().parents[1]


class Home:
    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "kvhome"
        self.dir = tmp_path
        user_home = tmp_path / "user"
        user_home.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KEYVEIL_") and not k.lower().endswith("_proxy")}
        self.env.update(
            KEYVEIL_HOME=str(self.root),
            HOME=str(user_home),
            PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring",
            PYTHONUNBUFFERED="1",
        )
        self.values: list[str] = []
        self.outputs: list[str] = []

    def run(self, *args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "keyveil", *args], capture_output=True, text=True, env=self.env, timeout=60
        )
        self.outputs += [proc.stdout, proc.stderr]
        return proc

    def vault(self) -> dict[str, bytes]:
        return open_vault(self.root, "file").load().current

    def write_env(self, text: str, values: list[str]) -> Path:
        self.values += values
        path = self.dir / ".env"
        path.write_text(text)
        return path

    def assert_no_value_shown(self) -> None:
        assert self.values and self.outputs
        for value in self.values:
            raw = value.encode()
            forms = [value, base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode().rstrip("="), raw.hex()]
            # a piece of a value is a leak too: its random ends
            forms += [value[-12:], value[:12]] if len(value) >= 24 else []
            for form in forms:
                for i, out in enumerate(self.outputs):
                    assert form not in out, f"a value (or part of one) is in output #{i}"
        vault_file = self.root / "vault" / "vault.json"
        for path in self.root.rglob("*"):
            if path.is_file() and path != vault_file:
                data = path.read_bytes()
                assert not any(v.encode() in data for v in self.values), path


@pytest.fixture
def home(tmp_path: Path) -> Home:
    return Home(tmp_path)


def _fixture_env() -> tuple[str, dict[str, str], list[str]]:
    """A .env with every kind of entry; returns (text, expected name -> value, all values)."""
    github = "ghp_" + rnd(36)
    github_old = "ghp_" + rnd(36)
    anthropic = "sk-ant-api03-" + rnd(93, ALNUM + "-_") + "AA"
    password = rnd(20)
    aws_id = "AKIA" + rnd(16, UPPER + DIGITS)
    aws_secret = rnd(40, ALNUM + "/+")
    hook = f"T{rnd(8, UPPER)}/B{rnd(9, UPPER)}/{rnd(24)}"
    (_, pem), *_ = samples("private-key")
    escaped = rnd(12) + '"' + rnd(12)
    text = f"""\
# a project's environment
export GITHUB_TOKEN={github_old}
ANTHROPIC_API_KEY="{anthropic}"   # inline comment
DEBUG=true
API_URL=https://api.example.com/v1
DB_PASSWORD='{password}'
AWS_ACCESS_KEY_ID = {aws_id}
AWS_SECRET_ACCESS_KEY={aws_secret}\r
SLACK_WEBHOOK_URL=https://hooks.slack.com/services/{hook}
SECRET_KEY_PATH=/etc/app/secret.key # a path, not a secret
EMPTY_TOKEN=
SIGNING_KEY="{pem}"
QUOTED_SECRET="{escaped.replace('"', '\\"')}"
this line is not an assignment
GITHUB_TOKEN={github}
"""
    expected = {
        "env/github_token": github,
        "env/anthropic_api_key": anthropic,
        "env/db_password": password,
        "env/aws_access_key_id": aws_id,
        "env/aws_secret_access_key": aws_secret,
        "env/slack_webhook_url": hook,
        "env/signing_key": pem,
        "env/quoted_secret": escaped,
    }
    return text, expected, [github, github_old, anthropic, password, aws_id, aws_secret, hook, pem, escaped]


def _line(text: str, start: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(start))


def test_import_registers_secret_looking_entries_and_proposes_bindings(home: Home):
    text, expected, values = _fixture_env()
    env_file = home.write_env(text, values)
    r = home.run("secret", "import", str(env_file))
    assert r.returncode == 0, r.stderr
    assert {k: v.decode() for k, v in home.vault().items()} == expected
    out = r.stdout
    for name, kind in [
        ("env/github_token", "github-pat"),
        ("env/anthropic_api_key", "anthropic-api-key"),
        ("env/db_password", "secret-looking name"),
        ("env/aws_access_key_id", "aws-access-key"),
        ("env/aws_secret_access_key", "aws-secret-key"),
        ("env/slack_webhook_url", "slack-webhook, the token inside the value"),
        ("env/signing_key", "private-key"),
    ]:
        assert re.search(rf"registered\s+{re.escape(name)}\s+line \d+: \S+ \({re.escape(kind)}\)", out), name
    for variable, reason in [
        ("DEBUG", "does not look like a secret"),
        ("API_URL", "does not look like a secret"),
        ("SECRET_KEY_PATH", "a path"),
        ("EMPTY_TOKEN", "empty"),
        ("GITHUB_TOKEN", f"set again on line {_line(text, 'GITHUB_TOKEN=' + expected['env/github_token'])}"),
    ]:
        assert re.search(rf"skipped\s+{variable}\s+line \d+: {reason}", out), variable
    assert re.search(rf"skipped\s+-\s+line {_line(text, 'this line is not')}: not NAME=VALUE", out)

    # The proposal is a valid rules.yaml section: a ghp_ token goes to GitHub, with Basic for git.
    snippet = out.split("then run keyveil rules check\n", 1)[1].split("\nno binding", 1)[0]
    proposed = yaml.safe_load(snippet)["secrets"]
    assert proposed["env/github_token"] == {
        "hosts": ["api.github.com", "github.com"],
        "inject": [{"header": "Authorization"}, {"basic_auth": True}],
    }
    assert proposed["env/anthropic_api_key"] == {"hosts": ["api.anthropic.com"], "inject": [{"header": "x-api-key"}]}
    assert proposed["env/slack_webhook_url"]["inject"] == [{"path": True}]
    assert "env/aws_access_key_id" not in proposed and "env/db_password" not in proposed
    rules = parse_rules(yaml.safe_dump({"version": 1, "secrets": proposed}), "proposal.yaml")
    assert set(rules.names()) == set(proposed)
    assert "no binding proposed for env/db_password" in out
    assert "{{secret:env/" in out
    home.assert_no_value_shown()


def test_dry_run_shows_the_plan_and_stores_nothing(home: Home):
    text, expected, values = _fixture_env()
    env_file = home.write_env(text, values)
    r = home.run("secret", "import", "--dry-run", str(env_file))
    assert r.returncode == 0, r.stderr
    assert "would register" in r.stdout and "registered " not in r.stdout
    assert all(f"would register {name}" in re.sub(r"\s+", " ", r.stdout) for name in expected)
    assert "nothing was stored" in r.stdout
    assert home.vault() == {}
    home.assert_no_value_shown()


def test_importing_again_reports_unchanged_and_replaced_values(home: Home):
    token, newer = "npm_" + rnd(36), "npm_" + rnd(36)
    password = rnd(24)
    env_file = home.write_env(f"NPM_TOKEN={token}\nSERVICE_PASSWORD={password}\n", [token, newer, password])
    assert home.run("secret", "import", str(env_file)).returncode == 0
    env_file.write_text(f"NPM_TOKEN={newer}\nSERVICE_PASSWORD={password}\n")
    r = home.run("secret", "import", str(env_file))
    assert r.returncode == 0, r.stderr
    assert re.search(r"replaced\s+env/npm_token", r.stdout) and re.search(r"unchanged\s+env/service_password", r.stdout)
    assert "stays sealed" in r.stdout
    assert home.vault()["env/npm_token"] == newer.encode()
    versions = {i.name: i.versions for i in open_vault(home.root, "file").info()}
    assert versions["env/npm_token"] == 2  # the old value is kept, sealed, for 30 days
    home.assert_no_value_shown()


def test_a_name_already_bound_in_the_rules_gets_no_proposal(home: Home):
    assert home.run("init").returncode == 0
    rules = home.root / "config" / "rules.yaml"
    rules.write_text("version: 1\nsecrets:\n  env/github_token:\n    hosts: [api.github.com]\n    inject: [{header: Authorization}]\n")
    token = "ghp_" + rnd(36)
    env_file = home.write_env(f"GITHUB_TOKEN={token}\n", [token])
    r = home.run("secret", "import", str(env_file))
    assert r.returncode == 0, r.stderr
    assert f"already bound in {rules}: env/github_token" in r.stdout
    assert "Proposed bindings" not in r.stdout
    home.assert_no_value_shown()


def test_a_file_with_nothing_secret_registers_nothing(home: Home):
    env_file = home.write_env("DEBUG=1\nLOG_LEVEL=info\nTOKEN_URL=https://example.com/token\n", ["https://example.com/token"])
    r = home.run("secret", "import", str(env_file))
    assert r.returncode == 0 and "nothing to register" in r.stdout
    assert re.search(r"skipped\s+TOKEN_URL\s+line 3: a URL", r.stdout)
    assert home.vault() == {}


@pytest.mark.parametrize(
    "content, message",
    [(None, "cannot read"), (b"TOKEN=\xff\xfe" + b"x" * 20 + b"\n", "is not UTF-8 text")],
    ids=["missing", "not-utf8"],
)
def test_an_unreadable_file_is_a_usage_error(home: Home, content, message):
    path = home.dir / "x.env"
    if content is not None:
        path.write_bytes(content)
    r = home.run("secret", "import", str(path))
    assert r.returncode == 1 and message in r.stderr and str(path) in r.stderr
    assert r.stdout == ""


def test_an_unclosed_quote_is_reported_by_line_without_its_text(home: Home):
    value = rnd(30)
    env_file = home.write_env(f"FIRST_TOKEN={rnd(2)}\nBROKEN_SECRET=\"{value}\nLATER_KEY={value}x\n", [value])
    r = home.run("secret", "import", str(env_file))
    assert r.returncode == 0, r.stderr
    assert "line 2: the quoted value of BROKEN_SECRET is never closed" in r.stdout
    home.assert_no_value_shown()


def test_version(home: Home):
    r = home.run("--version")
    assert r.returncode == 0
    assert re.fullmatch(r"keyveil \d+\.\d+\.\d+\S*\n", r.stdout)
    from importlib.metadata import version

    assert version("keyveil") in r.stdout
