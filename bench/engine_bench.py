"""In-process benchmarks of the sealer (``keyveil._engine.Sealer``).

Five questions, each answered against the targets of the Benchmarks issue:
how much faster than a naive ``bytes.replace`` loop is sealing a 1 MiB JSON
body; how fast is a body with no value; how does seal time grow from 10 to
10,000 values; does streaming a 64 MiB response stay within a few MiB; how
long does compiling 10,000 values take. Baselines are timed in the same
rounds as the sealer, interleaved.
"""

from __future__ import annotations

import base64
import gc
import json
import random
import time
import tracemalloc
import zlib
from urllib.parse import quote

from benchlib import MiB, Row, fake_value, fmt_mib, fmt_ms, median, new_rng, proc_status, reset_peak, timed
from naive import NaiveSealer

from keyveil._engine import Sealer

SECTION = "engine"

_WORDS = (
    "the of and to in is that for it as with was on be by this are from or at which an but not have has "
    "function return value request response error config file path import class def self None True False "
    "async await const let var if else for while try except raise print len dict list str bytes int "
    "model message content assistant user tool result input output token stream event data json http "
    "server client proxy header body status code line column test assert expected actual build deploy"
).split()


# -- bodies ----------------------------------------------------------------------------


def _prose(rng: random.Random, n_chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(_WORDS)
        r = rng.random()
        if r < 0.05:
            w = f"{w}\n"
        elif r < 0.08:
            w = f"{w}."
        elif r < 0.10:
            w = f'"{w}"'
        elif r < 0.12:
            w = f"/usr/src/app/{w}.py:{rng.randint(1, 999)}"
        elif r < 0.14:
            w = str(rng.randint(0, 10**6))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)


def embedded_forms(rng: random.Random, values: list[bytes]) -> list[bytes]:
    """Each value in one form, in turn: raw, JSON-escaped, percent, base64 at an offset, Basic."""
    out = []
    for i, v in enumerate(values):
        kind = i % 5
        if kind == 0:
            out.append(v)
        elif kind == 1:
            out.append("".join(f"\\u{ord(c):04x}" for c in v.decode()).encode())  # every character escaped
        elif kind == 2:
            out.append(b"https://example.com/callback?state=x&code=" + quote(v, safe="").encode())
        elif kind == 3:
            payload = rng.randbytes(rng.choice((1, 2, 4, 5, 61))) + v + rng.randbytes(45)
            enc = base64.urlsafe_b64encode if i % 2 else base64.b64encode
            out.append(enc(payload))
        else:
            out.append(b"Authorization: Basic " + base64.b64encode(b"x-access-token:" + v))
    return out


def json_body(rng: random.Random, inserts: list[bytes], size: int = MiB) -> bytes:
    """An Anthropic-style messages request of about SIZE bytes with INSERTS spread through its text."""
    messages = []
    marks = [f"@@KEYVEIL-BENCH-{i}@@" for i in range(len(inserts))]
    total = 0
    per_message = size // max(1, len(inserts)) if inserts else 16384
    per_message = min(per_message, 16384)
    i = 0
    while total < size - per_message:
        text = _prose(rng, per_message)
        if i < len(marks):
            cut = rng.randrange(len(text))
            text = f"{text[:cut]} {marks[i]} {text[cut:]}"
        role = "user" if len(messages) % 2 == 0 else "assistant"
        messages.append({"role": role, "content": [{"type": "text", "text": text}]})
        total += len(text) + 60
        i += 1
    doc = {"model": "claude-sonnet-4-5", "max_tokens": 8192, "stream": True, "messages": messages}
    body = json.dumps(doc).encode()
    for mark, data in zip(marks, inserts, strict=False):
        assert body.count(mark.encode()) == 1, "body too small for its inserts"
        body = body.replace(mark.encode(), data)
    if len(body) < size:  # top up to SIZE exactly with a trailing metadata field
        body = body[:-1] + b', "metadata": {"pad": "' + b"p" * max(0, size - len(body) - 25) + b'"}}'
    return body


def image_body(rng: random.Random, size: int = MiB) -> bytes:
    """A request carrying a base64 screenshot: the worst common case (one long base64 run)."""
    head = b'{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"'
    tail = b'"}},{"type":"text","text":"what is on this screen?"}]}]}'
    raw = rng.randbytes((size - len(head) - len(tail)) * 3 // 4)
    return head + base64.b64encode(raw) + tail


def sse_block(rng: random.Random, values: list[bytes], size: int = MiB, chunk: int = 16384) -> tuple[bytes, int]:
    """SIZE bytes of Anthropic SSE text deltas where a value straddles every 4th CHUNK boundary.

    Returns the bytes and how many values straddle a boundary.
    """
    out = bytearray()
    boundaries = list(range(chunk, size, 4 * chunk))
    vi = 0
    while len(out) < size - 600:
        nxt = next((b for b in boundaries if b > len(out)), None)
        prefix = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"'
        if nxt is not None and 0 < nxt - len(out) - len(prefix) - 12 < 400:
            v = values[vi % len(values)]
            vi += 1
            pad = nxt - len(out) - len(prefix) - 12  # the value starts 12 bytes before the boundary
            text = json.dumps("x" * pad + v.decode())[1:-1].encode()
            boundaries.remove(nxt)
        else:
            text = json.dumps(_prose(rng, rng.randint(10, 200)))[1:-1].encode()
        out += prefix + text + b'"}}\n\n'
    out += b": " + b"k" * (size - len(out) - 4) + b"\n\n"  # an SSE comment pads to SIZE exactly
    assert len(out) == size
    return bytes(out), vi


# -- the benchmarks --------------------------------------------------------------------------


def _registered(names_values: list[bytes]) -> dict[str, list[bytes]]:
    return {f"bench/v{i:05d}": [v] for i, v in enumerate(names_values)}


def run(quick: bool) -> list[Row]:
    rng, seed = new_rng()
    rows: list[Row] = []
    print(f"engine: fake values from seed {seed}", flush=True)

    def add(row: Row) -> None:
        row.show()
        rows.append(row)

    present = [fake_value(rng) for _ in range(20)]
    others = [fake_value(rng) for _ in range(10_000 - 20)]
    values_1000 = present + others[:980]
    body = json_body(rng, embedded_forms(rng, present))
    clean = json_body(rng, embedded_forms(rng, [fake_value(rng) for _ in range(20)]))

    t0 = time.perf_counter()
    sealer = Sealer(_registered(values_1000))
    build_1000 = time.perf_counter() - t0
    naive = NaiveSealer(_registered(values_1000))

    # Correctness first: a fast sealer that misses values would be no result.
    result = sealer.seal(body)
    assert sum(result.counts.values()) >= 20 and len(result.counts) == 20, result.counts
    assert not any(v in result.data for v in present)
    assert sealer.seal(clean).data is clean

    # 1. sealer vs naive, 1 MiB JSON, 1,000 values, 20 present -------------------------
    rounds = 3 if quick else 7
    t_naive: list[float] = []
    t_seal: list[float] = []
    for r in range(rounds):
        steps = [lambda: t_naive.append(timed(lambda: naive.seal(body)))]
        steps.append(lambda: t_seal.extend(timed(lambda: sealer.seal(body)) for _ in range(5)))
        for step in steps if r % 2 else steps[::-1]:
            step()
    ratio = median(t_naive) / median(t_seal)
    add(Row(
        SECTION,
        f"seal 1 MiB JSON, 1,000 values ({sealer.form_count:,} forms), 20 present: speed-up over naive bytes.replace loop",
        f"{ratio:.0f}×",
        "≥ 50×",
        ratio >= 50,
        f"sealer median {fmt_ms(median(t_seal))} (n={len(t_seal)}), naive median {fmt_ms(median(t_naive))} "
        f"(n={len(t_naive)}, {len(naive.pairs)} replace calls); body {len(body)} B; forms sealed: "
        f"{sum(result.counts.values())}",
    ))

    # 2. throughput with no value present, with a crc32 pass over the same bytes as baseline --
    reps = 10 if quick else 30
    t_clean: list[float] = []
    t_img: list[float] = []
    t_crc: list[float] = []
    img = image_body(rng)
    assert sealer.seal(img).data is img
    for _ in range(reps):
        t_clean.append(timed(lambda: sealer.seal(clean)))
        t_img.append(timed(lambda: sealer.seal(img)))
        t_crc.append(timed(lambda: zlib.crc32(clean)))
    mbps = len(clean) / median(t_clean) / 1e6
    crc_mbps = len(clean) / median(t_crc) / 1e6
    add(Row(
        SECTION,
        "seal 1 MiB JSON with no value (1,000 values): throughput",
        f"{mbps:.0f} MB/s",
        "≥ 200 MB/s",
        mbps >= 200,
        f"median {fmt_ms(median(t_clean))} (n={reps}); zlib.crc32 over the same bytes, interleaved: "
        f"{crc_mbps:.0f} MB/s (sealer = {mbps / crc_mbps:.2f}× crc32)",
    ))
    img_mbps = len(img) / median(t_img) / 1e6
    add(Row(
        SECTION,
        "seal 1 MiB body that is one base64 image (no value): throughput",
        f"{img_mbps:.0f} MB/s",
        "— (informative)",
        None,
        f"median {fmt_ms(median(t_img))} (n={reps}); {img_mbps / crc_mbps:.2f}× crc32",
    ))

    # 2b. decode, then match: what a body of each kind costs (issue 8 targets) --------------
    plain = json_body(rng, []).replace(b"\\n", b" ").replace(b'\\"', b"'")
    assert b"\\" not in plain and b"%" not in plain
    escaped = json.dumps({"messages": [{"role": "user", "content": "".join(
        chr(rng.randint(0x4E00, 0x9FFF)) if rng.random() < 0.85 else " " for _ in range(3000))} for _ in range(62)]}).encode()
    wrapped = base64.encodebytes(rng.randbytes(MiB * 3 // 4 - 10000))
    for body_ in (plain, escaped, wrapped):
        assert sealer.seal(body_).data is body_
    t = {"plain": [], "escaped": [], "wrapped": [], "crc": []}
    for _ in range(reps):
        t["plain"].append(timed(lambda: sealer.seal(plain)))
        t["escaped"].append(timed(lambda: sealer.seal(escaped)))
        t["wrapped"].append(timed(lambda: sealer.seal(wrapped)))
        t["crc"].append(timed(lambda: zlib.crc32(plain)))
    crc_mbps = len(plain) / median(t["crc"]) / 1e6
    for key, data_, label, target in (
        ("plain", plain, "1 MiB JSON without `\\` or `%`, 1,000 values", 400),
        ("escaped", escaped, "1 MiB JSON with every non-ASCII character `\\u`-escaped (ensure_ascii of CJK text)", 100),
        ("wrapped", wrapped, "1 MiB base64 image wrapped at 76 columns", 100),
    ):
        mbps = len(data_) / median(t[key]) / 1e6
        add(Row(
            SECTION, f"seal {label}: throughput", f"{mbps:.0f} MB/s", f"≥ {target} MB/s", mbps >= target,
            f"median {fmt_ms(median(t[key]))} (n={reps}); zlib.crc32 interleaved: {crc_mbps:.0f} MB/s "
            f"(sealer = {mbps / crc_mbps:.2f}× crc32)",
        ))

    # 3. growth from 10 to 10,000 values -------------------------------------------------------
    sizes = (8, 10, 100, 1000, 10_000)  # 8 values: 88 forms, below the automaton switch
    all_values = present + others
    sealers: dict[int, Sealer] = {}
    builds_10k: list[float] = []
    for n in sizes:
        if n == 1000:
            sealers[n] = sealer
            continue
        t0 = time.perf_counter()
        sealers[n] = Sealer(_registered(all_values[:n]))
        if n == 10_000:
            builds_10k.append(time.perf_counter() - t0)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    times_clean: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(5 if quick else 15):
        order = list(sizes)
        rng.shuffle(order)
        for n in order:
            times[n].append(timed(lambda: sealers[n].seal(body)))
            times_clean[n].append(timed(lambda: sealers[n].seal(clean)))
    growth = median(times[10_000]) / median(times[10])
    growth_clean = median(times_clean[10_000]) / median(times_clean[10])
    step = median(times_clean[10]) / median(times_clean[8])
    growth_100 = median(times[10_000]) / median(times[100])
    add(Row(
        SECTION,
        "seal time of the same 1 MiB JSON body, 10 → 10,000 values: growth",
        f"{growth:.2f}×",
        "≤ 2×",
        growth <= 2,
        "medians (values: time) " + ", ".join(f"{n}: {fmt_ms(median(times[n]))}" for n in sizes[1:])
        + f"; body with no value: growth {growth_clean:.2f}× ("
        + ", ".join(f"{n}: {fmt_ms(median(times_clean[n]))}" for n in sizes[1:]) + ")",
    ))
    add(Row(
        SECTION,
        "seal time of the same 1 MiB JSON body, 100 → 10,000 values: growth",
        f"{growth_100:.2f}×",
        "— (informative)",
        None,
        "the matcher is one Hyperscan literal database: its SIMD literal matchers (FDR, Teddy) change "
        "with the number of patterns, so the growth is watched from 100 values on as well",
    ))
    add(Row(
        SECTION,
        "seal 1 MiB JSON with no value: 10 values (110 forms) / 8 values (88 forms)",
        f"{step:.2f}×",
        "— (informative)",
        None,
        f"8: {fmt_ms(median(times_clean[8]))}, 10: {fmt_ms(median(times_clean[10]))}; watches for a step at ~100 "
        "patterns (Hyperscan picks its literal matcher by their number)",
    ))

    # 4. streaming 64 MiB in 16 KiB chunks ------------------------------------------------------
    chunk = 16384
    block, straddling = sse_block(rng, present)
    chunks = [block[i : i + chunk] for i in range(0, len(block), chunk)]
    per_block = sum(sealer.scrub(block).counts.values())
    total = 64 * len(block)

    def stream_pass() -> tuple[int, int]:
        s = sealer.stream()
        n_out = 0
        for _ in range(64):
            for c in chunks:
                n_out += len(s.feed(c))
        n_out += len(s.feed(b"", final=True))
        return n_out, sum(s.counts.values())

    def whole_pass() -> None:
        for _ in range(64):
            sealer.seal(block)

    t_stream: list[float] = []
    t_whole: list[float] = []
    rss_growth: list[int] = []
    for r in range(1 if quick else 3):
        gc.collect()
        before = proc_status()["VmRSS"]
        can_reset = reset_peak()
        t0 = time.perf_counter()
        n_out, found = stream_pass()
        t_stream.append(time.perf_counter() - t0)
        if can_reset:
            rss_growth.append(proc_status()["VmHWM"] - before)
        assert found == 64 * per_block, (found, per_block)
        t_whole.append(timed(whole_pass))
    gc.collect()
    tracemalloc.start()
    stream_pass()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stream_mbps = total / median(t_stream) / 1e6
    whole_mbps = total / median(t_whole) / 1e6
    add(Row(
        SECTION,
        "stream-scrub 64 MiB SSE in 16 KiB chunks: peak memory (tracemalloc)",
        fmt_mib(peak) if peak >= MiB else f"{peak / 1024:.0f} KiB",
        "bounded: < 4 MiB",
        peak < 4 * MiB,
        (f"RSS growth (VmHWM − VmRSS before) {fmt_mib(median(rss_growth))}; " if rss_growth else "")
        + f"{64 * per_block} values scrubbed, {straddling} per MiB straddling a chunk boundary",
    ))
    add(Row(
        SECTION,
        "stream-scrub 64 MiB SSE in 16 KiB chunks: throughput",
        f"{stream_mbps:.0f} MB/s",
        "— (informative)",
        None,
        f"median {median(t_stream):.2f} s (n={len(t_stream)}); whole-buffer seal of the same bytes in 1 MiB "
        f"blocks, interleaved: {whole_mbps:.0f} MB/s (stream = {stream_mbps / whole_mbps:.2f}× whole)",
    ))

    # 5. compiling 10,000 values ------------------------------------------------------------------
    values_10k = _registered(all_values)
    for _ in range(0 if quick else 2):
        builds_10k.append(timed(lambda: Sealer(values_10k)))
    n_forms = sealers[10_000].form_count
    add(Row(
        SECTION,
        "build the sealer for 10,000 values",
        f"{median(builds_10k):.2f} s",
        "< 2 s",
        median(builds_10k) < 2,
        f"n={len(builds_10k)}; {n_forms} patterns (one per value: encodings are decoded, not listed); "
        f"1,000 values: {build_1000:.2f} s",
    ))
    return rows
