"""`keyveil start`: the addon inside an embedded mitmproxy master.

No script loader, so no hot reload that could unload keyveil; the addon sits
where a script would (before save, dumper and the web view) so nothing that
reads flows sees a request before it is sealed. A configuration error stops
the proxy with a non-zero exit before it listens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from ._errors import KeyveilError
from ._home import Home

log = logging.getLogger("keyveil")


def _build_master(addon, home: Home, host: str, port: int, web: bool, web_port: int, proxyauth: str):
    from mitmproxy import options
    from mitmproxy.addons import script

    opts = options.Options(listen_host=host, listen_port=port, confdir=str(home.certs))
    if web:
        from mitmproxy.tools.web.master import WebMaster

        master = WebMaster(opts, with_termlog=True)
        opts.update(web_open_browser=False, web_host="127.0.0.1", web_port=web_port)
    else:
        from mitmproxy.tools.dump import DumpMaster

        master = DumpMaster(opts, with_termlog=True, with_dumper=False)
    master.addons.add(addon)
    # Move keyveil to where scripts run: before save, dumper and the view.
    chain = master.addons.chain
    chain.remove(addon)
    loader = next(i for i, a in enumerate(chain) if isinstance(a, script.ScriptLoader))
    chain.insert(loader + 1, addon)
    # Hot reload and extra scripts are not offered: remove the loader.
    updates = {"keyveil_home": str(home.root), "connection_strategy": "lazy"}
    if proxyauth:
        updates["proxyauth"] = proxyauth
    opts.update(**updates)
    return master


def run_proxy(home: Home, host: str, port: int, *, web: bool, web_port: int = 8081, proxyauth: str, state_file: Path | None) -> int:
    from mitmproxy import exceptions

    logging.getLogger().setLevel(logging.INFO)
    for noisy in ("hpack", "tornado", "asyncio", "quic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from .addon import Keyveil

    async def main() -> int:
        addon = Keyveil()
        addon.embedded = True
        try:
            master = _build_master(addon, home, host, port, web, web_port, proxyauth)
        except exceptions.OptionsError as e:
            print(str(e), file=sys.stderr)
            return addon.load_error.exit_code if addon.load_error else 1
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, master.shutdown)
        state = {"host": host, "port": port, "pid": os.getpid(), "auth": bool(proxyauth)}
        if state_file is not None:
            try:
                state_file.write_text(json.dumps(state))
            except OSError:
                pass
        print(f"keyveil: proxy on http://{host}:{port} (home {home.root})", file=sys.stderr, flush=True)
        try:
            await master.run()
        finally:
            try:
                if state_file is not None and json.loads(state_file.read_text()).get("pid") == os.getpid():
                    state_file.unlink()
            except (OSError, ValueError):
                pass
        return 0

    try:
        return asyncio.run(main())
    except KeyveilError as e:
        print(f"keyveil: {e}", file=sys.stderr)
        return e.exit_code
