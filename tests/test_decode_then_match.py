"""Each encoding class of SPEC §3, as the independent check of issue 8 sent it, sealed in requests and responses.

Every carrier is built with the standard library, and every check decodes
with the standard library: the sealed carrier must decode to exactly the
original plaintext with the value replaced by its reference.
"""

import base64
import binascii
import contextlib
import json
import random
import re
import secrets
import string
from urllib.parse import quote, quote_plus, unquote_to_bytes

import pytest

from keyveil._engine import STREAM_RUN_BOUND, Sealer
from keyveil._inject import for_form, for_header, for_json, for_url, inject
from tests import stdlib_forms as sf
from tests.stdlib_oracle import check_round_trip, split_carrier

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


def _token(rng: random.Random) -> bytes:
    """A GitHub-shaped token of letters and digits (no character any layer escapes), from RNG."""
    return b"ghp_" + bytes(rng.choices(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz0123456789", k=36))


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


# --- `%25`, `%0A` and `\\\\u` escapes that start or join an escape of the next layer ----------------


@pytest.fixture
def plain_value() -> bytes:
    # No `%`, no backslash, no line break: those bytes then matter only as the
    # syntax of a layer below.
    return b"ghp_" + secrets.token_urlsafe(24).encode()


def percent_some(text: str, rng: random.Random, share: float = 0.5) -> str:
    """TEXT with `%` always and any other character at random percent-escaped, in random hex case."""
    out = []
    for ch in text:
        if ch == "%" or rng.random() < share:
            out.append("".join(f"%{b:02X}" if rng.random() < 0.5 else f"%{b:02x}" for b in ch.encode()))
        else:
            out.append(ch)
    return "".join(out)


@pytest.mark.parametrize("seed", range(8))
def test_two_percent_layers_with_the_hex_digits_after_25_escaped(plain_value, seed):
    """`%25%34%31` is `%41` one layer down: the digits after a `%25` may be escaped themselves."""
    rng = random.Random(seed)
    twice = percent_some(percent_some(plain_value.decode(), rng, 1.0), rng).encode()
    assert b"%25%3" in twice or b"%25%4" in twice or b"%25%6" in twice
    for sealed in seal_both(Sealer({NAME: [plain_value]}), b"q=" + twice):
        assert unquote_to_bytes(unquote_to_bytes(sealed)) == b"q=" + REF


@pytest.mark.parametrize("seed", range(8))
def test_json_of_two_percent_layers_with_the_hex_digits_after_25_u_escaped(plain_value, seed):
    """`%25\\u0034\\u0031` in a JSON string: `%2541`, then `%41`, then the character."""
    rng = random.Random(seed)
    twice = quote(percent_some(plain_value.decode(), rng, 1.0), safe="")
    assert "%25" in twice
    escaped = "".join(f"\\u{ord(c):04x}" if c in "0123456789ABCDEFabcdef" and rng.random() < 0.5 else c for c in twice)
    body = b'{"url": "' + escaped.encode() + b'"}'
    for sealed in seal_both(Sealer({NAME: [plain_value]}), body):
        assert unquote_to_bytes(unquote_to_bytes(json.loads(sealed)["url"])) == REF


@pytest.mark.parametrize("seed", range(8))
def test_json_of_json_with_u_escapes_and_no_backslash_in_the_value(plain_value, seed):
    """`\\\\u0067` is `\\u0067` one layer down: an escaped backslash before a `u` escape of a value's character."""
    rng = random.Random(seed)
    inner = '{"token": "' + u_escape(plain_value.decode(), rng, 0.7) + '"}'
    body = json.dumps({"tool_result": inner, "note": "\u2190 \\u2190"}).encode()
    assert b"\\\\u00" in body
    for sealed in seal_both(Sealer({NAME: [plain_value]}), body):
        assert json.loads(json.loads(sealed)["tool_result"]) == {"token": REF.decode()}


@pytest.mark.parametrize("crlf", [False, True])
def test_wrapped_base64_whose_only_escapes_are_its_line_breaks(plain_value, crlf):
    """`quote(encodebytes(...))` of base64 without `+`, `/` or `=`: the `%0A` (or
    `%0D%0A`) between its lines is the only escape, and it joins the lines."""
    rng = random.Random(7)
    while True:
        payload = b"x" * rng.randrange(3, 40) + plain_value + b"y" * rng.randrange(60, 90)
        payload += b"z" * (-len(payload) % 3)
        wrapped = base64.encodebytes(payload)
        if not any(c in wrapped for c in b"+/="):
            break
    if crlf:
        wrapped = wrapped.replace(b"\n", b"\r\n")
    escaped = quote(wrapped, safe="").encode()
    assert b"%0A" in escaped and b"%2" not in escaped and b"%3" not in escaped
    body = b"note=see ``%0a`` in the docs&file=" + escaped
    for sealed in seal_both(Sealer({NAME: [plain_value]}), body):
        head, _, tail = sealed.partition(b"&file=")
        assert head == b"note=see ``%0a`` in the docs"
        decoded = base64.b64decode(unquote_to_bytes(tail))
        assert REF in decoded and plain_value not in decoded


# --- a long base64 run glued to the tail of an escape ------------------------------------------------


def _long_payload(value: bytes) -> bytes:
    # Over SHORT_RUN (512) base64 characters: such a run is not decoded from all four offsets.
    return b"# deploy config\n" + b"REGION=eu-west-1\nRETRIES=3\n" * 14 + b"GITHUB_TOKEN=" + value + b"\n"


@pytest.mark.parametrize(
    "carrier",
    ["percent, after %20", "percent, after %0A", "JSON, after \\n", "JSON, after \\t", "JSON, after \\u2190"],
)
def test_a_long_base64_run_glued_to_the_tail_of_an_escape(plain_value, carrier):
    """`Hello%20<base64>`: the run scan reads the `20` of `%20` (or the `n` of `\\n`,
    the `u2190` of `\\u2190`) as base64 characters. Decoded from its first character
    the payload is shifted; keyveil also decodes it from after the escape's tail."""
    payload = _long_payload(plain_value)
    if carrier.startswith("percent"):  # URL-safe without padding in a URL, standard in JSON
        b64, b64decode = base64.urlsafe_b64encode(payload).rstrip(b"=").decode(), base64.urlsafe_b64decode
    else:
        b64, b64decode = base64.b64encode(payload).decode(), base64.b64decode
    assert len(b64) > 512
    if carrier == "percent, after %20":
        body, read = quote("Hello " + b64).encode(), lambda out: unquote_to_bytes(out).split(b" ", 1)[1]
    elif carrier == "percent, after %0A":
        body, read = quote("See the attached file.\n" + b64).encode(), lambda out: unquote_to_bytes(out).split(b"\n", 1)[1]
    else:
        glue = {"JSON, after \\n": "config:\n", "JSON, after \\t": "a:\t", "JSON, after \\u2190": "\u2190"}[carrier]
        body = json.dumps({"file": glue + b64}).encode()
        read = lambda out: json.loads(out)["file"][len(glue) :].encode()
    for sealed in seal_both(Sealer({NAME: [plain_value]}), body):
        text = read(sealed)
        decoded = b64decode(text + b"=" * (-len(text) % 4))
        assert plain_value not in decoded
        assert decoded == payload.replace(plain_value, REF)


@pytest.mark.parametrize("glue", ["Hello%20", '{"f": "config:\\n', '{"f": "\\u2190', '{"f": "x\\\\'])
def test_a_streamed_run_past_the_bound_glued_to_an_escape(plain_value, glue):
    """Past STREAM_RUN_BOUND a streamed run is transcoded from one offset: after the
    tail of the escape before it (`%20`, `\\n`, `\\u2190`), not through it; after an
    escaped backslash (`x\\\\`) the run starts right there."""
    payload = b"a" * 99 + plain_value + b"b" * (STREAM_RUN_BOUND + 1000) + plain_value + b"end"
    text = glue.encode() + base64.b64encode(payload)
    stream = Sealer({NAME: [plain_value]}).stream()
    out = b"".join(stream.feed(text[i : i + 65536]) for i in range(0, len(text), 65536)) + stream.feed(b"", final=True)
    assert out.startswith(glue.encode())
    decoded = base64.b64decode(out[len(glue) :])
    assert plain_value not in decoded and stream.counts[NAME] == 2
    assert decoded.replace(REF + b"  ", REF).replace(REF + b" ", REF) == payload.replace(plain_value, REF)


# --- line breaks written half escaped ----------------------------------------------------------------


@pytest.mark.parametrize("plain", ["\n", "\r"])
def test_a_wrapped_block_whose_line_breaks_are_half_escaped(plain_value, plain):
    """`quote(block, safe="\\n")` of a CRLF-wrapped base64 block writes each break as
    `%0D` and a plain LF (`safe="\\r"`: a plain CR and `%0A`). The two halves are one
    break, escaped: the block is one run, not lines cut apart at each plain half.
    (It leaked: each line alone is too short to hold the value.)"""
    payload = b"x" * 40 + b"user:" + plain_value + b"y" * 90
    block = base64.encodebytes(payload).replace(b"\n", b"\r\n")
    escaped = quote(block, safe=plain + "/+=").encode()
    assert (b"%0D\n" if plain == "\n" else b"\r%0A") in escaped
    body = b"see the note.\nfile=" + escaped + b"&next=1 a%2Fb"
    for sealed in seal_both(Sealer({NAME: [plain_value]}), body):
        head, _, tail = sealed.partition(b"file=")
        assert head == b"see the note.\n"
        run, _, rest = tail.partition(b"&")
        assert rest == b"next=1 a%2Fb"
        decoded = base64.b64decode(unquote_to_bytes(run))
        assert decoded == payload.replace(plain_value, REF)


def test_base64_with_plus_glued_to_a_json_escape_in_a_form_body(plain_value):
    """A JSON document sent as a form body (`curl -d`), its base64 glued to a `\\n`
    escape and holding `+`: read with `+` as a space the run is cut, read with `+` as
    base64 it is whole and padded, and both readings start after the `n` of `\\n`. The
    whole one is sealed: the `+` and the bits around it decode as they were. (Without
    padding nothing tells the `+` from a space: the form's reading stands.)"""
    rng = random.Random(3)
    while True:  # padded, a `+` in the last groups, the value's last bits beside it
        payload = rng.randbytes(2) + b"Bearer " + plain_value + rng.randbytes(rng.randrange(1, 5))
        b64 = base64.b64encode(payload).decode()
        if b64.endswith("=") and "+" in b64[-8:] and "+" not in b64[:-8]:
            break
    # the content of a JSON string, as a form body: no quotes around it
    body = json.dumps("-----BEGIN PRIVATE KEY-----\n" + b64 + "\n\n-----END PRIVATE KEY-----\n").encode()[1:-1]
    sealed = Sealer({NAME: [plain_value]}).seal(body, plus=True).data
    text = json.loads(b'"' + sealed + b'"')
    head, _, tail = text.partition("\n")
    assert head == "-----BEGIN PRIVATE KEY-----" and tail.endswith("\n\n-----END PRIVATE KEY-----\n")
    decoded = base64.b64decode(tail.partition("\n")[0])
    assert decoded == payload.replace(plain_value, REF)


def test_a_data_url_in_a_path_with_plain_plus_and_escaped_punctuation(plain_value):
    """`quote(data_url, safe="/+;")`: `data%3A…;base64%2C<run>`, the run holding plain `+`.
    No value needs `%3A` or `%2C`, so the only view that decodes them is the one that
    reads `+` as a space (another value holds a space), and there the run is cut at each
    `+`. The run touches `%2C`, yet it is looked at as it stands. (It leaked: seed 27, case 634.)"""
    rng = random.Random(634)
    text = b"".join(rng.choice([b"build ", b"log ", b"again\n", b"says "]) for _ in range(300))
    payload = b""
    for _ in range(64):  # bounded: a `+` in the run is the point of the test
        payload = rng.randbytes(3) + text[:600] + b"user:" + plain_value + b"\n" + text[600:]
        if b"+" in base64.b64encode(payload):
            break
    run = base64.b64encode(payload).rstrip(b"=")
    assert b"+" in run
    path = b"/v1/files/" + quote(b"data:application/octet-stream;base64," + run, safe="/+;").encode()
    assert b"%2C" in path and b"%3A" in path
    sealer = Sealer({NAME: [plain_value], "team/passphrase": [b"correct horse battery staple"]})
    sealed = sealer.seal(path, url=True).data
    head, _, tail = unquote_to_bytes(sealed).partition(b";base64,")
    assert head == b"/v1/files/data:application/octet-stream"
    decoded = base64.b64decode(tail + b"=" * (-len(tail) % 4))
    assert decoded == payload.replace(plain_value, REF)


def test_url_safe_base64_wrapped_after_a_plus_for_a_space():
    """Seed 22, case 763 of the leak corpus (values and carrier from its stdlib generator):
    `quote_plus("blob " + url-safe base64 wrapped at 60, safe="!$*=\\n")` in a WebSocket
    message. The space became a `+` glued to the block's first line, which the standard
    alphabet reads as part of the run; the view that reads `+` as a space found the value,
    and the run, looked at as it stands too, was sealed over it: the text around the value
    did not decode to what it was. A run an escape touches is looked at as it stands only
    where no view found a value, `+` included."""
    from tests.leak_corpus import Oracle, generate, make_values, replay_case

    values = make_values(22)
    case = generate(22, 764, values)[763]
    assert case.location == "body" and case.transport == "ws" and "b64[url,pad,w60" in case.describe()
    assert replay_case(case, Sealer({k: [v] for k, v in values.items()}), Oracle(values)) == []


@pytest.mark.parametrize("prefix", [b"id-", b"_", b"token", b"xy", b"abc", b"blob+", b"Bearer+x", b"abcdefghijklmno"])
def test_a_long_base64_run_behind_glued_base64_characters(plain_value, prefix):
    """Base64 of more than 512 characters behind base64 characters that are not its
    own (`id-`, `token`, `blob+` where `+` was a space): it was decoded from its first
    character only, where a text payload reads as garbage, and the value leaked
    (session-8 attack, 60 of 60; prefixes of 4 characters and more in session 9, 50 of
    61 for `blob+`: the groups of the prefix itself made the right reading look like
    garbage). The head read from each offset, past its first four groups, tells where
    the text starts. Streamed alike."""
    payload = b'{"user":"bot","token":"' + plain_value + b'","blob":"' + b"abcdefgh" * 80 + b'"}'
    run = base64.b64encode(payload).rstrip(b"=")
    data = b"see " + prefix + run + b" end"
    for sealed in seal_both(Sealer({NAME: [plain_value]}), data):
        assert sealed.startswith(b"see " + prefix) and sealed.endswith(b" end")
        got = sealed[len(b"see " + prefix) : -len(b" end")]
        assert base64.b64decode(got + b"=" * (-len(got) % 4)) == payload.replace(plain_value, REF)


def test_a_long_base64_run_after_a_backslash_and_n_in_source_code_in_json(plain_value):
    """Source code holding `\\n` (a backslash and `n`, not an escape) right before a long
    base64 literal, sent in a JSON string: the run starts at the `n` (attack, 37-47 of 60)."""
    payload = b'{"user":"bot","token":"' + plain_value + b'","blob":"' + b"hgfedcba" * 80 + b'"}'
    e = base64.b64encode(payload).decode()
    code = 'const cert = "-----BEGIN DATA-----\\n' + e + '\\n-----END DATA-----";\n'
    body = json.dumps({"name": "write_file", "input": {"path": "cert.js", "content": code}}).encode()
    out = json.loads(Sealer({NAME: [plain_value]}).seal(body).data)["input"]["content"]
    got = out.split("-----BEGIN DATA-----\\n")[1].split("\\n-----END")[0]
    assert base64.b64decode(got) == payload.replace(plain_value, REF)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
@pytest.mark.parametrize("width", [12, 16, 20, 32])
def test_percent_encoded_wrapped_base64_in_a_path_between_a_prefix_and_a_suffix(newline, width):
    """`/api/items/<block>/details?x=1`: base64 wrapped at WIDTH, unpadded, percent-encoded
    whole by `quote(safe="")`, the path's prefix glued to its first line and `/details` to
    its last. A block of one full line between them was not read as one (its last line,
    with the suffix, is longer than the block's), and the value leaked (session-8 attack:
    about 100 of 1,500). Left to the corpus: padding, lower-case escapes, other safe sets."""
    rng = random.Random(width)
    for _ in range(40):
        value = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(rng.randint(16, 48))).encode()
        e = base64.b64encode(rng.randbytes(rng.randint(0, 6)) + value + rng.randbytes(rng.randint(0, 6))).rstrip(b"=")
        block = newline.join(e[i : i + width] for i in range(0, len(e), width))
        path = b"/api/items/" + quote(block, safe="").encode() + b"/details?x=1"
        sealed = Sealer({NAME: [value]}).seal(path, url=True).data
        text = unquote_to_bytes(sealed)
        assert value not in text
        assert text.startswith(b"/api/items/")
        inner = b"".join(text[len(b"/api/items/") :].partition(b"?")[0].split())
        for cut in range(len(inner), 0, -1):  # the block is what decodes; the suffix is text
            with contextlib.suppress(binascii.Error):
                if value in base64.b64decode(inner[:cut] + b"=" * (-cut % 4)):
                    raise AssertionError("the value is recoverable from the sealed path")


def test_lf_wrapped_base64_after_an_escaped_line_break(plain_value):
    """`note.%0A` and then a block wrapped with plain LFs (`base64.encodebytes`), in a
    buffer with another escape that matters: the layer above escaped one break and
    left the block's own plain. The block is one block all the same. (It leaked: read
    as lines ended at each plain break, none of them long enough for the value.)"""
    payload = b"x" * 40 + b"user:" + plain_value + b"y" * 90
    body = b"note.%0A" + base64.encodebytes(payload) + b" a%2Fb"
    for sealed in seal_both(Sealer({NAME: [plain_value]}), body):
        text = unquote_to_bytes(sealed)
        head, _, rest = text.partition(b"\n")
        block, _, tail = rest.rpartition(b"\n")
        assert head == b"note." and tail == b" a/b"
        lines = block.split(b"\n")
        assert all(len(line) == 76 for line in lines[:-1]) and len(lines[-1]) <= 76
        assert base64.b64decode(block) == payload.replace(plain_value, REF)


@pytest.mark.parametrize("after", [b" a%2Fb", b"%20end"])
def test_a_literal_percent_before_base64_that_starts_with_two_hex_digits(plain_value, after):
    """`100%` and then base64 whose first two characters are hex digits (`12do…`): the
    percent view reads `%12` as an escape and decodes the run two characters late,
    so the run is looked at as it stands too. (It leaked, one payload in five.)"""
    rng = random.Random(12)
    payloads = []
    while len(payloads) < 16:
        payload = rng.randbytes(1) + plain_value + rng.randbytes(rng.randrange(0, 20))
        if re.fullmatch(rb"[0-9A-Fa-f]{2}", base64.b64encode(payload)[:2]):
            payloads.append(payload)
    for payload in payloads:
        body = b"done: 100%" + base64.b64encode(payload) + after
        for sealed in seal_both(Sealer({NAME: [plain_value]}), body):
            assert sealed.startswith(b"done: 100%") and sealed.endswith(after)
            run = sealed[len(b"done: 100%") : len(sealed) - len(after)]
            assert base64.b64decode(run) == payload.replace(plain_value, REF)


@pytest.mark.parametrize("glued", [b"/", b"/details", b"+x"])
def test_a_wrapped_block_whose_last_line_has_text_glued_to_it(plain_value, glued):
    """Two 76-character lines and `/details` right after them: the last line is longer
    than the block's. Its first 76 characters are the block's in another reading, looked
    at when the usual one (one line, then a line of its own) finds nothing. (It leaked
    in every such two-line block: found by the session-7 attack.)"""
    rng = random.Random(76)
    for _ in range(12):
        payload = b'{"user":"bot","token":"' + plain_value + b'","note":"' + rng.randbytes(60) + b'"}'
        encoded = base64.b64encode(payload[:114])  # two full lines, no padding
        block = encoded[:76] + b"\n" + encoded[76:]
        body = b"blob: " + block + glued + b" end"
        for sealed in seal_both(Sealer({NAME: [plain_value]}), body):
            assert sealed.startswith(b"blob: ") and sealed.endswith(glued + b" end")
            run = sealed[len(b"blob: ") : len(sealed) - len(glued + b" end")]
            assert base64.b64decode(run.replace(b"\n", b"")) == payload[:114].replace(plain_value, REF)


@pytest.mark.parametrize("escape", [b"%2520", b"%2525", b"%2526state%253Dx", b"%252F", b"%253D"])
def test_base64_glued_to_a_doubly_percent_encoded_escape(plain_value, escape):
    """Plain base64 followed by `%2520` (text percent-encoded twice): the views decode
    the escapes, and no longer read the run as it was. The run as it stands is looked
    at too. (It leaked, 8 runs in 600.) Where the escape decodes, two layers down, to a
    base64 character (`%252F` is `/`, `%253D` is `=`), the views' reading of it as part
    of the run may win: the value is sealed, the round trip is not exact (open,
    docs/encodings.md)."""
    rng = random.Random(5)
    for _ in range(40):
        payload = rng.randbytes(rng.randint(0, 8)) + plain_value + rng.randbytes(rng.randint(0, 8))
        run = base64.b64encode(payload).rstrip(b"=")
        body = b"text " + run + escape
        for sealed in seal_both(Sealer({NAME: [plain_value]}), body):
            assert sealed.startswith(b"text ")
            for reading in (sealed, unquote_to_bytes(unquote_to_bytes(sealed))):
                chars = re.match(rb"text ([A-Za-z0-9+/]*)", reading).group(1)
                for cut in range(4):
                    piece = chars[: len(chars) - cut]
                    with contextlib.suppress(binascii.Error):
                        assert plain_value not in base64.b64decode(piece + b"=" * (-len(piece) % 4))
            if escape in (b"%252F", b"%253D"):
                continue
            out = sealed[len(b"text ") : len(sealed) - len(escape)]
            assert sealed.endswith(escape)
            assert base64.b64decode(out + b"=" * (-len(out) % 4)) == payload.replace(plain_value, REF)


@pytest.mark.parametrize("before", [b'{"a":"%20%2F","b":"link%3d', b"see %2F then x%3d", b"q=%2F&r=%3d"])
def test_a_reference_in_a_percent_layer_has_one_hex_case_however_the_stream_is_cut(before):
    """A percent-encoded value whose own span holds no hex letter (`pass+word+…`), in a text
    with escapes of both cases around it: the reference's escapes took the buffer's usual
    case, and a stream sees only part of the buffer (session-8 attack: about half of all
    two-chunk cuts differed from the whole seal). The span's own case, or upper, now."""
    value = b"pass word " + secrets.token_hex(8).encode()
    data = before + quote_plus(value.decode()).encode() + b'&x=y"}'
    sealer = Sealer({NAME: [value]})
    whole = sealer.seal(data).data
    assert whole != data and value not in unquote_to_bytes(whole.replace(b"+", b" "))
    for cut in range(1, len(data)):
        stream = sealer.stream()
        assert stream.feed(data[:cut]) + stream.feed(data[cut:]) + stream.feed(b"", final=True) == whole, cut


@pytest.mark.parametrize("after", [b"User-Agent: curl/8.5.0", b"Accept: */*", b"--boundary42"])
def test_a_line_after_a_base64_line_that_opens_text_is_not_its_last_line(after):
    """A base64 line that needs no padding, then a header (`User-Agent: curl`) or a MIME
    boundary (`--boundary42`) on the next line: that line was read as the block's last
    line and re-encoded with it, destroying the header or the multipart body's boundary
    (session-8 attack: 198 of 200, 72 of 100). A name before a colon, and a line opening
    with `--`, open text."""
    value = secrets.token_urlsafe(24).encode()
    payload = b'{"token":"' + value + b'"}'
    payload += b" " * (-len(payload) % 3)  # no padding: nothing marks where the base64 ends
    e = base64.b64encode(payload)
    assert not e.endswith(b"=")
    data = b"Content-Transfer-Encoding: base64\r\n\r\n" + e + b"\r\n" + after + b"\r\n"
    sealed = Sealer({NAME: [value]}).seal(data).data
    lines = sealed.split(b"\r\n")
    assert lines[3] == after, lines
    assert base64.b64decode(lines[2]) == payload.replace(value, REF)


@pytest.mark.parametrize("lead", ["blob+", "blob%20"])
def test_a_plain_plus_is_a_space_where_the_layer_escaped_base64s_own(plain_value, lead):
    """`quote_plus("blob " + base64 + " end")` inside a JSON string: base64's own `+`
    became `%2B`, the spaces plain `+`. Read with `+` as a base64 character, the run
    went on into `+end` and was re-encoded with it, so the form-decoded text lost its
    ` end` (seed 2250711808, case 18272, where the first space was written `%20`). A
    writer that escapes base64's `+` writes a space as `+`: the run ends at the plain one."""
    rng = random.Random(18272)
    tried = 0
    for _ in range(200):
        words = b"".join(rng.choice([b"the ", b"build ", b"env\n", b"says "]) for _ in range(rng.randint(5, 200)))
        payload = words + b"note: " + plain_value + b"\n" + rng.randbytes(rng.randint(30, 90))
        run = base64.b64encode(payload)
        if b"+" not in run or run.endswith(b"="):
            continue  # the shape: base64's own `+` escaped, no padding to end the run
        tried += 1
        text = lead + quote_plus(run + b" end")
        data = b'{"q": "' + text.encode() + b'"}'
        # Another value holds a space: `+` is read as one too, where it was written plainly.
        sealed = Sealer({NAME: [plain_value], "x/words": [b"two words " + plain_value[::-1]]}).seal(data).data
        inner = json.loads(sealed)["q"]
        decoded = unquote_to_bytes(inner.replace("+", " "))
        assert decoded.startswith(b"blob ") and decoded.endswith(b" end")
        assert base64.b64decode(decoded[5:-4]) == payload.replace(plain_value, REF)
    assert tried >= 20


@pytest.mark.parametrize("width", [0, 60, 76, "whole groups"])
def test_a_short_line_that_text_goes_on_after_is_not_a_blocks_last_line(plain_value, width):
    """A base64 run, then a line break and `ok here again`: `ok` is base64, and was read
    as the run's last line and re-encoded with it, so the text after the run lost its
    line break (seed 2250711808, case 19980; seed 3, case 1459). A run that ends part
    way into a group is not a full line of a wrapped block (wrappers write multiples of
    four), and a word that text goes on after on the same line is text; so is one after
    a run of whole groups, where the run and the word together could not end an
    encoding (`…fJF6` then `ok`). Otherwise, and after two full lines, such a line is
    the block's last (`blob <base64> end`). Streamed alike."""
    rng = random.Random(f"19980{width}")
    whole = width == "whole groups"
    for word in (b"ok", b"Hi", b"no", b"Thanks") if whole else (b"ok", b"Hi", b"no", b"fine", b"Thanks"):
        payload = b"user: " + plain_value + b"\n" + rng.randbytes(rng.randint(40, 200))
        if whole:
            payload += b"." * (-len(payload) % 3)  # whole groups: no padding either way
        else:
            payload += b"." * (len(payload) % 3 == 0)  # unpadded, the run ends part way into a group
        run = base64.b64encode(payload).rstrip(b"=")
        if width and not whole:
            run = b"\n".join(run[i : i + width] for i in range(0, len(run), width))
        after = b"\n" + word + b" here again\n"
        data = b"data:application/octet-stream;base64," + run + after
        for sealed in seal_both(Sealer({NAME: [plain_value]}), data):
            assert sealed.endswith(after), word
            got = sealed[len(b"data:application/octet-stream;base64,") : -len(after)].replace(b"\n", b"")
            assert base64.b64decode(got + b"=" * (-len(got) % 4)) == payload.replace(plain_value, REF)


@pytest.mark.parametrize("first", [18, 30, 50, 57])
@pytest.mark.parametrize("where", ["first line", "across", "below"])
def test_a_first_line_a_label_shares_is_the_blocks_first_line(plain_value, first, where):
    """`X-Blob: ` and FIRST characters, then 64-column lines: the wrapper wrapped the
    whole line, label included. The short line was a run of its own and the block
    below it another, decoded from its own first character: a value across the break
    or, in a long binary payload, anywhere below it leaked (session-8 attack, 63 of
    80). The line and the block are one run; re-encoded with the same layout."""
    rng = random.Random(f"{first}{where}")
    lead = {"first line": 0, "across": max(0, first * 3 // 4 - 10), "below": 400}[where]
    payload = rng.randbytes(lead) + plain_value + rng.randbytes(1000)
    text = base64.b64encode(payload)
    lines = [text[:first]] + [text[i : i + 64] for i in range(first, len(text), 64)]
    head, tail = b"GET / HTTP/1.1\nX-Blob: ", b"\nHost: example.test\n"
    data = head + b"\n".join(lines) + tail
    for sealed in seal_both(Sealer({NAME: [plain_value]}), data):
        assert sealed.startswith(head) and sealed.endswith(tail)
        got = sealed[len(head) : -len(tail)].split(b"\n")
        assert len(got[0]) == first and all(len(line) == 64 for line in got[1:-1])
        assert base64.b64decode(b"".join(got)) == payload.replace(plain_value, REF)


@pytest.mark.parametrize("brk", ["\n", "\r", "\t", "\r\n"])
def test_a_value_holding_a_line_break_or_tab_in_json_inside_json(brk):
    """A value holding a line break or a tab, in a JSON string inside a JSON string
    (a tool call's `arguments`), one and two layers further: `\\n` became `\\\\n`, which
    neither the one-layer literal of its neighbours nor the `\\\\` pattern called a JSON
    view for (session-9 attack: TAB 111 of 111, LF 61 of 103). Streamed alike."""
    rng = random.Random(brk)
    for _ in range(30):
        chars = [rng.choice(string.ascii_letters + string.digits + "/+-_=.:@") for _ in range(rng.randint(20, 48))]
        chars.insert(rng.randint(3, len(chars) - 3), brk)
        value = "".join(chars)
        sealer = Sealer({NAME: [value.encode()]})
        inner = json.dumps({"token": "tok " + value})
        outer = json.dumps({"cfg": inner})
        third = json.dumps({"x": outer})
        for data, decode in (
            (outer, lambda o: json.loads(json.loads(o)["cfg"])["token"]),
            (third, lambda o: json.loads(json.loads(json.loads(o)["x"])["cfg"])["token"]),
        ):
            for sealed in seal_both(sealer, data.encode()):
                assert decode(sealed) == "tok " + REF.decode()


@pytest.mark.parametrize("carrier", ["raw", "json", "percent", "path"])
def test_a_glued_prefix_before_a_block_that_mixes_lf_and_crlf(plain_value, carrier):
    """Characters glued before the first line of a block wrapped at 12-32 columns whose
    line breaks mix LF and CRLF (`tok` + block; `/v1/files/` before percent-encoded
    base64 in a path): the longer first line was taken for a glued prefix only where
    the two line breaks after it were alike, and the value leaked (session-9 attack,
    103 of 200 in a path, 130 of 300 in bodies). Mixed breaks count as one block's, as
    everywhere else."""
    rng = random.Random(carrier)
    for _ in range(40):
        payload = b"export TOKEN=" + plain_value + b"\nok"
        glue = rng.choice([b"tok", b"x", b"id-", b"Zm9v", b"ab", b"/v1/files/"])
        width = rng.choice([12, 13, 16, 20, 24, 32])
        text = base64.b64encode(payload)
        lines = [text[i : i + width] for i in range(0, len(text), width)]
        block = glue + b"".join(line + rng.choice([b"\n", b"\r\n"]) for line in lines[:-1]) + lines[-1]
        if carrier == "raw":
            data, unwrap = block, lambda o: o
        elif carrier == "json":
            data, unwrap = json.dumps({"content": block.decode()}).encode(), lambda o: json.loads(o)["content"].encode()
        elif carrier == "percent":
            data, unwrap = quote(block, safe="").encode(), unquote_to_bytes
        else:
            data = b"/upload/" + quote(block, safe="").encode() + b".json"
            unwrap = lambda o: unquote_to_bytes(o[len(b"/upload/") : -len(b".json")])  # noqa: E731
        sealed = Sealer({NAME: [plain_value]}).seal(data, url=carrier == "path").data
        inner = unwrap(sealed)
        assert inner.startswith(glue)
        got = inner[len(glue) :].replace(b"\r", b"").replace(b"\n", b"")
        assert base64.b64decode(got + b"=" * (-len(got) % 4)) == payload.replace(plain_value, REF)


def test_a_percent_layer_read_over_a_json_string_writes_no_backslash(plain_value):
    """A JSON string (the value's `/` as `\\/`), percent-encoded, in a JSON body whose
    letters are `\\u`-escaped: read as percent over the body's own JSON, the span held
    plain backslashes (the body's escapes), so the percent layer kept `\\` plain and wrote
    `github\\%2Fpat`, which is no JSON (session-9 attack, 200 of 200). A percent layer
    escapes `\\` where its span escaped one (the plain ones are the JSON's own)."""
    value = plain_value[:10] + b"/" + plain_value[10:]
    inner = json.dumps(("key " + value.decode() + " ok"))[1:-1].replace("/", "\\/")
    text = quote(inner, safe="")
    lettered = "".join("\\u%04x" % ord(c) if c.isalpha() and c not in "abcdefABCDEF" else c for c in text)
    sealed = Sealer({NAME: [value]}).seal(('{"text":"' + lettered + '"}').encode()).data
    decoded = json.loads('"' + unquote_to_bytes(json.loads(sealed)["text"]).decode() + '"')
    assert decoded == "key " + REF.decode() + " ok"


@pytest.mark.parametrize("escaped", ["a hex digit", "the percent sign"])
def test_a_percent_escape_written_partly_as_a_json_escape(value, escaped):
    """Every byte percent-encoded, in a JSON string that writes some `%` or hex digits
    of the value's escapes as `\\u00XX` (`%6\\u0032`, `\\u00256E`). The reading JSON,
    then percent found the value; so did percent over the raw JSON, then JSON, then
    percent again, which wrote the reference percent-encoded once more (`%257B`) and
    won for its span (session-9 attack: 213 and 259 of 300). Of two readings of one
    value's bytes, the one through fewer layers is taken."""
    rng = random.Random(escaped)
    sealer = Sealer({NAME: [value]})
    plain = b"note: " + value + b" end"
    for _ in range(40):
        out = []
        for j, ch in enumerate("".join("%%%02X" % c for c in plain)):
            in_value = 18 <= j < (6 + len(value)) * 3
            pick = ch == "%" if escaped == "the percent sign" else ch != "%"
            out.append("\\u%04x" % ord(ch) if in_value and pick and rng.random() < 0.15 else ch)
        sealed = sealer.seal(('{"prompt":"' + "".join(out) + '"}').encode()).data
        assert unquote_to_bytes(json.loads(sealed)["prompt"]) == plain.replace(value, REF)



def test_percent_encoded_text_in_a_json_string_whose_slashes_are_escaped():
    """Percent-encoded text (random safe sets, `/` often plain), then a JSON string that
    may write `/` as `\\/`; the value holds a backslash before a space or a letter. Read
    percent first, then JSON, the view finds the value too: the `\\/` is a JSON escape
    there, the value's `%5C` a backslash that starts no escape. That reading wrote the
    reference's `/` as `%5C/` (JSON inside percent), which the client's order decodes to
    `\\/` (random seed 1118329944, cases 3126 and 13260). A reading over a backslash that
    starts no escape gives way to one that reads every escape."""
    rng = random.Random("pct-then-json")
    failures = []
    for _ in range(400):
        core = "".join(rng.choices(string.ascii_letters + string.digits, k=16))
        value = (core[:6] + "\\" + rng.choice(" qZ.") + core[6:] + rng.choice((" /+=%", "/x", " <a&b> /"))).encode()
        form = sf.make_form(value, ("pct", "json"), rng, name="corpus/punct")
        data = form.in_carrier()
        sealed = Sealer({"corpus/punct": [value]}).seal(data).data
        span = split_carrier(sealed, *form.carrier)
        problems = ["the carrier changed"] if span is None else check_round_trip(form, span, b"{{secret:corpus/punct}}")
        failures += [f"{p}: {form.describe()}" for p in problems]
    assert not failures, f"{len(failures)} of 400:\n" + "\n".join(failures[:8])


@pytest.mark.parametrize("width", [24, 64, 76])
@pytest.mark.parametrize("eol", ["\n", "\r\n", "\\n"])
def test_a_wrapped_block_with_plain_plus_in_a_form_body(width, eol):
    """A form body (`note=<block>&b=2`) whose client left a wrapped base64 block as it
    was: its `+` are base64's, though a form's `+` is a space. The reading with `+` as a
    space cut the block at its first `+` and sealed what lay before it, re-encoded,
    joined to the rest (random seeds 12, case 363, and 29, case 497). Read with `+` as
    base64 the block ends on a group's end; the space reading cut part way into a
    group, or inside a line the block goes on below, or at the end of a line whose
    next line starts with the `+`: then the block is sealed whole. Left out, because
    either reading is as likely: a first `+` on the last line after whole groups. With
    the line breaks JSON escapes (`\\n`: a JSON string sent as a form), the JSON view
    reads the block whole: a line the escape ends is no run of its own (random-seed
    soak 596597952, case 11604)."""
    rng = random.Random(f"{width}{eol!r}")
    value = _token(rng)
    sealer = Sealer({NAME: [value]})
    checked = 0
    for _ in range(300):
        payload = rng.randbytes(rng.randrange(0, 20)) + value + rng.randbytes(rng.randrange(1, 40))
        flat = base64.b64encode(payload).decode()
        cut = flat.find("+")
        lines = [flat[i : i + width] for i in range(0, len(flat), width)]
        last = (len(lines) - 1) * width
        if cut == -1 or (cut > last and cut % 4 == 0):
            continue
        checked += 1
        body = ("a=1&note=" + eol.join(lines) + "&b=2").encode()
        sealed = sealer.seal(body, plus=True).data
        assert sealed.startswith(b"a=1&note=") and sealed.endswith(b"&b=2")
        block = sealed[9:-4].decode()
        assert "%" not in block, "the block's + were written as the client wrote them"
        got = block.split(eol)
        assert all(len(line) == width for line in got[:-1]) and 0 < len(got[-1]) <= width, got
        assert base64.b64decode("".join(got), validate=True) == payload.replace(value, REF)
    assert checked > 80


@pytest.mark.parametrize("tail", ["junk", "text"])
def test_unpadded_base64_with_plain_plus_in_a_query(tail):
    """`?q=<base64>` that a client wrote unpadded and left as it was: its `+` are base64's,
    though a query's `+` is a space (random-seed soak 596597952, cases 13656 and 7958). A
    run of a length base64 can have whose first `+` stands one character into a group
    (`…5T+o`: the space reading ends the text before it where no base64 ends), or two into
    it or three with text encoded after that group, is sealed whole. Checked by decoding the
    query's raw value with the standard library."""
    rng = random.Random(tail)
    value = _token(rng)
    sealer = Sealer({NAME: [value]})
    checked = 0
    for _ in range(6000):
        after = rng.randbytes(rng.randrange(1, 6))
        if tail == "text":
            after += "".join(rng.choice(["\nhere ok ", "the log ", "deploy env "]) for _ in range(rng.randrange(3, 12))).encode()
        payload = rng.randbytes(rng.randrange(0, 4)) + value + after
        flat = base64.b64encode(payload).decode().rstrip("=")
        cut = flat.find("+")
        if cut == -1 or len(flat) % 4 == 0 or cut % 4 == 0 or len(flat) - cut <= 4:
            continue
        if tail == "junk" and cut % 4 != 1:
            continue  # two or three into a group, junk after: either reading is as likely
        checked += 1
        query = f"a=1&q={flat}&b=2".encode()
        sealed = sealer.seal(query, url=True, plus=True).data
        assert sealed.startswith(b"a=1&q=") and sealed.endswith(b"&b=2"), sealed
        got = sealed[6:-4]
        assert b"%" not in got, "the run's + are written as the client wrote them"
        assert base64.b64decode(got + b"=" * (-len(got) % 4), validate=True) == payload.replace(value, REF)
    assert checked > 30


@pytest.mark.parametrize("escape", ["%2c", "%2C", "%3A", "%20"])
def test_one_line_of_base64_glued_to_an_escape_and_a_word_on_the_next_line(escape):
    """`…;base64%2c<one line of base64>\nlog env log` (a data URL written percent-encoded,
    then text): read raw, the line starts with the escape's tail (`2c`) and is one
    character past a group, so it could not end a base64 text and the word below was
    taken as its last line (random-seed soak 400042423, case 15342). The line is judged
    from after the escape's tail too: the word stays text. Checked with the standard
    library: the text percent-decoded, the line base64-decoded."""
    rng = random.Random(escape)
    value = _token(rng)
    sealer = Sealer({NAME: [value]})
    checked = 0
    for _ in range(300):
        payload = rng.randbytes(rng.randrange(0, 4)) + b"token: " + value + rng.randbytes(rng.randrange(0, 3))
        line = base64.urlsafe_b64encode(payload).decode().rstrip("=")
        if len(line) % 4 == 0:
            continue  # a line that ends on a group's end ends the text as it stands: not this case
        word = rng.choice(["log", "env", "the", "says", "here", "fix"])
        after = f"\n{word} {rng.choice(['env log', 'please', 'ok'])}\r\n"
        data = f"TOKEN=data:application/octet-stream;base64{escape}{line}{after}".encode()
        sealed = sealer.seal(data).data
        checked += 1
        text = unquote_to_bytes(sealed)
        head, sep, rest = text.partition(b";base64" + unquote_to_bytes(escape))
        assert head == b"TOKEN=data:application/octet-stream" and sep, sealed
        got_line, _, tail = rest.partition(b"\n")
        assert b"\n" + tail == after.encode(), (data, sealed)
        assert base64.urlsafe_b64decode(got_line + b"=" * (-len(got_line) % 4)) == payload.replace(value, REF)
    assert checked > 150


def test_unpadded_base64_then_words_written_with_plus_in_a_query():
    """The guard for the rule above: `quote_plus("<base64> more words")`, base64 that holds
    no `+` of its own and ends two or three characters into a group, then words for which
    `+` is a space. The words decode to no text as base64: the space reading stands, and
    the words stay as they were. Left out: base64 and words that together end on a group's
    end, which the older rule for forms reads whole (docs/encodings.md, open cases)."""
    rng = random.Random(11)
    value = _token(rng)
    sealer = Sealer({NAME: [value]})
    checked = 0
    for _ in range(400):
        payload = rng.randbytes(rng.randrange(0, 4)) + value + rng.randbytes(rng.randrange(0, 6))
        flat = base64.b64encode(payload).decode().rstrip("=")
        if "+" in flat or len(flat) % 4 in (0, 1):
            continue
        words = " ".join(rng.choice(["please", "deploy", "the", "log", "again"]) for _ in range(rng.randrange(1, 5)))
        if (len(flat) + 1 + len(words)) % 4 == 0:
            continue
        checked += 1
        query = ("q=" + quote_plus(f"{flat} {words}", safe="/")).encode()
        sealed = sealer.seal(query, url=True, plus=True).data
        text = unquote_to_bytes(sealed[2:].replace(b"+", b" "))
        head, _, rest = text.partition(b" ")
        assert rest == words.encode(), (query, sealed)
        assert base64.b64decode(head + b"=" * (-len(head) % 4)) == payload.replace(value, REF)
    assert checked > 100


def test_padded_base64_in_a_header_whose_writer_escaped_some_of_its_plusses():
    """A cookie holding padded base64, percent-encoded by a writer that may leave `+`
    as it is but escaped some characters it may leave anyway (`…8J%2BUkXr+MQ%3D%3D`):
    a plain `+` beside a `%2B` is then no space. Read from its own first character the
    run ends in padding, so it is one text to its end and is sealed whole (random-seed
    soak 596597952, case 15292: the reading between plain `+` ended part way into a
    group and left `+MQ==` behind). Checked with the standard library."""
    rng = random.Random(15292)
    value = b"kv_" + bytes(rng.choices(b"abcdefghijkmnpqrstuvwxyzABCDEFGH23456789", k=28))
    sealer = Sealer({NAME: [value]})
    checked = 0
    for _ in range(30000):
        payload = rng.randbytes(rng.randrange(0, 8)) + value + rng.randbytes(rng.randrange(1, 12))
        text = base64.b64encode(payload).decode()
        if not text.endswith("=") or text.count("+") < 2:
            continue
        written = "".join(
            quote(c, safe="") if (c not in "+/" or rng.random() < 0.4) and rng.random() < 0.5 else c for c in text
        )
        if "%2B" not in written or "+" not in written:
            continue
        checked += 1
        header = f"theme=dark; session={written}; path=/".encode()
        sealed = sealer.seal(header).data
        assert sealed.startswith(b"theme=dark; session=") and sealed.endswith(b"; path=/"), sealed
        got = unquote_to_bytes(sealed[len(b"theme=dark; session=") : -len(b"; path=/")])
        assert base64.b64decode(got, validate=True) == payload.replace(value, REF), (header, sealed)
    assert checked > 40


def test_wrapped_base64_after_a_word_percent_encoded_with_plus_for_space_in_a_header():
    """`Basic <base64 wrapped in lines>` percent-encoded with `+` for a space (quote_plus: random
    safe sets, each escape's hex in either case) in a header, where a value holds a space (so `+`
    may be a space outside a form too). Read as percent-encoding with `+` for a space, once, the
    run is sealed and its padding written as that layer writes it; the reading that took the
    bytes as percent-encoded twice (`+` for a space one layer down) wrote `%253D` and gave way to
    no one, for lifting did not mark its guess (random-seed soak 183517992, case 11104). Checked
    with the standard library. Left out: CRLF line breaks, and a `+` of the base64 left plain
    (quote_plus always escapes it)."""
    rng = random.Random(11104)
    value = _token(rng)
    sealer = Sealer({NAME: [value], "corpus/words": [b"two words here"]})
    checked = 0
    for _ in range(400):
        payload = rng.randbytes(rng.randrange(0, 6)) + b"user:" + value + rng.randbytes(rng.randrange(0, 6))
        urlsafe = rng.random() < 0.5
        text = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(payload).decode()
        width = rng.choice([20, 25, 40, 60, 76])
        block = "\n".join(text[i : i + width] for i in range(0, len(text), width))
        written = quote_plus("Basic " + block, safe=rng.choice(["", "/", "=", "/:!$';?=", "~"]))
        written = re.sub(r"%[0-9A-F]{2}", lambda m: m.group() if rng.random() < 0.5 else m.group().lower(), written)
        sealed = sealer.seal(b"Bearer " + written.encode()).data
        assert sealed.startswith(b"Bearer "), sealed
        decoded = unquote_to_bytes(sealed[len(b"Bearer ") :].replace(b"+", b" "))
        assert decoded.startswith(b"Basic "), (written, sealed)
        run = decoded[len(b"Basic ") :].replace(b"\n", b"")
        run += b"=" * (-len(run) % 4)  # a run the writer did not pad (its length was a multiple of 4) is not padded
        got = base64.b64decode(run, altchars=b"-_" if urlsafe else None, validate=True)
        assert got == payload.replace(value, REF), (written, sealed)
        checked += text.endswith("=")
    assert checked > 100


def test_a_wrapped_block_after_a_word_glued_by_plus_keeps_its_lines():
    """`blob <block> end` with the block wrapped at a width, percent-encoded with `+` for a space
    and its line breaks (quote_plus, random safe sets): `blob+` glued to the first line made it
    longer than the others, so the run read with `+` as itself ended a line early, and the pieces
    between `+` were taken from that run only: the block's last line was left out of the
    re-encoding, which broke its width (random-seed soak 77234259, case 2509). The pieces are
    now read to the end of the block. Checked with the standard library: the text around it,
    the payload, and every line but the last as wide as before."""
    rng = random.Random(2509)
    value = _token(rng)
    sealer = Sealer({NAME: [value], "corpus/words": [b"two words here"]})
    checked = 0
    for _ in range(300):
        payload = rng.randbytes(rng.randrange(0, 6)) + value + rng.randbytes(rng.randrange(1, 30))
        text = base64.urlsafe_b64encode(payload).decode() if rng.random() < 0.5 else base64.b64encode(payload).decode()
        width = rng.choice([16, 20, 24, 32])
        lines = [text[i : i + width] for i in range(0, len(text), width)]
        if len(lines) < 3:
            continue
        written = quote_plus("blob " + "\n".join(lines) + "\n end", safe=rng.choice(["", "/", "/@!'(*,=", "="]))
        sealed = sealer.seal(written.encode()).data
        decoded = unquote_to_bytes(sealed.replace(b"+", b" "))
        assert decoded.startswith(b"blob ") and decoded.endswith(b"\n end"), (written, sealed)
        block = decoded[len(b"blob ") : -len(b"\n end")].split(b"\n")
        assert all(len(line) == width for line in block[:-1]) and len(block[-1]) <= width, (written, sealed)
        run = b"".join(block)
        run += b"=" * (-len(run) % 4)
        std = run.translate(bytes.maketrans(b"-_", b"+/"))  # either alphabet (a block never mixes them)
        assert base64.b64decode(std, validate=True) == payload.replace(value, REF), (written, sealed)
        checked += 1
    assert checked > 100


def test_base64_ending_in_plus_and_a_character_from_a_writer_that_escapes_some_plusses():
    """`blob <base64>\\n end` percent-encoded by a writer that may leave `+` but escapes some
    characters anyway (one `+` as `%2B`, another plain), the base64 unpadded and ending in
    `+` and one character (`…ei+t`). Read from its first character it is whole groups; the
    pieces between plain `+` cut it part way into one, and the last bytes were lost
    (random-seed soak 77234259, case 16076). Checked with the standard library. Left out:
    padded base64, a line-wrapped block, and `+` written as `%2b` (lower case)."""
    rng = random.Random(16076)
    value = _token(rng)
    sealer = Sealer({NAME: [value], "corpus/words": [b"two words here"]})
    checked = 0
    for _ in range(60000):
        payload = rng.randbytes(rng.randrange(0, 4)) + value + rng.randbytes(3 * rng.randrange(1, 4))
        payload = payload[: len(payload) - len(payload) % 3]  # whole groups: no padding (the value is kept)
        text = base64.b64encode(payload).decode()
        others = [i for i, c in enumerate(text[:-2]) if c == "+"]
        if text[-2] != "+" or not others:
            continue
        escape_at = rng.choice(others)
        written = "".join(
            "%2B" if i == escape_at else (quote(c, safe="") if c != "+" and rng.random() < 0.35 else c)
            for i, c in enumerate(text)
        )
        header = f"blob%20{written}%0A%20end".encode()
        sealed = sealer.seal(header).data
        decoded = unquote_to_bytes(sealed)
        assert decoded.startswith(b"blob ") and decoded.endswith(b"\n end"), (header, sealed)
        run = decoded[len(b"blob ") : -len(b"\n end")]
        run += b"=" * (-len(run) % 4)
        assert base64.b64decode(run, validate=True) == payload.replace(value, REF), (header, sealed)
        checked += 1
    assert checked > 20


def test_a_wrapped_block_with_plus_inside_a_group_outside_a_form_is_read_with_plus_as_base64():
    """Random-seed soak 325343615, case 10805 (values and carrier from its stdlib generator):
    a path holding URL-safe base64 of `Basic ` and MIME base64 of five random bytes and
    `export GITHUB_TOKEN=<value>` whose last characters are on a short last line (`egri`),
    a `+` of the block part way into its second group. Outside a query or form, the reading
    with `+` as a space is a guess; it found the value (its run joins the last line) and the
    block read with `+` as base64's, an alternative reading of the same lines, was not looked
    at: the re-encoded run lost its last line and wrote `%3D` padding inside base64. That
    reading now takes the guess's place when _plus_is_base64 says its `+` are base64's.
    (A generator built here from the standard library did not meet the case in 300,000
    draws: it needs the guess to find the value while the first line alone does not.)"""
    from tests.leak_corpus import Oracle, generate, make_values, replay_case

    values = make_values(325343615)
    case = generate(325343615, 10806, values)[10805]
    assert case.location == "path" and "b64[std,pad,w76,off1,mime]" in case.describe()
    assert replay_case(case, Sealer({k: [v] for k, v in values.items()}), Oracle(values)) == []


@pytest.mark.parametrize("shape", ["one line", "wrapped", "plain pieces"])
def test_base64_between_words_in_a_header_written_with_plus_for_space(shape):
    """`blob <base64> end` in a header, percent-encoded with `+` for a space (quote_plus,
    random safe sets and extra escapes), or left plain as `blob+<base64>+end`. Read
    with `+` as a character, the run took `+end` in as its last group and the word was
    lost (random seeds 23, case 1378; 38, case 1533, where `%0A+end` lost its line
    break); read as pieces between the plain `+`, the new run's own `+` was written
    plain, a space to the reader (15, case 557). The reading that ends in `+` and a
    word gives way to the one with `+` as a space where the percent layer wrote that
    `+` plainly (`+ok` after `%37`: the session-11 attack), and a piece's new `+` is
    `%2B`. (`blob <base64> end` is the corpus's text; other words are drawn too.)"""
    rng = random.Random(shape)
    failures = []
    checked = 0
    for i in range(150):
        value = b"glpat-" + bytes(rng.choices(b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789", k=20))
        payload = rng.randbytes(rng.randrange(0, 3)) + b"user:" + value + b"@host"
        payload += rng.randbytes(-len(payload) % 3)  # whole groups: ` end` read as `+end` is one more
        b64 = (base64.urlsafe_b64encode if rng.random() < 0.5 else base64.b64encode)(payload).decode()
        b64 = b64 if rng.random() < 0.5 else b64.rstrip("=")
        if shape == "plain pieces" and "+" in b64:
            continue  # a client that writes a space as a plain `+` writes base64's as `%2B`
        if shape == "wrapped":
            b64 = "\n".join(b64[j : j + 76] for j in range(0, len(b64), 76)) + "\n"
        word = rng.choice(["end", "ok", "again", "is", "here"])
        text = "blob " + b64 + " " + word
        if shape == "plain pieces":
            header = text.replace(" ", "+").encode()
        else:
            quoted = quote_plus(text, safe="".join(rng.sample("@!'(,*:$", rng.randint(0, 4))))
            header = "".join(  # extra escapes, a space too (`%20` beside a `+`)
                "%%%02X" % (0x20 if c == "+" else ord(c)) if (c.isalnum() or c == "+") and rng.random() < 0.3 else c
                for c in re.findall(r"%[0-9A-F]{2}|.", quoted)
            ).encode()
        sealed = Sealer({NAME: [value]}).seal(b"x-note: " + header).data[len(b"x-note: ") :]
        got = unquote_to_bytes(sealed.replace(b"+", b" "))
        head, _, rest = got.partition(b" ")
        run, _, tail = rest.rpartition(b" ")
        try:
            decoded = base64.b64decode(run.replace(b"\n", b"").translate(bytes.maketrans(b"-_", b"+/")) + b"==")
        except binascii.Error:
            decoded = None
        if head != b"blob" or tail != word.encode() or decoded != payload.replace(value, REF):
            failures.append(f"{i}: {header!r} -> {sealed!r}")
        checked += 1
    assert checked >= 60 and not failures, f"{len(failures)} of {checked}:\n" + "\n".join(failures[:5])


def test_base64_that_ends_in_a_plus_and_letters_is_whole_where_no_percent_layer_is():
    """Base64 whose last group is `+` and letters that read as a word (`…Xk+end`), in a
    header and a JSON body: no percent layer wrote that `+`, so it is base64's, and the
    run is sealed whole (the rule for `+end` after quote_plus must not cut it)."""
    from keyveil._letters import reads_as_words

    rng = random.Random(11)
    value = b"ghp_" + bytes(rng.choices(b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789", k=36))
    sealer = Sealer({NAME: [value]})
    checked = 0
    while checked < 40:
        payload = rng.randbytes(rng.randrange(0, 3)) + value + rng.randbytes(rng.randrange(3, 9))
        payload += rng.randbytes(-len(payload) % 3)
        b64 = base64.b64encode(payload)
        word = b64[-3:]
        if b64[-4:-3] != b"+" or not (word.isalpha() and word.islower()) or not reads_as_words([word], at_least=-1.5):
            continue
        checked += 1
        for data, unwrap in [
            (b"Basic " + b64, lambda out: out[6:]),
            (b'{"blob": "' + b64 + b'"}', lambda out: json.loads(out)["blob"].encode()),
        ]:
            got = unwrap(sealer.seal(data).data)
            assert base64.b64decode(got, validate=True) == payload.replace(value, REF)


@pytest.mark.parametrize("where", ["json string", "percent-encoded path"])
def test_base64_with_plus_is_read_whole_outside_a_query_or_form(where):
    """Where some value holds a space, keyveil also reads `+` as a space outside a query
    or form (a header, a JSON string): a guess. Base64 holding `+` in a JSON string, and
    percent-encoded with `+` left plain in a URL path, was cut at its `+` by that guess:
    the run before it was re-encoded alone and its last bits lost (`…xHh+M` came back
    `…xHg+M`; random-seed soak 397885151, cases 8941 and 3806). The run read whole wins
    over the guess; the percent view that reads `+` as itself over the one that guesses."""
    rng = random.Random(where)
    value = b"glpat/" + bytes(rng.choices(b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789", k=20)) + b"+=&"
    sealer = Sealer({NAME: [value], "other/spaced": [b"has a space " + secrets.token_hex(8).encode()]})
    checked = 0
    while checked < 60:
        payload = rng.randbytes(rng.randrange(0, 4)) + b"TOKEN=" + value + b"\n" + rng.randbytes(rng.randrange(1, 6))
        b64 = base64.b64encode(payload).decode()
        if "+" not in b64[-12:]:
            continue
        checked += 1
        if where == "json string":
            text = "data:application/octet-stream;base64," + b64 + "\r\n env"
            data = json.dumps({"content": text}).replace("/", "\\/").encode()
            got = json.loads(sealer.seal(data).data)["content"].split(",", 1)[1].removesuffix("\r\n env")
        else:
            data = ("/v1/messages/Basic%20" + quote(b64, safe="+")).encode()
            got = unquote_to_bytes(sealer.seal(data, url=True).data).decode().removeprefix("/v1/messages/Basic ")
        assert base64.b64decode(got, validate=True) == payload.replace(value, REF), (b64, got)


@pytest.mark.parametrize("where", ["json string", "percent-encoded path"])
def test_the_soaks_base64_with_plus_outside_a_query_or_form(where):
    """The two failing cases of random-seed soak 397885151 (8941 and 3806), built again
    from the corpus's own generated values: base64 holding `+` in a JSON string whose
    `/` are `\\/`, and in a URL path percent-encoded with `+` safe. With these values
    the guess that reads `+` as a space found the value too and its cut reading won."""
    from tests.leak_corpus import make_values

    values = make_values(397885151)
    sealer = Sealer({name: [v] for name, v in values.items()})
    value = values["gitlab/token"]
    ref = b"{{secret:gitlab/token}}"
    if where == "json string":
        payload = b"cR\x90" + value + b"\xb1\x1e\x1f\x8c"
        body = (
            b'{"model":"m","messages":[{"role":"user","content":"here: says log data:application\\/octet-stream;base64,'
            + base64.b64encode(payload) + b'\\r\\n env token here: see"}],"stream":true}'
        )
        text = json.loads(sealer.seal(body).data)["messages"][0]["content"]
        got = text.split(",", 1)[1].removesuffix("\r\n env token here: see")
    else:
        payload = b"\xcd2export GITHUB_TOKEN=" + value + b"\n\xef\x80\x14"
        path = ("/v1/messages/" + quote("Basic " + base64.b64encode(payload).decode(), safe="!$&*+=")).encode()
        got = unquote_to_bytes(sealer.seal(path, url=True).data).decode().removeprefix("/v1/messages/Basic ")
    assert base64.b64decode(got, validate=True) == payload.replace(value, ref)

