"""`keyveil service`: the proxy always on for the user, and sessions pointed at it (SPEC §10).

This module renders, writes, reads back and removes the files that make
`keyveil start` a user service: on Linux a systemd user unit and an
environment.d file with the variables of `keyveil env`; on macOS a launchd
agent for the proxy and one that runs `launchctl setenv` at login. It also
checks an installed service (for `keyveil service status` and `keyveil
doctor`). It must never write a value, a passphrase or a proxy password into
any file, command line or environment it renders — only paths, the listen
address and configuration names — and never remove or overwrite a file it did
not write: each file carries a marker, and records the directories that
install created for it so that uninstall removes exactly those.
"""

from __future__ import annotations

import ipaddress
import json
import os
import plistlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ._errors import UsageError
from ._home import Home

PLATFORMS = ("linux", "macos")
UNIT = "keyveil.service"
ENV_FILE = "50-keyveil.conf"
PROXY_LABEL = "dev.keyveil.proxy"
ENV_LABEL = "dev.keyveil.env"
MARKER = "Written by `keyveil service install`"
_CREATED = "keyveil-created-directories:"

# Configuration the service takes over from the installing shell; never a credential.
CARRIED = ("KEYVEIL_VAULT", "PYTHON_KEYRING_BACKEND")
# environment.d gives every user service the session's proxy and CA variables:
# the proxy must not point at itself nor trust its own CA toward upstreams, and
# its environment holds nothing that opens the vault or the proxy.
WITHHELD_EXTRA = ("ALL_PROXY", "all_proxy", "KEYVEIL_PASSPHRASE", "KEYVEIL_PROXYAUTH")
START_LIMIT_INTERVAL = 60  # seconds
START_LIMIT_BURST = 5  # starts within that interval before systemd gives up
RESTART_SEC = 2
LAUNCHD_THROTTLE = 10  # launchd's only brake: seconds between two starts

# Characters that systemd, environment.d, launchd and sh would each read
# differently (quotes, escapes, expansions): a path holding one is refused.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f$%\\\"'`]")

Variables = dict[str, str]


def default_platform() -> str:
    return "macos" if sys.platform == "darwin" else "linux"


def _safe(what: str, text: str) -> str:
    bad = _UNSAFE.search(text)
    if bad:
        raise UsageError(
            f"{what} {text!r} holds {bad.group()!r}: keyveil writes service files only with paths "
            "free of quotes, backslashes, $, % and control characters (systemd, launchd and a shell "
            "read those differently); choose a path without it, e.g. another KEYVEIL_HOME"
        )
    return text


def check_listen(host: str, port: int) -> str:
    """The proxy URL of a service listening on HOST:PORT; only IPv4 loopback is offered."""
    host = "127.0.0.1" if host == "localhost" else host
    try:
        loopback = ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UsageError(
            f"the service listens on loopback only, not {host}: beyond loopback the proxy needs a "
            "password, which a service file must not hold; use --listen 127.0.0.1:PORT"
        )
    if not 0 < port < 65536:
        raise UsageError(f"--listen port {port} is not a TCP port (1-65535)")
    return f"http://{host}:{port}"


def check_vault(home: Home, environ: Mapping[str, str]) -> list[str]:
    """Refuse a vault the service could open only with a value in its environment; notes to print."""
    backend = environ.get("KEYVEIL_VAULT") or "file"
    if backend == "env":
        raise UsageError(
            "the env vault (KEYVEIL_VAULT=env) keeps values in the proxy's environment, which a "
            "service file must never hold: move them to the file vault (unset KEYVEIL_VAULT, then "
            "keyveil secret set NAME for each) and install again"
        )
    if backend == "keyring":
        return ["note: the values are in the OS keyring: the service reads them only while it is unlocked (after login)"]
    from ._vault import FileVault

    path = FileVault(home.root).path
    try:
        source = json.loads(path.read_bytes()).get("key_source")
    except (OSError, ValueError, AttributeError):
        return []  # no vault yet, or one `keyveil start` will report on
    if source == "passphrase":
        raise UsageError(
            f"the vault {path} is encrypted with KEYVEIL_PASSPHRASE, which a service file must never "
            "hold: the service could not open it. Use a vault keyed by the OS keyring or a key file "
            "(a new KEYVEIL_HOME, `keyveil secret set` without KEYVEIL_PASSPHRASE), then install again"
        )
    if source == "keyring":
        return ["note: the vault key is in the OS keyring: the service opens the vault only while it is unlocked (after login)"]
    return []


# -- where the files go -------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    platform: str
    root: Path  # the tree the files live in: XDG_CONFIG_HOME, or ~/Library
    files: tuple[Path, ...]  # in install order; uninstall goes backwards

    @property
    def main(self) -> Path:
        return self.files[0]

    @property
    def enable_link(self) -> Path | None:
        """Where `systemctl --user enable` puts its link (WantedBy=default.target)."""
        if self.platform != "linux":
            return None
        return self.main.parent / "default.target.wants" / UNIT


def layout(platform: str, environ: Mapping[str, str]) -> Layout:
    home = Path(environ.get("HOME") or Path.home())
    if platform == "macos":
        agents = home / "Library" / "LaunchAgents"
        return Layout(platform, home / "Library", (agents / f"{PROXY_LABEL}.plist", agents / f"{ENV_LABEL}.plist"))
    # The XDG base directory spec: a relative XDG_CONFIG_HOME is invalid and ignored, as systemd does.
    xdg = environ.get("XDG_CONFIG_HOME", "")
    config = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".config"
    return Layout(platform, config, (config / "systemd" / "user" / UNIT, config / "environment.d" / ENV_FILE))


# -- what the files say ---------------------------------------------------------------


@dataclass(frozen=True)
class Service:
    """What the service runs and what sessions get, before it is written in any format."""

    argv: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    withheld: tuple[str, ...]
    session: tuple[tuple[str, str], ...]  # the variables of `keyveil env`
    url: str


def service(home: Home, url: str, session: Variables, environ: Mapping[str, str]) -> Service:
    listen = url.removeprefix("http://")
    # -P: no current directory on sys.path, so a stray keyveil/ or yaml.py in the
    # service's working directory (the user's home) can never be imported.
    argv = (_safe("the Python interpreter", sys.executable), "-P", "-m", "keyveil", "start", "--listen", listen)
    env = [("KEYVEIL_HOME", _safe("KEYVEIL_HOME", str(home.root.resolve()))), ("PYTHONUNBUFFERED", "1")]
    env += [(k, _safe(k, environ[k])) for k in CARRIED if environ.get(k)]
    for key, value in session.items():
        _safe(key, value)
    withheld = tuple(dict.fromkeys([*session, *WITHHELD_EXTRA]))
    return Service(argv, tuple(env), withheld, tuple(session.items()), url)


def _created_line(comment: str, created: list[Path]) -> str:
    # JSON, so any path fits on one comment line; `-` escaped so none can end an XML comment.
    return f"{comment} {_CREATED} " + json.dumps([str(p) for p in created]).replace("-", "\\u002d")


def _word(text: str) -> str:
    return f'"{text}"' if " " in text else text


def render_unit(svc: Service, created: list[Path]) -> str:
    env = "\n".join(f"Environment={_word(f'{k}={v}')}" for k, v in svc.environment)
    return f"""\
# {MARKER}; `keyveil service uninstall` removes it.
# The next `keyveil service install` (after an upgrade, say) rewrites it: edits are lost.
{_created_line("#", created)}
[Unit]
Description=keyveil proxy: agents use API keys without reading them
StartLimitIntervalSec={START_LIMIT_INTERVAL}
StartLimitBurst={START_LIMIT_BURST}

[Service]
Type=exec
ExecStart={" ".join(_word(a) for a in svc.argv)}
{env}
UnsetEnvironment={" ".join(svc.withheld)}
Restart=on-failure
RestartSec={RESTART_SEC}
# Exit 1 is a usage or rules error: retrying cannot fix it.
RestartPreventExitStatus=1
StandardOutput=journal
StandardError=journal
SyslogIdentifier=keyveil
NoNewPrivileges=yes
UMask=0077
LockPersonality=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
RestrictNamespaces=yes
SystemCallArchitectures=native

[Install]
WantedBy=default.target
"""


def render_environment_d(svc: Service, created: list[Path]) -> str:
    lines = [
        f"# {MARKER}; `keyveil service uninstall` removes it.",
        f"# New sessions of this user go through the keyveil service at {svc.url}.",
        _created_line("#", created),
    ]
    lines += [f"{k}={_word(v)}" for k, v in svc.session]
    return "\n".join(lines) + "\n"


def _plist(body: dict, created: list[Path]) -> str:
    text = plistlib.dumps(body, sort_keys=False).decode()
    head, sep, rest = text.partition("<plist")
    comment = f"<!-- {MARKER}; `keyveil service uninstall` removes it. -->\n{_created_line('<!--', created)} -->\n"
    return head + comment + sep + rest


def setenv_commands(svc: Service) -> list[str]:
    return [f"launchctl setenv {k} {shlex.quote(v)}" for k, v in svc.session]


def render_launchd_proxy(svc: Service, logs: Path, created: list[Path]) -> str:
    unset = [w for k in svc.withheld for w in ("-u", k)]  # launchd has no UnsetEnvironment
    return _plist(
        {
            "Label": PROXY_LABEL,
            "ProgramArguments": ["/usr/bin/env", *unset, *svc.argv],
            "EnvironmentVariables": dict(svc.environment),
            "RunAtLoad": True,
            "KeepAlive": {"SuccessfulExit": False},  # restart on failure only
            "ThrottleInterval": LAUNCHD_THROTTLE,
            "Umask": 0o077,
            "StandardOutPath": str(logs),
            "StandardErrorPath": str(logs),
        },
        created,
    )


def render_launchd_env(svc: Service, created: list[Path]) -> str:
    return _plist(
        {
            "Label": ENV_LABEL,
            "ProgramArguments": ["/bin/sh", "-c", " && ".join(f"/bin/{c}" for c in setenv_commands(svc))],
            "RunAtLoad": True,
        },
        created,
    )


def render(lay: Layout, svc: Service, path: Path, created: list[Path]) -> str:
    """The text of PATH, one of LAY's files; CREATED: the directories install made for it."""
    main, _ = lay.files
    if lay.platform == "macos":
        if path == main:
            return render_launchd_proxy(svc, lay.root / "Logs" / "keyveil.log", created)
        return render_launchd_env(svc, created)
    return render_unit(svc, created) if path == main else render_environment_d(svc, created)


# -- reading what is installed ----------------------------------------------------------


@dataclass(frozen=True)
class Installed:
    """The service files found on disk, and what they say."""

    layout: Layout
    texts: dict[Path, str]  # ours only
    foreign: tuple[Path, ...]  # at our paths, but not written by keyveil
    argv: tuple[str, ...]
    environment: dict[str, str]
    session: dict[str, str]

    @property
    def url(self) -> str | None:
        if "--listen" in self.argv[:-1]:
            return "http://" + self.argv[self.argv.index("--listen") + 1]
        return None

    @property
    def complete(self) -> bool:
        return set(self.texts) == set(self.layout.files)


def _read_ours(path: Path) -> str | None:
    """The text of PATH if keyveil wrote it; None if absent; raises ValueError if foreign."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(str(e)) from None
    if MARKER not in "\n".join(text.splitlines()[:4]):
        raise ValueError("no keyveil marker")
    return text


def _created(text: str | None) -> list[Path] | None:
    for line in (text or "").splitlines():
        _, sep, rest = line.partition(_CREATED)
        if sep:
            return [Path(p) for p in json.loads(rest.removesuffix("-->").strip())]
    return None


def _unit_fields(text: str) -> tuple[tuple[str, ...], dict[str, str]]:
    argv: tuple[str, ...] = ()
    env: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "ExecStart":
            argv = tuple(shlex.split(value))
        elif key == "Environment":
            for word in shlex.split(value):
                k, _, v = word.partition("=")
                env[k] = v
    return argv, env


def _env_d_fields(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key] = shlex.split(value)[0] if value else ""
    return out


def read_installed(lay: Layout) -> Installed:
    texts, foreign = {}, []
    for path in lay.files:
        try:
            text = _read_ours(path)
        except ValueError:
            foreign.append(path)
            continue
        if text is not None:
            texts[path] = text
    argv: tuple[str, ...] = ()
    env: dict[str, str] = {}
    session: dict[str, str] = {}
    main, second = lay.files
    try:
        if lay.platform == "macos":
            if main in texts:
                proxy = plistlib.loads(texts[main].encode())
                args = list(proxy["ProgramArguments"])  # /usr/bin/env -u NAME ... PYTHON -P -m keyveil ...
                i = 1
                while args[i] == "-u":
                    i += 2
                argv = tuple(args[i:])
                env = dict(proxy.get("EnvironmentVariables", {}))
            if second in texts:
                script = plistlib.loads(texts[second].encode())["ProgramArguments"][-1]
                for command in script.split(" && "):
                    words = shlex.split(command)
                    if words[1:2] == ["setenv"] and len(words) == 4:
                        session[words[2]] = words[3]
        else:
            if main in texts:
                argv, env = _unit_fields(texts[main])
            if second in texts:
                session = _env_d_fields(texts[second])
    except (ValueError, KeyError, IndexError, plistlib.InvalidFileException):
        pass  # reported as "differs from what install writes"
    return Installed(lay, texts, tuple(foreign), argv, env, session)


# -- install / uninstall -------------------------------------------------------------------


def _missing_dirs(directory: Path) -> list[Path]:
    """DIRECTORY and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    return missing


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)  # a reader never sees half a unit


def activation(lay: Layout, rewrote: bool) -> str:
    if lay.platform == "macos":
        plists = " ".join(str(p) for p in lay.files)
        if rewrote:
            return f"launchctl bootout gui/$(id -u)/{PROXY_LABEL}; launchctl bootstrap gui/$(id -u) {plists}"
        return f"launchctl bootstrap gui/$(id -u) {plists}"
    link = lay.enable_link
    if rewrote and link is not None and link.is_symlink():
        return "systemctl --user daemon-reload && systemctl --user restart keyveil"
    return "systemctl --user enable --now keyveil"


def install(lay: Layout, svc: Service) -> list[str]:
    """Write the service files (refusing to overwrite foreign ones); the lines to print."""
    found = read_installed(lay)
    if found.foreign:
        raise UsageError(
            f"{found.foreign[0]} exists and was not written by keyveil: move it away (or remove it) "
            "and run `keyveil service install` again"
        )
    lines, changed, rewrote = [], False, False
    for path in lay.files:
        old = found.texts.get(path)
        # A rewrite keeps the record of the first install: those directories are still ours.
        created = _created(old)
        text = render(lay, svc, path, created if created is not None else _missing_dirs(path.parent))
        if old == text:
            lines.append(f"unchanged {path}")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, text)
        lines.append(f"{'rewrote' if old is not None else 'wrote'} {path}")
        changed, rewrote = True, rewrote or old is not None
    link = lay.enable_link
    if changed or (link is not None and not link.is_symlink()):
        lines += ["", "Activate it with:", f"  {activation(lay, rewrote)}"]
    else:
        lines += ["", "Nothing changed: the service is installed" + (" and enabled." if link is not None else ".")]
    lines += ["", *_session_note(lay, svc)]
    return lines


def _session_note(lay: Layout, svc: Service) -> list[str]:
    if lay.platform == "macos":
        return [
            f"At each login {ENV_LABEL} runs `launchctl setenv` for HTTPS_PROXY and the CA variables;",
            "for the apps of this session, run now:",
            *(f"  {c}" for c in setenv_commands(svc)),
            'In this shell: eval "$(keyveil env)"',
        ]
    return [
        "Sessions started after the next login get HTTPS_PROXY and the CA variables from",
        f"{lay.files[1]}; in this shell: eval \"$(keyveil env)\"",
    ]


def _run(argv: list[str], timeout: float = 15) -> subprocess.CompletedProcess | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _rmdirs(dirs: list[Path]) -> list[str]:
    lines = []
    for d in dirs:  # deepest first, as recorded
        try:
            d.rmdir()
            lines.append(f"removed {d}/")
        except OSError:
            break  # not empty (something else lives there now) or already gone
    return lines


def _disable(lay: Layout) -> list[str]:
    """Undo the activation command, so no dangling link or running proxy is left."""
    if lay.platform == "macos":
        if sys.platform != "darwin":
            return [f"(not on macOS: if the agents are loaded there, run launchctl bootout gui/$(id -u)/{PROXY_LABEL})"]
        lines = []
        for label in (PROXY_LABEL, ENV_LABEL):
            r = _run(["launchctl", "bootout", f"gui/{os.getuid()}/{label}"])
            if r is not None and r.returncode == 0:
                lines.append(f"stopped {label}")
        return lines
    link = lay.enable_link
    if link is None or not link.is_symlink():
        return []
    r = _run(["systemctl", "--user", "disable", "--now", UNIT])
    if r is not None and r.returncode == 0 and not link.is_symlink():
        return ["stopped and disabled keyveil.service (systemctl --user disable --now keyveil)"]
    # No user manager to ask (a container, a tree no manager reads): systemctl may
    # still have removed the link offline; else it is the only trace `enable`
    # left in this tree.
    lines = [f"disabled keyveil.service: removed {link}"]
    if link.is_symlink():
        link.unlink()
        try:
            link.parent.rmdir()  # as `systemctl disable` does when it empties it
        except OSError:
            pass
    return [*lines, "could not reach the systemd user manager: if the proxy still runs, `systemctl --user stop keyveil`"]


def uninstall(lay: Layout) -> list[str]:
    found = read_installed(lay)
    lines = [f"left {p} alone: keyveil did not write it" for p in found.foreign]
    if not found.texts:
        return [*lines, "nothing to remove: the service is not installed"]
    lines += _disable(lay)
    for path in reversed(lay.files):
        if path not in found.texts:
            continue
        path.unlink(missing_ok=True)
        lines.append(f"removed {path}")
        lines += _rmdirs(_created(found.texts[path]) or [])
    if lay.platform == "linux":
        r = _run(["systemctl", "--user", "daemon-reload"])
        if r is not None and r.returncode == 0:
            lines.append("reloaded the systemd user manager")
    lines += [
        "",
        "Sessions started before now still have HTTPS_PROXY and the CA variables pointing at the",
        "service: their clients now get connection errors (fail closed) until the next login.",
    ]
    if lay.platform == "macos" and found.session:
        lines += ["For this login session on macOS: " + "; ".join(f"launchctl unsetenv {k}" for k in found.session)]
    return lines


# -- status ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    ok: bool | None  # None: a note, not a problem
    what: str
    fix: str = ""


def format_finding(f: Finding) -> str:
    if f.ok is None:
        return f"note {f.what}"
    return f"{'ok  ' if f.ok else 'FAIL'} {f.what}" + (f"\n     → {f.fix}" if f.fix and not f.ok else "")


def _answers(url: str) -> bool:
    host, _, port = url.removeprefix("http://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except (OSError, ValueError):
        return False


def _manager_state(lay: Layout) -> str | None:
    """The service manager's word on the proxy ("active", "failed" ...), or None if it cannot be asked."""
    if lay.platform == "macos":
        if sys.platform != "darwin":
            return None
        r = _run(["launchctl", "print", f"gui/{os.getuid()}/{PROXY_LABEL}"])
        if r is None:
            return None
        m = re.search(r"^\s*state = (\S+)", r.stdout, re.M)
        return ("active" if m.group(1) == "running" else m.group(1)) if m else "not loaded"
    r = _run(["systemctl", "--user", "is-active", UNIT])
    if r is None:
        return None
    return r.stdout.strip() or None  # nothing on stdout: no user manager to ask


def _start_fix(lay: Layout) -> str:
    if lay.platform == "macos":
        return f"launchctl kickstart gui/$(id -u)/{PROXY_LABEL} (log: {lay.root / 'Logs' / 'keyveil.log'})"
    link = lay.enable_link
    if link is not None and not link.is_symlink():
        return "systemctl --user enable --now keyveil"
    return "systemctl --user restart keyveil (why it stopped: journalctl --user -u keyveil -e)"


def checks(
    home: Home,
    lay: Layout,
    environ: Mapping[str, str],
    *,
    session_for: Callable[[str], Variables],
    running: str | None,
) -> list[Finding]:
    """Installed? Does its proxy answer? Does this shell point at it? Each problem with its fix."""
    found = read_installed(lay)
    out = [Finding(False, f"{p} exists but keyveil did not write it", "move it away, then keyveil service install") for p in found.foreign]
    if not found.texts:
        return [*out, Finding(False, f"service not installed ({lay.main})", "keyveil service install")]
    missing = [p for p in lay.files if p not in found.texts and p not in found.foreign]
    for path in missing:
        out.append(Finding(False, f"{path} is missing", "keyveil service install"))
    url = found.url
    if url is None or not found.argv:
        return [*out, Finding(False, f"{lay.main} does not say what to run", "keyveil service install")]
    out.append(Finding(True, f"service installed ({lay.main}), proxy {url}"))
    service_home = found.environment.get("KEYVEIL_HOME")
    if service_home and Path(service_home) != home.root.resolve():
        out.append(
            Finding(
                False,
                f"the service uses the home {service_home}, this shell {home.root}",
                f"KEYVEIL_HOME={service_home} keyveil ..., or keyveil service install to move the service here",
            )
        )
    if not os.access(found.argv[0], os.X_OK):
        out.append(Finding(False, f"the service runs {found.argv[0]}, which is gone", "keyveil service install"))
    link = lay.enable_link
    if link is not None:
        enabled = link.is_symlink()
        out.append(Finding(enabled, "service enabled at login" if enabled else "service not enabled at login", "systemctl --user enable --now keyveil"))
    expected = session_for(url)
    if found.session and found.session != expected:
        out.append(Finding(False, f"{lay.files[1]} does not hold the variables of `keyveil env` for {url}", "keyveil service install"))
    state = _manager_state(lay)
    if state is None:
        out.append(Finding(None, "the service manager cannot be asked from here; checking the proxy itself"))
    else:
        out.append(Finding(state == "active", f"service manager says: {state}", _start_fix(lay)))
    if running == url:
        out.append(Finding(True, f"keyveil answers on {url}"))
    elif _answers(url):
        port = url.rpartition(":")[2]
        out.append(
            Finding(
                False,
                f"something other than this home's keyveil answers on {url}",
                f"stop it (ss -ltnp 'sport = :{port}' names it), or keyveil service install --listen 127.0.0.1:PORT",
            )
        )
    else:
        out.append(
            Finding(False, f"nothing answers on {url}: clients that use HTTPS_PROXY get connection errors (fail closed)", _start_fix(lay))
        )
    # Names only: a proxy variable may hold a proxy password.
    unset = [k for k in expected if k not in environ]
    elsewhere = [k for k, v in expected.items() if k in environ and environ[k] != v]
    if not unset and not elsewhere:
        out.append(Finding(True, f"this shell's HTTPS_PROXY and CA variables point at {url} and its CA"))
    else:
        parts = [f"{', '.join(unset)} not set"] if unset else []
        parts += [f"{', '.join(elsewhere)} pointing elsewhere"] if elsewhere else []
        fix = 'eval "$(keyveil env)" (sessions started after the next login get them)'
        out.append(Finding(False, f"this shell bypasses the service: {'; '.join(parts)}", fix))
    return out


# -- desktop proxy settings (printed, never applied) -------------------------------------------


def system_proxy_text(platform: str, url: str) -> str:
    host, _, port = url.removeprefix("http://").rpartition(":")
    if platform == "macos":
        return f"""\
Desktop proxy settings (printed only; keyveil changes none of them). macOS, per network service
(list them with `networksetup -listallnetworkservices`; "Wi-Fi" here):
  networksetup -setwebproxy "Wi-Fi" {host} {port}
  networksetup -setsecurewebproxy "Wi-Fi" {host} {port}
  networksetup -setproxybypassdomains "Wi-Fi" localhost 127.0.0.1 ::1
undo: networksetup -setwebproxystate "Wi-Fi" off; networksetup -setsecurewebproxystate "Wi-Fi" off
Apps that follow the system proxy (browsers too) then need the keyveil CA in the login keychain: see certs/README.md."""
    return f"""\
Desktop proxy settings (printed only; keyveil changes none of them).
GNOME:
  gsettings set org.gnome.system.proxy mode 'manual'
  gsettings set org.gnome.system.proxy.http host '{host}'
  gsettings set org.gnome.system.proxy.http port {port}
  gsettings set org.gnome.system.proxy.https host '{host}'
  gsettings set org.gnome.system.proxy.https port {port}
  gsettings set org.gnome.system.proxy ignore-hosts "['localhost', '127.0.0.1', '::1']"
  undo: gsettings set org.gnome.system.proxy mode 'none'
KDE Plasma (kwriteconfig5 on Plasma 5):
  kwriteconfig6 --file kioslaverc --group 'Proxy Settings' --key ProxyType 1
  kwriteconfig6 --file kioslaverc --group 'Proxy Settings' --key httpProxy 'http://{host} {port}'
  kwriteconfig6 --file kioslaverc --group 'Proxy Settings' --key httpsProxy 'http://{host} {port}'
  kwriteconfig6 --file kioslaverc --group 'Proxy Settings' --key NoProxyFor 'localhost,127.0.0.1,::1'
  undo: kwriteconfig6 --file kioslaverc --group 'Proxy Settings' --key ProxyType 0
Apps that follow the desktop proxy (browsers too) then need the keyveil CA in the system
trust store: see certs/README.md."""
