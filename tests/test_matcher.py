"""The literal matcher against the plainest reference there is: bytes.find at every offset."""

import random
import re
import string
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from keyveil._matcher import Matcher

# Few distinct bytes, so patterns overlap, repeat, nest and share prefixes.
_BYTES = st.binary(min_size=0, max_size=1).map(lambda b: b or b"\x00")
_ALPHABET = st.sampled_from([b"a", b"b", b"\x00", b"\\", b"\xff"])


def _text(min_size: int, max_size: int):
    return st.lists(_ALPHABET, min_size=min_size, max_size=max_size).map(b"".join)


def reference(patterns: list[bytes], weak: set[int], data: bytes) -> list[tuple[int, int, int]]:
    """Every occurrence by bytes.find; strong ones leftmost-longest first, then the weak ones no strong match overlaps."""
    occurrences = sorted(
        (start, -len(p), i)
        for i, p in enumerate(patterns)
        for start in range(len(data))
        if data.startswith(p, start)
    )

    def pick(cands):
        out, pos = [], 0
        for start, neg, i in cands:
            if start >= pos:
                out.append((i, start, start - neg))
                pos = start - neg
        return out

    strong = pick([o for o in occurrences if o[2] not in weak])
    weak_ = [
        o for o in occurrences
        if o[2] in weak and not any(s < o[0] - o[1] and o[0] < e for _, s, e in strong)
    ]
    return sorted(strong + pick(weak_), key=lambda f: f[1])


@settings(max_examples=300, deadline=None)
@given(
    patterns=st.lists(_text(4, 9), min_size=1, max_size=12),
    data=_text(0, 120),
    weak_share=st.integers(0, 3),
)
def test_find_is_leftmost_longest_over_every_occurrence(patterns, data, weak_share):
    weak = {i for i in range(len(patterns)) if weak_share and i % 4 < weak_share - 1}
    # plant some patterns, so matches are not left to chance
    data = patterns[0] + data + patterns[-1] + data[:7]
    matcher = Matcher(patterns, weak=weak)
    assert matcher.find(data) == reference(patterns, weak, data)
    assert matcher.any(data)
    assert not matcher.any(b"") and matcher.find(b"") == []


def test_bytes_letters_and_digits_are_not_special():
    """Every byte value matches only itself: regular-expression syntax in a value is a literal."""
    patterns = [bytes(range(i, i + 8)) for i in range(0, 256, 8)] + [b".*+?", b"(a|b)", b"[^x]", b"\\x00"]
    matcher = Matcher(patterns)
    data = b"".join(patterns)
    assert [i for i, _, _ in matcher.find(data)] == list(range(len(patterns)))
    assert matcher.find(b"abcd" * 3 + b"\x00\x01" + b"....") == []
    assert not matcher.any(b"ab\\x0")


def test_no_patterns():
    matcher = Matcher([])
    assert len(matcher) == 0 and matcher.find(b"anything") == [] and not matcher.any(b"anything")


def test_threads_scan_one_matcher_at_once():
    """Each thread scans with a scratch space of its own (a shared one raises in use)."""
    patterns = [b"needle%d" % i for i in range(50)]
    matcher = Matcher(patterns)
    data = b"hay " * 5000 + b"needle7 " + b"hay " * 5000
    errors, results = [], []

    def scan():
        try:
            for _ in range(200):
                results.append(matcher.find(data))
        except Exception as e:  # noqa: BLE001 — collected and asserted on below
            errors.append(e)

    threads = [threading.Thread(target=scan) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 800 and all(r == [(7, 20000, 20007)] for r in results)


def test_long_patterns_are_found_whole():
    """Hyperscan limits an expression's size: a value of 64 KiB (a key file) is found by its
    head and confirmed whole; a buffer holding only its head does not match."""
    rng = random.Random(5)
    long_value = rng.randbytes(65536)
    twin = long_value[:-1] + bytes([long_value[-1] ^ 1])  # the same head, another last byte
    matcher = Matcher([long_value, b"short-one"])
    data = b"a" + twin + b" b " + long_value + b" short-one"
    start = len(twin) + 4
    assert matcher.find(data) == [(0, start, start + len(long_value)), (1, len(data) - 9, len(data))]
    assert matcher.find(b"a" + twin) == [] and matcher.any(b"a" + twin)  # any(): the head occurs


# -- the sealer's escape triggers: one Hyperscan scan, judged by Python's re ------------------------

_TRIGGER_PIECES = [
    b"\\n", b"\\r", b"\\r\\n", b"\\/", b"\\\\", b"\\\\/", b'\\"', b"\\t", b"\\u00", b"\\u4e2d", b"\\uD83D", b"\\u20ac",
    b"%", b"%2F", b"%2b", b"%e2", b"%41", b"%4", b"A" * 12, b"abc", b"xyz+/", b"=", b" ", b"\n", b"\xe4\xb8\xad", b"-_",
]


@st.composite
def _trigger_case(draw):
    alphabet = string.ascii_letters + string.digits + "+/_-\"\\\n\t%\u20ac\u4e2d"
    values = draw(st.lists(st.text(alphabet, min_size=4, max_size=12), min_size=1, max_size=3))
    pieces = draw(st.lists(st.one_of(st.sampled_from(_TRIGGER_PIECES), st.binary(max_size=4)), max_size=30))
    hexes = draw(st.lists(st.integers(0, 255), max_size=4))
    data = b"".join(pieces) + b"".join(b"\\u00%02x%%%02X" % (h, h) for h in hexes)
    return [v.encode() for v in values], data


@given(_trigger_case())
@settings(max_examples=400, deadline=None)
def test_the_escape_triggers_find_what_python_re_finds(case):
    """_AnyOf scans with Hyperscan; each of its patterns, and its literals, read
    by Python's re and bytes.find, must give the same answer on every buffer."""
    from keyveil._engine import _triggers
    from keyveil._matcher import Scanner
    from keyveil._views import WRAPPED_IN_JSON_PATTERNS

    values, data = case
    # The wrapped-base64 test (_views.WRAPPED_IN_JSON_PATTERNS) was a lookbehind from the line
    # break; Hyperscan has no lookaround, so it is the line, the break and what follows.
    line = rb"[A-Za-z0-9+/_\\-]{12}"
    lookbehind = rb"\\[nr](?<=" + line + rb"\\[nr])(?=[A-Za-z0-9+/_=-]|\\[/n])"
    plain = line + rb"\\[nr](?:[A-Za-z0-9+/_=-]|\\[/n])"
    assert (re.search(lookbehind, data) is None) == (re.search(plain, data) is None)
    assert Scanner(WRAPPED_IN_JSON_PATTERNS).any(data) == (re.search(plain, data) is not None)
    for trigger in _triggers(values):
        want = any(re.search(p, data) for p in trigger.patterns) or any(lit in data for lit in trigger.literals)
        assert trigger.search(data) == want, (trigger.patterns, data)
