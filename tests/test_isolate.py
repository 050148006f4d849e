"""`keyveil run --isolate` (issue 10, SPEC §10), with real processes.

Every sandbox here is a real bubblewrap sandbox started by a real `keyveil
run --isolate`; the proxy is a real mitmdump running keyveil, routed to the
local TLS upstream, found by `keyveil run` through the home's proxy.json as a
`keyveil start` proxy would be. Inside the sandbox real curl, Python (httpx),
Node, git and Codex talk to it. Each claim that something is *unreachable*
has a control that shows the same thing reachable without --isolate, so the
test can fail.

bubblewrap is installed by the session set-up (apt-get) when missing, and
Codex by npm into a cache directory. Values are generated per run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import pwd
import random
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import pytest

from keyveil import _isolate
from tests import infra
from tests.conftest import KeyveilSetup, base_env, fake_values, keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--isolate uses Linux namespaces")

RULES = """\
version: 1
providers:
  builtin: true
secrets:
  github/pat:
    hosts: [api.github.com, github.com]
    inject: [{header: Authorization}, {basic_auth: true}]
  codex/key:
    hosts: [codex.test.keyveil]
    inject: [{header: Authorization}]
  local/svc:
    hosts: ["127.0.0.1:{tls_port}"]
    inject: [{header: X-Svc}]
policy:
  max_body_bytes: {max_body}
  isolated_local_hosts: ["localhost:{plain_port}"]
"""

GIT_URL = "https://github.com/owner/repo.git/info/refs?service=git-upload-pack"
CODEX_VERSION = "0.169.0"


# --- set-up -------------------------------------------------------------------------------


def _apt_install(package: str) -> None:
    cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=120", "install", "-y", "--no-install-recommends", package]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(cmd, capture_output=True, env=env, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=120", "update"], capture_output=True, env=env, timeout=600)
        done = subprocess.run(cmd, capture_output=True, env=env, timeout=600)
        assert done.returncode == 0, f"apt-get install {package} failed:\n{done.stderr.decode(errors='replace')}"


@pytest.fixture(scope="session")
def bwrap() -> str:
    """bubblewrap, installed from the OS packages when missing (CI starts from a fresh image)."""
    found = shutil.which("bwrap")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        _apt_install("bubblewrap")
        found = shutil.which("bwrap")
    if found is None:
        pytest.skip("bubblewrap is not installed and these tests cannot install it (not root, or no apt-get)")
    return found


@pytest.fixture(scope="session")
def codex(bwrap) -> Path:
    """The Codex CLI from npm, installed once into a cache directory kept between runs."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "keyveil-tests" / f"codex-{CODEX_VERSION}"
    binary = cache / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed, so Codex cannot be installed for the harness test")
        cache.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund", f"@openai/codex@{CODEX_VERSION}"],
            capture_output=True,
            timeout=600,
        )
        assert done.returncode == 0, f"npm install @openai/codex failed:\n{done.stderr.decode(errors='replace')[-3000:]}"
    return binary


def _rules_for(upstream) -> str:
    return RULES.replace("{tls_port}", str(upstream.tls_port)).replace("{plain_port}", str(upstream.plain_port))


@pytest.fixture(scope="module")
def kvi(tmp_path_factory, bwrap, upstream) -> KeyveilSetup:
    setup = make_home(tmp_path_factory.mktemp("isolate"), rules=_rules_for(upstream))
    for name, prefix in (("codex/key", "cdx_"), ("local/svc", "svc_")):
        value = prefix.encode() + secrets.token_urlsafe(24).encode()
        r = keyveil(setup.env, "secret", "set", name, stdin=value + b"\n")
        assert r.returncode == 0, r.stderr
        setup.values[name] = value
    yield setup
    leaks = [i for i, out in enumerate(setup.outputs) for form in setup.forms() if form in out]
    assert leaks == [], f"a value appeared in captured output #{leaks}"


def _write_state(home: Path, proxy: infra.ProxyProcess) -> None:
    # What `keyveil start` writes: `keyveil run` then uses this proxy instead of starting one.
    state = {"host": "127.0.0.1", "port": proxy.port, "pid": proxy.process.pid, "auth": False}
    (home / "proxy.json").write_text(json.dumps(state))


@pytest.fixture(scope="module")
def routed(kvi, upstream, tmp_path_factory):
    """keyveil in mitmdump on the home's CA, routed to the upstream, known to `keyveil run`."""
    work = tmp_path_factory.mktemp("routed")
    with keyveil_proxy(upstream, work, kvi, options={"confdir": kvi.home / "certs"}) as proxy:
        _write_state(kvi.home, proxy)
        yield proxy
        (kvi.home / "proxy.json").unlink(missing_ok=True)
    kvi.outputs.append(proxy.output().encode())


@contextlib.contextmanager
def _state_of(home: Path, proxy: infra.ProxyProcess):
    """Point `keyveil run` at PROXY for a while, then back at what it was."""
    state = home / "proxy.json"
    before = state.read_bytes() if state.exists() else None
    _write_state(home, proxy)
    try:
        yield
    finally:
        if before is None:
            state.unlink(missing_ok=True)
        else:
            state.write_bytes(before)


# What a CMD that is this venv's python needs to see, wherever the venv lives.
SHOW_VENV = ["--ro", sys.prefix]


def run(setup: KeyveilSetup, *args: str, env=None, cwd=None, timeout: float = 60, isolate: bool = True):
    """`keyveil run [--isolate] ARGS` as a user would type it; the result, with .out and .err text.

    A CMD that is this venv's python gets the venv shown read-only, as a user
    would show it: under /tmp (CI checks out there) the sandbox has its own, empty /tmp.
    """
    shown = SHOW_VENV if isolate and sys.executable in args else []
    cmd = [sys.executable, "-m", "keyveil", "run", *(["--isolate"] if isolate else []), *shown, *args]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, env={**setup.env, **(env or {})}, cwd=cwd, timeout=timeout)
    setup.outputs += [proc.stdout, proc.stderr]
    proc.out = proc.stdout.decode(errors="replace")
    proc.err = proc.stderr.decode(errors="replace")
    return proc


def _processes_with(arg: str) -> list[int]:
    """PIDs of live processes with ARG among their arguments."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if arg.encode() in argv and state != "Z":
            found.append(int(entry.name))
    return found


def _marker() -> str:
    """A `sleep` argument no other process has: finds what a sandbox left behind."""
    return f"{random.randint(100000, 999999)}.{random.randint(1, 9)}"


# --- clients inside the sandbox reach a bound host through keyveil -----------------------------


def _basic(value: str) -> str:
    return "Basic " + base64.b64encode(f"x-access-token:{value}".encode()).decode()


# The request spec gets its proxy from $HTTPS_PROXY, where keyveil put it.
NODE_FROM_ENV = """
{ const a = process.argv, spec = JSON.parse(a[a.length - 1]);
  spec.proxy = process.env.HTTPS_PROXY; a[a.length - 1] = JSON.stringify(spec); }
"""

CLIENTS = {
    "curl": lambda ref: ["curl", "-sS", "--fail", "-u", f"x-access-token:{ref}", GIT_URL],
    "python-httpx": lambda ref: [
        sys.executable,
        "-c",
        "import httpx, sys; r = httpx.get(sys.argv[1], auth=('x-access-token', sys.argv[2]), timeout=20); "
        "print(r.status_code); sys.stdout.write(r.text)",
        GIT_URL,
        ref,
    ],
    "node": lambda ref: [
        "node",
        "-e",
        NODE_FROM_ENV + infra.NODE_PROXY_CLIENT_JS,
        json.dumps({"url": GIT_URL, "headers": {"authorization": _basic(ref)}, "timeout_ms": 20000}),
    ],
}


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_client_in_the_sandbox_gets_the_injected_value_through_keyveil(kvi, routed, up, client, tmp_path):
    pat = kvi.values["github/pat"].decode()
    up.set_git_credentials("x-access-token", pat)  # the ref advertisement only for the real value
    r = run(kvi, "--", *CLIENTS[client]("{{secret:github/pat}}"), cwd=tmp_path)
    assert r.returncode == 0, r.err
    assert infra.GIT_SHA.decode() in r.out  # the effect of the injected value, seen inside the sandbox
    (rec,) = [q for q in up.requests if q.path.endswith("service=git-upload-pack")]
    assert rec.header("authorization") == _basic(pat)
    assert rec.sni == "github.com"
    assert pat not in r.out + r.err


def test_git_ls_remote_with_a_reference_in_the_sandbox(kvi, routed, up, tmp_path):
    pat = kvi.values["github/pat"].decode()
    up.set_git_credentials("x-access-token", pat)
    url = "https://x-access-token:" + quote("{{secret:github/pat}}", safe="") + "@github.com/owner/repo.git"
    env = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_TERMINAL_PROMPT": "0"}
    r = run(kvi, "--", "git", "ls-remote", url, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.err
    assert f"{infra.GIT_SHA.decode()}\trefs/heads/main" in r.out
    assert up.requests[-1].header("authorization") == _basic(pat)
    assert pat not in r.out + r.err


# --- nothing else is reachable ------------------------------------------------------------------

NET_PROBE = r"""
import errno, json, socket, subprocess, sys
tcp_port, udp_port, unix_tmp, unix_run, udp_wait = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "connected"
    except TimeoutError:
        out[name] = "timeout"
    except socket.gaierror as e:
        out[name] = "dns-failed"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
def tcp(addr, family=socket.AF_INET):
    with socket.socket(family) as s:
        s.settimeout(10)
        s.connect(addr)
def udp(addr):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(udp_wait)  # the host's server never answers: only a refusal ends this early
        s.connect(addr)
        s.send(b"keyveil-probe")
        s.recv(64)
def udp_send(addr):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"keyveil-probe", addr)
def unix(path):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
attempt("tcp to a server on the host's loopback", lambda: tcp(("127.0.0.1", tcp_port)))
attempt("tcp to the host's ::1", lambda: tcp(("::1", tcp_port, 0, 0), socket.AF_INET6))
attempt("tcp to another address", lambda: tcp(("192.0.2.1", 443)))
attempt("tcp to an IPv6 address", lambda: tcp(("2001:db8::1", 443, 0, 0), socket.AF_INET6))
attempt("udp to a server on the host's loopback", lambda: udp(("127.0.0.1", udp_port)))
attempt("udp to another address", lambda: udp_send(("192.0.2.1", 53)))
attempt("dns lookup", lambda: socket.getaddrinfo("api.github.com", 443))
attempt("unix socket of a host service in /tmp", lambda: unix(unix_tmp))
attempt("unix socket of a host service in /run", lambda: unix(unix_run))
def httpx_without_proxy():
    import httpx
    try:
        httpx.get("https://api.github.com/", trust_env=False, timeout=10)
    except httpx.TimeoutException:
        raise TimeoutError
    except httpx.ConnectError as e:
        raise OSError(errno.ECONNABORTED, str(e))
attempt("httpx ignoring the proxy variables", httpx_without_proxy)
for name, url in (("curl ignoring the proxy variables", "https://api.github.com/"),
                  ("curl to the host's loopback", f"https://127.0.0.1:{tcp_port}/")):
    done = subprocess.run(["curl", "-sS", "-k", "--noproxy", "*", "-m", "10", "-o", "/dev/null", url], capture_output=True)
    out[name] = "connected" if done.returncode == 0 else ("timeout" if done.returncode == 28 else f"curl exit {done.returncode}")
print(json.dumps(out))
"""

FAILED_AT_ONCE = {
    "ECONNREFUSED",
    "ENETUNREACH",
    "EHOSTUNREACH",
    "ENOENT",
    "EACCES",
    "ECONNABORTED",
    "dns-failed",
    "curl exit 6",
    "curl exit 7",
}


@pytest.fixture
def host_services(upstream, tmp_path):
    """A UDP server on the host's loopback, and Unix-socket servers in /tmp and /run."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    # Not under the working directory (tmp_path), which the sandbox shows on purpose.
    tmp_dir = Path(tempfile.mkdtemp(prefix="keyveil-test-", dir="/tmp"))
    run_dir = Path(tempfile.mkdtemp(prefix="keyveil-test-", dir="/run"))
    unix_servers = []
    for path in (tmp_dir / "service.sock", run_dir / "service.sock"):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.listen()
        s.setblocking(False)
        unix_servers.append((path, s))
    try:
        yield upstream.tls_port, udp, unix_servers
    finally:
        udp.close()
        for _, s in unix_servers:
            s.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _probe_args(host_services, udp_wait: float) -> list[str]:
    tcp_port, udp, unix_servers = host_services
    ports = [str(tcp_port), str(udp.getsockname()[1])]
    return [sys.executable, "-c", NET_PROBE, *ports, *(str(p) for p, _ in unix_servers), str(udp_wait)]


def test_every_connection_but_the_proxy_fails_at_once(kvi, routed, up, host_services, tmp_path):
    r = run(kvi, "--", *_probe_args(host_services, udp_wait=10), cwd=tmp_path)
    assert r.returncode == 0, r.err
    results = json.loads(r.out)
    assert len(results) == 12
    assert {name: how for name, how in results.items() if how not in FAILED_AT_ONCE} == {}
    # and the host's services saw nothing
    _, udp, unix_servers = host_services
    with pytest.raises(BlockingIOError):
        udp.recvfrom(64)
    for _, server in unix_servers:
        with pytest.raises(BlockingIOError):
            server.accept()
    assert up.requests == []


def test_the_same_probe_without_isolate_reaches_the_host(kvi, routed, up, host_services, tmp_path):
    # The control for the test above: the probe is able to see a reachable service.
    r = run(kvi, "--", *_probe_args(host_services, udp_wait=0.2), cwd=tmp_path, isolate=False)
    assert r.returncode == 0, r.err
    results = json.loads(r.out)
    assert results["tcp to a server on the host's loopback"] == "connected"
    assert results["unix socket of a host service in /tmp"] == "connected"
    assert results["unix socket of a host service in /run"] == "connected"
    assert results["curl to the host's loopback"] == "connected"
    _, udp, _ = host_services
    assert udp.recvfrom(64)[0] == b"keyveil-probe"


# --- through keyveil, only the public internet and the hosts rules.yaml names ---------------------

# curl through the proxy on purpose (--noproxy '' overrides NO_PROXY): what an
# agent would try to reach the host's services via keyveil. One JSON line per URL:
# the CONNECT status, the HTTP status, the block code, and the body.
VIA_PROXY = r"""
import json, os, subprocess, sys
out = {}
for url, *headers in (json.loads(a) for a in sys.argv[1:]):
    args = ["curl", "-sS", "--noproxy", "", "-x", os.environ["HTTPS_PROXY"], "-m", "20", "-D", "-", "-o", "body"]
    for h in headers:
        args += ["-H", h]
    done = subprocess.run([*args, "-w", "\n%{http_connect} %{http_code}", url], capture_output=True, text=True)
    head, _, codes = done.stdout.rpartition("\n")
    blocks = [l.split(":", 1)[1].strip() for l in head.splitlines() if l.lower().startswith("x-keyveil-block:")]
    body = open("body").read() if os.path.exists("body") else ""
    if os.path.exists("body"):
        os.unlink("body")
    out[url] = {"connect": codes.split()[0], "status": codes.split()[1], "block": blocks, "body": body}
print(json.dumps(out))
"""


@pytest.fixture
def host_service():
    """A TCP service on the host's loopback that nothing binds: it must see no connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    with server:
        yield server.getsockname()[1], server


def _refused_urls(port: int) -> list[str]:
    return [
        f"https://127.0.0.1:{port}/",
        f"https://localhost:{port}/",  # a name that resolves to loopback
        f"https://{socket.gethostname()}:{port}/",  # this host's own name (loopback or its own address)
        f"https://[::1]:{port}/",
        f"https://[::ffff:127.0.0.1]:{port}/",
        f"http://127.0.0.1:{port}/",  # a plain proxy request, not a tunnel
        "https://169.254.169.254/",  # cloud metadata
        "https://10.0.0.1/",  # a private network
        "https://no-such-host.invalid/",  # what keyveil cannot resolve it cannot check
    ]


def test_through_keyveil_a_sandbox_cannot_reach_the_host_or_private_networks(kvi, routed, up, host_service, tmp_path):
    port, server = host_service
    urls = _refused_urls(port)
    r = run(kvi, "--", sys.executable, "-c", VIA_PROXY, *(json.dumps([u]) for u in urls), cwd=tmp_path)
    assert r.returncode == 0, r.err
    seen = json.loads(r.out)
    for url in urls:
        plain = url.startswith("http:")
        # refused at the CONNECT (421), or as the answer to the plain request
        expected = {"connect": "000" if plain else "421", "status": "421" if plain else "000", "block": ["host_mismatch"]}
        assert {k: seen[url][k] for k in expected} == expected, url
    body = json.loads(seen[f"http://127.0.0.1:{port}/"]["body"])["error"]
    assert body["code"] == "host_mismatch"
    assert f"to 127.0.0.1:{port}: a loopback address" in body["message"]
    assert f'add "127.0.0.1:{port}" to policy.isolated_local_hosts in rules.yaml' in body["message"]
    assert up.requests == []  # nothing was forwarded (the test proxy routes every connection to the upstream)
    with pytest.raises(BlockingIOError):
        server.accept()
    deadline = time.monotonic() + 10  # the audit log is flushed twice a second
    while time.monotonic() < deadline:
        lines = [json.loads(line) for p in (kvi.home / "audit").glob("*") for line in p.read_text().splitlines()]
        hosts = {(e["host"], e["code"]) for e in lines if e["action"] == "blocked"}
        if ("169.254.169.254", "host_mismatch") in hosts:
            break
        time.sleep(0.2)
    assert {("127.0.0.1", "host_mismatch"), ("localhost", "host_mismatch"), ("169.254.169.254", "host_mismatch")} <= hosts


def test_outside_a_sandbox_the_same_requests_are_not_refused(kvi, routed, up, host_service, tmp_path):
    # The control: keyveil refuses these only to a sandbox (a client outside can connect anyway).
    port, _ = host_service
    url = f"https://127.0.0.1:{port}/echo"
    r = run(kvi, "--", sys.executable, "-c", VIA_PROXY, json.dumps([url]), cwd=tmp_path, isolate=False)
    assert r.returncode == 0, r.err
    assert json.loads(r.out)[url]["status"] == "200"
    assert len(up.requests) == 1


def test_a_sandbox_reaches_a_local_host_that_a_binding_or_the_policy_names(kvi, routed, up, tmp_path):
    bound = f"https://127.0.0.1:{up.tls_port}/echo"  # local/svc is bound to it
    listed = f"http://localhost:{up.plain_port}/echo"  # policy.isolated_local_hosts
    args = [json.dumps([bound, "X-Svc: {{secret:local/svc}}"]), json.dumps([listed])]
    r = run(kvi, "--", sys.executable, "-c", VIA_PROXY, *args, cwd=tmp_path)
    assert r.returncode == 0, r.err
    seen = json.loads(r.out)
    assert (seen[bound]["status"], seen[listed]["status"]) == ("200", "200"), seen
    first, second = up.requests
    assert first.header("x-svc") == kvi.values["local/svc"].decode()  # injected: the binding holds
    assert second.path == "/echo"
    assert kvi.values["local/svc"].decode() not in r.out


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.1.2.3", "::1", "0.0.0.0", "::", "169.254.169.254", "fe80::1", "10.1.2.3", "172.16.0.1",
     "192.168.1.1", "100.64.0.1", "fd00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "224.0.0.1", "192.0.2.1"],
)  # fmt: skip
def test_addresses_a_sandbox_may_not_reach(address):
    from keyveil.adapter import _destinations

    assert _destinations.refusal(ipaddress.ip_address(address), this_host=lambda a: False) is not None


def test_public_addresses_are_reached_unless_they_are_this_host():
    from keyveil.adapter import _destinations

    for public in ("8.8.8.8", "2606:4700:4700::1111"):
        assert _destinations.refusal(ipaddress.ip_address(public), this_host=lambda a: False) is None
        assert "an address of this host" in _destinations.refusal(ipaddress.ip_address(public), this_host=lambda a: True)
    assert _destinations.is_this_host(ipaddress.ip_address("127.0.0.1"))
    assert not _destinations.is_this_host(ipaddress.ip_address("203.0.113.77"))  # TEST-NET-3: assigned to no host


def test_the_server_connection_goes_to_the_address_that_was_checked():
    # DNS rebinding: the name is resolved once, at the CONNECT; a second answer
    # (loopback) never matters, as mitmproxy is given the checked address.
    from mitmproxy import connection
    from mitmproxy.proxy import server_hooks
    from mitmproxy.test import tflow

    from keyveil._rules import parse_rules
    from keyveil.adapter import _destinations

    blocks = []
    addon = SimpleNamespace(
        engine=SimpleNamespace(rules=parse_rules("version: 1\n", "rules.yaml")),
        outputs=SimpleNamespace(block=lambda flow, block, phase: blocks.append(block)),
    )
    destinations = _destinations.Destinations(addon)
    answers = iter([["93.184.215.14"], ["127.0.0.1"]])

    async def resolve(host, port):
        return [ipaddress.ip_address(a) for a in next(answers)]

    destinations.resolve = resolve
    flow = tflow.tflow()
    flow.request.host, flow.request.port = "rebind.example", 443
    flow.client_conn.peername = (_isolate.SANDBOX_SOURCE, 40000)
    asyncio.run(destinations.http_connect(flow))
    assert blocks == []
    server = connection.Server(address=("rebind.example", 443))
    destinations.server_connect(server_hooks.ServerConnectionHookData(server=server, client=flow.client_conn))
    assert (server.address, server.sni, server.error) == (("93.184.215.14", 443), "rebind.example", None)
    # a connection to a destination that was never checked is refused
    other = connection.Server(address=("other.example", 443))
    destinations.server_connect(server_hooks.ServerConnectionHookData(server=other, client=flow.client_conn))
    assert other.error and other.address == ("other.example", 443)
    # and a client outside a sandbox is left alone
    flow.client_conn.peername = ("127.0.0.1", 40001)
    outside = connection.Server(address=("other.example", 443))
    destinations.server_connect(server_hooks.ServerConnectionHookData(server=outside, client=flow.client_conn))
    assert (outside.address, outside.error) == (("other.example", 443), None)


def test_isolated_local_hosts_takes_host_patterns_only(kvi, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text('version: 1\npolicy:\n  isolated_local_hosts: ["*"]\n')
    r = keyveil(kvi.env, "rules", "check", str(rules))
    assert r.returncode == 1
    assert f"{rules}:3: policy.isolated_local_hosts" in r.stderr.decode()


# --- the vault and the CA key are not readable -----------------------------------------------

VAULT_PROBE = r"""
import hashlib, json, os, sys
home = sys.argv[1]
out = {"listing": sorted(os.listdir(home)), "certs": sorted(os.listdir(os.path.join(home, "certs")))}
for rel in ("vault/key", "vault/vault.json", "certs/mitmproxy-ca.pem", "config/rules.yaml", "audit"):
    try:
        with open(os.path.join(home, rel), "rb") as f:
            out[rel] = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        out[rel] = e.strerror
for rel in ("certs/mitmproxy-ca-cert.pem", "certs/keyveil-bundle.pem"):
    with open(os.path.join(home, rel), "rb") as f:
        out[rel] = hashlib.sha256(f.read()).hexdigest()
print(json.dumps(out))
"""

# Ways a process could try to take the hiding mount away; none may show the key file.
UNHIDE = r"""
H="$KEYVEIL_HOME"
umount "$H" 2>/dev/null; umount -l "$H" 2>/dev/null
test -e "$H/vault/key" && echo "LEAK: umount"
unshare -rm sh -c '
  umount -l "$1" 2>/dev/null; test -e "$1/vault/key" && echo "LEAK: umount in a nested namespace"
  mkdir -p /tmp/peek && mount --bind "$(dirname "$1")" /tmp/peek 2>/dev/null &&
    test -e "/tmp/peek/$(basename "$1")/vault/key" && echo "LEAK: bind mount of the parent"
  mount --rbind "$(dirname "$1")" /tmp/peek 2>/dev/null &&
    test -e "/tmp/peek/$(basename "$1")/vault/key" && echo "LEAK: recursive bind mount"
' sh "$H" 2>/dev/null
echo "checked"
"""


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_vault_and_the_ca_key_are_hidden_and_the_ca_certificate_is_not(kvi, routed, tmp_path):
    home = kvi.home
    for secret_file in ("vault/key", "vault/vault.json", "certs/mitmproxy-ca.pem"):
        assert (home / secret_file).is_file(), secret_file  # they exist, outside
    r = run(kvi, "--", sys.executable, "-c", VAULT_PROBE, str(home), cwd=tmp_path)
    assert r.returncode == 0, r.err
    seen = json.loads(r.out)
    assert seen["listing"] == ["certs"]
    assert seen["certs"] == ["keyveil-bundle.pem", "mitmproxy-ca-cert.pem"]
    for rel in ("vault/key", "vault/vault.json", "certs/mitmproxy-ca.pem", "config/rules.yaml", "audit"):
        assert seen[rel] == "No such file or directory", rel
    assert seen["certs/mitmproxy-ca-cert.pem"] == _sha(home / "certs" / "mitmproxy-ca-cert.pem")
    assert seen["certs/keyveil-bundle.pem"] == _sha(home / "certs" / "keyveil-bundle.pem")


def test_the_hiding_mount_cannot_be_undone_from_inside(kvi, routed, tmp_path):
    r = run(kvi, "--", "sh", "-c", UNHIDE, cwd=tmp_path)
    assert r.returncode == 0, r.err
    assert "checked" in r.out
    assert "LEAK" not in r.out


def test_sys_is_read_only_in_the_sandbox(kvi, routed, tmp_path):
    # Most of /sys is guarded by file modes alone, and root in the sandbox is uid 0 for them.
    script = "import sys; print([l.split()[5] for l in open('/proc/self/mountinfo') if l.split()[4] == '/sys'][-1])"
    r = run(kvi, "--", sys.executable, "-c", script, cwd=tmp_path)
    assert r.returncode == 0, r.err
    assert "ro" in r.out.strip().split(",")


# --- environment, exit codes, signals ---------------------------------------------------------


def _env_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.split("\0") if "=" in line)


def test_the_environment_is_that_of_keyveil_run_without_any_secret_variable(kvi, routed, tmp_path):
    value = lambda: secrets.token_urlsafe(18)  # noqa: E731
    secret_vars = {
        name: value()
        for name in (
            "KEYVEIL_PASSPHRASE",
            "KEYVEIL_SECRET_GITHUB__PAT",
            "KEYVEIL_PROXYAUTH",
            "BAO_TOKEN",
            "VAULT_TOKEN",
            "BAO_SECRET_ID",
            "KEYVEIL_BAO_ROLE_ID",
        )
    }
    kvi.values.update({f"env/{k}": v.encode() for k, v in secret_vars.items()})  # grep every output for them
    kept = {"BAO_ADDR": "https://bao.test.keyveil", "KEYVEIL_TEST_KEPT": "kept"}
    inside = run(kvi, "--", "env", "-0", env={**secret_vars, **kept}, cwd=tmp_path)
    plain = run(kvi, "--", "env", "-0", env={**secret_vars, **kept}, cwd=tmp_path, isolate=False)
    assert inside.returncode == plain.returncode == 0, inside.err + plain.err
    env, plain_env = _env_of(inside.out), _env_of(plain.out)
    assert not set(secret_vars) & set(env)
    assert not set(secret_vars) & set(plain_env)
    assert {k: env[k] for k in kept} == kept
    ignore = {"PWD", "OLDPWD", "_", "SHLVL"}
    assert {k: v for k, v in env.items() if k not in ignore} == {k: v for k, v in plain_env.items() if k not in ignore}
    assert env["HTTPS_PROXY"] == routed.url
    assert env["SSL_CERT_FILE"] == str(kvi.home / "certs" / "keyveil-bundle.pem")


@pytest.mark.parametrize(("script", "code"), [("exit 7", 7), ("exit 0", 0), ("kill -TERM $$", 128 + 15), ("kill -KILL $$", 128 + 9)])
def test_the_exit_code_and_a_fatal_signal_pass_through(kvi, routed, script, code, tmp_path):
    r = run(kvi, "--", "sh", "-c", script, cwd=tmp_path)
    assert r.returncode == code, r.err


def test_a_missing_command_is_a_usage_error(kvi, routed, tmp_path):
    r = run(kvi, "--", "keyveil-no-such-command", cwd=tmp_path)
    assert r.returncode == 1
    assert "command not found in the sandbox: keyveil-no-such-command" in r.err


def test_a_command_under_the_private_tmp_is_shown_with_ro(kvi, routed, tmp_path):
    tools = Path(tempfile.mkdtemp(prefix="keyveil-test-", dir="/tmp"))
    try:
        tool = tools / "tool"
        tool.write_text("#!/bin/sh\necho tool ran\n")
        tool.chmod(0o755)
        r = run(kvi, "--", str(tool), cwd=tmp_path)
        assert r.returncode == 1
        assert f"command not found in the sandbox: {tool} ({tool} lies under /tmp" in r.err
        assert "show what it needs with --ro PATH" in r.err
        r = run(kvi, "--ro", str(tools), "--", str(tool), cwd=tmp_path)
        assert (r.returncode, r.out) == (0, "tool ran\n"), r.err
    finally:
        shutil.rmtree(tools, ignore_errors=True)


def test_keyveil_installed_under_tmp_shows_nothing_of_itself_in_the_sandbox(kvi, routed, tmp_path):
    # As in CI, where the checkout and its venv live under /tmp: the helper
    # inside runs on the base interpreter, so the sandbox's /tmp stays empty.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    site = next(p for p in sys.path if p.startswith(sys.prefix) and p.endswith("site-packages"))
    env = {**kvi.env, "PYTHONPATH": os.pathsep.join([str(infra.REPO / "src"), site])}
    cmd = [str(venv / "bin" / "python"), "-m", "keyveil", "run", "--isolate", "--", "find", "/tmp"]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, env=env, cwd="/", timeout=60)
    kvi.outputs += [r.stdout, r.stderr]
    assert r.returncode == 0, r.stderr.decode()
    seen = {Path(line) for line in r.stdout.decode().splitlines()}
    assert kvi.home / "certs" / "keyveil-bundle.pem" in seen  # the run went through keyveil's sandbox
    # Only KEYVEIL_HOME (where it lies under /tmp, as here) and nothing of the venv.
    assert {p for p in seen if not (_isolate._inside(p, kvi.home) or _isolate._inside(kvi.home, p))} == set()


SIGNALLED = r"""
import signal, sys, time
def on(sig, _):
    print(signal.Signals(sig).name, flush=True)
    if sig == signal.SIGTERM:
        sys.exit(9)
for s in (signal.SIGUSR1, signal.SIGWINCH, signal.SIGTERM):
    signal.signal(s, on)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def _read_until(stream, text: str, timeout: float = 20) -> str:
    seen = b""
    deadline = time.monotonic() + timeout
    fd = stream if isinstance(stream, int) else stream.fileno()
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], f"{text!r} not seen; got {seen!r}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # a pty whose other side is gone
            chunk = b""
        assert chunk, f"{text!r} not seen before end of output; got {seen!r}"
        seen += chunk
    return seen.decode(errors="replace")


def test_signals_sent_to_keyveil_reach_the_command(kvi, routed, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyveil", "run", "--isolate", *SHOW_VENV, "--", sys.executable, "-c", SIGNALLED],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=kvi.env,
        cwd=tmp_path,
    )
    try:
        _read_until(proc.stdout, "ready")
        proc.send_signal(signal.SIGUSR1)
        _read_until(proc.stdout, "SIGUSR1")
        proc.send_signal(signal.SIGWINCH)
        _read_until(proc.stdout, "SIGWINCH")
        proc.send_signal(signal.SIGTERM)
        _read_until(proc.stdout, "SIGTERM")
        assert proc.wait(20) == 9
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    kvi.outputs.append(proc.stderr.read())


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_ctrl_z_stops_the_sandbox_with_keyveil_and_fg_resumes_both(kvi, routed, tmp_path):
    marker = _marker()
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyveil", "run", "--isolate", "--", "sh", "-c", f"echo ready; exec sleep {marker}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=kvi.env,
        cwd=tmp_path,
    )
    try:
        _read_until(proc.stdout, "ready")
        deadline = time.monotonic() + 10
        while not _processes_with(marker):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (sleeper,) = _processes_with(marker)
        proc.send_signal(signal.SIGTSTP)  # what Ctrl-Z sends to the terminal's job
        deadline = time.monotonic() + 10
        while (_state(proc.pid), _state(sleeper)) != ("T", "T"):
            assert time.monotonic() < deadline, (_state(proc.pid), _state(sleeper))
            time.sleep(0.05)
        proc.send_signal(signal.SIGCONT)  # what `fg` sends
        deadline = time.monotonic() + 10
        while "T" in (_state(proc.pid), _state(sleeper)):
            assert time.monotonic() < deadline, (_state(proc.pid), _state(sleeper))
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    kvi.outputs.append(proc.stderr.read())
    assert _processes_with(marker) == []


def _in_a_terminal(args: list[str], env: dict, cwd: Path) -> tuple[subprocess.Popen, int]:
    """ARGS as the foreground job of a new terminal (a pty): typing ^C there is a real Ctrl-C."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        args,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )
    os.close(slave)
    return proc, master


IGNORES_CTRL_C = r"""
import signal, subprocess, sys, time
subprocess.Popen(["sleep", sys.argv[1]], start_new_session=True)  # out of reach of Ctrl-C: only the end of the sandbox ends it
signal.signal(signal.SIGINT, lambda *_: print("interrupted, going on", flush=True))
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_ctrl_c_reaches_the_command_once_and_a_second_one_ends_the_sandbox(kvi, routed, tmp_path):
    marker = _marker()
    cmd = [sys.executable, "-m", "keyveil", "run", "--isolate", *SHOW_VENV, "--", sys.executable, "-c", IGNORES_CTRL_C, marker]
    proc, tty = _in_a_terminal(cmd, kvi.env, tmp_path)
    try:
        _read_until(tty, "ready")
        assert _processes_with(marker)
        os.write(tty, b"\x03")
        seen = _read_until(tty, "interrupted, going on")
        assert proc.poll() is None
        os.write(tty, b"\x03")
        assert proc.wait(20) == 130
        time.sleep(0.3)
        with contextlib.suppress(OSError):
            seen += os.read(tty, 65536).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        os.close(tty)
    assert seen.count("interrupted, going on") == 1  # the first Ctrl-C reached it exactly once
    assert _processes_with(marker) == []


def test_ctrl_c_ends_a_command_that_does_not_catch_it(kvi, routed, tmp_path):
    marker = _marker()
    script = f"sleep {marker} & echo ready; wait"
    proc, tty = _in_a_terminal([sys.executable, "-m", "keyveil", "run", "--isolate", "--", "sh", "-c", script], kvi.env, tmp_path)
    try:
        _read_until(tty, "ready")
        os.write(tty, b"\x03")
        assert proc.wait(20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        os.close(tty)
    assert _processes_with(marker) == []


def test_a_dying_proxy_ends_the_sandbox(kvi, upstream, tmp_path):
    marker = _marker()
    with keyveil_proxy(upstream, tmp_path / "proxy", kvi, options={"confdir": kvi.home / "certs"}) as proxy, _state_of(kvi.home, proxy):
        sandbox = subprocess.Popen(
            [sys.executable, "-m", "keyveil", "run", "--isolate", "--", "sh", "-c", f"sleep {marker} & wait"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=kvi.env,
            cwd=tmp_path,
        )
        try:
            deadline = time.monotonic() + 20
            while not _processes_with(marker):
                assert sandbox.poll() is None, sandbox.stderr.read()
                assert time.monotonic() < deadline, "the command did not start"
                time.sleep(0.05)
            proxy_pid = proxy.process.pid
            proxy.stop()
            assert sandbox.wait(20) == 2
        finally:
            if sandbox.poll() is None:
                sandbox.kill()
            sandbox.wait(10)
    err = sandbox.stderr.read().decode()
    kvi.outputs += [err.encode(), proxy.output().encode()]
    assert f"the proxy (pid {proxy_pid}) exited; ending the sandbox" in err
    assert _processes_with(marker) == []


def test_nothing_is_left_behind_when_the_command_exits(kvi, routed, tmp_path):
    marker = _marker()
    # A daemon in a session of its own, which would outlive CMD anywhere else.
    r = run(kvi, "--", "sh", "-c", f"setsid sleep {marker} </dev/null >/dev/null 2>&1 & exit 0", cwd=tmp_path)
    assert r.returncode == 0, r.err
    assert _processes_with(marker) == []  # at once: keyveil returns only when the sandbox is empty


PROXY_STATUS = r"""
import os, socket, urllib.parse, sys
u = urllib.parse.urlparse(os.environ["HTTP_PROXY"])
s = socket.create_connection((u.hostname, u.port), timeout=10)
s.sendall(f"GET http://127.0.0.1:{sys.argv[1]}/ HTTP/1.1\r\nHost: 127.0.0.1:{sys.argv[1]}\r\n\r\n".encode())
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(4096)
lines = head.decode().split("\r\n")
block = [l.split(":", 1)[1].strip() for l in lines if l.lower().startswith("x-keyveil-block:")]
print(lines[0].split()[1], *block)
"""


@pytest.mark.timeout(90)
def test_with_a_private_proxy_the_proxy_is_reachable_and_gone_afterwards(tmp_path, bwrap):
    setup = KeyveilSetup(tmp_path / "home", base_env(tmp_path / "home"), fake_values())
    assert keyveil(setup.env, "init").returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    r = run(setup, "--", sys.executable, "-c", PROXY_STATUS, str(closed), cwd=tmp_path, timeout=80)
    assert r.returncode == 0, r.err
    # The private proxy, outside, took the request, and refused the sandbox the host's loopback.
    assert r.out.strip() == "421 host_mismatch"
    still = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and f"KEYVEIL_HOME={setup.home}\0".encode() in (entry / "environ").read_bytes():
                still.append(int(entry.name))
    assert still == []


# --- paths: --ro, --rw, --hide -------------------------------------------------------------------

PATHS_PROBE = r"""
import json, os, sys
ro, rw, hidden_dir, hidden_file, other = sys.argv[1:6]
out = {}
def attempt(name, fn):
    try:
        out[name] = fn()
    except OSError as e:
        out[name] = e.strerror
def write(path):
    with open(path, "w") as f:
        f.write("x")
    return "written"
attempt("read ro", lambda: open(os.path.join(ro, "file")).read())
attempt("write ro", lambda: write(os.path.join(ro, "new")))
attempt("write rw", lambda: write(os.path.join(rw, "new")))
attempt("list hidden dir", lambda: os.listdir(hidden_dir))
attempt("read hidden file", lambda: open(hidden_file).read())
attempt("list a directory in /tmp not given", lambda: os.listdir(other))
attempt("write cwd", lambda: write("cwd-file"))
print(json.dumps(out))
"""


def test_ro_rw_and_hide(kvi, routed, tmp_path):
    ro, rw, hidden, other = (tmp_path / n for n in ("ro", "rw", "hidden", "other"))
    for d in (ro, rw, hidden, other):
        d.mkdir()
    (ro / "file").write_text("read me")
    (hidden / "secret").write_text("not for the agent")
    hidden_file = tmp_path / "hidden-file"
    hidden_file.write_text("not for the agent either")
    work = tmp_path / "work"
    work.mkdir()
    r = run(
        kvi,
        "--ro", str(ro), "--rw", str(rw), "--rw", str(hidden), "--hide", str(hidden), "--hide", str(hidden_file),
        "--", sys.executable, "-c", PATHS_PROBE, str(ro), str(rw), str(hidden), str(hidden_file), str(other),
        cwd=work,
    )  # fmt: skip
    assert r.returncode == 0, r.err
    assert json.loads(r.out) == {
        "read ro": "read me",
        "write ro": "Read-only file system",
        "write rw": "written",
        "list hidden dir": [],  # a later --hide wins over an earlier --rw
        "read hidden file": "Permission denied",
        "list a directory in /tmp not given": "No such file or directory",
        "write cwd": "written",  # the working directory stays writable, though under /tmp
    }
    assert (rw / "new").read_text() == "x"
    assert not (ro / "new").exists()
    assert (work / "cwd-file").exists()


READ_ONLY_ROOT = r"""
import json, os, sys
probe = sys.argv[1]
out = {"pids": len([d for d in os.listdir("/proc") if d.isdigit()]), "home": sorted(os.listdir(sys.argv[2]))}
try:
    open(probe, "w").close()
    out["write outside cwd"] = "written"
except OSError as e:
    out["write outside cwd"] = e.strerror
print(json.dumps(out))
"""


def test_ro_root_keeps_the_sandbox_own_proc_tmp_and_hidden_home(kvi, routed, tmp_path):
    # A writable host directory outside the private areas, wherever the checkout lives.
    probe = Path(tempfile.mkdtemp(prefix="keyveil-test-", dir="/var/tmp")) / "probe"
    try:
        r = run(kvi, "--ro", "/", "--", sys.executable, "-c", READ_ONLY_ROOT, str(probe), str(kvi.home), cwd=tmp_path)
        assert r.returncode == 0, r.err
        seen = json.loads(r.out)
        assert seen["write outside cwd"] == "Read-only file system"
        assert seen["pids"] < 5  # the sandbox's own /proc, not the host's
        assert seen["home"] == ["certs"]
        assert not probe.exists()
    finally:
        shutil.rmtree(probe.parent, ignore_errors=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rw", "{home}/vault"], "is inside KEYVEIL_HOME"),
        (["--ro", "{tmp}/no-such-dir"], "no such file or directory"),
        (["--rw", "/proc/1"], "the sandbox has its own /proc"),
        (["--hide", "/"], "hiding / leaves nothing to run"),
    ],
)
def test_path_options_keyveil_cannot_honour_are_refused_before_anything_runs(kvi, routed, tmp_path, args, message):
    args = [a.format(home=kvi.home, tmp=tmp_path) for a in args]
    marker = tmp_path / "ran"
    r = run(kvi, *args, "--", "touch", str(marker), cwd=tmp_path)
    assert r.returncode == 1
    assert message in r.err
    assert not marker.exists()


def test_path_options_need_isolate_and_the_home_is_no_working_directory(kvi, routed, tmp_path):
    r = run(kvi, "--ro", str(tmp_path), "--", "true", cwd=tmp_path, isolate=False)
    assert (r.returncode, "use them with --isolate" in r.err) == (1, True)
    r = run(kvi, "--", "true", cwd=kvi.home / "certs")
    assert (r.returncode, "is inside KEYVEIL_HOME" in r.err) == (1, True)
    r = run(kvi, "--hide", str(tmp_path / "nothing-here"), "--", "true", cwd=tmp_path)
    assert (r.returncode, "nothing to hide" in r.err) == (0, True)


# --- fail closed -------------------------------------------------------------------------------


def test_without_bubblewrap_the_command_is_not_run(kvi, routed, tmp_path):
    marker = tmp_path / "ran"
    r = run(kvi, "--", "touch", str(marker), env={"PATH": str(tmp_path / "empty-bin")}, cwd=tmp_path)
    assert r.returncode == 2
    assert r.err == (
        "keyveil: --isolate: bubblewrap (bwrap) is not installed, or not on PATH.\n"
        "  To enable it: install bubblewrap: `sudo apt-get install bubblewrap` (Debian, Ubuntu), "
        "`sudo dnf install bubblewrap` (Fedora, RHEL), `sudo pacman -S bubblewrap` (Arch), "
        "`sudo apk add bubblewrap` (Alpine).\n"
        "  touch was not run: keyveil never runs it unisolated.\n"
    )
    assert not marker.exists()


def test_where_the_kernel_allows_no_namespaces_the_command_is_not_run(kvi, routed, tmp_path):
    # A user namespace whose limit is 0 is a kernel that forbids them, without touching the host's setting.
    marker = tmp_path / "ran"
    limit = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    cmd = ["unshare", "--user", "--map-root-user", "sh", "-c", limit, "sh", sys.executable, "-m", "keyveil"]
    cmd += ["run", "--isolate", "--", "touch", str(marker)]
    r = subprocess.run(cmd, capture_output=True, env=kvi.env, cwd=tmp_path, timeout=60)
    kvi.outputs += [r.stdout, r.stderr]
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert err.startswith("keyveil: --isolate: the kernel allows no user namespaces here (user.max_user_namespaces = 0).\n")
    assert "To enable it: run `sudo sysctl -w user.max_user_namespaces=15000`" in err
    assert "touch was not run: keyveil never runs it unisolated." in err
    assert not marker.exists()


@pytest.mark.parametrize(
    ("stderr", "facts", "expected"),
    [
        (
            "bwrap: No permissions to creating new namespace, likely because the kernel does not allow non-privileged user namespaces.",
            {"root": False, "unprivileged_userns_clone": 0},
            "kernel.unprivileged_userns_clone = 0",
        ),
        (
            "bwrap: setting up uid map: Permission denied",
            {"root": False, "apparmor_restrict": 1},
            "apparmor_restrict_unprivileged_userns = 1",
        ),
        ("bwrap: Creating new namespace failed: Operation not permitted", {"root": True, "container": True}, "this container forbids"),
        ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", {"root": False}, "fresh /proc"),
        ("bwrap: Unknown option --perms", {}, "too old"),
        ("bwrap: Can't find source path /x: No such file or directory", {}, "bubblewrap could not create the sandbox"),
    ],
)
def test_the_diagnosis_names_what_is_missing(stderr, facts, expected):
    what, fix = _isolate.diagnose(stderr, facts)
    assert expected in what
    assert fix


def test_a_sandbox_that_is_not_sealed_is_refused(kvi, monkeypatch):
    # The helper inside checks the sandbox before it becomes CMD: without a
    # network namespace of its own it must refuse, and the doctor must say so.
    monkeypatch.setattr(_isolate, "_NAMESPACES", tuple(n for n in _isolate._NAMESPACES if n != "--unshare-net"))
    works, found, _ = _isolate.check(_isolate.Home(kvi.home), env={**os.environ, "HOME": str(kvi.home.parent)})
    assert not works
    assert "network interfaces besides loopback" in found


# --- policy and doctor ----------------------------------------------------------------------------


@contextlib.contextmanager
def _rules(home: Path, extra_policy: str):
    rules = home / "config" / "rules.yaml"
    before = rules.read_text()
    rules.write_text(before.replace("policy:\n", f"policy:\n  {extra_policy}\n", 1))
    try:
        yield rules
    finally:
        rules.write_text(before)


def test_require_isolation_refuses_a_bare_run_and_allows_an_isolated_one(kvi, routed, tmp_path):
    marker = tmp_path / "ran"
    with _rules(kvi.home, "require_isolation: true") as rules:
        bare = run(kvi, "--", "touch", str(marker), cwd=tmp_path, isolate=False)
        assert bare.returncode == 1
        assert bare.err == (
            f"keyveil: {rules} sets policy.require_isolation: true, so touch was not run: "
            f"run it as `keyveil run --isolate -- touch {marker}`\n"
        )
        assert not marker.exists()
        isolated = run(kvi, "--", "touch", str(marker), cwd=tmp_path)
        assert isolated.returncode == 0, isolated.err
        assert marker.exists()


def test_require_isolation_takes_only_a_boolean(kvi, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text('version: 1\npolicy:\n  require_isolation: "yes"\n')
    r = keyveil(kvi.env, "rules", "check", str(rules))
    assert r.returncode == 1
    assert f"{rules}:3: policy.require_isolation:" in r.stderr.decode()


def test_doctor_reports_whether_isolation_works(kvi, routed, tmp_path):
    r = keyveil(kvi.env, "doctor")
    kvi.outputs += [r.stdout, r.stderr]
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    assert re.search(r"^ok   isolation \(keyveil run --isolate\): bubblewrap [\d.]+: .*reaches only the proxy", r.stdout.decode(), re.M)

    no_bwrap = {**kvi.env, "PATH": str(tmp_path / "empty-bin")}
    r = keyveil(no_bwrap, "doctor")
    out = r.stdout.decode()
    assert r.returncode == 0, out  # unisolated keyveil still works: a note
    assert "note isolation (keyveil run --isolate) is not available: bubblewrap (bwrap) is not installed" in out
    with _rules(kvi.home, "require_isolation: true"):
        r = keyveil(no_bwrap, "doctor")
    out = r.stdout.decode()
    assert r.returncode == 2, out
    assert "FAIL isolation (keyveil run --isolate): bubblewrap (bwrap) is not installed" in out
    assert "the rules require isolation" in out


# --- a real harness: Codex completes a turn inside the sandbox ------------------------------------


def _sse(events: list[dict]) -> list[bytes]:
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


@pytest.mark.timeout(120)
def test_codex_completes_a_turn_inside_the_sandbox(kvi, routed, up, codex, tmp_path):
    answer = f"MOCK-ANSWER-{secrets.token_hex(4)}"
    up.set_response(
        "/v1/responses",
        200,
        [("content-type", "text/event-stream")],
        _sse(
            [
                {"type": "response.created", "response": {"id": "resp_1"}},
                {
                    "type": "response.output_item.done",
                    "output_index": 0,
                    "item": {"type": "message", "role": "assistant", "id": "msg_1", "content": [{"type": "output_text", "text": answer}]},
                },
                {
                    "type": "response.completed",
                    "response": {"id": "resp_1", "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}},
                },
            ]
        ),
    )
    codex_home, work = tmp_path / "codex-home", tmp_path / "work"
    codex_home.mkdir()
    work.mkdir()
    provider = {
        "model_provider": '"mock"',
        "model_providers.mock.name": '"mock"',
        "model_providers.mock.base_url": '"https://codex.test.keyveil/v1"',
        "model_providers.mock.env_key": '"MOCK_PROVIDER_KEY"',
        "model_providers.mock.wire_api": '"responses"',
    }
    args = [str(codex), "exec", "--skip-git-repo-check", "-m", "mock-model"]
    for key, value in provider.items():
        args += ["-c", f"{key}={value}"]
    args.append("Say the answer.")
    env = {"CODEX_HOME": str(codex_home), "MOCK_PROVIDER_KEY": "{{secret:codex/key}}", "RUST_LOG": "error"}
    r = run(kvi, "--rw", str(codex_home), "--", *args, env=env, cwd=work, timeout=110)
    assert r.returncode == 0, r.err[-3000:]
    assert answer in r.out
    turns = [q for q in up.requests if q.path == "/v1/responses" and q.method == "POST"]
    assert turns, [q.path for q in up.requests]
    value = kvi.values["codex/key"].decode()
    assert turns[0].header("authorization") == f"Bearer {value}"
    assert turns[0].sni == "codex.test.keyveil"
    assert value not in r.out + r.err


# --- as an unprivileged user --------------------------------------------------------------------


def _reachable_paths_script(uid: int, needed: list[Path], stash: Path) -> str:
    """Shell that, in a private mount namespace, makes NEEDED reachable to UID when an
    ancestor directory is closed to it (e.g. a Python under /root), then becomes UID."""
    lines = ["set -e"]
    covers: dict[Path, list[Path]] = {}
    for path in needed:
        closed = next((a for a in reversed(path.parents) if not os.stat(a).st_mode & 0o001), None)
        if closed is not None:
            covers.setdefault(closed, []).append(path)
    covers = {d: ps for d, ps in covers.items() if not any(o != d and o in d.parents for o in covers)}
    i = 0
    for paths in covers.values():
        for path in paths:
            lines.append(f"mkdir -p {stash}/{i} && mount --bind {shlex.quote(str(path))} {stash}/{i}")
            i += 1
    i = 0
    for closed, paths in covers.items():
        lines.append(f"mount -t tmpfs -o mode=0755 keyveil-test {shlex.quote(str(closed))}")
        for path in paths:
            lines.append(f"mkdir -p {shlex.quote(str(path))} && mount --bind {stash}/{i} {shlex.quote(str(path))}")
            i += 1
    lines.append(f'exec setpriv --reuid={uid} --regid={uid} --clear-groups --inh-caps=-all --bounding-set=-all -- "$@"')
    return "\n".join(lines)


@pytest.fixture
def unprivileged(tmp_path, bwrap):
    """A UID with no passwd entry and no privilege, and a wrapper that runs a command as it."""
    if os.geteuid() != 0:
        pytest.skip("creating an unprivileged user needs root (these tests run as root in CI)")
    uid = next(u for u in (random.randint(40000, 59999) for _ in range(100)) if not _has_passwd_entry(u))
    base = Path(tempfile.mkdtemp(prefix="keyveil-unpriv-"))
    os.chmod(base, 0o755)
    stash = Path(tempfile.mkdtemp(prefix="keyveil-stash-"))
    needed = [Path(os.path.realpath(sys.base_prefix)), Path(os.path.realpath(sys.prefix)), infra.REPO]
    wrapper = stash / "as-user.sh"
    wrapper.write_text(
        "#!/bin/sh\nexec unshare --mount --propagation private -- sh -c "
        + shlex.quote(_reachable_paths_script(uid, needed, stash))
        + ' sh "$@"\n'
    )
    wrapper.chmod(0o700)
    for name in ("home", "kvhome", "work"):
        (base / name).mkdir()
        os.chown(base / name, uid, uid)
    try:
        yield uid, wrapper, base
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(stash, ignore_errors=True)


def _has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


UNPRIVILEGED_PROBE = (
    r"""
id -u
curl -sS --fail -u 'x-access-token:{{secret:github/pat}}' "$1" || echo "curl failed"
cat "$KEYVEIL_HOME/vault/key" >/dev/null 2>&1 && echo "LEAK: vault key"
cat "$KEYVEIL_HOME/certs/mitmproxy-ca.pem" >/dev/null 2>&1 && echo "LEAK: CA key"
curl -sS -k --noproxy '*' -m 10 -o /dev/null "https://127.0.0.1:$2/" 2>/dev/null && echo "LEAK: host loopback"
"""
    + UNHIDE
)


@pytest.mark.timeout(120)
def test_as_an_unprivileged_user(unprivileged, upstream, up):
    uid, wrapper, base = unprivileged
    home = base / "kvhome"
    env = {**base_env(home), "HOME": str(base / "home")}
    pat = "ghp_" + secrets.token_urlsafe(27)
    outputs: list[bytes] = []

    def as_user(*args: str, stdin: bytes = b"", timeout: float = 60) -> subprocess.CompletedProcess:
        done = subprocess.run([str(wrapper), *args], input=stdin, capture_output=True, env=env, cwd=base / "work", timeout=timeout)
        outputs.extend([done.stdout, done.stderr])
        return done

    kernel_allows = as_user("unshare", "--user", "true").returncode == 0
    assert as_user(sys.executable, "-m", "keyveil", "init").returncode == 0
    (home / "config" / "rules.yaml").write_text(_rules_for(upstream).replace("{max_body}", "1048576"))
    assert as_user(sys.executable, "-m", "keyveil", "secret", "set", "github/pat", stdin=pat.encode()).returncode == 0
    up.set_git_credentials("x-access-token", pat)
    mitmdump = base / "mitmdump-as-user.sh"
    mitmdump.write_text(f'#!/bin/sh\nexec {shlex.quote(str(wrapper))} {shlex.quote(str(infra.MITMDUMP))} "$@"\n')
    mitmdump.chmod(0o755)
    work = base / "proxy"
    work.mkdir()
    upstream_ca = base / "upstream-ca.pem"  # the upstream's own copy is in a directory only root can read
    shutil.copyfile(upstream.ca_pem, upstream_ca)
    os.chmod(upstream_ca, 0o644)
    options = {
        **infra.route_options(upstream),
        "ssl_verify_upstream_trusted_ca": upstream_ca,
        "keyveil_home": home,
        "confdir": home / "certs",
    }
    proxy = infra.ProxyProcess([infra.KEYVEIL_ADDON, infra.ROUTE_ADDON], options, workdir=work, env=env, mitmdump=mitmdump)
    with proxy:
        _write_state(home, proxy)
        r = as_user(
            sys.executable, "-m", "keyveil", "run", "--isolate", "--", "sh", "-c", UNPRIVILEGED_PROBE, "sh", GIT_URL, str(upstream.tls_port)
        )
    outputs.append(proxy.output().encode())
    out, err = r.stdout.decode(), r.stderr.decode()
    if not kernel_allows:  # then keyveil must refuse, never run it unisolated
        assert r.returncode == 2, err
        assert "was not run: keyveil never runs it unisolated" in err
        return
    assert r.returncode == 0, err
    assert out.splitlines()[0] == str(uid)
    assert infra.GIT_SHA.decode() in out, err + proxy.output()[-3000:]
    assert "checked" in out
    assert "LEAK" not in out
    assert up.requests[-1].header("authorization") == _basic(pat)
    assert not [i for i, o in enumerate(outputs) if pat.encode() in o or base64.b64encode(pat.encode()) in o]
