"""Start a real ``mitmdump`` for integration tests, and point real clients at it.

``ProxyProcess`` runs the venv's mitmdump as a subprocess on 127.0.0.1 with a
private confdir (so its CA is generated there), ``connection_strategy=lazy``,
and stdout/stderr captured to files. It must never leave a process behind:
``stop()`` ends it by PID, and the context manager always calls it.

Also here: the client side. ``client_env`` gives the variables real clients
read (proxy + CA bundle), and ``node_request`` is a proxy-aware HTTPS client
for Node 20, whose built-in ``fetch`` ignores ``HTTPS_PROXY`` (there is no
``--use-env-proxy`` before Node 22/24 and the ``undici`` package is not
installed), so it tunnels with ``http.request`` CONNECT + ``tls.connect``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
MITMDUMP = VENV_BIN / "mitmdump"
_LISTENING = re.compile(rb"proxy listening at \S*?:(\d+)")
_READY_MARKER = b"keyveil-test-infra: start-up complete"
# Loaded first into every ProxyProcess (written to its work dir, never into the
# repository). mitmdump prints "listening" before its errorcheck addon decides
# to exit on errors logged during start-up; that decision is printed one loop
# iteration after the `running` hooks, so a marker printed from a timer set in
# `running` comes strictly after it.
_READY_ADDON = f"""
import asyncio, sys

class StartupMarker:
    def running(self):
        asyncio.get_running_loop().call_later(0.05, self.mark)

    def mark(self):
        print({_READY_MARKER.decode()!r}, file=sys.stderr, flush=True)

addons = [StartupMarker()]
"""


class ProxyStartError(RuntimeError):
    """mitmdump exited or did not listen in time; the message holds its output."""


def _option_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


class ProxyProcess:
    """A mitmdump subprocess on 127.0.0.1:<free port>.

    ``options`` become ``--set NAME=VALUE`` (a sequence of pairs may repeat a
    name, for list options). ``ca_cert`` exists once ``start()`` returns.
    """

    def __init__(
        self,
        scripts: Sequence[str | os.PathLike] = (),
        options: Mapping[str, object] | Iterable[tuple[str, object]] = (),
        *,
        confdir: str | os.PathLike | None = None,
        workdir: str | os.PathLike | None = None,
        flow_detail: int | None = None,
        flowfile: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 20.0,
        mitmdump: str | os.PathLike = MITMDUMP,
    ):
        self._tmp: tempfile.TemporaryDirectory | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="keyveil-proxy-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.confdir = Path(confdir) if confdir is not None else self.workdir / "confdir"
        self.flowfile = Path(flowfile) if flowfile is not None else None
        self.stdout_path = self.workdir / "mitmdump.stdout"
        self.stderr_path = self.workdir / "mitmdump.stderr"
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

        opts = list(options.items()) if isinstance(options, Mapping) else list(options)
        # mitmdump refuses a scalar option set twice, so a caller's value replaces the default.
        given = {name for name, _ in opts}
        defaults = {"confdir": self.confdir, "connection_strategy": "lazy"}
        if flow_detail is not None:
            defaults["flow_detail"] = flow_detail
        opts = [(k, v) for k, v in defaults.items() if k not in given] + opts
        self.confdir = Path(os.path.expanduser(_option_value(dict(opts)["confdir"])))
        self.args: list[str] = [os.fspath(mitmdump), "--listen-host", "127.0.0.1", "--listen-port", "0"]
        self._ready_addon = self.workdir / "_startup_marker.py"
        self.args += ["-s", os.fspath(self._ready_addon)]
        for script in scripts:
            self.args += ["-s", os.fspath(script)]
        if self.flowfile is not None:
            self.args += ["-w", os.fspath(self.flowfile)]
        for name, value in opts:
            self.args += ["--set", f"{name}={_option_value(value)}"]
        self.args += list(extra_args)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # A proxy started by a test must never itself go through a proxy.
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            self.env.pop(k, None)

    # ------------------------------------------------------------------ lifecycle

    def _launch(self) -> subprocess.Popen:
        if self.process is not None:
            raise RuntimeError("ProxyProcess is single-use; create a new one")
        self.stdout_path.write_bytes(b"")
        self.stderr_path.write_bytes(b"")
        self._ready_addon.write_text(_READY_ADDON)
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=self.env,
                cwd=self.workdir,
                start_new_session=True,
            )
        # Last line of defence against a leaked mitmdump: a test that forgot
        # stop() still ends its proxy when the object goes, or at exit.
        weakref.finalize(self, _terminate, self.process)
        return self.process

    def start(self) -> ProxyProcess:
        """Start and wait until it listens and start-up is complete;
        ProxyStartError with its output if it exits or times out instead."""
        proc = self._launch()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ProxyStartError(f"mitmdump exited with code {proc.returncode} at start-up\n{self._describe()}")
            out, err = self.stdout_path.read_bytes(), self.stderr_path.read_bytes()
            if b"logged during startup" in err:
                self.stop()
                raise ProxyStartError(f"mitmdump logged errors at start-up\n{self._describe()}")
            if self.port is None:
                m = _LISTENING.search(out) or _LISTENING.search(err)
                if m:
                    self.port = int(m.group(1))
            if self.port is not None and _READY_MARKER in err and _can_connect(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise ProxyStartError(f"mitmdump did not start within {self.startup_timeout} s\n{self._describe()}")

    def wait_exit(self, timeout: float = 20.0) -> int:
        """For a proxy expected to refuse to start: run it and return its exit
        code. Raises ProxyStartError (after stopping it) if still running at TIMEOUT."""
        proc = self._launch()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise ProxyStartError(f"mitmdump still running after {timeout} s, expected it to exit\n{self._describe()}") from None

    def stop(self, timeout: float = 10.0) -> int | None:
        """Terminate by PID (SIGTERM, then SIGKILL); return the exit code."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        return proc.returncode

    def close(self) -> None:
        """Stop and delete the private work dir (when none was given)."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        # Only stop: its output stays readable after the block (a private
        # work dir goes when the object does, or on close()).
        self.stop()

    # ------------------------------------------------------------------ access

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("proxy not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def ca_cert(self) -> Path:
        """The mitmproxy CA certificate (PEM) that clients must trust."""
        return self.confdir / "mitmproxy-ca-cert.pem"

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def output(self) -> str:
        """stdout + stderr, for asserting on (or for I5: grepping for) what it printed."""
        return self.stdout() + self.stderr()

    def wait_for_output(self, pattern: str, timeout: float = 5.0) -> re.Match[str]:
        """Block until PATTERN (a regex) appears in stdout or stderr."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.output())
            if m:
                return m
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pattern!r} not in mitmdump output within {timeout} s\n{self._describe()}")
            time.sleep(0.05)

    def client_env(self, base: Mapping[str, str] | None = None, ca_bundle: str | os.PathLike | None = None) -> dict[str, str]:
        """Environment for a client process: proxy variables (both cases),
        empty NO_PROXY, and every CA variable pointing at CA_BUNDLE (default:
        the mitmproxy CA alone, which is all an offline test needs)."""
        ca = os.fspath(ca_bundle or self.ca_cert)
        env = dict(os.environ if base is None else base)
        for k in ("no_proxy", "NO_PROXY", "ALL_PROXY", "all_proxy"):
            env.pop(k, None)
        for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
            env[k] = self.url
        for k in (
            "NODE_EXTRA_CA_CERTS",
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "GIT_SSL_CAINFO",
            "CODEX_CA_CERTIFICATE",
        ):
            env[k] = ca
        return env

    def _describe(self) -> str:
        return (
            f"command: {' '.join(self.args)}\n"
            f"--- stdout ---\n{self.stdout()[-4000:]}\n--- stderr ---\n{self.stderr()[-4000:]}"
        )


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


def _can_connect(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def write_ca_bundle(path: str | os.PathLike, *pem_files: str | os.PathLike, include_system: bool = False) -> Path:
    """Concatenate PEM_FILES (e.g. ``proxy.ca_cert``) into PATH, optionally
    after the system/certifi roots, for curl --cacert, httpx verify=,
    NODE_EXTRA_CA_CERTS, GIT_SSL_CAINFO."""
    parts: list[bytes] = []
    if include_system:
        import certifi

        parts.append(Path(certifi.where()).read_bytes())
    for f in pem_files:
        parts.append(Path(f).read_bytes())
    out = Path(path)
    out.write_bytes(b"\n".join(p.rstrip(b"\n") + b"\n" for p in parts))
    return out


class _H2FirstContext(ssl.SSLContext):
    def set_alpn_protocols(self, alpn_protocols):  # type: ignore[override]
        super().set_alpn_protocols(sorted(alpn_protocols, key=lambda p: p != "h2"))


def client_ssl_context(cafile: str | os.PathLike, *, h2_first: bool = False) -> ssl.SSLContext:
    """A client context trusting CAFILE (e.g. ``proxy.ca_cert``).

    With H2_FIRST, ALPN offers h2 before http/1.1 whatever the client library
    asks for. httpx/httpcore always offers ``["http/1.1", "h2"]`` through a
    proxy tunnel, and mitmproxy honours the client's order when it picks the
    client-side ALPN (lazy connect: before it has spoken to the server), so
    ``httpx.Client(http2=True, proxy=...)`` gets HTTP/1.1 unless given this
    context as ``verify=``. curl offers h2 first on its own.
    """
    ctx = _H2FirstContext(ssl.PROTOCOL_TLS_CLIENT) if h2_first else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=os.fspath(cafile))
    return ctx


# ---------------------------------------------------------------------- Node

NODE_PROXY_CLIENT_JS = r"""
// Proxy-aware HTTPS request for Node 20 (fetch ignores HTTPS_PROXY there).
// last argv: JSON {url, method, headers, body (latin-1 string), proxy, ca (PEM path), timeout_ms}
// stdout: JSON {status, headers (raw pairs), body (latin-1), chunks: [{t_ms, len}]}
const http = require('http'), https = require('https'), tls = require('tls'), fs = require('fs');
const req = JSON.parse(process.argv[process.argv.length - 1]);
const url = new URL(req.url), proxy = new URL(req.proxy);
const t0 = Date.now();
const fail = (e) => { process.stderr.write(String(e && e.stack || e) + '\n'); process.exit(3); };
const port = Number(url.port || (url.protocol === 'https:' ? 443 : 80));
const send = (opts, mod) => {
  const r = mod.request(opts, (res) => {
    const chunks = [], times = [];
    res.on('data', (c) => { chunks.push(c); times.push({t_ms: Date.now() - t0, len: c.length}); });
    res.on('end', () => {
      process.stdout.write(JSON.stringify({status: res.statusCode, headers: res.rawHeaders,
        body: Buffer.concat(chunks).toString('latin1'), chunks: times}));
    });
    res.on('error', fail);
  });
  r.on('error', fail);
  r.setTimeout(req.timeout_ms || 15000, () => fail('timeout'));
  if (req.body) r.write(Buffer.from(req.body, 'latin1'));
  r.end();
};
const base = {method: req.method || 'GET', path: url.pathname + url.search,
              headers: Object.assign({host: url.host}, req.headers || {})};
if (url.protocol === 'http:') {
  // Plain HTTP through a proxy: absolute-form request to the proxy.
  send(Object.assign({}, base, {host: proxy.hostname, port: proxy.port, path: req.url}), http);
} else {
  const connect = http.request({host: proxy.hostname, port: proxy.port, method: 'CONNECT',
                                path: `${url.hostname}:${port}`, headers: {host: `${url.hostname}:${port}`}});
  connect.on('connect', (res, socket) => {
    if (res.statusCode !== 200) fail(`CONNECT answered ${res.statusCode}`);
    const ca = req.ca ? fs.readFileSync(req.ca) : undefined;
    const secure = tls.connect({socket, servername: url.hostname, ca, ALPNProtocols: ['http/1.1']}, () => {
      send(Object.assign({}, base, {createConnection: () => secure}), https);
    });
    secure.on('error', fail);
  });
  connect.on('error', fail);
  connect.end();
}
"""


class NodeRequestError(RuntimeError):
    """The Node client failed; the message holds Node's stderr."""


def node_request(
    proxy_url: str,
    url: str,
    *,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
    ca: str | os.PathLike | None = None,
    timeout: float = 20.0,
    env: Mapping[str, str] | None = None,
    node: str | None = None,
) -> dict:
    """One request from a real Node 20 process through the proxy.

    Returns ``{"status", "headers" (flat raw list), "body" (bytes),
    "chunks" ([{t_ms, len}] arrival times)}``. Raises NodeRequestError
    with Node's stderr on failure. Without CA, Node's default roots plus
    ``NODE_EXTRA_CA_CERTS`` from ENV are trusted.
    """
    node = node or shutil.which("node")
    if node is None:
        raise FileNotFoundError("node not found on PATH")
    spec = {
        "url": url,
        "method": method,
        "headers": dict(headers or {}),
        "body": body.decode("latin-1"),
        "proxy": proxy_url,
        "ca": os.fspath(ca) if ca else None,
        "timeout_ms": int(timeout * 1000),
    }
    done = subprocess.run(
        [node, "-e", NODE_PROXY_CLIENT_JS, json.dumps(spec)],
        capture_output=True,
        env=dict(env) if env is not None else None,
        timeout=timeout + 5,
    )
    if done.returncode != 0:
        raise NodeRequestError(f"node exited {done.returncode} for {method} {url}: {done.stderr.decode(errors='replace')}")
    result = json.loads(done.stdout)
    result["body"] = result["body"].encode("latin-1")
    return result
