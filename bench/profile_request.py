"""Per-request CPU of keyveil's hooks on a 200 KB JSON POST to api.anthropic.com, in process (not in `make bench`).

    .venv/bin/python bench/profile_request.py [N] [--profile] [--size=BYTES]

The home is made as the proxy bench makes it (`keyveil init`, 10 fake secrets
set by `keyveil secret set`); the body is the proxy bench's (a conversation
holding a reference, x-api-key a reference). Each round builds a flow with
mitmproxy.test.tflow and runs requestheaders, request, the injector, then a
small JSON response through responseheaders, its body through the
stream keyveil set (as mitmproxy feeds it), and response. Prints the median
CPU time (process_time) per round over N rounds, and the cost of building the
flow alone (to subtract); --profile prints a cProfile of keyveil's functions.
--size=BYTES: a body of about BYTES (below 20,000: the proxy bench's small
JSON POST, `x` repeated). --sse: the proxy bench's SSE request instead (a
bodyless GET to api.github.com, a reference in Authorization injected) and
its event stream, two events in two chunks. Values are generated per run
and never printed.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import fake_value  # noqa: E402
from engine_bench import json_body  # noqa: E402
from mitmproxy import http  # noqa: E402
from mitmproxy.test import taddons, tflow  # noqa: E402

HOST = "api.anthropic.com"


def _home(rng: random.Random) -> Path:
    home = Path(tempfile.mkdtemp(prefix="keyveil-profile-")) / "home"
    env = {**os.environ, "KEYVEIL_HOME": str(home), "PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring"}
    env.pop("KEYVEIL_PASSPHRASE", None)
    keyveil = str(Path(sys.executable).parent / "keyveil")
    subprocess.run([keyveil, "init"], env=env, check=True, capture_output=True, timeout=120)
    for name in ["github/pat", "anthropic/key"] + [f"bench/extra-{i}" for i in range(8)]:
        subprocess.run([keyveil, "secret", "set", name], input=fake_value(rng), env=env, check=True, capture_output=True, timeout=60)
    os.environ.update(KEYVEIL_HOME=str(home), PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring")
    return home


def _flow(body: bytes | None) -> http.HTTPFlow:
    f = tflow.tflow()
    if body is None:  # --sse
        host = "api.github.com"
        headers = {"authorization": "Bearer {{secret:github/pat}}", "accept": "text/event-stream"}
        f.request = http.Request.make("GET", f"https://{host}/sse", b"", headers)
    else:
        host = HOST
        headers = {"content-type": "application/json", "x-api-key": "{{secret:anthropic/key}}", "anthropic-version": "2023-06-01"}
        f.request = http.Request.make("POST", f"https://{host}/v1/messages", body, headers)
    f.client_conn.sni = host
    f.server_conn.address = (host, 443)
    f.server_conn.sni = host
    return f


_EVENT = b'event: message\ndata: {"type": "delta", "text": "hello"}\n\n'


def main() -> None:
    n = int(next((a for a in sys.argv[1:] if a.isdigit()), "500"))
    rng = random.Random()
    home = _home(rng)
    size = int(next((a.removeprefix("--size=") for a in sys.argv[1:] if a.startswith("--size=")), "200000"))
    body = json_body(rng, [b"{{secret:github/pat}}"], size=size) if size >= 20_000 else (
        b'{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"' + b"x" * size + b'"}]}'
    )
    sse = "--sse" in sys.argv
    if sse:
        body = None
    from keyveil.addon import Keyveil

    addon = Keyveil()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, keyveil_home=str(home))

        def one() -> http.HTTPFlow:
            f = _flow(body)
            addon.requestheaders(f)
            addon.request(f)
            addon.late.request(f)
            if f.response is not None:
                raise SystemExit(f"the bench request was blocked: {f.response.content[:200]!r}")
            if sse:
                chunks = [_EVENT, _EVENT]
                f.response = http.Response.make(200, b"", {"content-type": "text/event-stream", "cache-control": "no-cache"})
                del f.response.headers["content-length"]
                f.response.headers["transfer-encoding"] = "chunked"
            else:
                chunks = [b'{"content": [{"type": "text", "text": "hi"}]}']
                f.response = http.Response.make(200, chunks[0], {"content-type": "application/json"})
            addon.responseheaders(f)
            if callable(f.response.stream):  # as mitmproxy runs a streamed body: its chunks, then b""
                for chunk in chunks:
                    f.response.stream(chunk)
                f.response.stream(b"")
            addon.response(f)
            return f

        for _ in range(20):
            one()
        times = []
        for _ in range(n):
            t = time.process_time()
            one()
            times.append(time.process_time() - t)
        build = []
        for _ in range(n):
            t = time.process_time()
            _flow(body)
            build.append(time.process_time() - t)
        times.sort()
        build.sort()
        print(f"per round CPU median {times[n // 2] * 1e3:.3f} ms (n={n}); building the flow alone {build[n // 2] * 1e3:.3f} ms")
        if "--profile" in sys.argv:
            prof = cProfile.Profile()
            prof.runcall(lambda: [one() for _ in range(n)])
            pstats.Stats(prof).sort_stats("cumtime").print_stats("keyveil", 40)
            pstats.Stats(prof).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof).sort_stats("tottime").print_stats("keyveil", 40)


if __name__ == "__main__":
    main()
