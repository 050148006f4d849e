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
    from ._vault import open_vault

    home = _home()
    if args.action == "ref":
        _out(format_reference(_name(args.name)))
        return 0
    if args.action == "import":
        from ._import import run_import

        return run_import(home, Path(args.file), dry_run=args.dry_run, out=_out)
    vault = open_vault(home.root)
    if args.action == "set":
        if args.value is not None:
            raise UsageError(
                "secret set takes no value argument (argv is visible to other processes): "
                "pipe the value on stdin or type it at the hidden prompt"
            )
        name = _name(args.name)
        vault.set(name, _read_value(name))
        _out(f"stored {name}; use it as {format_reference(name)}")
        if name not in _rules_names(home):
            _out(f"note: {name} is not bound to any host yet; add it under secrets: in {home.rules}")
        return 0
    if args.action == "rm":
        vault.remove(_name(args.name))
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
    if not _is_loopback(host) and not proxyauth:
        raise UsageError(
            f"refusing to listen on {host}: beyond loopback keyveil requires proxy authentication; "
            "set KEYVEIL_PROXYAUTH=user:password (clients then use http://user:password@HOST:PORT)"
        )
    from .embed import run_proxy

    state = None if args.private else _state_file(home)  # a private proxy is nobody else's
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
    url = _running_proxy(home) or f"http://{LOOPBACK}:{DEFAULT_PORT}"
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
    url = _running_proxy(home)
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
        )
        url = f"http://{LOOPBACK}:{port}"
        if not _wait_listening(port, private):
            private.kill()
            private.wait(10)
            log.seek(0)
            sys.stderr.write(f"keyveil: the private proxy did not start:\n{log.read().decode(errors='replace')}")
            return private.returncode if private.returncode and private.returncode > 0 else 2
    env = {k: v for k, v in os.environ.items() if not _withheld(k)}
    env.update(proxy_env(home, url))
    try:
        return subprocess.call(command, env=env)
    except FileNotFoundError:
        raise UsageError(f"command not found: {command[0]}") from None
    finally:
        if private is not None:
            private.send_signal(signal.SIGTERM)
            try:
                private.wait(10)
            except subprocess.TimeoutExpired:
                private.kill()


def _withheld(var: str) -> bool:
    """Variables the agent must not inherit: they open the vault."""
    return var == "KEYVEIL_PASSPHRASE" or var.startswith("KEYVEIL_SECRET_") or var == "KEYVEIL_PROXYAUTH"


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keyveil", description="Let AI agents use API keys without reading them.")
    parser.add_argument("--version", action="version", version=f"keyveil {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    sub.add_parser("init", help="create the home, rules file and CA").set_defaults(func=cmd_init)

    secret = sub.add_parser("secret", help="manage secret values")
    ssub = secret.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("set", "store a value (hidden prompt or stdin)"), ("rm", "forget a secret"), ("ref", "print the reference")):
        p = ssub.add_parser(action, help=text)
        p.add_argument("name")
        if action == "set":  # only to refuse it without echoing it back
            p.add_argument("value", nargs="?", help=argparse.SUPPRESS)
    ssub.add_parser("list", help="names, versions and bindings (never values)")
    imp = ssub.add_parser("import", help="register the secret-looking entries of a .env file")
    imp.add_argument("file", metavar="FILE")
    imp.add_argument("--dry-run", action="store_true", help="show the plan, store nothing")
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
    run.add_argument("command", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)

    sub.add_parser("env", help="print the proxy variables as export lines").set_defaults(func=cmd_env)

    audit = sub.add_parser("audit", help="show the audit log")
    audit.add_argument("--follow", "-f", action="store_true")
    audit.add_argument("--limit", type=int, default=50)
    audit.set_defaults(func=cmd_audit)

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
