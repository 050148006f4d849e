"""End-to-end benchmarks: plain mitmdump against mitmdump + keyveil, real processes, TLS both sides.

One bench upstream (its own process, trustme CA, HTTP/1.1) stands in for
api.anthropic.com and api.github.com; two proxies run side by side with the
same options, both routed to it by bench/route_addon.py: *plain* (routing
only, responses streamed as keyveil streams them) and *keyveil*
(``-s addons/keyveil.py``, a fresh home with a few fake secrets). Every
measurement alternates between the two, request by request or round by
round, and reports keyveil / plain. Proxy CPU time per request is read from
/proc, which the noise of a shared machine disturbs much less than wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trustme
from benchlib import MiB, OUT, REPO, Row, fake_value, fmt_mib, fmt_ms, median, new_rng, percentile, proc_status, reset_peak, stop_process
from engine_bench import json_body

SECTION = "proxy"
BENCH = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
KEYVEIL_ADDON = REPO / "addons" / "keyveil.py"
ROUTE_ADDON = BENCH / "route_addon.py"
HOSTS = ("api.anthropic.com", "api.github.com")
_ENV_DROP = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Upstream:
    def __init__(self, workdir: Path) -> None:
        self.ca = trustme.CA()
        cert = self.ca.issue_cert(*HOSTS)
        self.ca_pem = workdir / "upstream-ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_pem))
        chain, key = workdir / "upstream-chain.pem", workdir / "upstream-key.pem"
        cert.private_key_pem.write_to_path(str(key))
        chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH / "upstream_server.py"), str(chain), str(key)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        line = self.proc.stdout.readline().decode()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"bench upstream did not start: {line!r}")
        self.port = int(line.split()[1])

    def stop(self) -> None:
        stop_process(self.proc, 10)


class Proxy:
    """A mitmdump on 127.0.0.1, routed to the bench upstream."""

    def __init__(self, label: str, workdir: Path, upstream: Upstream, scripts: list[Path], options: dict[str, str], env: dict[str, str]) -> None:
        self.label = label
        self.port = _free_port()
        self.confdir = workdir / f"confdir-{label}"
        opts = {
            "confdir": str(self.confdir),
            "connection_strategy": "lazy",
            "ssl_verify_upstream_trusted_ca": str(upstream.ca_pem),
            "bench_upstream_port": str(upstream.port),
            **options,
        }
        args = [str(VENV_BIN / "mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port", str(self.port)]
        for script in [*scripts, ROUTE_ADDON]:
            args += ["-s", str(script)]
        for k, v in opts.items():
            args += ["--set", f"{k}={v}"]
        self.log = OUT / f"mitmdump-{label}.log"
        full_env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
        full_env.update(env)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env, cwd=workdir, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{label} mitmdump exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if (self.confdir / "mitmproxy-ca-cert.pem").exists():
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{label} mitmdump did not listen within 60 s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ssl = ssl.create_default_context(cafile=str(self.confdir / "mitmproxy-ca-cert.pem"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(proxy=self.url, verify=self.ssl, trust_env=False, timeout=120, **kw)

    def async_client(self, **kw) -> httpx.AsyncClient:
        return httpx.AsyncClient(proxy=self.url, verify=self.ssl, trust_env=False, timeout=120, **kw)

    def cpu(self) -> float:
        return _cpu_seconds(self.pid)

    def stop(self) -> None:
        stop_process(self.proc, 15)


def make_home(workdir: Path, rng: random.Random) -> tuple[Path, dict[str, str]]:
    """A keyveil home from `keyveil init`, with fake secrets set through `keyveil secret set`."""
    home = workdir / "keyveil-home"
    env = {
        **{k: v for k, v in os.environ.items() if k not in _ENV_DROP},
        "KEYVEIL_HOME": str(home),
        "PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring",
    }
    env.pop("KEYVEIL_PASSPHRASE", None)
    keyveil = str(VENV_BIN / "keyveil")
    subprocess.run([keyveil, "init"], env=env, check=True, capture_output=True, timeout=120)
    names = ["github/pat", "anthropic/key"] + [f"bench/extra-{i}" for i in range(8)]
    for name in names:
        subprocess.run([keyveil, "secret", "set", name], input=fake_value(rng), env=env, check=True, capture_output=True, timeout=60)
    return home, {"KEYVEIL_HOME": str(home), "PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring"}


# -- measurements -----------------------------------------------------------------------------


def _check(resp: httpx.Response, proxy: Proxy) -> None:
    """The request went through and keyveil injected (plain forwards the reference as is)."""
    if resp.status_code != 200:
        raise RuntimeError(f"{proxy.label}: HTTP {resp.status_code} {resp.headers.get('x-keyveil-block', '')} {resp.text[:300]}")
    saw = resp.headers.get("x-bench-saw-reference")
    expected = "1" if proxy.label == "plain" else "0"
    if saw != expected:
        raise RuntimeError(f"{proxy.label}: upstream saw-reference={saw}, expected {expected}")


class RawConn:
    """One keep-alive HTTP/1.1 connection through a proxy's CONNECT tunnel.

    Deliberately lean (pre-built request bytes, minimal parsing) so that the
    proxy, not the client, is what the request tests measure; httpx costs
    more CPU per request than mitmproxy itself on this machine. A response
    without Content-Length or chunked framing is read to the end of the
    connection, and the next request opens a new one (CONNECT + TLS), as any
    client must: that cost is counted in the next request's time.
    """

    def __init__(self, proxy: Proxy, host: str) -> None:
        self.proxy, self.host = proxy, host
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.connects = 0
        self.requests = 0

    @classmethod
    async def open(cls, proxy: Proxy, host: str) -> RawConn:
        conn = cls(proxy, host)
        await conn._connect()
        return conn

    async def _connect(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.proxy.port, limit=1 << 20)
        writer.write(f"CONNECT {self.host}:443 HTTP/1.1\r\nHost: {self.host}:443\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200" not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"{self.proxy.label}: CONNECT refused: {head[:200]!r}")
        await writer.start_tls(self.proxy.ssl, server_hostname=self.host)
        self.reader, self.writer = reader, writer
        self.connects += 1

    async def request(self, raw: bytes, first_event: bool = False) -> tuple[float, float]:
        """Send RAW; return (seconds to the first SSE event or to the headers, seconds to the end)."""
        t0 = time.perf_counter()
        if self.writer is None:
            await self._connect()
        assert self.reader is not None and self.writer is not None
        self.requests += 1
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        t_first = time.perf_counter() - t0
        lines = head.split(b"\r\n")
        status = lines[0].split(b" ", 2)[1]
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        seen = b""
        events = 0

        def got(data: bytes) -> None:
            nonlocal seen, events, t_first
            if len(seen) < 4096:
                seen += data
            if first_event and not events and b"\n\n" in seen:
                events = 1
                t_first = time.perf_counter() - t0

        if b"content-length" in headers:
            got(await self.reader.readexactly(int(headers[b"content-length"])))
        elif b"chunked" in headers.get(b"transfer-encoding", b""):
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                got((await self.reader.readexactly(size + 2))[:-2])
        else:  # delimited by the end of the connection
            while data := await self.reader.read(65536):
                got(data)
            self.close()
        if status != b"200":
            raise RuntimeError(f"{self.proxy.label}: HTTP {status!r} {headers.get(b'x-keyveil-block')!r} {seen[:300]!r}")
        saw = headers.get(b"x-bench-saw-reference")
        expected = b"1" if self.proxy.label == "plain" else b"0"
        if saw != expected:  # plain forwards the reference, keyveil injects the value
            raise RuntimeError(f"{self.proxy.label}: upstream saw-reference={saw!r}, expected {expected!r}")
        if first_event and not events:
            raise RuntimeError(f"{self.proxy.label}: no SSE event in {seen[:200]!r}")
        return t_first, time.perf_counter() - t0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def _raw_request(method: str, host: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _alternate(i: int, a, b):
    return (a, b) if i % 2 == 0 else (b, a)


async def _sequential(plain: Proxy, kv: Proxy, host: str, raw: bytes, n: int, warmup: int, first_event: bool = False):
    """N requests on one keep-alive connection per proxy, alternating; (first, whole) times and CPU seconds."""
    conns = {p.label: await RawConn.open(p, host) for p in (plain, kv)}
    first: dict[str, list[float]] = {"plain": [], "keyveil": []}
    whole: dict[str, list[float]] = {"plain": [], "keyveil": []}
    cpu = {"plain": 0.0, "keyveil": 0.0}
    try:
        for p in (plain, kv):
            for _ in range(warmup):
                await conns[p.label].request(raw, first_event)
        for i in range(n):
            for p in _alternate(i, plain, kv):
                c0 = p.cpu()
                f, w = await conns[p.label].request(raw, first_event)
                cpu[p.label] += p.cpu() - c0
                first[p.label].append(f)
                whole[p.label].append(w)
    finally:
        for c in conns.values():
            c.close()
    connects = {k: f"{c.connects}/{c.requests}" for k, c in conns.items()}
    return first, whole, cpu, connects


def latency_post(plain: Proxy, kv: Proxy, rng: random.Random, n: int) -> Row:
    # A conversation that already holds a sealed reference, as every turn after a seal does.
    body = json_body(rng, [b"{{secret:github/pat}}"], size=200_000)
    headers = {"x-api-key": "{{secret:anthropic/key}}", "anthropic-version": "2023-06-01", "content-type": "application/json"}
    raw = _raw_request("POST", "api.anthropic.com", "/v1/messages", headers, body)
    _, whole, cpu, connects = asyncio.run(_sequential(plain, kv, "api.anthropic.com", raw, n, 10))
    ratio = median(whole["keyveil"]) / median(whole["plain"])
    return Row(
        SECTION,
        "200 KB JSON POST to api.anthropic.com: p50 latency keyveil / plain",
        f"{ratio:.2f}×",
        "≤ 1.2× (issue 8)",
        ratio <= 1.2,
        f"p50 plain {fmt_ms(median(whole['plain']))}, keyveil {fmt_ms(median(whole['keyveil']))}; "
        f"p90 plain {fmt_ms(percentile(whole['plain'], 90))}, keyveil {fmt_ms(percentile(whole['keyveil'], 90))} "
        f"(n={n} each, alternated, one keep-alive connection each); proxy CPU per request plain "
        f"{cpu['plain'] / n * 1000:.2f} ms, keyveil {cpu['keyveil'] / n * 1000:.2f} ms "
        f"({cpu['keyveil'] / cpu['plain']:.2f}×); {_connects(connects)}",
    )


def _connects(connects: dict[str, str]) -> str:
    return f"connections opened / requests: plain {connects['plain']}, keyveil {connects['keyveil']}"


def sse_first_event(plain: Proxy, kv: Proxy, n: int) -> Row:
    headers = {"authorization": "Bearer {{secret:github/pat}}", "accept": "text/event-stream"}
    raw = _raw_request("GET", "api.github.com", "/sse", headers)
    first, whole, cpu, connects = asyncio.run(_sequential(plain, kv, "api.github.com", raw, n, 5, first_event=True))
    ratio = median(first["keyveil"]) / median(first["plain"])
    return Row(
        SECTION,
        "time to first SSE event from api.github.com (reference injected into Authorization): keyveil / plain",
        f"{ratio:.2f}×",
        "≤ 1.2×",
        ratio <= 1.2,
        f"p50 plain {fmt_ms(median(first['plain']))}, keyveil {fmt_ms(median(first['keyveil']))} "
        f"(n={n} each, alternated); the second event follows 50 ms later: whole stream p50 plain "
        f"{fmt_ms(median(whole['plain']))}, keyveil {fmt_ms(median(whole['keyveil']))}; proxy CPU per "
        f"request plain {cpu['plain'] / n * 1000:.2f} ms, keyveil {cpu['keyveil'] / n * 1000:.2f} ms; "
        f"{_connects(connects)}",
    )


async def _throughput_round(conns: list[RawConn], raw: bytes, warmup: float, seconds: float) -> tuple[float, float, int, int]:
    proxy = conns[0].proxy
    done = 0

    async def worker(conn: RawConn) -> None:
        nonlocal done
        while True:
            await conn.request(raw)
            done += 1

    tasks = [asyncio.create_task(worker(c)) for c in conns]
    await asyncio.sleep(warmup)
    n0, c0, t0 = done, proxy.cpu(), time.perf_counter()
    k0 = sum(c.connects for c in conns)
    await asyncio.sleep(seconds)
    n1, c1, t1 = done, proxy.cpu(), time.perf_counter()
    k1 = sum(c.connects for c in conns)
    for t in tasks:
        if t.done():
            t.result()  # a failed request fails the benchmark
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return (n1 - n0) / (t1 - t0), (c1 - c0) / max(1, n1 - n0), k1 - k0, n1 - n0


def concurrent_throughput(plain: Proxy, kv: Proxy, rounds: int, seconds: float, workers: int = 50) -> Row:
    body = b'{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"' + b"x" * 900 + b'"}]}'
    headers = {"x-api-key": "{{secret:anthropic/key}}", "content-type": "application/json"}
    raw = _raw_request("POST", "api.anthropic.com", "/v1/messages", headers, body)

    async def main() -> dict[str, list[tuple[float, float, int, int]]]:
        out: dict[str, list[tuple[float, float, int, int]]] = {"plain": [], "keyveil": []}
        for r in range(rounds):
            for p in _alternate(r, plain, kv):
                # New connections every round: a cancelled request leaves its connection mid-response.
                conns = await asyncio.gather(*(RawConn.open(p, "api.anthropic.com") for _ in range(workers)))
                try:
                    out[p.label].append(await _throughput_round(list(conns), raw, 1.0, seconds))
                finally:
                    for c in conns:
                        c.close()
        return out

    res = asyncio.run(main())
    rps = {k: median([r[0] for r in v]) for k, v in res.items()}
    cpu = {k: median([r[1] for r in v]) for k, v in res.items()}
    connects = {k: f"{sum(r[2] for r in v)}/{sum(r[3] for r in v)}" for k, v in res.items()}
    ratio = rps["keyveil"] / rps["plain"]
    return Row(
        SECTION,
        f"{workers} concurrent keep-alive clients, 1 KB POST to api.anthropic.com: throughput keyveil / plain",
        f"{ratio:.2f}×",
        "≥ 0.8×",
        ratio >= 0.8,
        f"plain {rps['plain']:.0f} req/s, keyveil {rps['keyveil']:.0f} req/s (median of {rounds} alternated "
        f"rounds of {seconds:.0f} s); proxy CPU per request plain {cpu['plain'] * 1000:.2f} ms, keyveil "
        f"{cpu['keyveil'] * 1000:.2f} ms ({cpu['keyveil'] / cpu['plain']:.2f}×, i.e. a CPU-bound throughput of "
        f"{cpu['plain'] / cpu['keyveil']:.2f}× plain); {_connects(connects)} (in the measured windows)",
    )



def _download(client: httpx.Client, proxy: Proxy, size: int) -> None:
    n = 0
    with client.stream("GET", f"https://api.github.com/download?size={size}", headers={"authorization": "Bearer {{secret:github/pat}}"}) as resp:
        _check(resp, proxy)
        for data in resp.iter_raw():
            n += len(data)
    assert n == size, (n, size)


def _upload(client: httpx.Client, proxy: Proxy, size: int, content_length: bool) -> None:
    piece = (b"lorem ipsum dolor sit amet, consectetur adipiscing elit; " * 300)[:16384]

    def gen():
        left = size
        while left:
            out = piece[: min(left, len(piece))]
            left -= len(out)
            yield out

    headers = {"authorization": "Bearer {{secret:github/pat}}", "content-type": "application/octet-stream"}
    if content_length:
        headers["content-length"] = str(size)
    resp = client.post("https://api.github.com/upload", content=gen(), headers=headers)
    _check(resp, proxy)
    assert resp.json()["received"] == size, resp.text


def memory(plain: Proxy, kv: Proxy, rounds: int) -> list[Row]:
    size = 64 * MiB
    kinds = {
        "download": ("64 MiB streamed download", lambda c, p: _download(c, p, size)),
        "upload": ("64 MiB streamed (chunked) upload", lambda c, p: _upload(c, p, size, content_length=False)),
        "upload_cl": (
            "upload with Content-Length 64 MiB + 1 B (above keyveil's max_body_bytes)",
            lambda c, p: _upload(c, p, size + 1, content_length=True),
        ),
    }
    clients = {p.label: p.client() for p in (plain, kv)}
    rows = []
    try:
        for key, (title, fn) in kinds.items():
            growth: dict[str, list[int]] = {"plain": [], "keyveil": []}
            secs: dict[str, list[float]] = {"plain": [], "keyveil": []}
            for r in range(rounds):
                for p in _alternate(r, plain, kv):
                    if not reset_peak(p.pid):
                        raise RuntimeError("cannot reset VmHWM through /proc/PID/clear_refs")
                    before = proc_status(p.pid)["VmRSS"]
                    t0 = time.perf_counter()
                    fn(clients[p.label], p)
                    secs[p.label].append(time.perf_counter() - t0)
                    growth[p.label].append(max(0, proc_status(p.pid)["VmHWM"] - before))
            g = {k: median(v) for k, v in growth.items()}
            # Growth below 1 MiB is allocator noise, not buffering: floor both there.
            ratio = max(g["keyveil"], MiB) / max(g["plain"], MiB)
            detail = (
                f"peak RSS growth plain {fmt_mib(g['plain'])}, keyveil {fmt_mib(g['keyveil'])} (median of {rounds}, "
                f"ratio floored at 1 MiB); transfer time plain {median(secs['plain']):.2f} s, keyveil {median(secs['keyveil']):.2f} s"
            )
            if key == "upload_cl":
                rows.append(Row(SECTION, f"{title}: peak RSS growth keyveil", fmt_mib(g["keyveil"]), "— (informative)", None, detail))
            else:
                rows.append(Row(SECTION, f"{title}: peak RSS growth keyveil / plain", f"{ratio:.2f}×", "< 2×", ratio < 2, detail))
            rows[-1].show()
    finally:
        for c in clients.values():
            c.close()
    return rows


def run(quick: bool) -> list[Row]:
    rng, seed = new_rng()
    print(f"proxy: fake values from seed {seed}", flush=True)
    OUT.mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="keyveil-bench-"))
    rows: list[Row] = []
    upstream = plain = kv = None
    try:
        home, kv_env = make_home(workdir, rng)
        upstream = Upstream(workdir)
        plain = Proxy("plain", workdir, upstream, [], {"bench_stream_responses": "true"}, {})
        kv = Proxy("keyveil", workdir, upstream, [KEYVEIL_ADDON], {"keyveil_home": str(home)}, kv_env)
        print(f"proxy: upstream pid {upstream.proc.pid}, plain pid {plain.pid}, keyveil pid {kv.pid}", flush=True)
        for fn in (
            lambda: latency_post(plain, kv, rng, 40 if quick else 300),
            lambda: sse_first_event(plain, kv, 20 if quick else 200),
            lambda: concurrent_throughput(plain, kv, 2 if quick else 5, 3.0 if quick else 4.0),
        ):
            row = fn()
            row.show()
            rows.append(row)
        rows += memory(plain, kv, 1 if quick else 2)
    finally:
        for p in (plain, kv):
            if p is not None:
                p.stop()
        if upstream is not None:
            upstream.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return rows
