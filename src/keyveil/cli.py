"""The `keyveil` command (SPEC §10).

Exit codes: 0 ok, 1 usage or validation error, 2 runtime failure. A value is
read from a hidden prompt or stdin, never from argv, and is never printed.
"""

from __future__ import annotations

import argparse
import getpass
import ipaddress
import json
import os
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._errors import KeyveilError, UsageError
from ._home import Home, default_home
from ._references import check_name, format_reference

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8080


def _home() -> Home:
    home = Home(default_home())
    home.ensure()
    return home


def _out(text: str = "") -> None:
    print(text, flush=True)


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


# -- init ------------------------------------------------------------------------


def ensure_ca(home: Home) -> None:
    """Create mitmproxy's CA in certs/ (key 0600) and the combined CA bundle."""
    from mitmproxy.certs import CertStore

    CertStore.from_store(str(home.certs), "mitmproxy", 2048)
    for key_file in home.certs.glob("mitmproxy-ca*.p12"):
        os.chmod(key_file, 0o600)
    for key_file in ("mitmproxy-ca.pem",):
        path = home.certs / key_file
        if path.exists():
            os.chmod(path, 0o600)
    system = _system_bundle()
    parts = [system.read_text()] if system else []
    parts.append(home.ca_cert.read_text())
    tmp = home.ca_bundle.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text("\n".join(parts))
    os.replace(tmp, home.ca_bundle)  # a concurrent `run` never reads half a bundle


def _system_bundle() -> Path | None:
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile, "/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    try:
        import certifi

        return Path(certifi.where())
    except ImportError:
        return None


def cmd_init(args) -> int:
    home = Home(default_home())
    created = home.ensure()
    ensure_ca(home)
    from ._rules import load_rules

    load_rules(home.rules)
    _out(f"keyveil home: {home.root}")
    _out(f"rules: {home.rules} ({'created from the example' if created else 'kept as it was'})")
    _out(f"CA certificate: {home.ca_cert}")
    _out("")
    _out("Next steps:")
    _out("  keyveil secret set github/pat        # paste the value at the hidden prompt")
    _out(f"  $EDITOR {home.rules}                # bind it to hosts and a header")
    _out("  keyveil run -- claude                # or: keyveil start, then eval \"$(keyveil env)\"")
    return 0


# -- secrets -----------------------------------------------------------------------


def _read_value(name: str) -> bytes:
    if sys.stdin.isatty():
        value = getpass.getpass(f"value for {name} (hidden): ")
        return value.encode("utf-8")
    data = sys.stdin.buffer.read()
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    return data


def cmd_secret(args) -> int:
    from .vault import open_vault

    home = _home()
    if args.action == "ref":
        _out(format_reference(_name(args.name)))
        return 0
    if args.action == "import":
        from ._import import run_import

        return run_import(home, Path(args.file), dry_run=args.dry_run, out=_out)
    if args.action == "adopt":
        from ._import import run_adopt

        return run_adopt(home, args.detected, args.name, out=_out)
    vault = open_vault(home.root)
    if args.action == "set":
        if args.value:
            raise UsageError(
                "secret set takes no value argument (argv is visible to other processes): "
                "pipe the value on stdin or type it at the hidden prompt"
            )
        name = _name(args.name)
        vault.set(name, _read_value(name))
        home.bump_generation()  # a running proxy seals the new value from its very next request
        _out(f"stored {name}; use it as {format_reference(name)}")
        if name not in _rules_names(home) and not name.startswith("agents/"):
            _out(f"note: {name} is not bound to any host yet; add it under secrets: in {home.rules}")
        return 0
    if args.action == "rm":
        vault.remove(_name(args.name))
        home.bump_generation()
        _out(f"removed {args.name}")
        return 0
    # list
    rules = _rules_or_none(home)
    bindings = {row[0]: row for row in rules.table()} if rules else {}
    rows = []
    for info in vault.info():
        row = bindings.get(info.name)
        rows.append((info.name, str(info.versions), info.updated.strftime("%Y-%m-%d %H:%M"), row[1] if row else "(not bound)", row[2] if row else ""))
    if not rows:
        _out("no secrets yet: keyveil secret set NAME")
        return 0
    _out(_table(rows, ("NAME", "VERSIONS", "UPDATED", "HOSTS", "INJECT")))
    return 0


def _name(name: str) -> str:
    try:
        return check_name(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _rules_or_none(home: Home):
    from ._rules import load_rules

    try:
        return load_rules(home.rules)
    except KeyveilError:
        return None


def _rules_names(home: Home) -> list[str]:
    rules = _rules_or_none(home)
    return rules.names() if rules else []


# -- rules ------------------------------------------------------------------------


def cmd_rules(args) -> int:
    from ._rules import load_rules

    home = _home()
    path = Path(args.file) if args.file else home.rules
    rules = load_rules(path)
    _out(f"{path}: valid")
    rows = rules.table()
    if rows:
        _out(_table(rows, ("SECRET", "HOSTS", "INJECT", "RESTRICTIONS")))
    else:
        _out("no secrets bound")
    if rules.agents is not None:
        _out("")
        agents = [(name, ", ".join(sorted(secrets)) or "(none)") for name, secrets in sorted(rules.agents.items())]
        _out(_table(agents, ("AGENT", "SECRETS")) if agents else "agents: none (every client is refused)")
    return 0


# -- start / run / env --------------------------------------------------------------


def _parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        raise UsageError(f"--listen takes HOST:PORT, got {text!r}")
    host = host.strip("[]") or LOOPBACK
    try:
        return host, int(port)
    except ValueError:
        raise UsageError(f"--listen takes HOST:PORT, got {text!r}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _state_file(home: Home) -> Path:
    return home.root / "proxy.json"


def cmd_start(args) -> int:
    home = _home()
    ensure_ca(home)
    host, port = _parse_listen(args.listen)
    proxyauth = os.environ.get("KEYVEIL_PROXYAUTH", "")
    rules = _rules_or_none(home)
    agents = rules is not None and rules.agents is not None  # agents authenticate to the proxy themselves
    if agents and proxyauth:
        raise UsageError(
            "rules.yaml names agents, which authenticate to the proxy with their own credentials: "
            "unset KEYVEIL_PROXYAUTH (it would refuse them)"
        )
    if not _is_loopback(host) and not proxyauth and not agents:
        raise UsageError(
            f"refusing to listen on {host}: beyond loopback keyveil requires proxy authentication; "
            "set KEYVEIL_PROXYAUTH=user:password (clients then use http://user:password@HOST:PORT), "
            "or name agents in rules.yaml (agents:)"
        )
    from .embed import run_proxy

    state = None if args.private else _state_file(home)  # a private proxy is nobody else's
    if state is not None and _running_proxy(home) is not None:
        # Another live proxy (the service, say) owns the state file: leave it to
        # it, or this proxy's exit would hide the service from `keyveil run`.
        state = None
    return run_proxy(home, host, port, web=args.web, web_port=args.web_port, proxyauth=proxyauth, state_file=state)


def proxy_env(home: Home, proxy_url: str) -> dict[str, str]:
    ca = str(home.ca_cert)
    bundle = str(home.ca_bundle)
    no_proxy = "localhost,127.0.0.1,::1"
    return {
        "HTTPS_PROXY": proxy_url,
        "https_proxy": proxy_url,
        "HTTP_PROXY": proxy_url,
        "http_proxy": proxy_url,
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
        "NODE_EXTRA_CA_CERTS": ca,
        "SSL_CERT_FILE": bundle,
        "REQUESTS_CA_BUNDLE": bundle,
        "CURL_CA_BUNDLE": bundle,
        "GIT_SSL_CAINFO": bundle,
        "CODEX_CA_CERTIFICATE": bundle,
    }


def _running_proxy(home: Home) -> str | None:
    """URL of a `keyveil start` proxy the agent can use as is (not one that needs auth)."""
    try:
        state = json.loads(_state_file(home).read_text())
        host, port, pid = state["host"], int(state["port"]), int(state["pid"])
        if state.get("auth"):
            return None
        os.kill(pid, 0)
        with socket.create_connection((host if host not in ("0.0.0.0", "::") else LOOPBACK, port), timeout=0.5):
            pass
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return None
    return f"http://{LOOPBACK if host in ('0.0.0.0', '::') else host}:{port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def cmd_env(args) -> int:
    home = _home()
    ensure_ca(home)
    url = _running_proxy(home) or _service_url() or f"http://{LOOPBACK}:{DEFAULT_PORT}"
    for key, value in proxy_env(home, url).items():
        _out(f"export {key}={shlex.quote(value)}")
    return 0


def cmd_run(args) -> int:
    command = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("keyveil run needs a command: keyveil run -- CMD [ARGS...]")
    home = _home()
    ensure_ca(home)
    from ._rules import load_rules

    # An invalid rules file is the proxy's to report, unless CMD is to run as an agent.
    rules = load_rules(home.rules) if args.agent is not None else _rules_or_none(home)
    if rules is not None and rules.agents is not None and args.agent is None:
        names = ", ".join(sorted(rules.agents)) or "none"
        raise UsageError(f"rules.yaml names agents: run CMD as one of them with --agent NAME (agents: {names})")
    password = _agent_password(home, rules, args.agent) if args.agent is not None else None
    plan = None
    if args.isolate:
        from . import _isolate

        # Everything that can refuse is checked before a proxy is started.
        _isolate.find_bwrap(os.environ, command)
        plan = _isolate.plan_mounts(home, [_isolate.PathRule(kind, path) for kind, path in args.paths], os.environ)
    else:
        if args.paths:
            raise UsageError("--ro, --rw and --hide shape the sandbox: use them with --isolate")
        _refuse_unless_isolated(home, command)
    url = _running_proxy(home)
    if url is not None and plan is not None:
        from urllib.parse import urlsplit

        from . import _isolate

        if not _isolate.is_ipv4_loopback(urlsplit(url).hostname or ""):
            url = None  # the sandbox bridge reaches a proxy on IPv4 loopback only: start one there
    proxy_pid = _running_proxy_pid(home) if url else None
    private = None
    if url is None:
        port = _free_port()
        log = tempfile.TemporaryFile()  # the proxy's log; shown only if it fails to start
        private = subprocess.Popen(
            [sys.executable, "-m", "keyveil", "start", "--listen", f"{LOOPBACK}:{port}", "--private"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            # loopback and private to CMD: no proxy authentication
            env={k: v for k, v in os.environ.items() if k != "KEYVEIL_PROXYAUTH"},
            # Its own session, so that a Ctrl-C meant for CMD does not stop the
            # proxy under it; and it ends with keyveil run, even a killed one.
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
        url, proxy_pid = f"http://{LOOPBACK}:{port}", private.pid
        if not _wait_listening(port, private):
            private.kill()
            private.wait(10)
            log.seek(0)
            sys.stderr.write(f"keyveil: the private proxy did not start:\n{log.read().decode(errors='replace')}")
            return private.returncode if private.returncode and private.returncode > 0 else 2
    if password is not None:
        from ._agents import with_credentials

        url = with_credentials(url, args.agent, password)
    env = {k: v for k, v in os.environ.items() if not _withheld(k)}
    try:
        if plan is not None:
            from urllib.parse import urlsplit

            from . import _isolate

            where = urlsplit(url)
            proxy = _isolate.Endpoint(where.hostname or LOOPBACK, where.port or DEFAULT_PORT, proxy_pid)
            # Inside the sandbox the proxy is at 127.0.0.1 on the same port, whatever
            # loopback address it listens on outside (credentials in the URL are kept).
            userinfo = where.netloc.rpartition("@")[0]
            env.update(proxy_env(home, f"http://{userinfo + '@' if userinfo else ''}{LOOPBACK}:{proxy.port}"))
            return _isolate.run_isolated(command, env=env, home=home, proxy=proxy, plan=plan)
        env.update(proxy_env(home, url))
        rc = subprocess.call(command, env=env)
        return 128 - rc if rc < 0 else rc  # killed by signal N: 128+N, as a shell reports it
    except FileNotFoundError:
        raise UsageError(f"command not found: {command[0]}") from None
    finally:
        if private is not None:
            private.send_signal(signal.SIGTERM)
            try:
                private.wait(10)
            except subprocess.TimeoutExpired:
                private.kill()


def _agent_password(home: Home, rules, agent: str) -> bytes:
    """AGENT's proxy password, read from the vault's agents/NAME."""
    from ._agents import agent_password
    from .vault import open_vault

    return agent_password(rules, open_vault(home.root).load().current, agent)


def _refuse_unless_isolated(home: Home, command: list[str]) -> None:
    """policy.require_isolation: true (SPEC §4) makes `keyveil run` refuse to run CMD bare."""
    try:
        text = home.rules.read_text()
    except OSError:
        return
    if "require_isolation" not in text:  # spares loading the rules (~0.4 s) on every run
        return
    from ._rules import load_rules

    if load_rules(home.rules).policy.require_isolation:
        raise UsageError(
            f"{home.rules} sets policy.require_isolation: true, so {shlex.quote(command[0])} was not run: "
            f"run it as `keyveil run --isolate -- {shlex.join(command)}`"
        )


def _running_proxy_pid(home: Home) -> int | None:
    try:
        return int(json.loads(_state_file(home).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None


def _die_with_parent():
    """A preexec_fn that makes a child get SIGTERM when keyveil run ends (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork, not in the child
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # keyveil ended before prctl took effect
            os._exit(1)

    return preexec


def _withheld(var: str) -> bool:
    """Variables the agent must not inherit: they open the vault or the proxy."""
    from ._isolate import is_secret_variable

    return is_secret_variable(var)


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


# -- service ----------------------------------------------------------------------------


def _service_url() -> str | None:
    """The address of the installed user service, if there is one."""
    from . import _service

    return _service.read_installed(_service.layout(_service.default_platform(), os.environ)).url


def cmd_service(args) -> int:
    from . import _service

    home = _home()
    lay = _service.layout(args.platform or _service.default_platform(), os.environ)
    if args.action == "uninstall":
        for line in _service.uninstall(lay):
            _out(line)
        return 0
    if args.action == "status":
        findings = _service.checks(home, lay, os.environ, session_for=lambda url: proxy_env(home, url), running=_running_proxy(home))
        for f in findings:
            _out(_service.format_finding(f))
        return 0 if all(f.ok is not False for f in findings) else 2
    host, port = _parse_listen(args.listen)
    url = _service.check_listen(host, port)
    notes = _service.check_vault(home, os.environ)
    ensure_ca(home)  # the session variables name the CA files
    svc = _service.service(home, url, proxy_env(home, url), os.environ)
    for line in [*_service.install(lay, svc), *notes]:
        _out(line)
    if args.system_proxy:
        _out("")
        _out(_service.system_proxy_text(lay.platform, url))
    return 0


# -- audit / doctor -------------------------------------------------------------------


def _audit_rows(records: list[dict]) -> list[tuple[str, ...]]:
    return [
        (
            r.get("ts", ""),
            r.get("action", ""),
            r.get("code") or "",
            r.get("method", ""),
            r.get("host", ""),
            r.get("path", ""),
            ", ".join(f"{n}×{c}" for n, c in sorted((r.get("counts") or {}).items())),
        )
        for r in records
    ]


def cmd_audit(args) -> int:
    from ._audit import read_records

    home = _home()
    header = ("TIME", "ACTION", "CODE", "METHOD", "HOST", "PATH", "NAMES")
    records = read_records(home.audit)
    if not args.follow:
        _out(_table(_audit_rows(records[-args.limit :]), header) if records else "the audit log is empty")
        return 0
    seen = len(records)
    _out(_table(_audit_rows(records[-args.limit :]), header))
    try:
        while True:
            time.sleep(0.5)
            records = read_records(home.audit)
            for row in _audit_rows(records[seen:]):
                _out("  ".join(row))
            seen = len(records)
    except KeyboardInterrupt:
        return 0


def cmd_doctor(args) -> int:
    from .doctor import run_doctor

    return run_doctor(_home())


# -- main ------------------------------------------------------------------------------


class _PathOption(argparse.Action):
    """--ro, --rw and --hide into one list, in the order given (later options win)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*getattr(namespace, self.dest), (option_string.lstrip("-"), values)])


class _Parser(argparse.ArgumentParser):
    """argparse, without echoing what it could not parse: a mistyped
    `keyveil secret set NAME VALUE` must not print the value back."""

    def error(self, message: str):
        if "unrecognized arguments" in message or "invalid choice" in message:
            message = message.split(":", 1)[0] + " (not shown: an argument may hold a value)"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="keyveil", description="Let AI agents use API keys without reading them.")
    parser.add_argument("--version", action="version", version=f"keyveil {_version()}")
    sub = parser.add_subparsers(parser_class=_Parser, dest="cmd", required=True, metavar="COMMAND")

    sub.add_parser("init", help="create the home, rules file and CA").set_defaults(func=cmd_init)

    secret = sub.add_parser("secret", help="manage secret values")
    ssub = secret.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("set", "store a value (hidden prompt or stdin)"), ("rm", "forget a secret"), ("ref", "print the reference")):
        p = ssub.add_parser(action, help=text)
        p.add_argument("name")
        if action == "set":  # only to refuse it without echoing it back; REMAINDER also takes a value that starts with "-"
            p.add_argument("value", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ssub.add_parser("list", help="names, versions and bindings (never values)")
    imp = ssub.add_parser("import", help="register the secret-looking entries of a .env file")
    imp.add_argument("file", metavar="FILE")
    imp.add_argument("--dry-run", action="store_true", help="show the plan, store nothing")
    adopt = ssub.add_parser("adopt", help="register a detected value under NAME (its detected reference stays an alias)")
    adopt.add_argument("detected", metavar="detected/KIND-ID")
    adopt.add_argument("name", metavar="NAME")
    secret.set_defaults(func=cmd_secret)

    rules = sub.add_parser("rules", help="rules file")
    rsub = rules.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = rsub.add_parser("check", help="validate and print the bindings")
    check.add_argument("file", nargs="?")
    rules.set_defaults(func=cmd_rules)

    start = sub.add_parser("start", help="run the proxy")
    start.add_argument("--listen", default=f"{LOOPBACK}:{DEFAULT_PORT}", metavar="HOST:PORT")
    start.add_argument("--web", action="store_true", help="also serve mitmweb on 127.0.0.1 (see --web-port)")
    start.add_argument("--web-port", type=int, default=8081, help=argparse.SUPPRESS)
    start.add_argument("--private", action="store_true", help=argparse.SUPPRESS)
    start.set_defaults(func=cmd_start)

    run = sub.add_parser("run", help="run a command through the proxy")
    run.add_argument("--agent", metavar="NAME", help="run CMD as this agent of rules.yaml (agents:)")
    run.add_argument(
        "--isolate",
        action="store_true",
        help="run it in a sandbox (user, mount, network, PID namespaces) that reaches only the proxy "
        "and cannot read KEYVEIL_HOME; refuses (exit 2) where that is impossible",
    )
    for kind, text in (
        ("ro", "with --isolate: show PATH read-only"),
        ("rw", "with --isolate: show PATH read-write (also under the private /tmp and /run)"),
        ("hide", "with --isolate: hide PATH (an empty directory, a file that cannot be opened)"),
    ):
        run.add_argument(f"--{kind}", action=_PathOption, dest="paths", default=[], metavar="PATH", help=text)
    run.add_argument("command", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)

    sub.add_parser("env", help="print the proxy variables as export lines").set_defaults(func=cmd_env)

    audit = sub.add_parser("audit", help="show the audit log")
    audit.add_argument("--follow", "-f", action="store_true")
    audit.add_argument("--limit", type=int, default=50)
    audit.set_defaults(func=cmd_audit)

    service = sub.add_parser("service", help="keep the proxy always on as a user service")
    vsub = service.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("install", "write the user service and the session variables; print how to activate them"),
        ("uninstall", "remove exactly what install wrote"),
        ("status", "installed? answering? does this shell point at it?"),
    ):
        p = vsub.add_parser(action, help=text)
        p.add_argument("--platform", choices=("linux", "macos"), help="write or check the files of this platform (default: this one)")
        if action == "install":
            p.add_argument("--listen", default=f"{LOOPBACK}:{DEFAULT_PORT}", metavar="HOST:PORT")
            p.add_argument("--system-proxy", action="store_true", help="also print (never apply) the desktop proxy settings")
    service.set_defaults(func=cmd_service)

    sub.add_parser("doctor", help="check home, vault, rules, CA and a sealed round trip").set_defaults(func=cmd_doctor)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("keyveil")
    except PackageNotFoundError:  # run from a source tree without installing
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 1 if e.code else 0
    try:
        return args.func(args)
    except KeyveilError as e:
        print(f"keyveil: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
