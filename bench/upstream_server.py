"""A fast TLS HTTP/1.1 upstream for the proxy benchmarks, run as its own process.

    python bench/upstream_server.py CERT_CHAIN_PEM KEY_PEM

prints ``PORT <n>`` once it listens on 127.0.0.1 and serves until SIGTERM.
Its own process, so the client, the proxy and the server do not share a GIL.
It answers at once and keeps nothing it receives; each response says in
``x-bench-saw-reference`` whether a request header still held a reference
(1: nothing was injected on the way, 0: a value was).

- ``POST /upload``: reads and discards the body, answers ``{"received": N}``.
- any other ``POST``: a small Anthropic-style JSON message.
- ``GET /sse``: ``text/event-stream``; the first event at once, the second
  after SSE_DELAY seconds (a proxy that buffers shows it), then the end.
- ``GET /download?size=N``: N bytes of text with a Content-Length.
- ``GET /small``: a small JSON document.
"""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import sys
from urllib.parse import parse_qs, urlsplit

SSE_DELAY = 0.05
_PIECE = 65536
_TEXT = (b"lorem ipsum dolor sit amet, consectetur adipiscing elit; " * 20000)[: 1 << 20]
_MESSAGE = json.dumps(
    {
        "id": "msg_bench",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": "ok"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }
).encode()
_EVENT = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"hello from the bench upstream"}}\n\n'
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _read_body(reader: asyncio.StreamReader, headers: dict[bytes, bytes]) -> int:
    """Read and discard the body; return its length."""
    n = 0
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
                return n
            left = size
            while left:
                got = await reader.read(min(left, _PIECE))
                if not got:
                    raise ConnectionError("eof in chunk")
                left -= len(got)
            n += size
            await reader.readexactly(2)
    left = int(headers.get(b"content-length", b"0"))
    while left:
        got = await reader.read(min(left, _PIECE))
        if not got:
            raise ConnectionError("eof in body")
        left -= len(got)
        n += len(got)
    return n


def _head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    reason = {200: b"OK", 404: b"Not Found"}.get(status, b"X")
    lines = [b"HTTP/1.1 %d %s" % (status, reason)] + [k + b": " + v for k, v in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.split(b"\r\n")
            method, target, _ = lines[0].split(b" ", 2)
            headers: dict[bytes, bytes] = {}
            saw_reference = b"0"
            for line in lines[1:]:
                if not line:
                    continue
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip()
                if b"{{secret:" in v:
                    saw_reference = b"1"
            received = await _read_body(reader, headers)
            url = urlsplit(target.decode("latin-1"))
            common = [(b"x-bench-saw-reference", saw_reference)]
            if method == b"POST":
                body = json.dumps({"received": received}).encode() if url.path == "/upload" else _MESSAGE
                writer.write(
                    _head(200, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *common])
                    + body
                )
            elif url.path == "/sse":
                sse = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"transfer-encoding", b"chunked")]
                writer.write(_head(200, sse + common) + _chunk(_EVENT))
                await writer.drain()
                await asyncio.sleep(SSE_DELAY)
                writer.write(_chunk(_EVENT) + b"0\r\n\r\n")
            elif url.path == "/download":
                size = int(parse_qs(url.query).get("size", ["0"])[0])
                writer.write(_head(200, [(b"content-type", b"text/plain"), (b"content-length", b"%d" % size), *common]))
                sent = 0
                while sent < size:
                    piece = _TEXT[: min(_PIECE, size - sent)]
                    writer.write(piece)
                    sent += len(piece)
                    await writer.drain()
            elif url.path == "/small":
                body = b'{"ok": true}'
                writer.write(_head(200, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *common]) + body)
            else:
                writer.write(_head(404, [(b"content-length", b"0"), *common]))
            await writer.drain()
            if headers.get(b"connection", b"").lower() == b"close":
                return
    except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()


async def main(cert: str, key: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx, backlog=512, limit=1 << 20)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
