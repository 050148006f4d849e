"""The sealer and stream sealer (SPEC §3, §7): properties and concrete forms.

Forms are produced here with the standard library's own encoders, not with
keyveil's form generator, so a form keyveil forgets is a failing test.
"""

import base64
import json
import os
import re
import secrets
import string
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from keyveil._engine import Sealer
from keyveil._inject import for_header, for_json, inject, inject_basic

VALUE_CHARS = string.ascii_letters + string.digits + "-_./+=~!*'()<>&\"\\ :;@$,?#%"


def fake_value(rng_bytes: bytes, alphabet: str = VALUE_CHARS, length: int = 24) -> bytes:
    return "".join(alphabet[b % len(alphabet)] for b in rng_bytes[:length]).encode()


def value_strategy(min_size=8, max_size=40):
    return st.text(alphabet=VALUE_CHARS, min_size=min_size, max_size=max_size).map(str.encode)


# --- encoders a client might use -------------------------------------------------


def json_escapes(v: bytes) -> list[bytes]:
    text = v.decode()
    out = [
        json.dumps(text)[1:-1],
        json.dumps(text, ensure_ascii=False)[1:-1],
        json.dumps(text)[1:-1].replace("/", "\\/"),
    ]
    html = json.dumps(text)[1:-1].replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    out += [html, html.replace("\\u003c", "\\u003C").replace("\\u003e", "\\u003E")]
    return [o.encode() for o in out]


def percent_escapes(v: bytes) -> list[bytes]:
    out = [quote(v, safe=""), quote(v), quote_plus(v), quote(v, safe="-_.!~*'()")]
    out += ["%".join(p[:2].lower() + p[2:] if i else p for i, p in enumerate(o.split("%"))) for o in out]
    return [o.encode() for o in out]


def base64_embeddings(v: bytes, before: bytes, after: bytes) -> list[bytes]:
    raw = before + v + after
    std = base64.b64encode(raw)
    url = base64.urlsafe_b64encode(raw)
    return [std, std.rstrip(b"="), url, url.rstrip(b"=")]


FORMS = {
    "raw": lambda v, b, a: [v],
    "json": lambda v, b, a: json_escapes(v),
    "percent": lambda v, b, a: percent_escapes(v),
    "base64": base64_embeddings,
    "basic": lambda v, b, a: [b"Basic " + base64.b64encode(b + b":" + v)],
    "bearer": lambda v, b, a: [b"Bearer " + v],
}


def all_forms(v: bytes) -> list[bytes]:
    forms = []
    for make in FORMS.values():
        forms += make(v, b"", b"")
    return forms


B64_RUN = re.compile(rb"[A-Za-z0-9+/_-]{8,}")


def decodings(data: bytes):
    """Every base64 run of DATA decoded at each of its 4 alignments (either alphabet)."""
    for m in B64_RUN.finditer(data):
        run = m.group().replace(b"-", b"+").replace(b"_", b"/")
        for shift in range(4):
            part = run[shift:]
            part = part[: len(part) - len(part) % 4]
            if part:
                yield base64.b64decode(part)


def assert_no_form(data: bytes, values: list[bytes]) -> None:
    for v in values:
        assert v not in data
        for f in all_forms(v):
            assert f not in data
        for decoded in decodings(data):
            assert v not in decoded


# --- properties ------------------------------------------------------------------

filler = st.binary(max_size=64).filter(lambda b: b"{{" not in b)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(value_strategy(), min_size=1, max_size=4, unique=True),
    pieces=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(sorted(FORMS)), st.integers(0, 20), filler, st.binary(max_size=5), st.binary(max_size=5)),
        min_size=1,
        max_size=6,
    ),
)
def test_a_sealed_output_holds_no_form(values, pieces):
    # values must not contain each other, or "no form of any value" is ill-posed
    assume(all(a == b or a not in b for a in values for b in values))
    sealer = Sealer({f"s/{i}": [v] for i, v in enumerate(values)})
    parts = []
    for which, kind, choice, text, before, after in pieces:
        forms = FORMS[kind](values[which % len(values)], before, after)
        parts += [text, forms[choice % len(forms)]]
    data = b" ".join(parts)
    sealed = sealer.seal(data)
    assert_no_form(sealed.data, values)
    assert sealed.changed


@settings(max_examples=200)
@given(values=st.lists(value_strategy(), min_size=1, max_size=5), data=st.binary(max_size=2000))
def test_b_a_buffer_without_value_is_unchanged(values, data):
    for v in values:
        for f in all_forms(v):
            assume(f not in data)
    sealer = Sealer({f"s/{i}": [v] for i, v in enumerate(values)})
    result = sealer.seal(data)
    assert result.data == data
    assert not result.changed


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(value_strategy(), min_size=1, max_size=3, unique=True),
    pieces=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(sorted(FORMS)), filler), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_c_any_chunking_scrubs_like_whole(values, pieces, cuts):
    sealer = Sealer({f"s/{i}": [v] for i, v in enumerate(values)})
    data = b"".join(text + FORMS[kind](values[w % len(values)], b"u", b"")[0] for w, kind, text in pieces)
    whole = sealer.scrub(data).data
    stream = sealer.stream()
    out = []
    last = 0
    for cut in sorted(c % (len(data) + 1) for c in cuts):
        out.append(stream.feed(data[last:cut]))
        last = cut
    out.append(stream.feed(data[last:]))
    out.append(stream.feed(b"", final=True))
    assert b"".join(out) == whole
    for v in values:
        assert v not in whole


@settings(max_examples=200)
@given(values=st.lists(value_strategy(), min_size=1, max_size=3, unique=True), user=st.text(string.ascii_letters, max_size=8))
def test_d_inject_after_seal_restores_bound_locations(values, user):
    assume(all(a == b or a not in b for a in values for b in values))
    named = {f"s/{i}": v for i, v in enumerate(values)}
    sealer = Sealer({n: [v] for n, v in named.items()})
    printable = {n: v for n, v in named.items() if not any(c in v for c in b"\r\n\0")}
    for name, v in printable.items():
        header = b"Bearer " + v
        sealed = sealer.seal(header).data
        assert sealed == b"Bearer {{secret:" + name.encode() + b"}}"
        assert inject(sealed, named, {name}, for_header, "header")[0] == header

        basic = b"Basic " + base64.b64encode(user.encode() + b":" + v)
        assert inject_basic(sealer.seal(basic).data, named, {name})[0] == basic

        body = json.dumps({"k": v.decode(), "n": 1}).encode()
        injected = inject(sealer.seal(body).data, named, {name}, for_json, "body")[0]
        assert json.loads(injected) == json.loads(body)


# --- concrete cases --------------------------------------------------------------


def test_value_split_across_chunks_is_caught_and_held_back_minimally():
    v = b"tok_" + secrets.token_hex(16).encode()
    sealer = Sealer({"api/key": [v]})
    stream = sealer.stream()
    first = stream.feed(b'data: {"text": "' + v[:10])
    assert v[:10] not in first  # the beginning of the value waits for the rest
    assert first == b'data: {"text": "'  # and only it: everything before is released
    rest = stream.feed(v[10:] + b'"}\n\n')
    assert first + rest == b'data: {"text": "{{secret:api/key}}"}\n\n'


def test_sse_event_end_is_released_at_once():
    sealer = Sealer({"api/key": [b"tok_" + secrets.token_hex(16).encode()]})
    stream = sealer.stream()
    event = b'data: {"delta": "hello world"}\n\n'
    assert stream.feed(event) == event


def test_basic_credentials_keep_padding_and_alphabet():
    v = b"pw_" + secrets.token_urlsafe(20).encode()
    sealer = Sealer({"git/pw": [v]})
    header = b"Basic " + base64.b64encode(b"me:" + v)
    sealed = sealer.seal(header).data
    assert base64.b64decode(sealed[6:]) == b"me:{{secret:git/pw}}"
    unpadded = base64.urlsafe_b64encode(b"xx" + v + b"yyy").rstrip(b"=")
    sealed = sealer.seal(unpadded).data
    assert b"=" not in sealed
    assert base64.urlsafe_b64decode(sealed + b"=" * (-len(sealed) % 4)) == b"xx{{secret:git/pw}}yyy"


def test_value_inside_long_base64_payload():
    v = b"AKIA" + secrets.token_hex(12).encode()
    sealer = Sealer({"aws/key": [v]})
    payload = os.urandom(3000) + v + os.urandom(1000)
    for k in range(3):
        data = b'{"blob": "' + base64.b64encode(payload[k:]) + b'"}'
        sealed = sealer.seal(data).data
        decoded = base64.b64decode(json.loads(sealed)["blob"])
        assert decoded == payload[k:].replace(v, b"{{secret:aws/key}}")


def test_previous_values_are_sealed_as_the_same_reference():
    sealer = Sealer({"gh/pat": [b"new-value-123456", b"old-value-123456"]})
    assert sealer.seal(b"old-value-123456 new-value-123456").data == b"{{secret:gh/pat}} {{secret:gh/pat}}"


def test_protected_spans_shield_base64_forms_only():
    v = b"sig-value-1234567"
    sealer = Sealer({"x/y": [v]})
    blob = base64.b64encode(b"\x00" * 9 + v + b"\x00" * 9)
    data = b"keep:" + blob + b" seal:" + blob + b" raw:" + v
    result = sealer.seal(data, protect=lambda d: [(0, 5 + len(blob))])
    kept, sealed, raw = result.data[5:].split(b" ")
    assert kept == blob
    assert base64.b64decode(sealed[5:]) == b"\x00" * 9 + b"{{secret:x/y}}" + b"\x00" * 9
    assert raw == b"raw:{{secret:x/y}}"
    # a raw value inside a protected span is sealed all the same
    assert sealer.seal(b"in:" + v, protect=lambda d: [(0, len(d))]).data == b"in:{{secret:x/y}}"


@pytest.mark.parametrize("n", [1, 50])
def test_longest_value_wins_when_values_overlap(n):
    short = b"abcdefgh12"
    long = short + b"345678"
    sealer = Sealer({"a/short": [short], "a/long": [long]})
    assert sealer.seal(long * n).data == b"{{secret:a/long}}" * n


def test_no_values_means_no_work():
    sealer = Sealer({})
    data = b"anything"
    assert sealer.seal(data).data is data
    assert sealer.scrub(data).data == data


def test_may_hold_value_checks_many_parts_at_once():
    v = b"tok_" + secrets.token_hex(12).encode()
    sealer = Sealer({"a/b": [v]})
    assert sealer.may_hold_value([b"accept", b"*/*", b"authorization", b"Bearer " + v])
    assert sealer.may_hold_value([b"x", base64.b64encode(b"u:" + v)])
    assert not sealer.may_hold_value([b"accept", b"*/*"])
    # a value cut in two across parts is not a form in either part
    assert not sealer.may_hold_value([v[:10], v[10:]])
