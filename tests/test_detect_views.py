"""Detection through the decoded views of a request (keyveil._detected), and the engine's use of it.

A token in a request is found however its carrier wrote it (SPEC §3): JSON with
any character \\u-escaped, percent-encoding, base64 at any offset, two layers.
Once found and given to the engine, the ordinary sealer seals every form.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import secrets
import string
from urllib.parse import quote, quote_plus

import pytest

from keyveil._detect import shipped_detector
from keyveil._detected import RequestDetector, detection_key, views
from keyveil._pipeline import Engine, Request
from keyveil._rules import parse_rules
from keyveil.vault import VaultSnapshot
from tests.tokens import MAKERS, samples, seeded_tokens  # noqa: F401 (fixture)

KEY = bytes(range(32))


@pytest.fixture(scope="module")
def rd():
    return RequestDetector(shipped_detector(), KEY)


def _all_escaped(text: str) -> bytes:
    return "".join(f"\\u{ord(c):04X}" if i % 2 else f"\\u{ord(c):04x}" for i, c in enumerate(text)).encode()


CARRIERS = {
    "json, every character \\u-escaped": lambda t: b'{"content": "' + _all_escaped(t) + b'"}',
    "json, '/' escaped": lambda t: json.dumps({"c": f"cat .env\n{t}\n"}).replace("/", "\\/").encode(),
    "percent, every character": lambda t: ("q=" + "".join(f"%{b:02X}" for b in t.encode())).encode(),
    "Basic base64(user:token)": lambda t: b"Basic " + base64.b64encode(b"user:" + t.encode()),
    "base64 inside JSON with \\/": lambda t: json.dumps({"d": base64.b64encode(b"k:" + t.encode()).decode()}).replace("/", "\\/").encode(),
    "percent-encoded base64": lambda t: quote(base64.b64encode(t.encode()).decode(), safe="").encode(),
    "base64 of a JSON document holding it escaped": lambda t: base64.b64encode(json.dumps({"k": t}).replace("/", "\\/").encode()),
    "JSON string inside a JSON string": lambda t: json.dumps({"outer": json.dumps({"inner": t})}).encode(),
}


@pytest.mark.parametrize("carrier", CARRIERS)
def test_every_kind_is_found_in_every_carrier(rd, carrier):
    missed = []
    for kind in sorted(MAKERS):
        for text, value in samples(kind):
            if kind == "private-key" and "base64" in carrier:
                continue  # a PEM inside base64 inside base64: three layers
            found = {f.value for f in rd.find([CARRIERS[carrier](text)])}
            if value.encode() not in found:
                missed.append(kind)
    assert missed == []


def test_names_are_keyed_and_stable(rd):
    text, value = samples("github-pat")[0]
    (a,) = rd.find([text.encode()])
    (b,) = rd.find([b"Basic " + base64.b64encode(b"u:" + value.encode())])
    assert a.name == b.name and a.name.startswith("detected/github-pat-")
    other = RequestDetector(shipped_detector(), os.urandom(32))
    assert other.find([text.encode()])[0].name != a.name
    assert value not in repr(a) and value not in str([a])


def test_known_values_are_skipped_and_nothing_is_capped(rd):
    tokens = [samples("npm-token")[0][1] for _ in range(2000)]
    found = rd.find([" ".join(tokens).encode()], known={tokens[0].encode()})
    assert [f.value for f in found] == [t.encode() for t in tokens[1:]]


def test_a_short_part_found_clean_is_not_looked_at_again_and_one_holding_a_token_always_is():
    """Header fields repeat on every request: one detection found nothing in is skipped after,
    one that held a token (known, or not) is looked at every time; the memory is bounded."""
    from keyveil import _detected

    rd = RequestDetector(shipped_detector(), KEY)
    scanned = []

    def hits(data: bytes) -> list:
        scanned.append(data)
        return rd.detector.hits(data)

    text, value = samples("github-pat")[0]
    clean, holding = b"application/json; charset=utf-8", f"Bearer {text}".encode()
    for known in (frozenset(), frozenset({value.encode()}), frozenset()):
        found = rd.find([clean, holding, bytearray(holding)], known=known, hits=hits)
        assert [f.value for f in found] == ([] if known else [value.encode()])
    assert scanned.count(clean) == 1 and scanned.count(holding) == 6  # the bytes part and the bytearray, 3 times
    long_part = b"x" * (_detected._CLEAN_BYTES + 1)
    rd.find([long_part], hits=hits)
    rd.find([long_part], hits=hits)
    assert scanned.count(long_part) == 2
    for i in range(_detected._CLEAN_ENTRIES + 10):
        rd.find([b"value %d" % i], hits=hits)
    assert len(rd._clean) <= _detected._CLEAN_ENTRIES


def test_views_stop_at_binary(rd):
    data = base64.b64encode(os.urandom(4096))
    assert list(views(data)) == [data]


def test_the_detection_key_is_made_once_private_and_kept(tmp_path):
    key = detection_key(tmp_path / "vault")
    assert len(key) == 32 and (tmp_path / "vault" / "detection-key").stat().st_mode & 0o777 == 0o600
    assert detection_key(tmp_path / "vault") == key


RULES = """\
version: 1
secrets:
  github/token:
    hosts: [api.github.com]
    inject: [{header: Authorization}]
"""


def _req(host: str, body: bytes, headers=()) -> Request:
    return Request("POST", "https", host, 443, b"/v1/x", None, list(headers), body, "application/json")


def test_engine_seals_detected_values_toward_providers_only_and_adopted_ones_are_aliases(rd):
    rules = parse_rules(RULES, "rules.yaml")
    text, token = samples("github-pat")[0]
    (f,) = rd.find([text.encode()])
    engine = Engine(rules, VaultSnapshot(), {f.name: f.value})
    body = json.dumps({"t": f"x {token}"}).encode()
    out = engine.process_request(_req("api.anthropic.com", body, [(b"authorization", b"Bearer " + token.encode())]))
    assert token.encode() not in out.request.body and f.name.encode() in out.request.body
    assert out.request.headers == [(b"authorization", b"Bearer " + token.encode())]  # a credential header: as it came
    out = engine.process_request(_req("api.example.net", body))
    assert out.block is None and out.request.body == body and out.passed == {f.name: 1}
    assert token.encode() not in out.sealed_request.body  # what is shown and stored stays sealed
    ref = b"{{secret:" + f.name.encode() + b"}}"
    out = engine.process_request(_req("api.github.com", b"", [(b"authorization", b"token " + ref)]))
    assert out.block is not None and out.block.code == "unbound_reference" and "secret adopt" in out.block.message
    # adopted: the value is registered under github/token too
    adopted = Engine(rules, VaultSnapshot(current={"github/token": token.encode(), f.name: f.value}))
    assert adopted.aliases == {f.name: "github/token"}
    out = adopted.process_request(_req("api.github.com", b"", [(b"authorization", b"token " + ref)]))
    assert out.block is None and out.request.headers == [(b"authorization", b"token " + token.encode())]
    out = adopted.process_request(_req("api.anthropic.com", body))
    assert b"{{secret:github/token}}" in out.request.body


def test_a_detection_touching_a_registered_value_is_not_remembered_and_never_hides_it(rd):
    """Sealed as one span, a detected value overlapping a registered one would take part of it
    and leave the rest as it was (found by the leak corpus): such a detection is left to the
    registered value's own seal, and a location holding a registered value is never passed."""
    rules = parse_rules(RULES, "rules.yaml")
    registered = samples("github-pat")[0][1].encode()
    engine = Engine(rules, VaultSnapshot(current={"github/token": registered}))
    for value, around in (
        (base64.b64encode(registered), b"API_KEY=" + base64.b64encode(registered)),  # holds it encoded
        (registered + b"Zq9", b"TOKEN=" + registered + b"Zq9"),  # holds it with more
        (registered[10:] + b"Zq9", b"k " + registered + b"Zq9"),  # starts inside it
        # Read from one line of a wrapped base64 block (leak corpus, soak seed 1953768134,
        # case 6511): a view that holds only part of the registered value.
        (b"user:" + registered[:20], b"TOKEN=https://x:user:" + registered[:20]),  # ends with its first 20 bytes
        (registered[-9:] + b"_more_text", b"KEY=" + registered[-9:] + b"_more_text"),  # begins with its last 9
    ):
        assert engine.overlaps_registered(value, around), around
    other = samples("npm-token")[0][1].encode()
    assert not engine.overlaps_registered(other, b"x " + other + b" y " + registered)
    # Even if such a value was remembered, it does not hide the registered value, and a
    # location holding the registered value is not forwarded as it came.
    shadow = registered + b"Zq9x"
    (name,) = {f.name for f in rd.find([b"TOKEN=" + shadow])}
    engine = Engine(rules, VaultSnapshot(current={"github/token": registered}), {name: shadow})
    assert name not in engine.names
    out = engine.process_request(_req("api.example.net", b"", [(b"x-api-key", shadow)]))
    assert registered not in b"".join(v for _, v in out.request.headers) or out.block is not None


def test_encoded_text_assigned_to_a_secret_name_is_read_in_its_decoded_view():
    from keyveil._detect import looks_random

    url = base64.b64encode(b"https://x-access-token:abc@github.com/org/repo").decode()
    for text in ("%7B%22model%22%3A%22m%22%7D", "ex%70o%72t+G%49T%48U", url):
        assert not looks_random(text.encode()), text
    assert looks_random(base64.b64encode(os.urandom(24)))  # base64 of random bytes: random


@pytest.mark.parametrize("wrap", ["lf", "crlf", "json"])
def test_one_line_of_wrapped_base64_text_is_not_an_assigned_value(rd, wrap):
    """`TOKEN=` and then base64 of text wrapped at 76 (a file's content): the first
    line is no value (learning it sealed a piece of every later carrier of the same
    block, soak seed 2250711808); a token the text holds is found in its decoding."""
    text, value = samples("github-pat")[0]
    content = ("the deploy log says\n" * 12 + text + "\nplease build again\n" * 8).encode()
    block = base64.encodebytes(content).decode()
    carrier = {
        "lf": "TOKEN=" + block,
        "crlf": "TOKEN=" + block.replace("\n", "\r\n"),
        "json": json.dumps({"env": "TOKEN=" + block}),
    }[wrap].encode()
    assert [(f.kind, f.value) for f in rd.find([carrier])] == [("github-pat", value.encode())]


@pytest.mark.parametrize("width", [64, 76])
@pytest.mark.parametrize("wrap", ["lf", "crlf"])
def test_a_two_line_block_of_base64_text_is_not_an_assigned_value(rd, wrap, width):
    """`TOKEN=` and a block of one full line and a shorter, padded last one (soak seed
    2250711808 learned such first lines, of `data:…;base64,…` and of a form body): the
    block is text, its first line no value; the token the text holds is found where
    the block is decoded."""
    text, value = samples("github-pat")[0]
    content = ("grant_type=client_credentials&client_secret=" + text).encode()
    b64 = base64.b64encode(content).decode()
    assert width < len(b64) < 2 * width
    block = b64[:width] + "\n" + b64[width:] + "\n\nthe log says\n"
    carrier = ("TOKEN=" + (block if wrap == "lf" else block.replace("\n", "\r\n"))).encode()
    assert [(f.kind, f.value) for f in rd.find([carrier])] == [("github-pat", value.encode())]


@pytest.mark.parametrize("width", [16, 76])
def test_a_two_line_block_of_base64_text_in_json(rd, width):
    """The same block inside a JSON string, its breaks `\\n` escapes. The views join a
    block of lines of 27 characters or more there (its token, across the break, is
    found) and its first line is no value; a narrower block's lines are not joined, so
    its first line stays a detection rather than leave the token unsealed."""
    text, value = samples("github-pat")[0]
    b64 = base64.b64encode(("grant_type=client_credentials&client_secret=" + text).encode()).decode()
    first, last = b64[:width], b64[width : min(len(b64), 2 * width - 4)]  # a shorter last line
    carrier = json.dumps({"env": "TOKEN=" + first + "\n" + last + "\n"}).encode()
    found = [(f.kind, f.value) for f in rd.find([carrier])]
    if width == 76:
        assert found == [("github-pat", value.encode())]
    else:
        assert ("assignment", first.encode()) in found


def test_a_value_before_a_shorter_next_line_that_is_no_base64_end_is_still_assigned(rd):
    """The shorter line must end the block: `OTHER=xyz` after a value is an assignment of its own."""
    value = base64.b64encode(secrets.token_bytes(45)).decode()[:60]
    found = rd.find([f"TOKEN={value}\nOTHER=xyz\n".encode()])
    assert [(f.kind, f.value) for f in found] == [("assignment", value.encode())]


def test_an_assigned_value_cut_by_a_json_escape_of_its_own_character_is_found_whole(rd):
    """`TOKEN=eC1hY2Nlc3MtdG9r\\u005A…` in a file's text: the raw bytes end the value at
    the backslash, a piece that is no value (soak seed 2250711808 learned the base64 of
    `x-access-tok` so, and sealed it inside every later run of it); the JSON view holds
    the value whole, and it is found there."""
    value = base64.b64encode(secrets.token_bytes(30)).decode()
    at = next(i for i in range(16, len(value)) if value[i].isalnum())
    escaped = value[:at] + f"\\u{ord(value[at]):04X}" + value[at + 1 :]
    found = rd.find([("KEY FILE\nTOKEN=" + escaped + "\nplease here\n").encode()])
    assert [(f.kind, f.value) for f in found] == [("assignment", value.encode())]


def test_an_assigned_value_cut_by_a_percent_escape_is_found_whole(rd):
    """`TOKEN=…%4F…` and `API_KEY=…%2Fabc` in percent-encoded text: a value cut inside or
    before an escape is a piece that is no value (a random-seed soak, 161696831, learned
    four such pieces ending in `%`, `%4`, `%7` from its carriers; none with the rule). The
    percent view holds the value whole, and it is found there, alone. A value that ends
    inside an escape cut short (`…%4` at the end of a piece of text) is no value at all."""
    value = secrets.token_urlsafe(24)
    at = len(value) // 2
    for text in (
        "q=1&TOKEN=" + value[:at] + "%%%02X" % ord(value[at]) + value[at + 1 :] + "&x=1",
        "API_KEY=" + value + "%2Fabc",
    ):
        whole = (value + "/abc") if text.startswith("API_KEY") else value
        found = rd.find([text.encode()])
        assert [(f.kind, f.value) for f in found] == [("assignment", whole.encode())], text
    for cut in ("%", "%4"):
        assert rd.find([("TOKEN=" + value + cut).encode()]) == []


def test_one_line_of_wrapped_base64_of_binary_is_still_an_assigned_value(rd):
    """A block that decodes to binary may be key material: its first line stays a
    detection (a false seal costs a reference, a miss the key)."""
    block = base64.encodebytes(bytes(range(256)) * 2).decode()
    (found,) = rd.find([("PRIVATE_KEY=" + block).encode()])
    assert found.kind == "assignment" and found.value == block.split("\n")[0].encode()


@pytest.mark.parametrize("nesting", [1, 2])
def test_an_unregistered_token_in_a_dotenv_fetched_from_the_github_contents_api_is_found(rd, nesting):
    """The contents API answers base64 wrapped at 60 columns in a JSON string; a tool
    result carries that answer on to the model (one more JSON layer). The token usually
    lies across a line break of the block: it is found in the views all the same."""
    for pad in range(0, 60, 7):  # moves the token across the block's line breaks
        token, value = samples("github-pat")[0]
        env = "# app\nDEBUG=false\n" + "X" * pad + "\nGITHUB_TOKEN=" + token + "\nLOG_LEVEL=info\n"
        b64 = base64.b64encode(env.encode()).decode()
        content = "\n".join(b64[i : i + 60] for i in range(0, len(b64), 60)) + "\n"
        body = json.dumps({"type": "file", "name": ".env", "content": content, "encoding": "base64"})
        if nesting == 2:
            body = json.dumps({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": body}]}]})
        assert ("github-pat", value.encode()) in [(f.kind, f.value) for f in rd.find([body.encode()])], pad


@pytest.mark.parametrize("width", [27, 33, 48, 64, 76])
def test_a_token_in_wrapped_base64_text_inside_json_is_found_at_any_width_from_27(rd, width):
    # A file's text (a comment in French first: UTF-8 bytes the text test lets by) as base64
    # wrapped in a JSON string: its first line must open the JSON view, where it is joined.
    for pad in range(0, 40, 9):
        token, value = samples("github-pat")[0]
        env = "# cl\u00e9 d'acc\u00e8s \u00e0 l'API\n" + "Y" * pad + "\nGH_TOKEN=" + token + "\n"
        b64 = base64.b64encode(env.encode()).decode()
        content = "\n".join(b64[i : i + width] for i in range(0, len(b64), width))
        carrier = json.dumps({"content": content}).encode()
        assert ("github-pat", value.encode()) in [(f.kind, f.value) for f in rd.find([carrier])], pad


def test_lines_that_cannot_be_base64_of_text_open_no_json_view():
    # Option names and constants before a `\n` in a tool result (a manual page, source code)
    # look like the lines of a block, but no text decodes from them: no view of the whole body.
    text = "--add-upstream-certs-to-client-chain\n--upstream-trusted-confdir\n--no-pop\n"
    body = json.dumps({"content": "usage:\n" + text * 3 + "LARGEST_FLOW_CONTROL_WINDOW_SIZE\nDEFAULT_MAX_HEADER_LIST_SIZE\n"}).encode()
    assert list(views(body)) == [body]


def test_an_escape_with_no_token_character_beside_it_opens_no_json_view(rd):
    # `rstrip("\\/")` in source code carried in a JSON string: an escape, but no token holds it.
    body = json.dumps({"content": 'path = value.rstrip("\\/")\n'}).encode().replace(b"\\\\/", b"\\/")
    assert b'rstrip(\\"\\/\\")' in body
    assert list(views(body)) == [body]
    # A token written with escapes, or cut by one, is still looked for in the view.
    token, value = samples("github-pat")[0]
    escaped = "".join(f"\\u{ord(c):04x}" for c in token[:4]) + token[4:]
    for carrier in (b'{"t": "' + escaped.encode() + b'"}', b'{"t": "' + (token[:10] + "\\/" + token[10:]).encode() + b'"}'):
        assert len(list(views(carrier))) > 1
    assert [(f.kind, f.value) for f in rd.find([b'{"t": "' + escaped.encode() + b'"}'])] == [("github-pat", value.encode())]


def test_percent_runs_are_the_url_runs_holding_an_escape() -> None:
    # Oracle: every maximal run of URL characters that holds a %XX escape, decoded by urllib
    # (again with `+` as a space when it holds one), whatever the length of the text around it.
    from urllib.parse import unquote_to_bytes

    from keyveil._detected import _percent_runs

    url_run = re.compile(rb"[A-Za-z0-9%\-._~+/=:]+")
    rng = random.Random(5)
    alphabet = b"abcXYZ09%-._~+/=: \n\"&?4F2"
    for _ in range(3000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.choice([5, 50, 500, 3000])))
        if rng.random() < 0.3:
            data = rng.choice([b"a", b" "]) * rng.randint(200, 3000) + data
        expected = []
        for m in url_run.finditer(data):
            run = m.group()
            if re.search(rb"%[0-9A-Fa-f]{2}", run):
                expected.append(unquote_to_bytes(run))
                if b"+" in run:
                    expected.append(unquote_to_bytes(run.replace(b"+", b" ")))
        assert _percent_runs(data) == b"\n".join(expected)


def test_the_text_screen_never_turns_away_a_run_the_text_test_accepts() -> None:
    # _may_read_as_text skips the decoding of runs that cannot read as text; it must never
    # skip one `_textual` would take (stdlib base64 of random bytes, of text, of UTF-8, of
    # printable ASCII with control bytes here and there).
    from keyveil._detected import _head, _may_read_as_text, _textual

    rng = random.Random(1)
    accepted = skipped = 0
    printable = string.printable.encode()
    for _ in range(20000):
        kind = rng.randrange(6)
        if kind == 4:  # printable ASCII with its tabs and line breaks, now and then any byte
            raw = bytes(rng.choice(printable) if rng.random() > 0.08 else rng.randrange(256) for _ in range(rng.randint(10, 90)))
        elif kind == 5:
            raw = bytes(rng.choice(b"\t\n\r\x00\x7f ~AZaz09") for _ in range(rng.randint(10, 90)))
        elif kind == 0:
            raw = rng.randbytes(rng.randint(10, 80))
        elif kind == 1:
            raw = bytes(rng.choice(b"abcdefghij KLMNOP\n\t\xc3\xa9xyz") for _ in range(rng.randint(10, 80)))
        elif kind == 2:
            raw = "".join(rng.choice("a\u00e9\u20ac b\tc\u65e5d") for _ in range(rng.randint(5, 40))).encode()
        else:
            raw = bytes(rng.randrange(0x18, 0x90) for _ in range(rng.randint(10, 80)))
        chars = (base64.b64encode if rng.random() < 0.5 else base64.urlsafe_b64encode)(raw).rstrip(b"=")
        chars = bytes(rng.choice(b"ABCab") for _ in range(rng.randint(0, 3))) + chars  # a glued prefix
        chars = chars.replace(b"-", b"+").replace(b"_", b"/")[:91]  # as _head_chars gives them
        for align in range(4):
            text = _textual(_head(chars, align))
            assert _may_read_as_text(chars, align) or not text
            accepted += text
            skipped += not _may_read_as_text(chars, align)
    assert accepted > 2000 and skipped > 20000  # both sides are exercised


def test_the_group_screen_never_turns_away_a_run_whose_decoding_holds_a_detection_and_turns_away_identifiers() -> None:
    # _may_hold_a_detection skips runs that cannot decode, from any offset, to the shortest
    # detection (20 printable ASCII bytes): stdlib base64, both alphabets, padded or not, wrapped
    # or not, of any bytes around 20..40 printable ASCII ones at any offset, with 0-3 characters
    # glued before, must always pass. Not generated: runs of more than _SHORT_RUN characters
    # (never screened).
    from keyveil._detected import _SHORT_RUN, _may_hold_a_detection
    from keyveil._views import Run

    rng = random.Random(2)
    printable = bytes(range(0x20, 0x7F))
    for _ in range(5000):
        text = bytes(rng.choice(printable) for _ in range(rng.randint(20, 40)))
        before, after = rng.randbytes(rng.randint(0, 60)), rng.randbytes(rng.randint(0, 60))
        encode = base64.b64encode if rng.random() < 0.5 else base64.urlsafe_b64encode
        chars = encode(before + text + after)
        if rng.random() < 0.5:
            chars = chars.rstrip(b"=")
        chars = bytes(rng.choice(b"ABCab+/") for _ in range(rng.randint(0, 3))) + chars.rstrip(b"=")
        if rng.random() < 0.3:
            width = rng.choice([60, 64, 76])
            chars = b"\n".join(chars[i : i + width] for i in range(0, len(chars), width))
        assert len(chars) <= _SHORT_RUN
        assert _may_hold_a_detection(chars, Run(0, len(chars), 0))
    # What it is for: identifiers and paths of source code, which a text test would decode four times.
    names = [b"SemanticAnalyzerPluginInterface", b"test_a_short_prefix_is_scanned_for", b"/usr/lib/python3/site-packages/x"]
    assert not any(_may_hold_a_detection(n, Run(0, len(n), 0)) for n in names)


def test_a_scheme_before_a_plus_for_a_space_is_no_part_of_the_assigned_value(rd):
    # A query writes `token=Basic <base64>` as `token=Basic+<base64>` (a random-seed soak,
    # 161696831 cases 3020 and 11609: base64 of text wrapped at 76, percent-encoded). In the
    # percent view, `Basic+` glued to the block's first line made that line read as random
    # (misaligned): it was learned as a value, and sealed over the registered value inside.
    text = "deploy see ok\n" * 8 + "fix env fix the deploy now and then see\n" * 3
    b64 = base64.b64encode(text.encode()).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    assert rd.find([f"/ws?case=1&token=Basic+{quote(wrapped, safe='')}&x=1".encode()]) == []
    # A token after the scheme is the value, without it.
    token = secrets.token_urlsafe(30).replace("-", "x").replace("_", "y")
    (found,) = rd.find([f"/api?token=Bearer+{token}".encode()])
    assert (found.kind, found.value) == ("assignment", token.encode())


@pytest.mark.parametrize("width", [17, 24, 64, 76])
def test_a_word_glued_by_a_plus_before_a_wrapped_block_is_no_assigned_value(rd, width):
    # `token=blob <base64 of text, wrapped>` in a query: `+` for the space, the line breaks
    # `%0D%0A` (random-seed soak 850423658, case 12868, width 17). In the percent view that
    # keeps `+`, `blob+` glued to the block's first line made it read as random (misaligned):
    # it was learned and sealed as one value over the registered value's first line. A
    # value whose last characters and the next line decode to text is a wrapped block's line.
    rng = random.Random(width)
    for _ in range(20):
        text = " ".join(rng.choice(["deploy", "see", "ok", "the", "key", "is", "fix", "env"]) for _ in range(30))
        b64 = base64.b64encode(bytes([rng.randrange(256)]) + text.encode()).decode()
        wrapped = "\r\n".join(b64[i : i + width] for i in range(0, len(b64), width)) + "\r\n"
        query = quote_plus("blob " + wrapped + " end", safe=rng.choice(["", "/:", "=@"]))
        assert rd.find([f"/v1/responses?case=1&token={query}".encode()]) == [], query


@pytest.mark.parametrize("width", [16, 64, 76])
@pytest.mark.parametrize("scheme", ["", "Basic "])
def test_the_first_line_of_wrapped_base64_of_utf8_text_is_no_assigned_value(rd, width, scheme):
    # `token=<base64 of text with é, €, 🔑, wrapped>` in a query, the line breaks `%0A`
    # (random-seed soak 397885151, cases 4023 and 5630). The first line and the next were
    # judged binary: the text's UTF-8 letters counted as non-printable bytes, and two lines
    # of 16 columns held too few bytes beside a glued prefix. The line was learned and
    # sealed over the registered value inside. UTF-8 is text; a narrow block is read further.
    rng = random.Random(f"{width}{scheme}")
    for _ in range(20):
        words = ["deploy", "see", "ok", "the", "key", "is", "kvé-pTV", "€20", "🔑", "fix", "naïve"]
        text = " ".join(rng.choice(words) for _ in range(40))
        b64 = base64.b64encode(rng.randbytes(rng.randrange(0, 3)) + text.encode()).decode()
        if rng.random() < 0.5:
            b64 = b64.replace("+", "-").replace("/", "_")
        wrapped = "\n".join(b64[i : i + width] for i in range(0, len(b64), width))
        query = quote(scheme + wrapped, safe=rng.choice(["", "/:", "=@"]))
        assert rd.find([f"/v1/messages?case=1&token={query}".encode()]) == [], query


def test_one_line_of_base64_of_words_is_not_an_assigned_value(rd):
    """`TOKEN=<base64 of "export GITHUB_TOKEN=…\\n">` on one line, behind a glued prefix of
    up to three characters or none: text with spaces and line breaks is no secret; the
    token it holds is found where the run is decoded. Base64 of one random string
    (a Kubernetes secret's data) is still an assigned value."""
    rng = random.Random(3)
    text, value = samples("github-pat")[0]
    for lead in ("", "Q", "x9", "_Ee"):
        line = lead + base64.b64encode(f"export GITHUB_TOKEN={text}\nplease deploy\n".encode()).decode()
        found = [(f.kind, f.value) for f in rd.find([f"note\nTOKEN={line}\nthe end\n".encode()])]
        assert found == [("github-pat", value.encode())], (lead, found)
    secret = "".join(rng.choice(string.ascii_letters + string.digits + "!#%") for _ in range(32))
    blob = base64.b64encode(secret.encode()).decode()
    assert [(f.kind, f.value) for f in rd.find([f"TOKEN={blob}\n".encode()])] == [("assignment", blob.encode())]


@pytest.mark.parametrize("width", [16, 18, 20, 24, 26])
def test_a_narrow_block_behind_a_glued_group_whose_third_line_an_escape_cuts_is_not_an_assigned_value(rd, width):
    """`TOKEN=` and base64 of 1-3 random bytes and `export GITHUB_TOKEN=…` (the prefix's
    characters glued to the block's first line), wrapped narrower than MIN_RUN with `\\r\\n`
    or `\\n` escapes, the third line's characters `\\u`-escaped in part: only the first two
    lines are read before the escape, and the prefix's bytes made them look binary, so the
    first line was an assigned value (random-seed soak 2805018454, case 1246). Built with
    the standard library; left out: standard blocks of MIN_RUN columns or more (the test above
    and the sealer's views read those)."""
    rng = random.Random(width)
    for _ in range(40):
        text, value = samples("github-pat")[rng.randrange(len(samples("github-pat")))]
        payload = rng.randbytes(rng.randint(1, 3)) + f"export GITHUB_TOKEN={text}\n".encode()
        b64 = base64.b64encode(payload).decode()
        lines = [b64[i : i + width] for i in range(0, len(b64), width)]
        lines[2] = lines[2][:2] + "".join("\\u%04x" % ord(c) if rng.random() < 0.4 else c for c in lines[2][2:])
        eol = rng.choice(["\\r\\n", "\\n"])
        carrier = ('{"file": "env here\\nTOKEN=' + eol.join(lines) + '\\nplease"}').encode()
        assert json.loads(carrier)["file"].split("\n")[1].replace("\r", "")[len("TOKEN=") :].startswith(lines[0])
        found = [(f.kind, f.value) for f in rd.find([carrier])]
        assert ("assignment", lines[0].encode()) not in found, carrier
        assert ("github-pat", value.encode()) in found, carrier


def test_a_narrow_block_in_json_whose_next_line_an_escape_cuts_is_not_an_assigned_value(rd):
    """A 17-column block of base64 of text inside a JSON string, its breaks `\\r\\n`
    escapes and some of its characters `\\u`-escaped: the first line's next line goes on
    behind such an escape, so the line is no value (random-seed soak 183517992, case
    3520: remembered, it was sealed inside 42 later runs that encode the same words).
    The token the text holds is found in the JSON view."""
    text, value = samples("github-pat")[0]
    b64 = base64.b64encode(f"export GITHUB_TOKEN={text}\nplease deploy\n".encode()).decode()
    lines = [b64[i : i + 17] for i in range(0, len(b64), 17)]
    at = re.search(r"[a-z]", lines[1][1:]).start() + 1  # an escape after a character or more of the line
    second = lines[1][:at] + "\\u%04x" % ord(lines[1][at]) + lines[1][at + 1 :]
    raw = "TOKEN=" + lines[0] + "\\r\\n" + second + "\\r\\n" + "\\r\\n".join(lines[2:])
    carrier = ('{"env": "' + raw + '"}').encode()
    assert json.loads(carrier)["env"].replace("\r\n", "") == "TOKEN=" + b64
    found = [(f.kind, f.value) for f in rd.find([carrier])]
    assert ("assignment", lines[0].encode()) not in found
    assert ("github-pat", value.encode()) in found
