"""`keyveil doctor`: check home, rules, vault, CA, a sealed round trip, and the service.

Each check prints one line, ok or what to do. Nothing printed holds a value.
"""

from __future__ import annotations

import base64
import json
import os
import stat

from ._errors import KeyveilError
from ._home import Home


def run_doctor(home: Home) -> int:
    failures = 0

    def report(ok: bool, what: str, fix: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f"\n     → {fix}" if fix and not ok else ""), flush=True)

    report(home.root.is_dir(), f"home {home.root}", "run `keyveil init`")
    mode = stat.S_IMODE(home.root.stat().st_mode) if home.root.exists() else 0
    report(not mode & 0o077, f"home is private (mode {mode:o})", f"chmod 700 {home.root}")

    from ._rules import load_rules

    rules = None
    try:
        rules = load_rules(home.rules)
        report(True, f"rules {home.rules}: {len(rules.names())} secrets bound")
    except KeyveilError as e:
        report(False, f"rules {home.rules}", str(e))
    if home.rules.exists():
        rmode = stat.S_IMODE(home.rules.stat().st_mode)
        report(not rmode & 0o022, f"rules file not writable by others (mode {rmode:o})", f"chmod 600 {home.rules}")

    from .vault import open_vault

    snapshot = None
    try:
        vault = open_vault(home.root)
        snapshot = vault.load()
        report(True, f"vault ({vault.backend}): {len(snapshot.current)} secrets")
    except KeyveilError as e:
        report(False, "vault", str(e))

    key = home.certs / "mitmproxy-ca.pem"
    if key.exists():
        kmode = stat.S_IMODE(key.stat().st_mode)
        report(kmode == 0o600, f"CA key {key} mode {kmode:o}", f"chmod 600 {key}")
    else:
        report(False, "CA key", "run `keyveil init`")
    report(home.ca_cert.exists(), f"CA certificate {home.ca_cert}", "run `keyveil init`")

    if rules is not None and snapshot is not None:
        unbound = sorted(set(snapshot.current) - set(rules.names()))
        missing = sorted(set(rules.names()) - set(snapshot.current))
        if missing:  # a reference to it is blocked (vault_unavailable) until it is set
            print(f"note bound secrets without a value: {', '.join(missing)} (keyveil secret set NAME)")
        if unbound:
            print(f"note secrets sealed but bound nowhere: {', '.join(unbound)}")
        from ._pipeline import Engine, Request

        engine = Engine(rules, snapshot)
        leaked = []
        for name, value in snapshot.current.items():
            body = json.dumps({"text": value.decode("utf-8", "replace")}).encode() + b" " + base64.b64encode(b"u:" + value)
            out = engine.process_request(Request("POST", "https", "api.anthropic.com", 443, b"/v1/messages", None, [], body))
            if out.block or value in (out.request.body or b""):
                leaked.append(name)
        report(not leaked, "sealed round trip toward a model vendor", "sealing failed for: " + ", ".join(leaked))

    # The always-on service is optional: checked only once it is installed.
    from . import _service
    from .cli import _running_proxy, proxy_env

    lay = _service.layout(_service.default_platform(), os.environ)
    found = _service.read_installed(lay)
    if not found.texts and not found.foreign:
        print("note service not installed (optional: `keyveil service install` keeps the proxy always on)")
    else:
        session_for = lambda url: proxy_env(home, url)  # noqa: E731
        for f in _service.checks(home, lay, os.environ, session_for=session_for, running=_running_proxy(home)):
            if f.ok is None:
                print(_service.format_finding(f), flush=True)
            else:
                report(f.ok, f.what, f.fix)

    from ._isolate import check as check_isolation

    works, found, fix = check_isolation(home)
    required = rules is not None and rules.policy.require_isolation
    if works or required:  # without the policy, keyveil works unisolated: a note, not a failure
        report(works, f"isolation (keyveil run --isolate): {found}", fix + ("; the rules require isolation" if required else ""))
    else:
        print(f"note isolation (keyveil run --isolate) is not available: {found}\n     → {fix}", flush=True)
    return 0 if failures == 0 else 2
