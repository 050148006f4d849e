"""`keyveil run --isolate`: CMD in its own user, mount, network and PID namespaces.

bubblewrap builds the sandbox; this module decides what CMD may see (the
mount plan), what it inherits (the environment minus everything that opens
the vault), and bridges the one endpoint CMD can reach: keyveil's proxy, at
the same 127.0.0.1:PORT inside the sandbox as outside. A helper started
inside the sandbox binds that listening socket in the sandbox's network
namespace and hands it out over a socket pair; keyveil accepts on it and
copies each connection to the proxy. Nothing else crosses: the sandbox has
only a loopback interface, so every other connection fails at once.

This module must never run CMD outside a sandbox: any failure before CMD
starts is an IsolationError (exit 2) and CMD is not run. Nothing it prints
holds a value; it only ever names paths, variables and programs.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ipaddress
import json
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._errors import KeyveilError, UsageError
from ._home import Home

# How long a sandbox gets to end after SIGTERM or SIGHUP (forwarded to it), or
# after the proxy died, before keyveil kills every process in it.
GRACE_SECONDS = 5.0
SETUP_TIMEOUT = 30.0
_CHUNK = 1 << 16

# Signals keyveil passes on to the sandbox's process group. SIGINT, SIGTERM,
# SIGHUP and SIGTSTP are forwarded too, as Sandbox._on_signal describes.
_PASSED_ON = (signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH, signal.SIGCONT)
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP, *_PASSED_ON)

DOCS = "docs/isolation.md"

# The loopback address the bridge connects to the proxy from: the proxy knows
# a sandbox's flows by it, and checks where they go (adapter/_destinations.py).
# Every connection out of a sandbox comes through the bridge, so none can
# avoid it; a process outside that uses it only restricts itself.
SANDBOX_SOURCE = "127.75.86.1"


class IsolationError(KeyveilError):
    """The sandbox could not be set up: CMD was not run (exit 2)."""

    exit_code = 2


# -- the environment -------------------------------------------------------------------

_OPENBAO_PREFIXES = ("BAO_", "VAULT_", "KEYVEIL_BAO_")
_CREDENTIAL_WORDS = ("TOKEN", "SECRET", "PASSWORD", "ROLE_ID")


def is_secret_variable(name: str) -> bool:
    """A variable that opens the vault or the proxy: never handed to CMD.

    KEYVEIL_PASSPHRASE (the file vault's key), KEYVEIL_SECRET_* (the env vault),
    KEYVEIL_PROXYAUTH (the proxy's own credentials), and the OpenBao / Vault
    credentials: BAO_TOKEN, VAULT_TOKEN and any BAO_*, VAULT_* or KEYVEIL_BAO_*
    variable naming a token, secret, password or AppRole id.
    """
    upper = name.upper()
    if upper in ("KEYVEIL_PASSPHRASE", "KEYVEIL_PROXYAUTH") or upper.startswith("KEYVEIL_SECRET_"):
        return True
    return upper.startswith(_OPENBAO_PREFIXES) and any(word in upper for word in _CREDENTIAL_WORDS)


def sandbox_env(env: Mapping[str, str]) -> dict[str, str]:
    """ENV without any secret variable (see is_secret_variable)."""
    return {k: v for k, v in env.items() if not is_secret_variable(k)}


# -- what CMD sees: the mount plan ---------------------------------------------------------

PATH_OPTIONS = ("ro", "rw", "hide")


@dataclass(frozen=True)
class PathRule:
    """One --ro, --rw or --hide option, as given (PATH may be relative or use ~)."""

    kind: str
    path: str


# Directories that hold the sockets of host services (a session bus, systemd,
# Docker, ssh-agent, tmux, X11, databases …): any of them is a way out of a
# network namespace, so the sandbox gets its own, empty ones.
_PRIVATE_DIRS = ("/tmp", "/run", "/var/run")
# Parts of /run a system needs to work at all (NixOS keeps its PATH there).
_RUN_KEEP = ("/run/current-system", "/run/booted-system", "/run/wrappers", "/run/opengl-driver", "/run/opengl-driver-32")


def _resolve(path: str, cwd: Path) -> Path:
    return Path(os.path.realpath(Path(cwd, os.path.expanduser(path))))


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _socket_paths(env: Mapping[str, str]) -> list[Path]:
    """Sockets the environment points CMD at, which lead to services outside."""
    out = []
    for var in ("SSH_AUTH_SOCK",):
        if env.get(var):
            out.append(env[var])
    for var in ("DBUS_SESSION_BUS_ADDRESS", "DBUS_SYSTEM_BUS_ADDRESS"):
        for part in env.get(var, "").split(";"):
            for kv in part.partition(":")[2].split(","):
                key, _, value = kv.partition("=")
                if key == "path" and value:
                    out.append(value)
    docker = env.get("DOCKER_HOST", "")
    if docker.startswith("unix://"):
        out.append(docker[len("unix://") :])
    gnupg = Path(env.get("GNUPGHOME") or Path(env.get("HOME", "/nonexistent"), ".gnupg"))
    with contextlib.suppress(OSError):
        out += [str(p) for p in gnupg.glob("S.*")]
    for candidate in ("/var/run/docker.sock", "/run/docker.sock", "/run/podman/podman.sock"):
        out.append(candidate)
    return [Path(os.path.realpath(p)) for p in out if os.path.isabs(p) and os.path.lexists(p)]


@dataclass(frozen=True)
class Plan:
    """The bwrap mount arguments, and the paths the helper must find hidden."""

    args: tuple[str, ...]
    cwd: Path
    must_be_hidden: tuple[Path, ...]
    private: tuple[Path, ...] = ()  # the areas the sandbox has its own, empty copy of


def plan_mounts(home: Home, rules: Sequence[PathRule], env: Mapping[str, str], cwd: Path | None = None) -> Plan:
    """What the sandbox shows, in the order bwrap applies it (later wins).

    1. The host's / as it is (the user's files stay as they are), then the
       user's --ro/--rw/--hide options for paths outside the private areas;
    2. /sys read-only, a fresh /dev and /proc, and private, empty /tmp, /run and
       $XDG_RUNTIME_DIR, and the host-service sockets named by the
       environment hidden (these win over a --ro or --rw of a parent);
    3. the working directory, if it lies inside a private area, then the
       user's options for paths inside the private areas (so `--rw
       /tmp/work` brings that one back);
    4. KEYVEIL_HOME as an empty directory holding only the CA certificate
       and the CA bundle. This is last: nothing undoes it.

    Raises UsageError for an option keyveil cannot honour.
    """
    cwd = Path(os.path.realpath(cwd or os.getcwd()))
    root = Path(os.path.realpath(home.root))
    private = [Path(p) for p in _PRIVATE_DIRS if os.path.isdir(p) and not os.path.islink(p)]
    xdg = env.get("XDG_RUNTIME_DIR")
    xdg_path = Path(os.path.realpath(xdg)) if xdg and os.path.isabs(xdg) and os.path.isdir(xdg) else None
    recreate_xdg = xdg_path is not None and any(_inside(xdg_path, p) for p in private)
    if xdg_path is not None and not recreate_xdg:
        private.append(xdg_path)  # somewhere of its own: made private in place
    sockets = [s for s in _socket_paths(env) if not any(_inside(s, p) for p in private)]
    # Paths an option may reach only after keyveil has laid them down itself.
    private_areas = [*private, *sockets, Path("/dev"), Path("/sys")]

    outside: list[str] = []
    inside: list[str] = []
    hidden_by_user: list[Path] = []
    for rule in rules:
        if rule.kind not in PATH_OPTIONS:
            raise UsageError(f"unknown path option --{rule.kind}")
        path = _resolve(rule.path, cwd)
        flag = f"--{rule.kind} {rule.path}"
        if _inside(path, Path("/proc")):
            raise UsageError(f"{flag}: the sandbox has its own /proc; it cannot show the host's")
        if _inside(path, root) and rule.kind != "hide":
            raise UsageError(f"{flag}: it is inside KEYVEIL_HOME ({root}), which the sandbox always hides")
        if not os.path.lexists(path):
            if rule.kind == "hide":
                print(f"keyveil: {flag}: no such file or directory, nothing to hide", file=sys.stderr)
                continue
            raise UsageError(f"{flag}: no such file or directory")
        if rule.kind == "hide" and path == Path("/"):
            raise UsageError(f"{flag}: hiding / leaves nothing to run; hide the directories you mean")
        target = inside if any(_inside(path, area) for area in private_areas) else outside
        p = str(path)
        if rule.kind == "ro":
            target += ["--ro-bind", p, p]
        elif rule.kind == "rw":
            target += ["--dev-bind" if _inside(path, Path("/dev")) else "--bind", p, p]
        else:
            target += _hide(path)
            hidden_by_user.append(path)

    if _inside(cwd, root):
        raise UsageError(f"the working directory {cwd} is inside KEYVEIL_HOME, which the sandbox hides: run keyveil from another directory")
    for path in hidden_by_user:
        if _inside(cwd, path):
            raise UsageError(f"the working directory {cwd} is inside --hide {path}: run keyveil from another directory")

    # /sys read-only: only DAC guards most of it, and root in the sandbox is uid 0 there.
    args = ["--bind", "/", "/", *outside, "--ro-bind", "/sys", "/sys", "--dev", "/dev", "--proc", "/proc"]
    for area in private:
        mode = "1777" if area == Path("/tmp") else "0700" if area == xdg_path else "0755"
        args += ["--perms", mode, "--tmpfs", str(area)]
        if area == Path("/run"):
            for keep in _RUN_KEEP:
                if os.path.islink(keep):
                    args += ["--symlink", os.readlink(keep), keep]
                elif os.path.isdir(keep):
                    args += ["--ro-bind", keep, keep]
    if recreate_xdg:  # an empty one, as programs expect it to exist
        args += ["--perms", "0700", "--dir", str(xdg_path)]
    for sock in sockets:
        args += _hide(sock)
    if any(_inside(cwd, area) and cwd != area for area in private):
        args += ["--bind", str(cwd), str(cwd)]
    # The helper runs on the base interpreter with -I -S: it needs neither the
    # venv nor the checkout, so a keyveil installed under /tmp (CI clones there)
    # shows nothing of itself. Only a Python *installed* under a private area
    # is shown, read-only, at its own path (its libraries are found by absolute
    # paths, so it cannot move); CMD gets what it needs from --ro / --rw.
    python, installation = helper_python()
    for own in dict.fromkeys((installation, Path(python).parent)):
        if any(_inside(own, area) and own != area for area in private) and not _inside(own, root):
            args += ["--ro-bind", str(own), str(own)]
    args += inside
    args += ["--perms", "0700", "--tmpfs", str(root)]
    for visible in (home.ca_cert, home.ca_bundle):
        real = os.path.realpath(visible)
        if os.path.isfile(real):
            args += ["--ro-bind", real, str(root / visible.relative_to(home.root))]
    args += ["--chdir", str(cwd)]
    must_be_hidden = (root / "vault", root / "config", root / "certs" / "mitmproxy-ca.pem", root / "certs" / "mitmproxy-ca.p12")
    return Plan(tuple(args), cwd, must_be_hidden, tuple(private))


def _hide(path: Path) -> list[str]:
    """A directory becomes empty and read-only; a file or socket cannot be opened
    (/dev/null on a nodev mount: EACCES, and a socket there refuses connections)."""
    if path.is_dir() and not path.is_symlink():
        return ["--perms", "0755", "--tmpfs", str(path), "--remount-ro", str(path)]
    return ["--ro-bind", "/dev/null", str(path)]


# -- why it failed, and how to fix it -------------------------------------------------------


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def host_facts() -> dict[str, object]:
    """What decides whether namespaces can be created here (for diagnose)."""
    return {
        "root": os.geteuid() == 0,
        "unprivileged_userns_clone": _read_int("/proc/sys/kernel/unprivileged_userns_clone"),
        "max_user_namespaces": _read_int("/proc/sys/user/max_user_namespaces"),
        "apparmor_restrict": _read_int("/proc/sys/kernel/apparmor_restrict_unprivileged_userns"),
        "container": any(os.path.exists(p) for p in ("/.dockerenv", "/run/.containerenv")) or _container_cgroup(),
    }


def _container_cgroup() -> bool:
    try:
        text = Path("/proc/1/cgroup").read_text()
    except OSError:
        return False
    return any(word in text for word in ("docker", "kubepods", "containerd", "libpod", "lxc"))


_CONTAINER_FIX = (
    "start the container with `--security-opt seccomp=unconfined --security-opt apparmor=unconfined` and "
    "`--security-opt systempaths=unconfined` (Docker) or `--security-opt unmask=ALL` (Podman), or treat the "
    f"container itself as the sandbox (see {DOCS})"
)


def diagnose(stderr: str, facts: Mapping[str, object]) -> tuple[str, str]:
    """(what is missing, how to enable it) from bubblewrap's message and the host's settings."""
    text = stderr.strip()
    last = text.splitlines()[-1] if text else "no message"
    if "Unknown option" in text or "unrecognized option" in text:
        return (f"this bubblewrap is too old ({last})", "install bubblewrap 0.5 or later")
    if facts.get("max_user_namespaces") == 0 or "ENOSPC" in text or "max_*_namespaces" in text:
        return (
            "the kernel allows no user namespaces here (user.max_user_namespaces = 0)",
            "run `sudo sysctl -w user.max_user_namespaces=15000` and set it in /etc/sysctl.d/ to keep it",
        )
    if not facts.get("root") and facts.get("unprivileged_userns_clone") == 0:
        return (
            "the kernel forbids unprivileged user namespaces (kernel.unprivileged_userns_clone = 0)",
            "run `sudo sysctl -w kernel.unprivileged_userns_clone=1` and set it in /etc/sysctl.d/ to keep it",
        )
    if not facts.get("root") and facts.get("apparmor_restrict") == 1:
        return (
            "AppArmor forbids unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns = 1) "
            "and no AppArmor profile lets bwrap create them",
            "load a profile for bwrap (Ubuntu ships one: `sudo cp /usr/share/apparmor/extra-profiles/bwrap-userns-restrict "
            "/etc/apparmor.d/ && sudo apparmor_parser -r /etc/apparmor.d/bwrap-userns-restrict`), or run "
            "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`",
        )
    if "Can't mount proc" in text:
        return (
            "the kernel refused a fresh /proc for the sandbox's PID namespace (the host's /proc is partly masked, as in most containers)",
            _CONTAINER_FIX,
        )
    if facts.get("container") and ("Operation not permitted" in text or "Permission denied" in text):
        return ("this container forbids creating namespaces (its seccomp profile or capabilities)", _CONTAINER_FIX)
    if "Operation not permitted" in text or "Permission denied" in text:
        return (f"the kernel refused to create the namespaces ({last})", f"see {DOCS} for the settings that allow them")
    return (f"bubblewrap could not create the sandbox ({last})", f"run `keyveil doctor`; see {DOCS}")


def _refuse(command: Sequence[str], what: str, fix: str) -> IsolationError:
    name = shlex.quote(command[0]) if command else "the command"
    return IsolationError(f"--isolate: {what}.\n  To enable it: {fix}.\n  {name} was not run: keyveil never runs it unisolated.")


_BWRAP_MISSING = (
    "bubblewrap (bwrap) is not installed, or not on PATH",
    "install bubblewrap: `sudo apt-get install bubblewrap` (Debian, Ubuntu), `sudo dnf install bubblewrap` (Fedora, RHEL), "
    "`sudo pacman -S bubblewrap` (Arch), `sudo apk add bubblewrap` (Alpine)",
)


def find_bwrap(env: Mapping[str, str], command: Sequence[str] = ()) -> str:
    if not sys.platform.startswith("linux"):
        raise _refuse(
            command,
            f"the sandbox is made of Linux namespaces, and this is {sys.platform}",
            f"on macOS run the agent in a Linux VM or container, or under sandbox-exec (see {DOCS})",
        )
    found = shutil.which("bwrap", path=env.get("PATH", os.defpath))
    if found is None:
        raise _refuse(command, *_BWRAP_MISSING)
    return found


# -- the helper that runs first inside the sandbox ----------------------------------------------

# Run as `python -I -S -c _HELPER PORT CHANNEL STDERR N HIDDEN... CMD...` (no
# site, and C modules only beyond os: it starts in ~15 ms). It checks that the sandbox is what
# keyveil asked for, binds the proxy's address in the sandbox's network
# namespace, hands that listening socket to keyveil, then becomes CMD. The
# channel closes on exec: end-of-file tells keyveil CMD started.
_HELPER = r"""
import array, os, sys, _socket as S
port, chan, err, n = (int(a) for a in sys.argv[1:5])
hidden, cmd = sys.argv[5:5 + n], sys.argv[5 + n:]
c = S.socket(fileno=chan)
def refuse(tag, text):
    c.send(tag + text.encode(errors="surrogateescape"))
    os._exit(2)
names = sorted(name for _, name in S.if_nameindex())
if names != ["lo"]:
    refuse(b"N", ", ".join(names))
for path in hidden:
    if os.path.lexists(path):
        refuse(b"H", path)
s = S.socket(S.AF_INET, S.SOCK_STREAM)
s.setsockopt(S.SOL_SOCKET, S.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", port))
    s.listen(1024)
except OSError as e:
    refuse(b"B", e.strerror or "")
c.sendmsg([b"L"], [(S.SOL_SOCKET, S.SCM_RIGHTS, array.array("i", [s.fileno()]))])
s.close()
os.dup2(err, 2)
os.close(err)
os.set_inheritable(chan, False)
try:
    os.execvp(cmd[0], cmd)
except OSError as e:
    c.send(b"X" + str(e.errno).encode() + b" " + (e.strerror or "").encode())
    os._exit(127)
"""

def helper_python() -> tuple[str, Path]:
    """The interpreter the sandbox helper runs on, and the installation it needs.

    The base interpreter at its real path, never a venv's: with -I -S the
    helper reads nothing but the standard library (a venv's python is a link,
    or with --copies a copy, that looks for its pyvenv.cfg beside it).
    """
    exe = Path(os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable))
    return str(exe), Path(os.path.realpath(sys.base_prefix))


_NAMESPACES = ("--unshare-user", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")


@dataclass(frozen=True)
class Endpoint:
    """The proxy as keyveil reaches it, and the process whose end ends the sandbox."""

    host: str
    port: int
    pid: int | None = None


def run_isolated(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    home: Home,
    proxy: Endpoint,
    plan: Plan | None = None,
    cwd: Path | None = None,
    quiet: bool = False,
    stdin: int | None = None,
    stdout: int | None = None,
) -> int:
    """Run COMMAND in a sandbox that reaches only PROXY; return its exit code.

    PLAN defaults to plan_mounts(HOME) with no path options, from CWD.
    The exit code is CMD's, or 128+N when a signal N ended it. 2 when the
    proxy died (the sandbox is then ended), 130 after a second Ctrl-C.
    IsolationError (CMD not run) when the sandbox cannot be set up.
    """
    bwrap = find_bwrap(env, command)
    _check_bridge(command, proxy)
    if plan is None:
        plan = plan_mounts(home, [], env, cwd)
    sandbox = Sandbox(bwrap, plan, command, sandbox_env(env), proxy, quiet=quiet, stdin=stdin, stdout=stdout)
    sandbox.start()
    return sandbox.serve()


def _check_bridge(command: Sequence[str], proxy: Endpoint) -> None:
    """The bridge can reach PROXY from SANDBOX_SOURCE, so that the proxy knows the sandbox's flows."""
    if not is_ipv4_loopback(proxy.host):
        raise _refuse(
            command,
            f"the proxy listens on {proxy.host}, and a sandbox's proxy must be on an IPv4 loopback address",
            "start it with `keyveil start --listen 127.0.0.1:PORT`, or stop it so that keyveil run starts its own",
        )
    try:
        with socket.socket(socket.AF_INET) as s:
            s.bind((SANDBOX_SOURCE, 0))
    except OSError as e:
        raise _refuse(
            command,
            f"the loopback address {SANDBOX_SOURCE}, from which the sandbox's connections reach the proxy, "
            f"cannot be used here ({e.strerror})",
            "give the loopback interface all of 127.0.0.0/8 (`sudo ip addr add 127.0.0.1/8 dev lo`)",
        ) from None


def is_ipv4_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.version == 4 and address.is_loopback


class Sandbox:
    """One bubblewrap sandbox and the bridge from its loopback to the proxy."""

    def __init__(
        self,
        bwrap: str,
        plan: Plan,
        command: Sequence[str],
        env: Mapping[str, str],
        proxy: Endpoint,
        *,
        quiet: bool = False,
        stdin: int | None = None,
        stdout: int | None = None,
    ):
        self.bwrap, self.plan, self.command, self.env, self.proxy = bwrap, plan, list(command), dict(env), proxy
        self.quiet, self.stdin, self.stdout = quiet, stdin, stdout
        self.proc: subprocess.Popen | None = None
        self.pid1: int | None = None  # the sandbox's PID 1 (host PID): its process group is the sandbox's
        self.pid1_fd: int | None = None
        self.listener: socket.socket | None = None
        self._interrupts = 0
        self._ended_by: int | None = None  # our exit code when keyveil ended the sandbox itself
        # Signals that came while the sandbox was being set up (CMD may already be
        # running and printing): handled once the event loop's handlers are in place.
        self._early: list[int] = []

    # -- setting up ---------------------------------------------------------------------

    def start(self) -> None:
        # From here a Ctrl-C is kept for _serve: CMD starts before the event loop, and a
        # signal with no handler yet would end keyveil and leave the sandbox running.
        before = {sig: signal.signal(sig, lambda n, _frame: self._early.append(n)) for sig in _HANDLED}
        try:
            self._start()
        except BaseException:
            for sig, handler in before.items():  # None: one not set from Python
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            raise

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        info_r, info_w = os.pipe()
        err = os.dup(2)
        helper_args = [str(self.proxy.port), str(theirs.fileno()), str(err), str(len(self.plan.must_be_hidden))]
        helper_args += [str(p) for p in self.plan.must_be_hidden]
        argv = [
            self.bwrap,
            *_NAMESPACES,
            # CMD keeps no capability, even as root: with CAP_SYS_ADMIN in its user
            # namespace it could unmount what hides KEYVEIL_HOME.
            "--cap-drop", "ALL",
            "--die-with-parent",
            # No controlling terminal: CMD cannot push keystrokes into the user's
            # shell (TIOCSTI). keyveil forwards Ctrl-C and window-size changes.
            "--new-session",
            "--info-fd", str(info_w),
            *self.plan.args,
            "--",
            helper_python()[0], "-I", "-S", "-c", _HELPER, *helper_args, *self.command,
        ]  # fmt: skip
        try:
            self.proc = subprocess.Popen(
                argv,
                env=self.env,
                pass_fds=(info_w, theirs.fileno(), err),
                stdin=self.stdin,
                stdout=self.stdout,
                stderr=subprocess.PIPE,
                # Its own session: a Ctrl-C in the terminal reaches keyveil only,
                # which forwards it once to CMD.
                start_new_session=True,
            )
        except OSError as e:
            raise _refuse(self.command, f"bubblewrap ({self.bwrap}) could not be started: {e.strerror}", _BWRAP_MISSING[1]) from None
        finally:
            os.close(info_w)
            os.close(err)
            theirs.close()
        try:
            self._handshake(ours, info_r)
        except BaseException:
            self._kill()
            raise
        finally:
            ours.close()
            os.close(info_r)

    def _handshake(self, chan: socket.socket, info_r: int) -> None:
        deadline = time.monotonic() + SETUP_TIMEOUT
        info = b""
        while True:
            if not select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise self._setup_failed("the sandbox did not start within 30 s")
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            info += chunk
        if not info:
            raise self._setup_failed()
        self.pid1 = int(json.loads(info)["child-pid"])
        with contextlib.suppress(OSError):
            self.pid1_fd = os.pidfd_open(self.pid1)
        chan.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            msg, ancdata, _, _ = chan.recvmsg(4096, socket.CMSG_SPACE(array.array("i").itemsize))
        except TimeoutError:
            raise self._setup_failed("the sandbox did not start within 30 s") from None
        fds = array.array("i")
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if msg[:1] == b"L" and len(fds) == 1:
            self.listener = socket.socket(fileno=fds[0])
        else:
            for fd in fds:
                os.close(fd)
            raise self._helper_refused(msg)
        try:
            msg = chan.recv(4096)  # b"" once CMD has replaced the helper
        except TimeoutError:
            raise self._setup_failed("the sandbox did not start within 30 s") from None
        if msg:
            raise self._helper_refused(msg)

    def _helper_refused(self, msg: bytes) -> KeyveilError:
        tag, text = msg[:1], os.fsdecode(msg[1:])
        if tag == b"X":
            errno_text, _, reason = text.partition(" ")
            self._wait_gone()
            if errno_text == "2":
                return UsageError(f"command not found in the sandbox: {self.command[0]}{self._private_hint()}")
            return UsageError(f"cannot run {self.command[0]} in the sandbox: {reason}")
        if tag == b"H":
            return _refuse(self.command, f"the sandbox still shows {text}, which it must hide", f"report this as a keyveil bug; see {DOCS}")
        if tag == b"N":
            return _refuse(
                self.command, f"the sandbox has network interfaces besides loopback ({text})", f"report this as a keyveil bug; see {DOCS}"
            )
        if tag == b"B":
            return _refuse(
                self.command, f"the proxy's address 127.0.0.1:{self.proxy.port} could not be bound in the sandbox ({text})", f"see {DOCS}"
            )
        return self._setup_failed()

    def _private_hint(self) -> str:
        """Why CMD, found outside, is not in the sandbox: it lies in a private area."""
        found = shutil.which(self.command[0], path=self.env.get("PATH", os.defpath))
        if found is None:
            return ""
        seen = (Path(os.path.abspath(found)), Path(os.path.realpath(found)))
        where, area = next(((w, a) for w in seen for a in self.plan.private if _inside(w, a)), (None, None))
        if area is None:
            return ""
        return (
            f" ({where} lies under {area}, of which the sandbox has its own, empty copy: "
            "show what it needs with --ro PATH, for a venv's python the venv)"
        )

    def _setup_failed(self, what: str | None = None) -> IsolationError:
        """The sandbox never reached CMD: say why, from bubblewrap's own words."""
        stderr = b""
        if self.proc is not None:
            if what is not None:
                self._kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self._kill()
            if self.proc.stderr is not None:  # what bubblewrap said, without waiting on a process that lingers
                fd = self.proc.stderr.fileno()
                while len(stderr) < 1 << 16 and select.select([fd], [], [], 2)[0] and (chunk := os.read(fd, 4096)):
                    stderr += chunk
        if what is not None:
            return _refuse(self.command, what, f"run `keyveil doctor`; see {DOCS}")
        return _refuse(self.command, *diagnose(stderr.decode(errors="replace"), host_facts()))

    # -- running -----------------------------------------------------------------------

    def serve(self) -> int:
        """Bridge connections until CMD ends; then make sure nothing is left."""
        try:
            return asyncio.run(self._serve())
        finally:
            self._kill()
            self._wait_gone()
            if self.listener is not None:
                self.listener.close()
            if self.proc is not None and self.proc.stderr is not None:
                self.proc.stderr.close()

    async def _serve(self) -> int:
        loop = asyncio.get_running_loop()
        assert self.proc is not None and self.listener is not None
        exited = loop.create_future()
        bwrap_fd = os.pidfd_open(self.proc.pid)

        def on_exit() -> None:
            loop.remove_reader(bwrap_fd)  # readers are level-triggered: once is enough
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(bwrap_fd, on_exit)
        watch = self._watch_proxy(loop)
        assert self.proc.stderr is not None
        err_fd = self.proc.stderr.fileno()
        os.set_blocking(err_fd, False)
        loop.add_reader(err_fd, self._relay_stderr, err_fd, loop)
        for sig in _HANDLED:
            loop.add_signal_handler(sig, self._on_signal, sig, loop)
        for sig in self._early:  # (each as it would have been handled then)
            self._on_signal(sig, loop)
        self._early.clear()
        self.listener.setblocking(False)
        bridge = asyncio.ensure_future(self._accept(loop))
        try:
            await exited
        finally:
            bridge.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await bridge
            loop.remove_reader(bwrap_fd)
            os.close(bwrap_fd)
            with contextlib.suppress(Exception):
                loop.remove_reader(err_fd)
            if watch is not None:
                watch()
            for sig in _HANDLED:
                loop.remove_signal_handler(sig)
        rc = self.proc.wait()
        self._drain_stderr(err_fd)
        if self._ended_by is not None:
            return self._ended_by
        return rc if rc >= 0 else 128 - rc

    def _watch_proxy(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        """End the sandbox when the proxy process ends: CMD can reach nothing without it."""
        if self.proxy.pid is None:
            return None
        try:
            fd = os.pidfd_open(self.proxy.pid)
        except ProcessLookupError:
            loop.call_soon(self._proxy_died, loop)
            return None
        except OSError:  # no pidfd (kernel < 5.3): ask once a second
            handle: list[asyncio.TimerHandle] = []

            def poll() -> None:
                try:
                    os.kill(self.proxy.pid, 0)  # type: ignore[arg-type]
                except ProcessLookupError:
                    self._proxy_died(loop)
                    return
                except PermissionError:
                    pass
                handle[:] = [loop.call_later(1.0, poll)]

            poll()
            return lambda: [h.cancel() for h in handle]

        def on_exit() -> None:
            loop.remove_reader(fd)
            self._proxy_died(loop)

        loop.add_reader(fd, on_exit)

        def stop() -> None:
            loop.remove_reader(fd)
            os.close(fd)

        return stop

    def _proxy_died(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._ended_by is not None:
            return
        self._ended_by = 2
        if not self.quiet:
            print(
                f"keyveil: the proxy (pid {self.proxy.pid}) exited; ending the sandbox, as {self.command[0]} can reach nothing without it",
                file=sys.stderr,
                flush=True,
            )
        self._signal_sandbox(signal.SIGTERM)
        loop.call_later(GRACE_SECONDS, self._kill)

    def _on_signal(self, sig: int, loop: asyncio.AbstractEventLoop) -> None:
        """SIGINT: the first goes to CMD, a second ends the sandbox at once.
        SIGTERM, SIGHUP: go to CMD, which gets GRACE_SECONDS to end.
        SIGTSTP (Ctrl-Z): the sandbox stops, then keyveil; SIGCONT (fg) resumes both.
        Others: passed on."""
        if sig == signal.SIGTSTP:
            self._signal_sandbox(signal.SIGSTOP)  # CMD is not in the terminal's job: stop it as the job would be
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if sig == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts >= 2:
                self._ended_by = 128 + signal.SIGINT
                self._kill()
                return
        self._signal_sandbox(sig)
        if sig in (signal.SIGTERM, signal.SIGHUP):

            def end() -> None:
                if self.proc is not None and self.proc.poll() is None:
                    self._ended_by = 128 + sig
                    self._kill()

            loop.call_later(GRACE_SECONDS, end)

    def _signal_sandbox(self, sig: int) -> None:
        # The sandbox's session: PID 1 (bubblewrap's init, which ignores it) and
        # CMD with every process that did not start a process group of its own,
        # as a terminal signals its foreground group.
        if self.pid1 is None or self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid1, sig)

    def _relay_stderr(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            return
        with contextlib.suppress(OSError):
            os.write(2, data)

    def _drain_stderr(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            while data := os.read(fd, _CHUNK):
                os.write(2, data)

    async def _accept(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.listener is not None
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                client, _ = await loop.sock_accept(self.listener)
                task = asyncio.ensure_future(self._bridge(loop, client))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _bridge(self, loop: asyncio.AbstractEventLoop, client: socket.socket) -> None:
        upstream = socket.socket(socket.AF_INET)
        with client, upstream:
            client.setblocking(False)
            upstream.setblocking(False)
            try:
                upstream.bind((SANDBOX_SOURCE, 0))  # how the proxy knows a sandbox's flows
                await loop.sock_connect(upstream, (self.proxy.host, self.proxy.port))
            except OSError:
                return  # the client sees its connection closed, as with a proxy that is down
            await asyncio.gather(_pipe(loop, client, upstream), _pipe(loop, upstream, client), return_exceptions=True)

    # -- ending --------------------------------------------------------------------------

    def _kill(self) -> None:
        """Kill bubblewrap; its PID 1 dies with it (--die-with-parent), and with
        PID 1 every process of the sandbox's PID namespace."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        if self.pid1_fd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pid1_fd, signal.SIGKILL)

    def _wait_gone(self) -> None:
        """Return once the sandbox's PID 1, hence every process in it, is gone."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(GRACE_SECONDS)
        if self.pid1_fd is not None:
            if not select.select([self.pid1_fd], [], [], GRACE_SECONDS)[0]:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(self.pid1_fd, signal.SIGKILL)
                select.select([self.pid1_fd], [], [], GRACE_SECONDS)
            os.close(self.pid1_fd)
            self.pid1_fd = None


async def _pipe(loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := await loop.sock_recv(src, _CHUNK):
            await loop.sock_sendall(dst, data)
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


# -- keyveil doctor ---------------------------------------------------------------------------

# Runs inside the probe sandbox: the bridged proxy must answer, the host's
# loopback and any other address must be unreachable, the vault hidden.
_PROBE = r"""
import socket, sys, os
proxy, host_port, vault = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
problems = []
with socket.create_connection(("127.0.0.1", proxy), timeout=5) as s:
    if s.recv(16) != b"keyveil-probe":
        problems.append("the proxy is not reachable")
for addr in (("127.0.0.1", host_port), ("192.0.2.1", 443)):
    try:
        socket.create_connection(addr, timeout=5).close()
        problems.append(f"{addr[0]}:{addr[1]} is reachable")
    except TimeoutError:
        problems.append(f"{addr[0]}:{addr[1]} hangs instead of failing")
    except OSError:
        pass
if os.path.lexists(vault):
    problems.append("the vault is visible")
print("; ".join(problems), end="")
sys.exit(1 if problems else 0)
"""


def check(home: Home, env: Mapping[str, str] | None = None) -> tuple[bool, str, str]:
    """Whether --isolate works here: (ok, what was found, how to fix it).

    Runs a real sandbox with a stand-in proxy: it must reach that proxy and
    nothing else (a server on the host's loopback, another address), and
    must not see the vault.
    """
    env = dict(os.environ if env is None else env)
    try:
        bwrap = find_bwrap(env)
    except IsolationError as e:
        return False, *_what_and_fix(e)
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout.strip() or "bwrap"
    with socket.create_server(("127.0.0.1", 0)) as fake_proxy, socket.create_server(("127.0.0.1", 0)) as host_service:
        fake_proxy.settimeout(0.2)
        stop = threading.Event()

        def answer() -> None:
            while not stop.is_set():
                try:
                    conn, _ = fake_proxy.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                with conn:
                    conn.sendall(b"keyveil-probe")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        port = fake_proxy.getsockname()[1]
        probe = [helper_python()[0], "-I", "-S", "-c", _PROBE, str(port), str(host_service.getsockname()[1]), str(home.vault)]
        with tempfile.TemporaryFile() as out, open(os.devnull, "rb") as devnull:
            try:
                rc = run_isolated(
                    probe,
                    env=env,
                    home=home,
                    proxy=Endpoint("127.0.0.1", port),
                    cwd=Path("/"),
                    quiet=True,
                    stdin=devnull.fileno(),
                    stdout=out.fileno(),
                )
            except KeyveilError as e:
                return False, *_what_and_fix(e)
            finally:
                stop.set()
                thread.join(2)
            out.seek(0)
            verdict = out.read().decode(errors="replace").strip()
    if rc != 0:
        return False, f"the sandbox is not sealed: {verdict or f'probe exit {rc}'}", f"report this as a keyveil bug; see {DOCS}"
    return True, f"{version}: user, mount, network and PID namespaces; the sandbox reaches only the proxy and cannot read the vault", ""


def _what_and_fix(error: KeyveilError) -> tuple[str, str]:
    lines = str(error).splitlines()
    what = lines[0].removeprefix("--isolate: ").rstrip(".")
    fix = next((line.strip().removeprefix("To enable it: ").rstrip(".") for line in lines if "To enable it:" in line), f"see {DOCS}")
    return what, fix
