"""The black-box attacks' oracle: does a value get through, decoded with the standard library only?

A value "got through" when the bytes hold it under up to DEPTH layers of the
SPEC §3 forms: percent-encoding (with and without `+` for space), JSON string
escapes between the quotes it pairs, and base64 runs in either alphabet from
each of their first four characters, line breaks and `\\n`/`\\/` escapes
dropped. ANYWHERE (the third attack's reading) also undoes JSON escapes
wherever they stand (bare quotes do not fool it) and decodes base64 the way
GNU `base64 -d` does, `=` inside a run included. Nothing here imports keyveil.

What it leaves out: hex, compression inside another encoding, split values
(SPEC §3's "not recognised" list), `%uXXXX` and HTML entities.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import string
import urllib.parse

import httpx

from tests import infra

_B64RUN = re.compile(rb"[A-Za-z0-9+/_=-]{8,}")
_JSTR = re.compile(rb'"((?:[^"\\]|\\.)*)"', re.S)
_ESC = re.compile(rb'\\(u[0-9a-fA-F]{4}|["\\/bfnrt])')
_SIMPLE = {b'"': b'"', b"\\": b"\\", b"/": b"/", b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t"}


def unescape_anywhere(data: bytes) -> bytes:
    def one(m: re.Match) -> bytes:
        t = m.group(1)
        return chr(int(t[1:], 16)).encode("utf-8", "surrogatepass") if t[:1] == b"u" else _SIMPLE[t]

    d = _ESC.sub(one, data)
    try:  # join surrogate pairs
        return d.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass").decode("utf-16").encode()
    except UnicodeError:
        return d


def _b64_pieces(run: bytes) -> bytes:
    """GNU-style: every padded group ends a piece, decoding goes on after it."""
    out = b""
    for piece in re.split(rb"=+", run):
        if len(piece) % 4 == 1:
            piece = piece[:-1]
        if piece:
            out += base64.b64decode(piece + b"=" * (-len(piece) % 4))
    return out


def _layers(data: bytes, anywhere: bool) -> list[bytes]:
    out = []
    for dec in (urllib.parse.unquote_to_bytes, lambda b: urllib.parse.unquote_to_bytes(b.replace(b"+", b" "))):
        d = dec(data)
        if d != data:
            out.append(d)
    for m in _JSTR.finditer(data):
        try:
            out.append(json.loads(b'"' + m.group(1) + b'"').encode("utf-8", "surrogatepass"))
        except ValueError:
            pass
    if anywhere:
        u = unescape_anywhere(data)
        if u != data:
            out.append(u)
    flat = data.replace(b"\\r", b"").replace(b"\\n", b"").replace(b"\r", b"").replace(b"\n", b"").replace(b"\\/", b"/")
    for m in _B64RUN.finditer(flat):
        run = m.group().replace(b"-", b"+").replace(b"_", b"/")
        if anywhere and b"=" in run.rstrip(b"="):
            out.append(_b64_pieces(run))
        run = run.replace(b"=", b"")
        for off in range(4):
            r = run[off:]
            if len(r) % 4 == 1:
                r = r[:-1]
            if len(r) >= 8:
                out.append(base64.b64decode(r + b"=" * (-len(r) % 4)))
    return out


def holds(data: bytes, value: bytes, depth: int = 3, anywhere: bool = False) -> bool:
    frontier, seen = [data], set()
    for level in range(depth + 1):
        nxt = []
        for d in frontier:
            if value in d or value in d.replace(b"\r", b"").replace(b"\n", b""):
                return True
            if level < depth:
                for x in _layers(d, anywhere):
                    if x not in seen and len(x) >= len(value):
                        seen.add(x)
                        nxt.append(x)
        frontier = nxt
    return False


def received(up) -> bytes:
    """Everything the upstream's HTTP requests held: method, path, headers, body."""
    parts = []
    for rec in up.requests:
        parts += [rec.method.encode(), rec.path.encode("latin-1"), *(k + b": " + v for k, v in rec.headers), rec.body]
    return b"\n".join(parts)


def client(proxy, **kw) -> httpx.Client:
    return httpx.Client(proxy=proxy.url, verify=infra.client_ssl_context(proxy.ca_cert), trust_env=False, timeout=30, **kw)


def rand(n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))
