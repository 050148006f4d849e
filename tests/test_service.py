"""`keyveil service install | uninstall | status` (SPEC §10), with real processes.

systemd's own tools judge what install writes: `systemd-analyze verify` the
unit, and systemd's environment.d generator (the program a user manager runs
at login) parses the environment.d file. A systemd user manager cannot run in
this container — PID 1 is not systemd, and `systemd --user` exits with
"Trying to run as user instance, but the system has not been booted with
systemd" — so the unit's ExecStart line is run here by hand, with the
environment the manager would give it: the generator's output, plus the
unit's Environment=, minus its UnsetEnvironment=.

Every test works in its own HOME and XDG_CONFIG_HOME, with XDG_RUNTIME_DIR and
the session bus pointed at nothing, so `systemctl --user` can never reach the
user manager of whoever runs the tests.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(90)

GENERATOR_DIRS = ("/usr/lib/systemd/user-environment-generators", "/lib/systemd/user-environment-generators")
SESSION_VARS = (
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "NO_PROXY",
    "no_proxy",
    "NODE_EXTRA_CA_CERTS",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "CODEX_CA_CERTIFICATE",
)
REF = "{{secret:github/pat}}"


# -- systemd's tools ---------------------------------------------------------------------


def _generator() -> str | None:
    for d in GENERATOR_DIRS:
        path = Path(d) / "30-systemd-environment-d-generator"
        if os.access(path, os.X_OK):
            return str(path)
    return None


@pytest.fixture(scope="session")
def systemd_tools() -> dict[str, str]:
    """systemd-analyze and the environment.d generator, from Debian's `systemd` package if missing."""
    if (shutil.which("systemd-analyze") is None or _generator() is None) and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "systemd"],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            capture_output=True,
            timeout=600,
        )
    analyze, generator = shutil.which("systemd-analyze"), _generator()
    if analyze is None or generator is None:
        pytest.skip("systemd-analyze or systemd-environment-d-generator is missing and apt-get could not install `systemd`")
    return {"analyze": analyze, "generator": generator}


def verify(tools, unit: Path, runtime: Path) -> subprocess.CompletedProcess:
    # --user needs a runtime directory, as a user manager has; nothing else of one.
    return subprocess.run(
        [tools["analyze"], "verify", "--user", str(unit)],
        env={"PATH": os.environ["PATH"], "XDG_RUNTIME_DIR": str(runtime), "HOME": str(runtime)},
        capture_output=True,
        text=True,
        timeout=30,
    )


def session_env(tools, env: dict[str, str]) -> dict[str, str]:
    """What a new login session of the user gets from environment.d, as systemd parses it."""
    out = subprocess.run(
        [tools["generator"]],
        env={"PATH": os.environ["PATH"], "HOME": env["HOME"], **({"XDG_CONFIG_HOME": env["XDG_CONFIG_HOME"]} if "XDG_CONFIG_HOME" in env else {})},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    result = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        result[key] = shlex.split(value)[0] if value else ""  # it shell-quotes what needs quoting
    return result


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections → key → every value (systemd unit syntax, as far as keyveil's unit uses it)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def service_environment(unit: dict, session: dict[str, str], home: str, runtime: str) -> dict[str, str]:
    """The environment a systemd user manager gives the unit's ExecStart."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": runtime}
    env.update(session)
    for value in unit["Service"].get("Environment", []):
        for word in shlex.split(value):
            k, _, v = word.partition("=")
            env[k] = v
    for value in unit["Service"].get("UnsetEnvironment", []):
        for name in value.split():
            env.pop(name, None)
    return env


# -- helpers ---------------------------------------------------------------------------------


class Relay:
    """TCP from HOST:<free port> to 127.0.0.1:TARGET: the one upstream under a second loopback
    address, since NO_PROXY names 127.0.0.1 and a client would not use the proxy for it."""

    def __init__(self, host: str, target: int) -> None:
        self.server = socket.create_server((host, 0))
        self.host, self.port = host, self.server.getsockname()[1]
        self.target, self.accepted = target, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_listening(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while not listening(port):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the proxy did not listen"
        time.sleep(0.05)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ROOT: kind, mode and bytes (or link target)."""
    out: dict[str, tuple] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            out[rel] = ("dir", stat.S_IMODE(st.st_mode))
        else:
            out[rel] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes())
    return out


def curl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--max-time", "20", *args], env=env, capture_output=True, timeout=30)


RULES = """\
version: 1
providers:
  builtin: true
  hosts: ["127.0.0.3:{provider_port}"]
secrets:
  github/pat:
    hosts: [api.github.com, "127.0.0.2:{bound_port}"]
    inject: [{{header: Authorization}}]
    allow_http: true
"""


@pytest.fixture(scope="module")
def relays(upstream):
    bound, provider = Relay("127.0.0.2", upstream.plain_port), Relay("127.0.0.3", upstream.plain_port)
    yield bound, provider
    bound.close()
    provider.close()


@pytest.fixture(scope="module")
def kv(relays, tmp_path_factory):
    bound, provider = relays
    return make_home(tmp_path_factory.mktemp("svc"), RULES.format(bound_port=bound.port, provider_port=provider.port))


@pytest.fixture
def user(kv, tmp_path) -> dict[str, str]:
    """The environment of a shell of the user: its own HOME and config tree, no manager to reach."""
    home, runtime = tmp_path / "user", tmp_path / "run"
    home.mkdir()
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in kv.env.items() if k not in SESSION_VARS}
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_RUNTIME_DIR=str(runtime),
        DBUS_SESSION_BUS_ADDRESS=f"unix:path={runtime}/no-bus",
    )
    return env


def unit_path(env) -> Path:
    return Path(env["XDG_CONFIG_HOME"]) / "systemd" / "user" / "keyveil.service"


def env_d_path(env) -> Path:
    return Path(env["XDG_CONFIG_HOME"]) / "environment.d" / "50-keyveil.conf"


def enable(env) -> None:
    """What `systemctl --user enable keyveil` leaves in the tree (systemctl runs offline here)."""
    r = subprocess.run(["systemctl", "--user", "enable", "keyveil.service"], env=env, capture_output=True, timeout=30)
    link = unit_path(env).parent / "default.target.wants" / "keyveil.service"
    if not link.is_symlink():  # no systemctl, or one that insists on a manager
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(unit_path(env))
    assert link.resolve() == unit_path(env).resolve(), r.stderr


# -- the unit ------------------------------------------------------------------------------


def test_unit_passes_systemd_analyze_verify(kv, user, systemd_tools, tmp_path):
    r = keyveil(user, "service", "install")
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert f"wrote {unit_path(user)}" in out and f"wrote {env_d_path(user)}" in out
    assert "systemctl --user enable --now keyveil" in out

    v = verify(systemd_tools, unit_path(user), Path(user["XDG_RUNTIME_DIR"]))
    assert (v.returncode, v.stdout + v.stderr) == (0, "")  # an unknown key is only a warning: none allowed

    unit = parse_unit(unit_path(user).read_text())
    service = unit["Service"]
    assert shlex.split(service["ExecStart"][0])[-4:] == ["keyveil", "start", "--listen", "127.0.0.1:8080"]
    assert service["Restart"] == ["on-failure"]
    assert int(unit["Unit"]["StartLimitBurst"][0]) > 0 and int(unit["Unit"]["StartLimitIntervalSec"][0]) > 0
    assert service["StandardOutput"] == service["StandardError"] == ["journal"]
    assert unit["Install"]["WantedBy"] == ["default.target"]

    # The check can fail: the same unit with an interpreter that is not there does not verify.
    broken = tmp_path / "broken" / "keyveil.service"
    broken.parent.mkdir()
    broken.write_text(unit_path(user).read_text().replace(sys.executable, str(tmp_path / "no-python")))
    assert verify(systemd_tools, broken, Path(user["XDG_RUNTIME_DIR"])).returncode != 0


def test_exec_start_serves_a_sealed_round_trip_run_reuses_it_and_clients_fail_closed(kv, user, relays, up, systemd_tools, tmp_path):
    bound, provider = relays
    port = free_port()
    r = keyveil(user, "service", "install", "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 0, r.stderr
    enable(user)
    url = f"http://127.0.0.1:{port}"
    session = session_env(systemd_tools, user)
    assert {k: session[k] for k in SESSION_VARS}["HTTPS_PROXY"] == url
    unit = parse_unit(unit_path(user).read_text())
    service_env = service_environment(unit, session, user["HOME"], user["XDG_RUNTIME_DIR"])
    # environment.d gives every user service the session's proxy: the unit takes it away again
    assert not set(SESSION_VARS) & set(service_env)
    assert service_env["KEYVEIL_HOME"] == str(kv.home.resolve())

    # The shell of a new session: environment.d and nothing else.
    client = {"PATH": os.environ["PATH"], "HOME": user["HOME"], **session}
    shell = {**user, **session}
    log = tmp_path / "journal.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(shlex.split(unit["Service"]["ExecStart"][0]), env=service_env, cwd=user["HOME"], stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_listening(port, proc, log)
        pat = kv.values["github/pat"]
        # injected toward the bound host, scrubbed on the way back
        r = curl(client, "-H", f"Authorization: Bearer {REF}", f"http://{bound.host}:{bound.port}/echo")
        assert r.returncode == 0, r.stderr
        assert REF.encode() in r.stdout and pat not in r.stdout
        assert up.requests[-1].header("authorization") == "Bearer " + pat.decode()
        # sealed toward a model vendor
        r = curl(client, "--data-binary", b'{"prompt": "' + pat + b'"}', f"http://{provider.host}:{provider.port}/v1/messages")
        assert r.returncode == 0, r.stderr
        assert REF.encode() in up.requests[-1].body and pat not in up.requests[-1].body

        r = keyveil(shell, "service", "status")
        assert r.returncode == 0, r.stdout.decode()
        assert f"keyveil answers on {url}" in r.stdout.decode()
        r = keyveil(shell, "doctor")
        assert r.returncode == 0 and f"keyveil answers on {url}" in r.stdout.decode(), r.stdout.decode()

        # `keyveil run` reuses the service, also after another `keyveil start` came and went
        other = free_port()
        with (tmp_path / "other.log").open("wb") as f:
            second = subprocess.Popen([sys.executable, "-m", "keyveil", "start", "--listen", f"127.0.0.1:{other}"], env=user, stdout=f, stderr=subprocess.STDOUT)
        wait_listening(other, second, tmp_path / "other.log")
        second.send_signal(signal.SIGTERM)
        assert second.wait(15) == 0
        r = keyveil(shell, "run", "--", "sh", "-c", 'printf %s "$HTTPS_PROXY"')
        assert (r.returncode, r.stdout.decode()) == (0, url), r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log.read_text()
    journal = log.read_bytes()
    assert b"keyveil: proxy on" in journal
    for form in kv.forms():
        assert form not in journal

    # Down: a client of the persisted HTTPS_PROXY gets a connection error, never a direct connection.
    seen, accepted = len(up.requests), bound.accepted
    for target in (f"http://{bound.host}:{bound.port}/echo", f"https://{bound.host}:{bound.port}/echo", "https://api.github.com/"):
        r = curl(client, "-H", f"Authorization: Bearer {REF}", target)
        assert r.returncode == 7, (target, r.returncode, r.stderr)  # curl: failed to connect (to the proxy)
    assert (len(up.requests), bound.accepted) == (seen, accepted)
    r = keyveil(shell, "service", "status")
    assert r.returncode == 2
    assert f"nothing answers on {url}" in r.stdout.decode() and "systemctl --user restart keyveil" in r.stdout.decode()
    # and `keyveil run` falls back to a private proxy of its own
    r = keyveil(shell, "run", "--", "sh", "-c", 'printf %s "$HTTPS_PROXY"')
    assert r.returncode == 0 and r.stdout.decode() not in ("", url), r.stdout


def test_environment_d_gives_curl_what_it_needs_through_the_proxy(kv, user, up, systemd_tools, tmp_path):
    """A routed mitmdump stands in for the service here (on the home's CA), so the TLS upstream is reachable."""
    with keyveil_proxy(up, tmp_path / "proxy", kv, options={"confdir": kv.home / "certs"}) as p:
        baseline = session_env(systemd_tools, user)  # what /etc and /usr/lib environment.d give already
        assert keyveil(user, "service", "install", "--listen", f"127.0.0.1:{p.port}").returncode == 0
        session = session_env(systemd_tools, user)
        assert set(session) - set(baseline) == set(SESSION_VARS)  # the comment lines set nothing
        exports = {}
        for line in keyveil(user, "env").stdout.decode().splitlines():
            key, _, value = shlex.split(line)[1].partition("=")
            exports[key] = value
        assert {k: session[k] for k in exports} == exports and set(exports) == set(SESSION_VARS)
        client = {"PATH": os.environ["PATH"], "HOME": user["HOME"], **session}  # no --cacert, no -x: the session's variables
        r = curl(client, "-H", f"Authorization: Bearer {REF}", "https://api.github.com/echo")
    assert r.returncode == 0, r.stderr
    pat = kv.values["github/pat"]
    assert REF.encode() in r.stdout and pat not in r.stdout
    rec = up.requests[-1]
    assert (rec.tls, rec.sni, rec.header("authorization")) == (True, "api.github.com", "Bearer " + pat.decode())


# -- install / uninstall ---------------------------------------------------------------------


def _populate(root: Path, platform: str) -> None:
    """Things of the user's that install and uninstall must leave alone."""
    if platform == "linux":
        (root / ".config" / "environment.d").mkdir(parents=True)
        (root / ".config" / "environment.d" / "10-mine.conf").write_text("EDITOR=vi\n")
        (root / ".config" / "systemd").mkdir()
    else:
        (root / "Library" / "Preferences").mkdir(parents=True)
        (root / "Library" / "Preferences" / "mine.plist").write_text("<plist/>\n")


@pytest.mark.parametrize("platform", ["linux", "macos"])
def test_install_uninstall_leaves_the_tree_as_it_was_and_install_twice_is_once(kv, user, platform):
    root = Path(user["HOME"])
    _populate(root, platform)
    before = snapshot(root)
    r = keyveil(user, "service", "install", "--platform", platform)
    assert r.returncode == 0, r.stderr
    installed = snapshot(root)
    files = [p for p, e in installed.items() if e[0] == "file" and p not in before]
    assert len(files) == 2, files
    assert sorted(Path(f).name for f in files) == (
        ["50-keyveil.conf", "keyveil.service"] if platform == "linux" else ["dev.keyveil.env.plist", "dev.keyveil.proxy.plist"]
    )

    r = keyveil(user, "service", "install", "--platform", platform)
    assert r.returncode == 0 and r.stdout.decode().count("unchanged ") == 2
    assert snapshot(root) == installed

    # an upgrade: the next install rewrites the file in place
    main = root / files[0] if "keyveil.service" in files[0] or "proxy" in files[0] else root / files[1]
    main.write_text(main.read_text().replace("127.0.0.1:8080", "127.0.0.1:8079"))  # as an older install wrote it
    r = keyveil(user, "service", "install", "--platform", platform)
    assert r.returncode == 0 and f"rewrote {main}" in r.stdout.decode()
    assert snapshot(root) == installed

    if platform == "linux":
        enable(user)
    r = keyveil(user, "service", "uninstall", "--platform", platform)
    assert r.returncode == 0, r.stderr
    assert snapshot(root) == before
    r = keyveil(user, "service", "uninstall", "--platform", platform)
    assert r.returncode == 0 and "nothing to remove" in r.stdout.decode()
    assert snapshot(root) == before


def test_install_never_overwrites_nor_uninstall_removes_a_file_keyveil_did_not_write(kv, user):
    unit = unit_path(user)
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/usr/bin/true\n")
    before = snapshot(Path(user["HOME"]))
    r = keyveil(user, "service", "install")
    assert r.returncode == 1 and f"{unit} exists and was not written by keyveil" in r.stderr.decode()
    r = keyveil(user, "service", "uninstall")
    assert r.returncode == 0 and f"left {unit} alone" in r.stdout.decode()
    r = keyveil(user, "service", "status")
    assert r.returncode == 2 and "keyveil did not write it" in r.stdout.decode()
    assert snapshot(Path(user["HOME"])) == before


def test_install_without_xdg_config_home_writes_under_home(kv, user):
    env = {k: v for k, v in user.items() if k != "XDG_CONFIG_HOME"}
    r = keyveil(env, "service", "install")
    assert r.returncode == 0, r.stderr
    assert (Path(user["HOME"]) / ".config" / "systemd" / "user" / "keyveil.service").is_file()
    assert (Path(user["HOME"]) / ".config" / "environment.d" / "50-keyveil.conf").is_file()


# -- what a service must never hold ------------------------------------------------------------


def test_no_value_in_any_file_and_what_a_service_cannot_hold_is_refused(kv, user, tmp_path):
    credentials = {
        "KEYVEIL_PASSPHRASE": secrets.token_urlsafe(18),
        "KEYVEIL_PROXYAUTH": "u:" + secrets.token_urlsafe(18),
        "KEYVEIL_SECRET_github__pat": secrets.token_urlsafe(18),
    }
    outputs = []
    for platform in ("linux", "macos"):
        r = keyveil({**user, **credentials}, "service", "install", "--platform", platform, "--system-proxy")
        assert r.returncode == 0, r.stderr
        outputs += [r.stdout, r.stderr]
    written = [p.read_bytes() for p in Path(user["HOME"]).rglob("*") if p.is_file()]
    assert len(written) == 4
    for needle in [*kv.forms(), *(v.encode() for v in credentials.values())]:
        for data in [*written, *outputs]:
            assert needle not in data

    empty = tmp_path / "empty"
    empty.mkdir()
    refused = {
        "env vault": ({**user, "KEYVEIL_VAULT": "env", "HOME": str(empty), "XDG_CONFIG_HOME": str(empty)}, (), "KEYVEIL_VAULT=env"),
        "beyond loopback": ({**user, "HOME": str(empty), "XDG_CONFIG_HOME": str(empty)}, ("--listen", "0.0.0.0:8080"), "loopback only"),
    }
    odd = tmp_path / "a$b"
    refused["a $ in the home path"] = ({**user, "KEYVEIL_HOME": str(odd), "HOME": str(empty), "XDG_CONFIG_HOME": str(empty)}, (), "holds '$'")
    for why, (env, extra, message) in refused.items():
        r = keyveil(env, "service", "install", *extra)
        assert r.returncode == 1 and message in r.stderr.decode(), (why, r.stderr)
    assert list(empty.iterdir()) == []


def test_a_passphrase_vault_is_refused_without_writing_anything(user, tmp_path):
    passphrase = secrets.token_urlsafe(18)
    env = {**user, "KEYVEIL_HOME": str(tmp_path / "pp"), "KEYVEIL_PASSPHRASE": passphrase}
    assert keyveil(env, "secret", "set", "github/pat", stdin=secrets.token_urlsafe(20).encode()).returncode == 0
    r = keyveil(env, "service", "install")
    assert r.returncode == 1 and "KEYVEIL_PASSPHRASE" in r.stderr.decode()
    assert passphrase.encode() not in r.stdout + r.stderr
    assert not Path(user["XDG_CONFIG_HOME"]).exists()


def test_paths_with_a_space_reach_systemd_intact(kv, user, systemd_tools, tmp_path):
    home = tmp_path / "my keyveil"
    shutil.copytree(kv.home, home)
    env = {**user, "KEYVEIL_HOME": str(home)}
    r = keyveil(env, "service", "install")
    assert r.returncode == 0, r.stderr
    v = verify(systemd_tools, unit_path(env), Path(user["XDG_RUNTIME_DIR"]))
    assert (v.returncode, v.stdout + v.stderr) == (0, "")
    unit = parse_unit(unit_path(env).read_text())
    service_env = service_environment(unit, {}, user["HOME"], user["XDG_RUNTIME_DIR"])
    assert service_env["KEYVEIL_HOME"] == str(home)
    session = session_env(systemd_tools, env)
    assert session["SSL_CERT_FILE"] == str(home / "certs" / "keyveil-bundle.pem")
    assert Path(session["NODE_EXTRA_CA_CERTS"]).is_file()


# -- status and the desktop settings -----------------------------------------------------------


def test_status_names_each_problem_with_its_fix(kv, user):
    r = keyveil(user, "service", "status")
    assert r.returncode == 2
    assert "service not installed" in r.stdout.decode() and "keyveil service install" in r.stdout.decode()
    r = keyveil(user, "doctor")
    assert "note service not installed" in r.stdout.decode()

    port = free_port()
    assert keyveil(user, "service", "install", "--listen", f"127.0.0.1:{port}").returncode == 0
    wrong = {**user, "HTTPS_PROXY": "http://127.0.0.1:1", "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}
    out = keyveil(wrong, "service", "status").stdout.decode()
    assert "FAIL service not enabled at login\n     → systemctl --user enable --now keyveil" in out
    assert f"FAIL nothing answers on http://127.0.0.1:{port}" in out
    assert "HTTPS_PROXY, SSL_CERT_FILE pointing elsewhere" in out and 'eval "$(keyveil env)"' in out
    assert "127.0.0.1:1" not in out  # names only: a proxy variable may hold a password

    # something else on the port is not mistaken for the service
    with socket.create_server(("127.0.0.1", port)):
        out = keyveil(user, "service", "status").stdout.decode()
    assert f"something other than this home's keyveil answers on http://127.0.0.1:{port}" in out
    r = keyveil(user, "doctor")
    assert r.returncode == 2 and "nothing answers" in r.stdout.decode()


def test_system_proxy_is_printed_never_applied(kv, user):
    port = free_port()
    r = keyveil(user, "service", "install", "--listen", f"127.0.0.1:{port}", "--system-proxy")
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert f"gsettings set org.gnome.system.proxy.https port {port}" in out
    assert f"--key httpsProxy 'http://127.0.0.1 {port}'" in out
    r = keyveil(user, "service", "install", "--platform", "macos", "--listen", f"127.0.0.1:{port}", "--system-proxy")
    assert f'networksetup -setsecurewebproxy "Wi-Fi" 127.0.0.1 {port}' in r.stdout.decode()
    assert "launchctl setenv HTTPS_PROXY" in r.stdout.decode()
    files = sorted(p.name for p in Path(user["HOME"]).rglob("*") if p.is_file())
    assert files == ["50-keyveil.conf", "dev.keyveil.env.plist", "dev.keyveil.proxy.plist", "keyveil.service"]
    plist = (Path(user["HOME"]) / "Library" / "LaunchAgents" / "dev.keyveil.proxy.plist").read_bytes()
    import plistlib

    agent = plistlib.loads(plist)
    assert agent["Label"] == "dev.keyveil.proxy" and agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["ProgramArguments"][-4:] == ["keyveil", "start", "--listen", f"127.0.0.1:{port}"]
    assert json.dumps(agent["EnvironmentVariables"]).count("KEYVEIL_HOME") == 1
