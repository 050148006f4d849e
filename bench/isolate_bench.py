"""What `keyveil run --isolate` costs: start-up, and bytes through the sandbox's bridge.

Start-up: `keyveil run --isolate -- true` against `keyveil run -- true`, both
using one running `keyveil start` proxy (so neither starts a private proxy),
alternated run by run, wall time of the whole command. Then the two parts
the sandbox adds, timed alone the same way: bubblewrap with keyveil's
namespaces and mounts running `true`, and the helper's Python start-up.

Bridge: a 64 MiB download through keyveil (mitmdump + keyveil, routed to the
bench upstream) by curl started with `keyveil run --isolate` and with
`keyveil run`, alternated: inside the sandbox every byte also crosses
keyveil run's bridge (the sandbox's loopback to the proxy).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import MiB, OUT, Row, fmt_ms, median, new_rng, percentile, stop_process

SECTION = "isolate"
VENV_BIN = Path(sys.executable).parent
KEYVEIL = [sys.executable, "-m", "keyveil"]
_ENV_DROP = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP and k != "KEYVEIL_PASSPHRASE"}
    env.update(KEYVEIL_HOME=str(home), PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed_run(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    t = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    elapsed = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:6]} exited {done.returncode}: {done.stderr.decode(errors='replace')[-2000:]}")
    return elapsed


def _alternated(variants: dict[str, list[str]], env: dict[str, str], cwd: Path, n: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in variants}
    for argv in variants.values():  # warm-up: page cache, pyc files
        _timed_run(argv, env, cwd)
    for i in range(n):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(_timed_run(variants[name], env, cwd))
    return times


def _describe(times: list[float]) -> str:
    return f"median {fmt_ms(median(times))}, p90 {fmt_ms(percentile(times, 90))}"


class _Start:
    """`keyveil start` on a free loopback port, as `keyveil run` finds it."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.port = _free_port()
        self.log = open(OUT / "isolate-keyveil-start.log", "wb")
        self.proc = subprocess.Popen(
            [*KEYVEIL, "start", "--listen", f"127.0.0.1:{self.port}"],
            env=env,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"keyveil start exited {self.proc.returncode}: see {self.log.name}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("keyveil start did not listen within 60 s") from None
                time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proc, 15)
        self.log.close()


def startup(workdir: Path, n: int) -> list[Row]:
    from keyveil import _isolate
    from keyveil._home import Home

    home = workdir / "home"
    env = _env(home)
    subprocess.run([*KEYVEIL, "init"], env=env, check=True, capture_output=True, timeout=120)
    proxy = _Start(env, workdir)
    try:
        times = _alternated(
            {"plain": [*KEYVEIL, "run", "--", "true"], "isolate": [*KEYVEIL, "run", "--isolate", "--", "true"]}, env, workdir, n
        )
        bwrap = _isolate.find_bwrap(env)
        plan = _isolate.plan_mounts(Home(home), [], env, workdir)
        sandbox = [bwrap, *_isolate._NAMESPACES, "--cap-drop", "ALL", "--die-with-parent", "--new-session", *plan.args, "--", "true"]
        parts = _alternated(
            {"bwrap": sandbox, "helper": [_isolate.helper_python()[0], "-I", "-S", "-c", "import array, os, sys, _socket"]}, env, workdir, n
        )
    finally:
        proxy.stop()
    plain, isolated = median(times["plain"]), median(times["isolate"])
    detail = (
        f"`keyveil run -- true` {_describe(times['plain'])}; `keyveil run --isolate -- true` {_describe(times['isolate'])} "
        f"(n={n} each, alternated, one running `keyveil start` proxy, so no private proxy is started)"
    )
    return [
        Row(
            SECTION,
            "`keyveil run --isolate -- true` / `keyveil run -- true`: start-up time",
            f"{isolated / plain:.2f}×",
            "— (informative)",
            None,
            detail,
        ),
        Row(
            SECTION,
            "start-up time --isolate adds (median difference)",
            f"+{(isolated - plain) * 1000:.0f} ms",
            "— (informative)",
            None,
            f"of which bubblewrap alone with keyveil's namespaces and mounts running `true`: {_describe(parts['bwrap'])}; "
            f"the helper's Python start-up (`python -I -S`): {_describe(parts['helper'])}; the rest is keyveil "
            "importing its sandbox code (asyncio) and the hand-over of the proxy's socket",
        ),
    ]


def bridge(workdir: Path, rounds: int, size: int) -> Row:
    import proxy_bench

    rng, _ = new_rng()
    home, kv_env = proxy_bench.make_home(workdir, rng)
    upstream = proxy_bench.Upstream(workdir)
    proxy = None
    try:
        proxy = proxy_bench.Proxy("keyveil-isolate", workdir, upstream, [proxy_bench.KEYVEIL_ADDON], {"keyveil_home": str(home)}, kv_env)
        (home / "proxy.json").write_text(f'{{"host": "127.0.0.1", "port": {proxy.port}, "pid": {proxy.pid}, "auth": false}}')
        env = _env(home)
        ca = proxy.confdir / "mitmproxy-ca-cert.pem"  # this proxy's own CA: visible in the sandbox through --ro
        curl = ["curl", "-sS", "--fail", "--cacert", str(ca), "-H", "authorization: Bearer {{secret:github/pat}}", "-o", "/dev/null"]
        curl.append(f"https://api.github.com/download?size={size}")
        times = _alternated(
            {"plain": [*KEYVEIL, "run", "--", *curl], "isolate": [*KEYVEIL, "run", "--isolate", "--ro", str(proxy.confdir), "--", *curl]},
            env,
            workdir,
            rounds,
        )
    finally:
        if proxy is not None:
            proxy.stop()
        upstream.stop()
    plain, isolated = median(times["plain"]), median(times["isolate"])
    mb = size / 1e6
    return Row(
        SECTION,
        f"{size // MiB} MiB download through keyveil by curl: --isolate / plain `keyveil run`",
        f"{isolated / plain:.2f}×",
        "— (informative)",
        None,
        f"whole command, median of {rounds} alternated: plain {fmt_ms(plain)} ({mb / plain:.0f} MB/s), --isolate "
        f"{fmt_ms(isolated)} ({mb / isolated:.0f} MB/s); inside the sandbox the bytes also cross keyveil run's bridge",
    )


def run(quick: bool) -> list[Row]:
    OUT.mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="keyveil-bench-isolate-"))
    rows: list[Row] = []
    try:
        for row in startup(workdir, 8 if quick else 30):
            row.show()
            rows.append(row)
        row = bridge(workdir, 2 if quick else 5, 64 * MiB)
        row.show()
        rows.append(row)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


if __name__ == "__main__":  # alone: .venv/bin/python bench/isolate_bench.py [--quick]; `make bench` records it
    run("--quick" in sys.argv)
