"""Security posture: private file modes, loopback by default, proxy authentication
beyond loopback, and warnings about files other users can read or change.

Real `keyveil` commands and real proxies (`keyveil start`, `mitmdump -s`).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from keyveil.cli import build_parser
from tests import infra
from tests.conftest import base_env, keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(120)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_sockets(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on PORT, from /proc/net/tcp{,6}."""
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr, _, p = local.partition(":")
            if state != "0A" or int(p, 16) != port:
                continue
            raw = bytes.fromhex(addr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, raw))
    return found


def wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not listening_sockets(port):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the proxy did not listen\n" + log.read_text()
        time.sleep(0.05)


def start(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "keyveil", "start", *args],
            env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
        )


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(5)
    return proc.returncode


def non_loopback_address() -> str | None:
    """An address of this machine other than loopback, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routing only, nothing leaves
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


@pytest.fixture
def kv(tmp_path):
    return make_home(tmp_path)


# --- files ---------------------------------------------------------------------------------


def test_init_makes_the_ca_key_and_the_home_private(tmp_path):
    kv = make_home(tmp_path)
    certs = kv.home / "certs"
    key = certs / "mitmproxy-ca.pem"
    assert key.exists() and b"PRIVATE KEY" in key.read_bytes()
    assert mode(key) == 0o600
    for p12 in certs.glob("mitmproxy-ca*.p12"):
        if p12.name != "mitmproxy-ca-cert.p12":  # the public certificate alone
            assert mode(p12) == 0o600, p12
    for d in ("", "certs", "vault", "audit", "config"):
        assert mode(kv.home / d) & 0o077 == 0, d
    for f in ("vault/vault.json", "vault/key", "config/rules.yaml"):
        assert mode(kv.home / f) & 0o077 == 0, f


def test_ca_key_is_private_even_under_a_permissive_umask(tmp_path):
    home = tmp_path / "home"
    env = base_env(home)
    r = subprocess.run(
        ["sh", "-c", f'umask 000 && exec "{sys.executable}" -m keyveil init'], env=env, capture_output=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert mode(home / "certs" / "mitmproxy-ca.pem") == 0o600
    assert mode(home / "certs") & 0o077 == 0


def test_audit_log_is_private(kv, tmp_path):
    port = free_port()
    log = tmp_path / "start.log"
    proc = start(kv.env, log, "--listen", f"127.0.0.1:{port}")
    try:
        wait_listening(port, proc, log)
        verify = infra.client_ssl_context(kv.home / "certs" / "mitmproxy-ca-cert.pem")
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", verify=verify, trust_env=False, timeout=20) as c:
            r = c.get("https://api.gitlab.com/x", headers={"authorization": "Bearer {{secret:github/pat}}"})
        assert r.status_code == 403
    finally:
        stop(proc)
    files = list((kv.home / "audit").glob("*.jsonl"))
    assert files
    for f in files:
        assert mode(f) == 0o600, f
    assert mode(kv.home / "audit") & 0o077 == 0


# --- listening ------------------------------------------------------------------------------


def test_default_listen_address_is_loopback():
    args = build_parser().parse_args(["start"])
    assert args.listen == "127.0.0.1:8080"


def test_start_binds_loopback_only(kv, tmp_path):
    port = free_port()
    log = tmp_path / "start.log"
    proc = start(kv.env, log, "--listen", f"127.0.0.1:{port}")
    try:
        wait_listening(port, proc, log)
        assert listening_sockets(port) == ["127.0.0.1"]
        other = non_loopback_address()
        if other:
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=2).close()
    finally:
        assert stop(proc) == 0


def test_start_without_listen_binds_127_0_0_1_8080(kv, tmp_path):
    if listening_sockets(8080):
        pytest.skip("port 8080 is in use on this machine")
    log = tmp_path / "start.log"
    proc = start(kv.env, log)
    try:
        wait_listening(8080, proc, log)
        assert listening_sockets(8080) == ["127.0.0.1"]
    finally:
        stop(proc)


@pytest.mark.parametrize("listen", ["0.0.0.0:{port}", "[::]:{port}", "{other}:{port}"])
def test_listening_beyond_loopback_without_proxy_auth_is_refused(kv, listen):
    other = non_loopback_address()
    if "{other}" in listen and other is None:
        pytest.skip("this machine has no non-loopback address")
    port = free_port()
    env = {k: v for k, v in kv.env.items() if k != "KEYVEIL_PROXYAUTH"}
    r = keyveil(env, "start", "--listen", listen.format(port=port, other=other), timeout=30)
    assert r.returncode == 1, r.stderr
    assert b"KEYVEIL_PROXYAUTH" in r.stderr
    assert listening_sockets(port) == []


@pytest.mark.parametrize("listen", ["localhost:{port}", "[::1]:{port}", ":{port}"])
def test_loopback_spellings_need_no_proxy_auth(kv, tmp_path, listen):
    if "::1" in listen and not socket.has_ipv6:
        pytest.skip("no IPv6")
    port = free_port()
    log = tmp_path / "start.log"
    proc = start(kv.env, log, "--listen", listen.format(port=port))
    try:
        wait_listening(port, proc, log)
        for addr in listening_sockets(port):
            assert addr in ("127.0.0.1", "::1"), addr
    finally:
        stop(proc)


def test_beyond_loopback_with_proxy_auth_demands_credentials(kv, tmp_path):
    port = free_port()
    password = "pw-" + os.urandom(8).hex()
    env = {**kv.env, "KEYVEIL_PROXYAUTH": f"agent:{password}"}
    log = tmp_path / "start.log"
    proc = start(env, log, "--listen", f"0.0.0.0:{port}")
    try:
        wait_listening(port, proc, log)
        assert listening_sockets(port) == ["0.0.0.0"]
        verify = infra.client_ssl_context(kv.home / "certs" / "mitmproxy-ca-cert.pem")
        url = "https://api.gitlab.com/x"
        auth = {"authorization": "Bearer {{secret:github/pat}}"}
        # no credentials: 407 on CONNECT (tunnel) and on a plain request
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", verify=verify, trust_env=False, timeout=20) as c:
            with pytest.raises(httpx.ProxyError, match="407"):
                c.get(url, headers=auth)
            assert c.get("http://api.gitlab.com/x").status_code == 407
        # wrong credentials
        with httpx.Client(proxy=f"http://agent:wrong@127.0.0.1:{port}", verify=verify, trust_env=False, timeout=20) as c:
            with pytest.raises(httpx.ProxyError, match="407"):
                c.get(url, headers=auth)
        # right credentials: through to keyveil, which decides (here: blocks the unbound reference)
        with httpx.Client(proxy=f"http://agent:{password}@127.0.0.1:{port}", verify=verify, trust_env=False, timeout=20) as c:
            r = c.get(url, headers=auth)
        assert (r.status_code, r.headers.get("x-keyveil-block")) == (403, "unbound_reference")
    finally:
        stop(proc)
    assert password not in log.read_text()


# --- files other users can read or change -------------------------------------------------------


def warnings_of(output: str) -> list[str]:
    return [line for line in output.splitlines() if "other users" in line]


def run_mitmdump(kv, upstream, work: Path) -> str:
    with keyveil_proxy(upstream, work, kv) as p:
        pass
    return p.output()


def test_private_files_give_no_warning(kv, upstream, tmp_path):
    assert warnings_of(run_mitmdump(kv, upstream, tmp_path / "w")) == []


@pytest.mark.parametrize(
    "path,chmod,expected",
    [
        ("config/rules.yaml", 0o666, "writable by other users"),
        ("config/rules.yaml", 0o620, "writable by other users"),
        ("vault/vault.json", 0o644, "readable by other users"),
        ("vault/key", 0o604, "readable by other users"),
        ("certs/mitmproxy-ca.pem", 0o640, "readable by other users"),
    ],
)
def test_exposed_file_gives_a_warning_in_the_proxy_log(kv, upstream, tmp_path, path, chmod, expected):
    target = kv.home / path
    os.chmod(target, chmod)
    found = warnings_of(run_mitmdump(kv, upstream, tmp_path / "w"))
    assert [line for line in found if str(target) in line and expected in line], found
    assert all(f"{path}" in line or "other users" in line for line in found)


def test_exposed_vault_gives_a_warning_under_keyveil_start(kv, tmp_path):
    target = kv.home / "vault" / "vault.json"
    os.chmod(target, 0o644)
    port = free_port()
    log = tmp_path / "start.log"
    proc = start(kv.env, log, "--listen", f"127.0.0.1:{port}")
    try:
        wait_listening(port, proc, log)
        time.sleep(0.3)
    finally:
        stop(proc)
    found = warnings_of(log.read_text())
    assert [line for line in found if str(target) in line and "readable by other users" in line], log.read_text()
