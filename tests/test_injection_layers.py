"""Injection through layers (SPEC §3, §4): a value put where a reference stood
is written for every layer around it, so the carrier still decodes, with the
standard library, to the document with the value in place of the reference.

The carriers are built with json.dumps and urllib.parse.quote; the value holds
every character those layers must escape.
"""

from __future__ import annotations

import json
import random
import secrets
from urllib.parse import quote, unquote, unquote_plus, unquote_to_bytes

import pytest

from keyveil._inject import for_form, for_json, for_url, inject

NAME = "odd/val"
REF = "{{secret:odd/val}}"


def odd_value() -> str:
    return 'p\u00e4"s\\s/+ &=%' + secrets.token_urlsafe(8) + "\U0001f600\n"


def _json_layers(doc: object, layers: int, rng: random.Random) -> str:
    text = json.dumps(doc, ensure_ascii=rng.random() < 0.5)
    for _ in range(layers - 1):
        text = json.dumps({"wrapped": text}, ensure_ascii=rng.random() < 0.5)
    return text


def _unwrap(text: str, layers: int) -> object:
    doc = json.loads(text)
    for _ in range(layers - 1):
        doc = json.loads(doc["wrapped"])
    return doc


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("slash", [False, True], ids=["plain", "escaped-slash"])
def test_a_value_in_json_strings_layers_deep_is_escaped_for_each(layers, slash):
    rng = random.Random(f"{layers}-{slash}")
    v = odd_value()
    text = _json_layers({"token": "Bearer " + REF, "n": 1}, layers, rng)
    if slash:
        text = text.replace("/", "\\/")  # PHP's habit, the reference's own / too
    out, counts = inject(text.encode(), {NAME: v.encode()}, {NAME}, for_json, "the body")
    assert counts[NAME] == 1
    assert _unwrap(out.decode(), layers) == {"token": "Bearer " + v, "n": 1}


@pytest.mark.parametrize("encoder", [for_url, for_form], ids=["url", "form"])
def test_a_json_document_in_a_percent_encoded_field_gets_the_value_escaped(encoder):
    v = odd_value()
    field = quote(json.dumps({"token": REF}), safe="")
    out, counts = inject(b"a=1&payload=" + field.encode(), {NAME: v.encode()}, {NAME}, encoder, "the body")
    assert counts[NAME] == 1
    payload = out.split(b"payload=")[1]
    assert json.loads(unquote_to_bytes(payload)) == {"token": v}


def test_a_value_in_a_path_segment_stays_one_segment():
    v = "glpat/" + secrets.token_urlsafe(12) + "+x y"
    for path in ("/api/" + quote(REF, safe="/:") + "/issues", "/api/" + quote(REF, safe="") + "/issues"):
        out, counts = inject(path.encode(), {NAME: v.encode()}, {NAME}, for_url, "the URL path")
        assert counts[NAME] == 1
        assert [unquote(s) for s in out.decode().split("/")] == ["", "api", v, "issues"]


@pytest.mark.parametrize("encoder", [for_url, for_form], ids=["url", "form"])
def test_a_json_document_with_a_plain_reference_in_a_query_gets_the_value_escaped(encoder):
    v = odd_value()
    query = b"a=1&filter=" + json.dumps({"token": REF}).encode() + b"&b=2"
    out, counts = inject(query, {NAME: v.encode()}, {NAME}, encoder, "the query")
    assert counts[NAME] == 1
    field = out.split(b"filter=")[1].split(b"&")[0].decode()
    assert json.loads(unquote_plus(field) if encoder is for_form else unquote(field)) == {"token": v}
