"""The decoded views (``keyveil._views``) alone: decoders against the standard library, maps back, writing back.

Each view must decode exactly as the standard library decodes the same
layer, map every span of its bytes back to the original bytes they came
from, and write a replacement so that the carrier, decoded again by the
standard library, holds exactly the replacement there.
"""

import base64
import binascii
import json
import random
import re
from urllib.parse import quote, unquote_to_bytes

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyveil._views import (
    Base64View,
    JsonView,
    PercentView,
    base64_runs,
    escape_tail,
    is_escape,
    json_unescape,
)

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


def _escape_some(text: str, rng: random.Random) -> str:
    """A JSON string body with a random subset of characters escaped, in random hex case."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\' or code < 0x20 or rng.random() < 0.4:
            if ch in "/" and rng.random() < 0.5:
                out.append("\\/")
            elif code > 0xFFFF:
                code -= 0x10000
                for unit in (0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF)):
                    out.append(("\\u%04X" if rng.random() < 0.5 else "\\u%04x") % unit)
            else:
                out.append(("\\u%04X" if rng.random() < 0.5 else "\\u%04x") % code)
        else:
            out.append(ch)
    return "".join(out)


@settings(max_examples=300)
@given(texts=st.lists(TEXT, min_size=1, max_size=5), seed=st.integers(0, 2**32))
def test_json_view_decodes_like_json_loads(texts, seed):
    rng = random.Random(seed)
    bodies = [_escape_some(t, rng) for t in texts]
    raw = ('{"a": [' + ", ".join(f'"{b}"' for b in bodies) + "]}").encode()
    view = JsonView.build(raw)
    assert json_unescape(raw) == view.data
    # Every string decodes, inside the view, to what json.loads makes of it.
    for text in json.loads(raw)["a"]:
        assert text.encode() in view.data


@settings(max_examples=300)
@given(data=st.binary(max_size=300), noise=st.lists(st.sampled_from([b"\\", b"\\u", b"\\u00", b"\\ud83d", b"\\udc80", b'\\"', b"\\\\", b'"', b"\\x", b"\\/", b"\\n"]), max_size=20), seed=st.integers(0, 2**32))
def test_fast_and_mapped_json_decoders_agree_on_anything(data, noise, seed):
    rng = random.Random(seed)
    pieces = [data[i : i + 7] for i in range(0, len(data), 7)] + list(noise)
    rng.shuffle(pieces)
    raw = b"".join(pieces)
    assert json_unescape(raw) == JsonView.build(raw).data


@settings(max_examples=200)
@given(text=TEXT.filter(lambda t: len(t) >= 3), seed=st.integers(0, 2**32))
def test_json_span_maps_back_and_writes_back(text, seed):
    rng = random.Random(seed)
    escaped = _escape_some(text, rng)
    raw = ('{"k": "<' + escaped + '>"}').encode()
    view = JsonView.build(raw)
    inner = text.encode()
    at = view.data.index(b"<" + inner + b">") + 1
    start, end = view.span(at, at + len(inner))
    # The span holds exactly the escaped text; writing a replacement keeps JSON valid.
    assert json.loads(b'"' + raw[start:end] + b'"') == text
    new = raw[:start] + view.encode(b'a/"b\\c\n', start, end) + raw[end:]
    assert json.loads(new) == {"k": '<a/"b\\c\n>'}


@settings(max_examples=200)
@given(value=st.binary(min_size=1, max_size=30), safe=st.sampled_from(["", "/", "-_.~", "!*'()"]), seed=st.integers(0, 2**32))
def test_percent_view_decodes_like_unquote(value, safe, seed):
    rng = random.Random(seed)
    encoded = re.sub("%[0-9A-F]{2}", lambda m: m.group(0) if rng.random() < 0.5 else m.group(0).lower(), quote(value, safe=safe))
    raw = b"q=" + encoded.encode() + b"&x=1"
    view = PercentView(raw, plus=False)
    assert view.data == unquote_to_bytes(raw)
    at = view.data.index(value, 2)
    start, end = view.span(at, at + len(value))
    assert unquote_to_bytes(raw[start:end]) == value
    new = raw[:start] + view.encode(b"{{secret:a/b}} &", start, end) + raw[end:]
    assert unquote_to_bytes(new) == b"q={{secret:a/b}} &&x=1"


def test_percent_view_reads_plus_as_space_only_when_asked():
    raw = b"a+b%2Bc"
    assert PercentView(raw, plus=False).data == b"a+b+c"
    assert PercentView(raw, plus=True).data == b"a b+c"


@settings(max_examples=200)
@given(
    payload=st.binary(min_size=12, max_size=400),
    urlsafe=st.booleans(),
    padded=st.booleans(),
    width=st.sampled_from([0, 60, 64, 76]),
    crlf=st.booleans(),
)
def test_base64_view_decodes_and_reencodes_in_the_same_style(payload, urlsafe, padded, width, crlf):
    text = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(payload)
    if not padded:
        text = text.rstrip(b"=")
    if width:
        newline = b"\r\n" if crlf else b"\n"
        text = newline.join(text[i : i + width] for i in range(0, len(text), width))
    raw = b'{"data": "' + text + b'"}'
    runs = list(base64_runs(raw, 16))
    # A shorter last line is read both as the block's last line and as a line of its own.
    run = max(runs, key=lambda r: r.end - r.start)
    assert raw[run.start : run.end + run.padding] == text
    view = Base64View(raw, run, 0)
    assert view.data == payload
    replacement = payload[:5] + b"{{secret:x/y}}" + payload[9:]
    edit = view.reencode(replacement)
    new = raw[: edit.start] + edit.replacement + raw[edit.end :]
    run = new[10:-2]
    decoder = base64.urlsafe_b64decode if urlsafe else base64.b64decode
    assert decoder(run.replace(b"\r", b"").replace(b"\n", b"") + b"=" * (-len(run.replace(b"\r", b"").replace(b"\n", b"")) % 4)) == replacement
    if width and len(text) > width:  # the same line width and line ending
        lines = run.split(b"\r\n" if crlf else b"\n")
        assert all(len(line) == width for line in lines[:-1]) and len(lines[-1]) <= width
    if not padded and len(payload) % 3:  # a run that showed it leaves padding out keeps it out
        assert not run.endswith(b"=")


def test_base64_runs_need_the_length_of_a_value():
    assert list(base64_runs(b"short words only here", 12)) == []
    raw = b"x " + base64.b64encode(b"0123456789abcdef") + b" y"
    (run,) = base64_runs(raw, 12)
    assert raw[run.start : run.end + run.padding] == base64.b64encode(b"0123456789abcdef")


def test_base64_view_from_each_offset():
    payload = b"user:" + b"s3cr3t-value-xyz"
    raw = b"/upload/z" + base64.b64encode(payload)
    (run,) = base64_runs(raw, 12)
    decoded = [Base64View(raw, run, align).data for align in range(4)]
    assert any(payload in d for d in decoded)


def test_json_windows_map_spans_as_the_whole_view_does():
    """A long buffer is mapped back in windows around a match; each span comes out as the whole view gives it."""
    from random import Random

    from keyveil._views import json_windows

    rng = Random(8)
    pieces = ['\\n', '\\"', "\\u00e9", "\\ud83d\\udd11", "\\\\", "\\/", "plain text ", "\\u4e2d", "x" * 40]
    raw = "".join(rng.choice(pieces) for _ in range(9000)).encode()
    whole = JsonView.build(raw)
    assert whole.data == json_unescape(raw)
    for _ in range(200):
        start = rng.randrange(len(whole.data) - 50)
        end = start + rng.randrange(1, 50)
        (window,) = json_windows(raw, whole.data, [(start, end)])
        assert window.agrees() and window.holds(start, end)
        assert window.span(start, end) == whole.span(start, end)
        for at in (start, end):
            assert window.boundary(at) == whole.boundary(at)


def test_fast_json_decoder_on_many_short_strings_agrees_with_the_mapped_one():
    # A document of many short strings with escapes between them (the fast decoder
    # takes stretches without a backslash whole): invalid escapes, escaped
    # backslashes before quotes, surrogates, a trailing lone backslash.
    rng = random.Random(3)
    pieces = ['{"a": "b"}', '"', '\\"', "\\\\", '\\\\"', "\\q", "\\u0041", "\\ud83d\\udd11", "\\udc80", "x", ", ", "\\n", "\\/"]
    for _ in range(300):
        raw = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60))).encode()
        assert json_unescape(raw) == JsonView.build(raw).data
    doc = json.dumps([{"role": "user", "content": rng.choice(["", "ok", 'say "hi"\n', "a\\b"])} for _ in range(2000)]).encode()
    assert json_unescape(doc) == JsonView.build(doc).data


@settings(max_examples=500)
@given(
    raw=st.binary(max_size=200),
    noise=st.lists(st.sampled_from([b"=", b"==", b"\n", b"\r\n", b" ", b"-", b"_", b"%", b"A"]), max_size=6),
    seed=st.integers(0, 2**32),
)
def test_fast_base64_decoder_is_binascii(raw, noise, seed):
    # keyveil._views.a2b_base64 takes pybase64's SIMD path only for strictly valid
    # text; on anything, it must give what binascii's lenient decoder gives, or fail as it does.
    import base64 as std

    from keyveil._views import a2b_base64

    rng = random.Random(seed)
    text = bytearray(std.b64encode(raw))
    if rng.random() < 0.5 and text:
        text = text.rstrip(b"=")
    for piece in noise:
        at = rng.randrange(len(text) + 1)
        text[at:at] = piece
    text = bytes(text)
    try:
        expected = binascii.a2b_base64(text)
    except binascii.Error:
        with pytest.raises(binascii.Error):
            a2b_base64(text)
        return
    assert a2b_base64(text) == expected
    assert a2b_base64(memoryview(text)) == expected


def test_a_word_after_a_line_break_of_another_kind_is_not_a_blocks_last_line():
    # A CRLF-wrapped block, then a LF and a word of text: the word stays text
    # (with mixed breaks allowed inside a block, the kind of break before a
    # short last line is what tells a word from base64's last line).
    import base64 as std

    payload = std.urlsafe_b64encode(random.Random(2).randbytes(51))  # 68 characters: four full lines of 17
    block = b"\r\n".join(payload[i : i + 17] for i in range(0, len(payload), 17))
    data = block + b"\nlog see the rest"
    runs = list(base64_runs(data, 24))
    assert runs and runs[0].end <= len(block)
    lines = [payload[i : i + 17] for i in range(0, len(payload), 17)]
    mixed = lines[0] + b"".join((b"\r\n" if i % 2 else b"\n") + line for i, line in enumerate(lines[1:]))
    (run,) = [r for r in base64_runs(mixed, 24) if not r.alternative]
    assert (run.start, run.end) == (0, len(mixed))


@pytest.mark.parametrize("seed", range(4))
def test_escape_tail_is_what_the_standard_library_wrote_after_the_escape_character(seed):
    """Each character escaped by urllib.parse.quote or json.dumps (ensure_ascii), then
    base64: escape_tail at the first character after the `%` or `\\` is the rest of
    that escape. After an escaped backslash (json.dumps of `\\`) no escape starts."""
    rng = random.Random(seed)
    chars = [" ", "\n", "\t", "\r", '"', "\u2190", "\u00e9", "\x7f", *(chr(rng.randrange(0x20, 0x3000)) for _ in range(40))]
    for ch in chars:
        for escaped in {quote(ch, safe=""), json.dumps(ch)[1:-1]}:
            data = ("x" + escaped + "QUFBQUFB").encode()
            last = 1 + max(escaped.rfind("%"), escaped.rfind("\\"))  # where the last escape's lead stands, +1
            if escaped[:1] not in ("%", "\\"):
                assert escape_tail(data, 1) == 0, escaped
                continue
            assert escape_tail(data, last + 1) == len(escaped) - last, escaped
    assert is_escape(b"a\\n", 1) and not is_escape(b"a\\\\n", 2) and is_escape(b"a\\\\\\n", 3)
    assert escape_tail(json.dumps("\\").encode()[1:-1] + b"QUFB", 2) == 0  # `\\\\` then the run
    assert escape_tail(b"100%zzQUFB", 4) == 0 and escape_tail(b"QUFB", 0) == 0


