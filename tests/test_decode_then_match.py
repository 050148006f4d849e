"""Each encoding class of SPEC §3, as the independent check of issue 8 sent it, sealed in requests and responses.

Every carrier is built with the standard library, and every check decodes
with the standard library: the sealed carrier must decode to exactly the
original plaintext with the value replaced by its reference.
"""

import base64
import json
import random
import secrets
from urllib.parse import quote, unquote_to_bytes

import pytest

from keyveil._engine import STREAM_RUN_BOUND, Sealer
from keyveil._inject import for_form, for_header, for_json, for_url, inject

NAME = "github/pat"
REF = b"{{secret:github/pat}}"


@pytest.fixture
def value() -> bytes:
    # A value with characters every layer escapes.
    return b"ghp_" + secrets.token_urlsafe(18).encode() + b"/+=&\"\\ x\xc3\xa9"


@pytest.fixture
def sealer(value) -> Sealer:
    return Sealer({NAME: [value]})


def seal_both(sealer: Sealer, data: bytes) -> list[bytes]:
    """The request-side seal and the response-side (streamed, in random chunks) scrub."""
    sealed = sealer.seal(data).data
    stream = sealer.stream()
    rng = random.Random(len(data))
    out, pos = [], 0
    while pos < len(data):
        step = rng.randint(1, 97)
        out.append(stream.feed(data[pos : pos + step]))
        pos += step
    out.append(stream.feed(b"", final=True))
    return [sealed, b"".join(out)]


def u_escape(text: str, rng: random.Random, share: float = 0.5) -> str:
    out = []
    for ch in text:
        if ch in '"\\' or rng.random() < share:
            fmt = "\\u%04X" if rng.random() < 0.5 else "\\u%04x"
            out.append(fmt % ord(ch))
        else:
            out.append(ch)
    return "".join(out)


def test_json_u_escapes_of_ordinary_characters(sealer, value):
    text = value.decode()
    for seed in range(20):
        body = ('{"messages": [{"content": "key: ' + u_escape(text, random.Random(seed)) + ' end"}]}').encode()
        for sealed in seal_both(sealer, body):
            assert json.loads(sealed) == {"messages": [{"content": "key: " + REF.decode() + " end"}]}


def test_mixed_case_percent_escapes(sealer, value):
    rng = random.Random(1)
    escaped = "".join(
        (f"%{c:02X}" if rng.random() < 0.5 else f"%{c:02x}") if rng.random() < 0.7 or chr(c) in "%&+= \"\\" or c > 0x7F else chr(c)
        for c in value
    )
    query = f"q=1&state={escaped}&x=2".encode()
    for sealed in seal_both(sealer, query):
        assert unquote_to_bytes(sealed) == b"q=1&state=" + REF + b"&x=2"


@pytest.mark.parametrize("width", [76, 64, 60])
def test_wrapped_base64(sealer, value, width):
    payload = b"# file\n" + b"token = " + value + b"\n" * 3 + b"end\n" * 40
    text = base64.b64encode(payload)
    wrapped = b"\n".join(text[i : i + width] for i in range(0, len(text), width)) + b"\n"
    for sealed in seal_both(sealer, wrapped):
        assert base64.b64decode(sealed.replace(b"\n", b"")) == payload.replace(value, REF)
        assert all(len(line) <= width for line in sealed.split(b"\n"))


def test_github_contents_api_base64_in_json(sealer, value):
    """The contents API: base64 wrapped at 60 columns, inside a JSON string (`\\n` escapes)."""
    payload = b"password: " + value + b"\n" + b"x" * 300
    text = base64.b64encode(payload).decode()
    doc = {"type": "file", "encoding": "base64", "content": "\n".join(text[i : i + 60] for i in range(0, len(text), 60)) + "\n"}
    for sealed in seal_both(sealer, json.dumps(doc).encode()):
        content = json.loads(sealed)["content"]
        assert base64.b64decode(content) == payload.replace(value, REF)


def test_base64_of_git_credentials_line(sealer, value):
    line = b"https://x-access-token:" + quote(value, safe="").encode() + b"@github.com\n"
    for sealed in seal_both(sealer, base64.b64encode(line)):
        assert base64.b64decode(sealed) == b"https://x-access-token:" + quote(REF, safe="").encode() + b"@github.com\n"


def test_scrubbed_base64_decodes_to_exactly_the_original(sealer, value):
    payload = b"user:" + value
    encoded = b"Basic " + base64.b64encode(payload)
    for sealed in seal_both(sealer, encoded):
        assert base64.b64decode(sealed[6:]) == b"user:" + REF  # no padding space after the reference


def test_json_string_inside_a_json_string(sealer, value):
    inner = json.dumps({"token": value.decode()}, ensure_ascii=True)
    outer = json.dumps({"tool_result": inner}).encode()
    for sealed in seal_both(sealer, outer):
        assert json.loads(json.loads(sealed)["tool_result"]) == {"token": REF.decode()}


def test_double_percent_encoding(sealer, value):
    twice = quote(quote(value, safe=""), safe="").encode()
    assert b"%25" in twice
    for sealed in seal_both(sealer, b"/cb?next=" + twice):
        assert unquote_to_bytes(unquote_to_bytes(sealed)) == b"/cb?next=" + REF


def test_base64_inside_json_with_escaped_slashes(sealer, value):
    payload = b"\xfb\xff\xbf" * 7 + value
    text = base64.b64encode(payload).decode()
    assert "/" in text
    body = json.dumps({"data": text}).replace("/", "\\/").encode()
    for sealed in seal_both(sealer, body):
        assert base64.b64decode(json.loads(sealed)["data"]) == payload.replace(value, REF)


def test_percent_encoded_base64(sealer, value):
    payload = b"\xfb\xff" + value
    form = b"blob=" + quote(base64.b64encode(payload), safe="").encode()
    assert b"%2B" in form or b"%2F" in form or b"%3D" in form
    for sealed in seal_both(sealer, form):
        assert base64.b64decode(unquote_to_bytes(sealed[5:])) == payload.replace(value, REF)


def test_base64_of_a_json_document_with_the_value_escaped(sealer, value):
    doc = json.dumps({"k": value.decode()}, ensure_ascii=True).replace("/", "\\/").encode()
    for sealed in seal_both(sealer, base64.b64encode(doc)):
        assert json.loads(base64.b64decode(sealed)) == {"k": REF.decode()}


def test_json_escaped_value_in_a_form_field(sealer, value):
    field = json.dumps({"v": value.decode()}).encode()
    body = b"a=1&payload=" + quote(field, safe="").encode()
    for sealed in seal_both(sealer, body):
        assert json.loads(unquote_to_bytes(sealed.split(b"payload=")[1])) == {"v": REF.decode()}


def test_base64_payload_after_other_base64_characters(sealer, value):
    path = b"/upload/" + base64.urlsafe_b64encode(b"k:" + value).rstrip(b"=")
    for sealed in seal_both(sealer, path):
        run = sealed[len(b"/upload/") :]
        assert base64.urlsafe_b64decode(run + b"=" * (-len(run) % 4)) == b"k:" + REF


def test_references_through_layers_are_injected(value):
    values = {NAME: value}
    body = b'{"auth": "Bearer {{secret:github\\/pat}}"}'
    injected, counts = inject(body, values, {NAME}, for_json, "the body")
    assert counts[NAME] == 1 and json.loads(injected) == {"auth": "Bearer " + value.decode()}
    for encoder in (for_url, for_form):
        url, counts = inject(b"/x/%7B%7Bsecret%3Agithub%2Fpat%7D%7D", values, {NAME}, encoder, "the URL path")
        assert counts[NAME] == 1 and unquote_to_bytes(url) == b"/x/" + value
    header, counts = inject(b"token %7b%7bsecret%3agithub%2fpat%7d%7d", {NAME: b"abcdefgh12"}, {NAME}, for_header, "h")
    assert header == b"token abcdefgh12"


def test_a_long_streamed_base64_run_is_transcoded_past_the_bound(sealer, value):
    """Past STREAM_RUN_BOUND, a streamed run is sealed group by group: the reference is
    followed by 0-2 spaces, and everything else decodes as it was."""
    payload = b"a" * 99 + value + b"b" * (STREAM_RUN_BOUND + 1000) + value + b"end"
    text = base64.encodebytes(payload)
    stream = sealer.stream()
    out = b"".join(stream.feed(text[i : i + 65536]) for i in range(0, len(text), 65536)) + stream.feed(b"", final=True)
    decoded = base64.b64decode(out.replace(b"\n", b""))
    assert value not in decoded and stream.counts[NAME] == 2
    assert decoded.replace(REF + b"  ", REF).replace(REF + b" ", REF) == payload.replace(value, REF)


def test_a_long_json_body_is_mapped_back_around_each_value():
    """Past a few kilobytes the JSON view is mapped back in windows: values far apart, escaped, still seal exactly."""
    import json as _json
    import secrets as _secrets

    from keyveil._engine import Sealer as _Sealer

    values = {f"t/v{i}": ("kv" + _secrets.token_urlsafe(24) + '"/\\').encode() for i in range(3)}
    sealer = _Sealer({k: [v] for k, v in values.items()})
    prose = 'a line of "quoted" prose\nwith C:\\path and \u4e2d\u6587\n' * 400
    texts = [prose + v.decode() + prose for v in values.values()]
    for ensure_ascii in (True, False):
        body = _json.dumps({"messages": texts}, ensure_ascii=ensure_ascii).encode().replace(b"/", b"\\/")
        assert len(body) > 50_000
        sealed = sealer.seal(body)
        assert sorted(sealed.counts) == sorted(values)
        want = [prose + "{{secret:" + name + "}}" + prose for name in values]
        assert _json.loads(sealed.data) == {"messages": want}
