"""The `keyveil` command, run for real in a subprocess (SPEC §9–§10).

Each test gets its own KEYVEIL_HOME and HOME, the file vault with the key
file source (no OS keyring), and fake values generated per run. Every test
that stores values ends by checking that no value, nor its base64, is in any
file of the home (the encrypted vault file aside) or in any output captured.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from cryptography import x509

from keyveil.vault import open_vault

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_RULES = REPO / "config" / "rules.example.yaml"

# A rules file whose only problem is on line 4, field secrets.github/pat.hosts.
BAD_RULES = "version: 1\nsecrets:\n  github/pat:\n    hosts: []\n    inject: [{header: Authorization}]\n"
BAD_RULES_LINE, BAD_RULES_FIELD = 4, "secrets.github/pat.hosts"
FILE_LINE_FIELD = re.compile(r"(?P<file>\S+\.yaml):(?P<line>\d+): (?P<field>[^\s:]+):")


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class KV:
    """One home, the command run against it, and everything it printed."""

    def __init__(self, tmp_path: Path) -> None:
        self.home = tmp_path / "kvhome"
        self.user_home = tmp_path / "userhome"
        self.user_home.mkdir()
        self.values: list[bytes] = []
        self.outputs: list[bytes] = []
        env = {k: v for k, v in os.environ.items() if not k.startswith("KEYVEIL_")}
        for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy"):
            env.pop(var, None)
        env.update(
            KEYVEIL_HOME=str(self.home),
            HOME=str(self.user_home),
            PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring",
            PYTHONUNBUFFERED="1",
        )
        self.env = env

    def new_value(self) -> str:
        value = secrets.token_urlsafe(24)
        self.remember(value)
        return value

    def remember(self, value: str) -> None:
        self.values.append(value.encode())

    def __call__(self, *args: str, input: bytes | str | None = None, env: dict | None = None, timeout: float = 30):
        if isinstance(input, str):
            input = input.encode()
        proc = subprocess.run(
            [sys.executable, "-m", "keyveil", *args],
            input=input if input is not None else b"",
            capture_output=True,
            env={**self.env, **(env or {})},
            timeout=timeout,
        )
        self.outputs += [proc.stdout, proc.stderr]
        proc.out = proc.stdout.decode(errors="replace")
        proc.err = proc.stderr.decode(errors="replace")
        return proc

    def popen(self, *args: str, env: dict | None = None, log: Path) -> subprocess.Popen:
        f = open(log, "wb")  # a file, not a pipe: a full pipe would stall the proxy
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "keyveil", *args],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
            )
        finally:
            f.close()

    def vault_values(self) -> dict[str, bytes]:
        return open_vault(self.home, "file").load().current

    @staticmethod
    def forms(value: bytes) -> list[bytes]:
        return [
            value,
            base64.b64encode(value),
            base64.b64encode(value).rstrip(b"="),
            base64.urlsafe_b64encode(value).rstrip(b"="),
            value.hex().encode(),
        ]

    def assert_no_leaks(self) -> None:
        assert self.values, "nothing to look for"
        vault_file = self.home / "vault" / "vault.json"
        places: list[tuple[str, bytes]] = [(f"output #{i}", out) for i, out in enumerate(self.outputs)]
        for root in (self.home, self.user_home):
            for path in sorted(root.rglob("*")):
                if path.is_file() and path != vault_file:
                    places.append((str(path), path.read_bytes()))
        hits = [
            (where, i)
            for i, value in enumerate(self.values)
            for form in self.forms(value)
            for where, data in places
            if form in data
        ]
        assert hits == [], f"values found in: {hits}"


@pytest.fixture
def fresh(tmp_path: Path) -> KV:
    """A home that does not exist yet."""
    return KV(tmp_path)


@pytest.fixture(scope="module")
def template_home(tmp_path_factory) -> Path:
    """One `keyveil init` per module (making a CA takes a second), copied per test."""
    kv = KV(tmp_path_factory.mktemp("template"))
    r = kv("init")
    assert r.returncode == 0, r.err
    return kv.home


@pytest.fixture
def initialized(fresh: KV, template_home: Path) -> KV:
    shutil.copytree(template_home, fresh.home, symlinks=True)
    return fresh


# --- init and the home ---------------------------------------------------------


def test_init_creates_home_rules_ca_vault_and_audit(fresh: KV):
    kv = fresh
    r = kv("init")
    assert r.returncode == 0, r.err
    assert stat.S_IMODE(kv.home.stat().st_mode) & 0o077 == 0
    rules = kv.home / "config" / "rules.yaml"
    assert rules.read_bytes() == EXAMPLE_RULES.read_bytes()
    assert (kv.home / "vault").is_dir() and (kv.home / "audit").is_dir()
    ca_key = kv.home / "certs" / "mitmproxy-ca.pem"
    assert stat.S_IMODE(ca_key.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in ca_key.read_bytes()
    assert b"BEGIN CERTIFICATE" in (kv.home / "certs" / "mitmproxy-ca-cert.pem").read_bytes()
    assert "Next steps" in r.out and "keyveil secret set" in r.out
    assert str(rules) in r.out


@pytest.mark.parametrize("changed", ["version: 1\n# mine\n", BAD_RULES], ids=["valid", "invalid"])
def test_second_init_keeps_a_changed_rules_file_and_the_ca(initialized: KV, changed: str):
    kv = initialized
    rules = kv.home / "config" / "rules.yaml"
    rules.write_text(changed)
    ca = (kv.home / "certs" / "mitmproxy-ca.pem").read_bytes()
    r = kv("init")
    assert r.returncode in (0, 1), r.err
    assert rules.read_text() == changed
    assert (kv.home / "certs" / "mitmproxy-ca.pem").read_bytes() == ca


@pytest.mark.parametrize(
    "args",
    [("secret", "list"), ("secret", "ref", "github/pat"), ("rules", "check"), ("env",), ("audit",), ("doctor",)],
    ids=lambda a: "-".join(a),
)
def test_every_command_creates_a_missing_home(fresh: KV, args):
    kv = fresh
    kv.home = kv.home / "not" / "there"
    kv.env["KEYVEIL_HOME"] = str(kv.home)
    kv(*args)
    assert (kv.home / "config" / "rules.yaml").read_bytes() == EXAMPLE_RULES.read_bytes()
    for sub in ("certs", "vault", "audit"):
        assert (kv.home / sub).is_dir()
    assert stat.S_IMODE(kv.home.stat().st_mode) & 0o077 == 0


# --- secrets --------------------------------------------------------------------


def test_secret_set_reads_stdin_and_drops_exactly_one_newline(initialized: KV):
    kv = initialized
    two = kv.new_value()
    none = kv.new_value()
    r = kv("secret", "set", "github/pat", input=two + "\n\n")
    assert r.returncode == 0, r.err
    assert "{{secret:github/pat}}" in r.out
    assert kv("secret", "set", "other/one", input=none).returncode == 0
    assert kv("secret", "set", "other/two", input=none + "\n").returncode == 0
    stored = kv.vault_values()
    assert stored["github/pat"] == (two + "\n").encode()
    assert stored["other/one"] == stored["other/two"] == none.encode()
    kv.assert_no_leaks()


def test_secret_set_refuses_a_short_value(initialized: KV):
    r = initialized("secret", "set", "github/pat", input="abc1234\n")
    assert r.returncode == 1
    assert "shorter than 8" in r.err
    assert "abc1234" not in r.out + r.err
    assert initialized.vault_values() == {}


def test_secret_set_refuses_an_empty_value(initialized: KV):
    r = initialized("secret", "set", "github/pat", input="")
    assert r.returncode == 1
    assert "empty" in r.err


@pytest.mark.parametrize("name", ["", "/pat", "github//pat", "git hub", "github/pat/", "-x"])
def test_secret_set_refuses_an_invalid_name(initialized: KV, name: str):
    kv = initialized
    value = kv.new_value()
    r = kv("secret", "set", name, input=value)
    assert r.returncode == 1
    assert "name" in r.err
    assert kv.vault_values() == {}
    kv.assert_no_leaks()


def test_secret_set_takes_no_value_from_argv(initialized: KV):
    kv = initialized
    value = kv.new_value()
    r = kv("secret", "set", "github/pat", value, input=kv.new_value())
    assert r.returncode == 1
    assert kv.vault_values() == {}


def test_secret_set_with_a_value_in_argv_does_not_echo_it(initialized: KV):
    kv = initialized
    value = kv.new_value()
    r = kv("secret", "set", "github/pat", value)
    assert r.returncode == 1
    assert value not in r.out + r.err
    assert "stdin" in r.err or "prompt" in r.err


@pytest.mark.parametrize("lead", ["-", "--", "--x="])
def test_secret_set_with_an_argv_value_that_looks_like_an_option_is_refused_the_same_way(initialized: KV, lead: str):
    # a generated value starting with "-" once went to argparse's "unrecognized arguments" instead
    kv = initialized
    value = lead + kv.new_value()
    r = kv("secret", "set", "github/pat", value)
    assert r.returncode == 1
    assert value not in r.out + r.err and value[len(lead):] not in r.out + r.err
    assert "stdin" in r.err
    assert kv.vault_values() == {}


def test_secret_list_shows_names_versions_and_bindings_never_values(initialized: KV):
    kv = initialized
    assert "no secrets" in kv("secret", "list").out
    for value in (kv.new_value(), kv.new_value()):
        assert kv("secret", "set", "github/pat", input=value + "\n").returncode == 0
    assert kv("secret", "set", "loose/one", input=kv.new_value()).returncode == 0
    r = kv("secret", "list")
    assert r.returncode == 0, r.err
    rows = {line.split()[0]: line.split() for line in r.out.splitlines()[1:]}
    assert rows["github/pat"][1] == "2"
    assert "api.github.com," in rows["github/pat"]
    assert rows["loose/one"][1] == "1"
    assert "(not bound)" in " ".join(rows["loose/one"])
    # the same value again is not a new version
    assert kv("secret", "set", "loose/one", input=kv.values[-1]).returncode == 0
    assert re.search(r"^loose/one\s+1\s", kv("secret", "list").out, re.M)

    assert kv("secret", "rm", "github/pat").returncode == 0
    r = kv("secret", "list")
    assert "github/pat" not in r.out and "loose/one" in r.out
    assert set(kv.vault_values()) == {"loose/one"}
    kv.assert_no_leaks()


def test_secret_rm_unknown_is_a_usage_error(initialized: KV):
    r = initialized("secret", "rm", "nobody/here")
    assert r.returncode == 1
    assert "nobody/here" in r.err


def test_secret_ref_prints_the_reference(fresh: KV):
    kv = fresh
    r = kv("secret", "ref", "github/pat")
    assert (r.returncode, r.out) == (0, "{{secret:github/pat}}\n")
    assert kv("secret", "ref", "bad name").returncode == 1


# --- rules check ----------------------------------------------------------------


def test_rules_check_the_home_rules_prints_a_table(initialized: KV):
    r = initialized("rules", "check")
    assert r.returncode == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].endswith("valid")
    assert lines[1].split()[:3] == ["SECRET", "HOSTS", "INJECT"]
    assert any(line.startswith("github/pat") and "api.github.com" in line for line in lines)
    assert any(line.startswith("anthropic/key") for line in lines)


def test_rules_check_an_invalid_file_says_file_line_field(fresh: KV, tmp_path: Path):
    kv = fresh
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_RULES)
    r = kv("rules", "check", str(bad))
    assert r.returncode == 1
    m = FILE_LINE_FIELD.search(r.err)
    assert m, r.err
    assert (m["file"], int(m["line"]), m["field"]) == (str(bad), BAD_RULES_LINE, BAD_RULES_FIELD)


def test_rules_check_a_missing_file(fresh: KV, tmp_path: Path):
    kv = fresh
    missing = tmp_path / "nope.yaml"
    r = kv("rules", "check", str(missing))
    assert r.returncode == 1
    assert str(missing) in r.err


# --- an unreadable vault ------------------------------------------------------------


def _corrupt_vault(kv: KV) -> None:
    assert kv("secret", "set", "github/pat", input=kv.new_value()).returncode == 0
    (kv.home / "vault" / "vault.json").write_text('{"format": "keyveil-vault", "ver')


def test_secret_list_on_a_corrupt_vault_exits_2(initialized: KV):
    kv = initialized
    _corrupt_vault(kv)
    r = kv("secret", "list")
    assert r.returncode == 2
    assert "vault.json" in r.err and "corrupt" in r.err
    assert "Traceback" not in r.err
    kv.assert_no_leaks()


def test_secret_list_with_the_wrong_passphrase_exits_2(initialized: KV):
    kv = initialized
    right, wrong = kv.new_value(), kv.new_value()
    r = kv("secret", "set", "github/pat", input=kv.new_value(), env={"KEYVEIL_PASSPHRASE": right})
    assert r.returncode == 0, r.err
    assert kv("secret", "list", env={"KEYVEIL_PASSPHRASE": right}).returncode == 0
    r = kv("secret", "list", env={"KEYVEIL_PASSPHRASE": wrong})
    assert r.returncode == 2
    assert "KEYVEIL_PASSPHRASE" in r.err and "Traceback" not in r.err
    r = kv("secret", "list")
    assert r.returncode == 2
    assert "KEYVEIL_PASSPHRASE" in r.err
    kv.assert_no_leaks()


# --- env ----------------------------------------------------------------------------

ENV_VARS = (
    "HTTPS_PROXY",
    "HTTP_PROXY",
    "https_proxy",
    "http_proxy",
    "NO_PROXY",
    "NODE_EXTRA_CA_CERTS",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "CODEX_CA_CERTIFICATE",
)
BUNDLE_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "CODEX_CA_CERTIFICATE")


def _exports(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        words = shlex.split(line)
        assert words[0] == "export" and len(words) == 2, line
        key, _, value = words[1].partition("=")
        out[key] = value
    return out


def _cert_subjects(path: str) -> list[str]:
    with warnings.catch_warnings():  # some system CAs have non-positive serials
        warnings.simplefilter("ignore")
        return [c.subject.rfc4514_string() for c in x509.load_pem_x509_certificates(Path(path).read_bytes())]


def test_env_prints_exports_and_a_bundle_with_system_and_keyveil_cas(initialized: KV):
    kv = initialized
    r = kv("env")
    assert r.returncode == 0, r.err
    exports = _exports(r.out)
    assert set(ENV_VARS) <= set(exports)
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", exports[var]), exports[var]
    assert {"localhost", "127.0.0.1"} <= set(exports["NO_PROXY"].split(","))
    ca = (kv.home / "certs" / "mitmproxy-ca-cert.pem").read_text().strip()
    assert ca in Path(exports["NODE_EXTRA_CA_CERTS"]).read_text()
    for var in BUNDLE_VARS:
        bundle = Path(exports[var]).read_text()
        assert ca in bundle, var
        subjects = _cert_subjects(exports[var])
        assert any("mitmproxy" in s for s in subjects)
        assert any("mitmproxy" not in s for s in subjects), f"{var}: no system CA in {exports[var]}"


# --- start ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_start_beyond_loopback_needs_proxy_authentication(initialized: KV):
    port = _free_port()
    r = initialized("start", "--listen", f"0.0.0.0:{port}", timeout=20)
    assert r.returncode == 1
    assert "proxy authentication" in r.err and "KEYVEIL_PROXYAUTH" in r.err
    assert not _listening(port)


@pytest.mark.timeout(30)
def test_start_with_invalid_rules_exits_1_with_file_line(initialized: KV):
    kv = initialized
    rules = kv.home / "config" / "rules.yaml"
    rules.write_text(BAD_RULES)
    port = _free_port()
    t0 = time.monotonic()
    r = kv("start", "--listen", f"127.0.0.1:{port}", timeout=20)
    assert r.returncode == 1, r.err
    assert time.monotonic() - t0 < 15
    m = FILE_LINE_FIELD.search(r.err)
    assert m, r.err
    assert (m["file"], int(m["line"]), m["field"]) == (str(rules), BAD_RULES_LINE, BAD_RULES_FIELD)
    assert not _listening(port)


@pytest.mark.timeout(30)
def test_start_with_a_corrupt_vault_exits_2(initialized: KV):
    kv = initialized
    _corrupt_vault(kv)
    port = _free_port()
    r = kv("start", "--listen", f"127.0.0.1:{port}", timeout=20)
    assert r.returncode == 2, r.err
    assert "vault.json" in r.err and "corrupt" in r.err
    assert not _listening(port)
    kv.assert_no_leaks()


@pytest.mark.timeout(60)
def test_start_then_env_and_run_use_the_running_proxy(initialized: KV, tmp_path: Path):
    kv = initialized
    assert kv("secret", "set", "github/pat", input=kv.new_value()).returncode == 0
    port = _free_port()
    log = tmp_path / "proxy.log"
    proxy = kv.popen("start", "--listen", f"127.0.0.1:{port}", log=log)
    try:
        deadline = time.monotonic() + 30
        while not _listening(port):
            assert proxy.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the proxy did not start listening"
            time.sleep(0.05)
        assert _exports(kv("env").out)["HTTPS_PROXY"] == f"http://127.0.0.1:{port}"
        r = kv("run", "--", "sh", "-c", 'printf %s "$HTTPS_PROXY"', timeout=30)
        assert (r.returncode, r.out) == (0, f"http://127.0.0.1:{port}")
    finally:
        proxy.send_signal(signal.SIGTERM)
        rc = proxy.wait(15)
    kv.outputs.append(log.read_bytes())
    assert rc == 0, log.read_text()
    assert not (kv.home / "proxy.json").exists()
    kv.assert_no_leaks()


PROXY_STATUS = """
import os, socket, urllib.parse
u = urllib.parse.urlparse(os.environ["HTTP_PROXY"])
s = socket.create_connection((u.hostname, u.port), timeout=10)
auth = ""
if u.username:
    import base64
    auth = "Proxy-Authorization: Basic " + base64.b64encode(f"{u.username}:{u.password}".encode()).decode() + "\\r\\n"
s.sendall(f"GET http://127.0.0.1:{PORT}/ HTTP/1.1\\r\\nHost: 127.0.0.1:{PORT}\\r\\n{auth}\\r\\n".encode())
print(s.recv(64).split()[1].decode())
"""


@pytest.mark.timeout(60)
def test_run_through_a_running_authenticated_proxy_is_not_refused(initialized: KV, tmp_path: Path):
    kv = initialized
    proxyauth = "u:" + kv.new_value()
    kv.remember(proxyauth)
    port, closed = _free_port(), _free_port()
    log = tmp_path / "proxy.log"
    proxy = kv.popen("start", "--listen", f"0.0.0.0:{port}", env={"KEYVEIL_PROXYAUTH": proxyauth}, log=log)
    try:
        deadline = time.monotonic() + 30
        while not _listening(port):
            assert proxy.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the proxy did not start listening"
            time.sleep(0.05)
        script = PROXY_STATUS.replace("{PORT}", str(closed))
        r = kv("run", "--", sys.executable, "-c", script, env={"KEYVEIL_PROXYAUTH": proxyauth}, timeout=30)
        assert r.returncode == 0, r.err
        # 502: the proxy took the request (nothing listens upstream); 407 would mean the
        # command was handed a proxy it cannot use
        assert r.out.strip() == "502", r.out
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(15)
    kv.outputs.append(log.read_bytes())


# --- run ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_run_returns_the_command_exit_code(initialized: KV):
    r = initialized("run", "--", "sh", "-c", "exit 7", timeout=45)
    assert r.returncode == 7, r.err


@pytest.mark.timeout(60)
def test_run_sets_the_proxy_and_withholds_what_opens_the_vault(initialized: KV):
    kv = initialized
    passphrase, env_secret, proxyauth = kv.new_value(), kv.new_value(), "u:" + kv.new_value()
    kv.remember(proxyauth)
    parent = {
        "KEYVEIL_PASSPHRASE": passphrase,
        "KEYVEIL_SECRET_GITHUB__PAT": env_secret,
        "KEYVEIL_PROXYAUTH": proxyauth,
    }
    # a passphrase vault: the private proxy needs the passphrase, the command must not get it
    assert kv("secret", "set", "github/pat", input=kv.new_value(), env=parent).returncode == 0
    r = kv("run", "--", "sh", "-c", "env", env=parent, timeout=45)
    assert r.returncode == 0, r.err
    child = dict(line.split("=", 1) for line in r.out.splitlines() if "=" in line)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", child["HTTPS_PROXY"]), child["HTTPS_PROXY"]
    assert child["HTTPS_PROXY"] != "http://127.0.0.1:8080"  # a private proxy on a free port
    for var in ENV_VARS:
        assert var in child, var
    assert "KEYVEIL_PASSPHRASE" not in child
    assert not [k for k in child if k.startswith("KEYVEIL_SECRET_")]
    assert "KEYVEIL_PROXYAUTH" not in child
    kv.assert_no_leaks()


@pytest.mark.timeout(60)
def test_run_with_a_corrupt_vault_exits_2(initialized: KV):
    kv = initialized
    _corrupt_vault(kv)
    r = kv("run", "--", "sh", "-c", "echo ran", timeout=45)
    assert r.returncode == 2
    assert "ran" not in r.out
    assert "corrupt" in r.err
    kv.assert_no_leaks()


def test_run_without_a_command_is_a_usage_error(fresh: KV):
    kv = fresh
    assert kv("run").returncode == 1
    assert kv("run", "--").returncode == 1


# --- doctor ---------------------------------------------------------------------------


def test_doctor_on_a_healthy_home(initialized: KV):
    kv = initialized
    assert kv("secret", "set", "github/pat", input=kv.new_value()).returncode == 0
    r = kv("doctor")
    assert r.returncode == 0, r.out + r.err
    assert "FAIL" not in r.out
    assert "sealed round trip" in r.out
    kv.assert_no_leaks()


def test_doctor_on_a_corrupt_vault_exits_2(initialized: KV):
    kv = initialized
    _corrupt_vault(kv)
    r = kv("doctor")
    assert r.returncode == 2
    assert re.search(r"^FAIL vault", r.out, re.M)
    kv.assert_no_leaks()


# --- usage ------------------------------------------------------------------------------


def test_usage_errors_exit_1(fresh: KV):
    kv = fresh
    assert kv().returncode == 1
    assert kv("frobnicate").returncode == 1
    assert kv("start", "--listen", "nonsense").returncode == 1
    assert kv("--help").returncode == 0


# --- everything in one home -----------------------------------------------------------------


@pytest.mark.timeout(90)
def test_no_value_anywhere_after_a_full_session(fresh: KV, tmp_path: Path):
    kv = fresh
    assert kv("init").returncode == 0
    for name in ("github/pat", "github/pat", "anthropic/key", "loose/one"):
        assert kv("secret", "set", name, input=kv.new_value() + "\n").returncode == 0
    assert kv("secret", "set", "short/one", input="1234567").returncode == 1
    assert kv("secret", "list").returncode == 0
    assert kv("secret", "rm", "loose/one").returncode == 0
    assert kv("secret", "ref", "github/pat").returncode == 0
    assert kv("rules", "check").returncode == 0
    assert kv("env").returncode == 0
    assert kv("doctor").returncode == 0
    assert kv("audit").returncode == 0
    r = kv("run", "--", "sh", "-c", "env; exit 3", timeout=45)
    assert r.returncode == 3, r.err
    assert kv("init").returncode == 0
    kv.assert_no_leaks()
