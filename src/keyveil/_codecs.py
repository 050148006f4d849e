"""Content decoding for bodies: gzip, deflate, br, zstd, chunk by chunk, strictly.

Strict means a body decodes only if it is complete and holds nothing else: a
truncated stream, trailing bytes after the end, or an unknown or stacked
encoding raise ValueError, so the caller can block (SPEC §6,
`undecodable_body`). A gzip body of several members decodes every member,
as real servers do: a second member must not smuggle a value past the sealer.
This module never sees what the bytes mean.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import brotli

try:  # Python 3.14 has compression.zstd; before it, the backport mitmproxy depends on
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    from backports import zstd  # type: ignore[no-redef]

DECODABLE = ("gzip", "x-gzip", "deflate", "br", "zstd")


class Decoder(Protocol):
    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes:
        """The rest; raise ValueError if the body ended early."""
        ...


class _Identity:
    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def flush(self) -> bytes:
        return b""


class _Gzip:
    def __init__(self) -> None:
        self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._in_member = False

    def feed(self, chunk: bytes) -> bytes:
        out = []
        while chunk:
            self._in_member = True
            try:
                out.append(self._d.decompress(chunk))
            except zlib.error as e:
                raise ValueError(f"invalid gzip data: {e}") from None
            if not self._d.eof:
                break
            chunk = self._d.unused_data  # the next member, if any
            self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            self._in_member = False
        return b"".join(out)

    def flush(self) -> bytes:
        if self._in_member:
            raise ValueError("truncated gzip data")
        return b""


class _Deflate:
    """HTTP 'deflate' is zlib-wrapped, but some servers send raw deflate."""

    def __init__(self) -> None:
        self._d: zlib._Decompress | None = None
        self._head = b""

    def feed(self, chunk: bytes) -> bytes:
        if self._d is None:
            self._head += chunk
            if len(self._head) < 2:
                return b""
            zlib_header = (self._head[0] & 0x0F) == 8 and int.from_bytes(self._head[:2], "big") % 31 == 0
            self._d = zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)
            chunk, self._head = self._head, b""
        if self._d.eof:
            if chunk:
                raise ValueError("bytes after the end of deflate data")
            return b""
        try:
            out = self._d.decompress(chunk)
        except zlib.error as e:
            raise ValueError(f"invalid deflate data: {e}") from None
        if self._d.eof and self._d.unused_data:
            raise ValueError("bytes after the end of deflate data")
        return out

    def flush(self) -> bytes:
        if self._d is None:
            if self._head:
                raise ValueError("truncated deflate data")
            return b""
        if not self._d.eof:
            raise ValueError("truncated deflate data")
        return b""


class _Brotli:
    def __init__(self) -> None:
        self._d = brotli.Decompressor()
        self._started = False

    def feed(self, chunk: bytes) -> bytes:
        if not chunk:
            return b""
        if self._d.is_finished():
            raise ValueError("bytes after the end of brotli data")
        self._started = True
        try:
            return self._d.process(chunk)
        except brotli.error as e:
            raise ValueError(f"invalid brotli data: {e}") from None

    def flush(self) -> bytes:
        if self._started and not self._d.is_finished():
            raise ValueError("truncated brotli data")
        return b""


class _Zstd:
    def __init__(self) -> None:
        self._d = zstd.ZstdDecompressor()
        self._in_frame = False

    def feed(self, chunk: bytes) -> bytes:
        out = []
        while chunk:
            self._in_frame = True
            try:
                out.append(self._d.decompress(chunk))
            except zstd.ZstdError as e:
                raise ValueError(f"invalid zstd data: {e}") from None
            if not self._d.eof:
                break
            chunk = self._d.unused_data  # concatenated frames
            self._d = zstd.ZstdDecompressor()
            self._in_frame = False
        return b"".join(out)

    def flush(self) -> bytes:
        if self._in_frame:
            raise ValueError("truncated zstd data")
        return b""


def decoder_for(content_encoding: str) -> Decoder | None:
    """A fresh decoder for a Content-Encoding value, or None if it is unknown or stacked."""
    ce = content_encoding.strip().lower()
    if ce in ("", "identity"):
        return _Identity()
    if ce in ("gzip", "x-gzip"):
        return _Gzip()
    if ce == "deflate":
        return _Deflate()
    if ce == "br":
        return _Brotli()
    if ce == "zstd":
        return _Zstd()
    return None


def decode(data: bytes, content_encoding: str) -> bytes:
    """DATA decoded whole; ValueError if it cannot be, completely and exactly."""
    decoder = decoder_for(content_encoding)
    if decoder is None:
        raise ValueError(f"unknown or stacked Content-Encoding {content_encoding!r}")
    return decoder.feed(data) + decoder.flush()
