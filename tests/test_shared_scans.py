"""One buffer, several readers: what `shared_scans` hands on is what each reader would work out alone.

Detection and the sealer both look for base64 runs in a request and both
JSON-unescape it; inside `_views.shared_scans` each is worked out once per
buffer. These tests compare the shared answers with the unshared functions
on generated buffers (base64 from the standard library, wrapped at random
widths, in prose and JSON), in both orders of asking, and check that nothing
is kept once the block ends.
"""

from __future__ import annotations

import base64
import json
import random
import re

import pytest

from keyveil import _views
from keyveil._views import base64_runs, json_unescape, runs_of, shared_scans


def _buffer(rng: random.Random) -> bytes:
    pieces = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.randrange(5)
        if kind == 0:
            pieces.append(" ".join(rng.choice(["token", "the", "key", "path/to/file.py", "a", "value"]) for _ in range(rng.randint(1, 30))))
        else:
            raw = rng.randbytes(rng.randint(5, 400))
            text = (base64.urlsafe_b64encode if rng.random() < 0.3 else base64.b64encode)(raw).decode()
            if rng.random() < 0.3:
                text = text.rstrip("=")
            if kind >= 3:
                width = rng.randint(8, 90)
                newline = rng.choice(["\n", "\r\n"])
                text = newline.join(text[i : i + width] for i in range(0, len(text), width))
            pieces.append(text)
    text = rng.choice([" ", "\n", "", "/"]).join(pieces)
    if rng.random() < 0.5:
        text = json.dumps({"content": text}, ensure_ascii=rng.random() < 0.5)
    return text.encode()


@pytest.mark.parametrize("seed", range(6))
def test_shared_runs_are_the_runs_each_reader_would_find(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        data = _buffer(rng)
        short, long = sorted(rng.sample([12, 16, 24, 28, 43, 48, 60, 100], 2))
        plus = rng.random() < 0.3
        for order in ((short, long), (long, short)):
            with shared_scans():
                got = [runs_of(data, n, plus=plus) for n in order]
                again = runs_of(data, order[0], plus=plus)
            assert got == [list(base64_runs(data, n, plus=plus)) for n in order]
            assert again == got[0]


def test_shared_json_view_is_the_json_view() -> None:
    rng = random.Random(7)
    for _ in range(200):
        data = _buffer(rng)
        alone = json_unescape(data)
        with shared_scans():
            first, second = json_unescape(data), json_unescape(data)
        assert first == second == alone
        assert first is second  # worked out once


def test_nothing_is_kept_after_the_block_or_outside_one() -> None:
    data = base64.b64encode(random.Random(1).randbytes(300))
    assert runs_of(data, 24) == list(base64_runs(data, 24))
    assert _views._SHARED.get() is None
    with shared_scans():
        runs_of(data, 24)
        json_unescape(data)
        assert len(_views._SHARED.get()) == 2
    assert _views._SHARED.get() is None


def test_an_equal_buffer_that_is_another_object_is_worked_out_again() -> None:
    # Entries are kept by identity and hold their buffer, so an id is never reused while kept.
    a = base64.b64encode(random.Random(2).randbytes(300))
    b = bytes(bytearray(a))
    with shared_scans():
        runs_of(a, 24)
        assert _views._shared("runs", b, False) is None
        assert runs_of(b, 24) == list(base64_runs(b, 24))


def test_a_mutable_buffer_is_never_kept():
    data = bytearray(base64.b64encode(random.Random(3).randbytes(300)))
    with shared_scans():
        first = runs_of(data, 24)
        data[100:101] = b" "  # cuts the run in two
        assert runs_of(data, 24) == list(base64_runs(bytes(data), 24)) != first


# -- the sealer's scan and the detector's, in one pass ----------------------------------------


def _with_tokens(rng: random.Random, values: list[bytes]) -> bytes:
    """A generated buffer with values, tokens, keywords and escapes the detector's views look for."""
    from tests.tokens import MAKERS, samples

    pieces = [_buffer(rng).decode()]
    for _ in range(rng.randint(0, 6)):
        pick = rng.randrange(6)
        if pick == 0:
            pieces.append(rng.choice(values).decode())
        elif pick == 1:
            pieces.append(samples(rng.choice(sorted(MAKERS)))[0][0])
        elif pick == 2:
            pieces.append(rng.choice(["API_KEY=", "token: ", '"secret": "', "Password="]) + base64.b64encode(rng.randbytes(18)).decode())
        elif pick == 3:
            pieces.append(rng.choice(["\\/", "\\\\/", "\\u0041", "\\\\u0041", "-----BEGIN PRIVATE KEY-----\\n"]))
        else:
            pieces.append(base64.b64encode(rng.choice(values)).decode())
    rng.shuffle(pieces)
    return rng.choice([" ", "\n", ""]).join(pieces).encode()


@pytest.mark.parametrize("seed", range(4))
def test_one_scan_for_the_sealer_and_the_detector_finds_what_each_finds_alone(seed: int) -> None:
    from keyveil._detect import shipped_detector
    from keyveil._detected import RequestDetector
    from keyveil._engine import Sealer

    rng = random.Random(seed)
    detector = shipped_detector()
    values = {f"t/v{i}": [base64.b64encode(rng.randbytes(rng.randint(12, 30)))] for i in range(20)}
    alone, joint = Sealer(values), Sealer(values, companion=detector.expressions)
    request_detector = RequestDetector(detector, bytes(32))
    flat = [v for vs in values.values() for v in vs]
    hits_seen = 0
    for _ in range(150):
        data = _with_tokens(rng, flat)
        with shared_scans():
            hits = joint.companion_hits(data)
            assert sorted(hits) == sorted(detector.hits(data))
            assert joint.seal(data).data == alone.seal(data).data
        hits_seen += bool(hits)
        with shared_scans():
            together = request_detector.find([data], hits=joint.companion_hits)
            sealed = joint.seal(data)
        assert [(f.name, f.value) for f in together] == [(f.name, f.value) for f in request_detector.find([data])]
        assert sealed.data == alone.seal(data).data
    assert hits_seen > 50  # the generator gives the detector something to find


def test_the_shared_scan_is_kept_per_sealer() -> None:
    # Two sealers number their values apart: one's scan is never handed to the other.
    from keyveil._detect import shipped_detector
    from keyveil._engine import Sealer

    expressions = shipped_detector().expressions
    a = Sealer({"a/one": [b"aaaa-first-value-0001"]}, companion=expressions)
    b = Sealer({"b/one": [b"bbbb-other-value-0002"], "b/two": [b"aaaa-first-value-0001"]}, companion=expressions)
    data = b"x aaaa-first-value-0001 y"
    with shared_scans():
        assert a.seal(data).data == b"x {{secret:a/one}} y"
        assert b.seal(data).data == b"x {{secret:b/two}} y"


def _with_escapes(rng: random.Random, values: list[bytes]) -> bytes:
    """A generated buffer (``_with_tokens``) with pieces written by the standard library's
    encoders: JSON strings (ensure_ascii or not, `/` escaped or not, random characters
    `\\u`-escaped in either hex case), percent-encoding (random safe sets, each escape's
    hex in either case), base64 wrapped at random widths inside a JSON string. Left out:
    escapes of more than two layers, and `\\u` escapes of characters beyond U+FFFF."""
    from urllib.parse import quote

    def cased(hex_digits: str) -> str:  # each digit's case at random
        return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in hex_digits)

    pieces = [_with_tokens(rng, values).decode()]
    for _ in range(rng.randint(0, 4)):
        text = rng.choice(values).decode() + rng.choice(["", " é", "\n", '"', "/"])
        pick = rng.randrange(4)
        if pick == 0:
            ascii_only = rng.random() < 0.5
            written = '"' + "".join(
                "\\u" + cased("%04x" % ord(c)) if rng.random() < 0.2 else json.dumps(c, ensure_ascii=ascii_only)[1:-1]
                for c in text
            ) + '"'
            pieces.append(written.replace("/", "\\/") if rng.random() < 0.3 else written)
        elif pick == 1:
            written = quote(text, safe=rng.choice(["", "/", "/+=", "~"]))
            pieces.append(re.sub(r"%[0-9A-F]{2}", lambda m: cased(m.group()), written))
        elif pick == 2:
            block = base64.b64encode(rng.randbytes(rng.randint(20, 200))).decode()
            width = rng.choice([12, 16, 60, 64, 76])
            pieces.append(json.dumps("\n".join(block[i : i + width] for i in range(0, len(block), width))))
        else:
            pieces.append(rng.choice(["%", "%4", "%zz", "\\", "\\n", "\\\\", "%25"]))
    rng.shuffle(pieces)
    return rng.choice([" ", "\n", ""]).join(pieces).encode()


@pytest.mark.parametrize("seed", range(4))
def test_the_joint_scan_answers_what_each_trigger_answers_alone(seed: int) -> None:
    """The sealer's escape triggers are read from the scan made for values and detector
    (``Sealer._joint_scan``): the answers are those of the triggers' own scans, on buffers
    written by the standard library's encoders."""
    from keyveil._detect import shipped_detector
    from keyveil._engine import Sealer

    rng = random.Random(seed)
    detector = shipped_detector()
    alphabet = "abcdefXYZ0189+/=\"\\ é%-_"
    values = {f"t/v{i}": ["".join(rng.choice(alphabet) for _ in range(rng.randint(12, 30))).encode()] for i in range(12)}
    joint = Sealer(values, companion=detector.expressions)
    flat = [v for vs in values.values() for v in vs]
    answers = set()
    for _ in range(300):
        data = _with_escapes(rng, flat)
        with shared_scans():
            joint.companion_hits(data)
            shared = (joint._escapes_matter(data, "json"), joint._escapes_matter(data, "percent"))
        alone = (joint._json_trigger.search(data), joint._percent_trigger.search(data))
        assert shared == alone, data
        answers.add(alone)
    assert len(answers) == 4  # each trigger said yes and no, apart and together


@pytest.mark.parametrize("seed", range(3))
def test_the_joint_scan_hands_over_the_references_it_finds(seed: int) -> None:
    """The references' markers are looked for in the scan made for values and detector, and handed
    to ``find_references_layered``: what it finds is what its own scan finds, on references
    written by the standard library's encoders (JSON with random characters `\\u`-escaped,
    percent-encoding with random safe sets, one inside the other)."""
    from urllib.parse import quote

    from keyveil._detect import shipped_detector
    from keyveil._engine import Sealer
    from keyveil._references import _HIDDEN, find_references_layered, hidden_hits

    rng = random.Random(seed)
    joint = Sealer({"t/one": [b"a-value-of-twenty-chars"]}, companion=shipped_detector().expressions)

    def written(reference: str) -> str:
        for _ in range(rng.randint(0, 2)):
            if rng.random() < 0.5:
                reference = json.dumps(reference, ensure_ascii=rng.random() < 0.5)[1:-1]
                reference = "".join("\\u%04x" % ord(c) if c.isalnum() and rng.random() < 0.2 else c for c in reference)
            else:
                reference = quote(reference, safe=rng.choice(["", "/", "{}:/"]))
        return reference

    def spans(found: list) -> list:  # a writer is a new function each time: compared by what it writes
        return [(start, end, name, writer and writer(b"v/{x}")) for start, end, name, writer in found]

    kinds = set()
    for _ in range(200):
        names = [rng.choice(["github/pat", "a/b-c", "x/y_z.1"]) for _ in range(rng.randint(0, 3))]
        pieces = [written("{{secret:%s}}" % n) for n in names] + [rng.choice(["text", "secret", "%73", "\\u0073", ""])]
        rng.shuffle(pieces)
        data = " ".join(pieces).encode()
        alone = spans(find_references_layered(data))
        with shared_scans():
            joint.companion_hits(data)
            assert hidden_hits(data) == _HIDDEN.find(data), data
            assert spans(find_references_layered(data)) == alone, data
        kinds.add(len(alone))
    assert {0, 1, 2} <= kinds  # buffers with none, one and several references were tried
