"""The request pipeline (SPEC §6) on sans-IO requests: seal, inject, enforce."""

import base64
import json
import secrets

import pytest

from keyveil._pipeline import Engine, Request, protected_spans
from keyveil._rules import parse_rules
from keyveil.vault import VaultSnapshot

RULES = """
version: 1
providers: {builtin: true, hosts: [llm.internal.example.com]}
secrets:
  github/pat:
    hosts: [api.github.com, github.com]
    inject: [{header: Authorization}, {basic_auth: true}]
  gitlab/token:
    hosts: [gitlab.example.com]
    inject: [{query: private_token}, {path: true}, {body: true}]
    methods: [GET, POST]
  anthropic/key:
    hosts: [api.anthropic.com]
    inject: [{header: x-api-key}]
  plain/http:
    hosts: [intranet.example.com]
    inject: [{header: Authorization}]
    allow_http: true
"""


@pytest.fixture
def values():
    return {
        "github/pat": b"ghp_" + secrets.token_hex(18).encode(),
        "gitlab/token": b"glpat-" + secrets.token_urlsafe(15).encode(),
        "anthropic/key": b"sk-ant-" + secrets.token_urlsafe(30).encode(),
        "plain/http": b"intra-" + secrets.token_hex(10).encode(),
    }


def make_engine(values, rules=RULES, previous=None):
    return Engine(parse_rules(rules, "rules.yaml"), VaultSnapshot(current=values, previous=previous or {}))


def req(host, path=b"/", query=None, headers=(), body=None, method="GET", scheme="https", port=443, ct=""):
    return Request(method, scheme, host, port, path, query, list(headers), body, ct)


def flat(r: Request) -> bytes:
    return b"\n".join([r.path, r.query or b"", *(k + b": " + v for k, v in r.headers), r.body or b""])


def test_reference_injected_in_bound_header(values):
    out = make_engine(values).process_request(
        req("api.github.com", headers=[(b"Authorization", b"Bearer {{secret:github/pat}}")])
    )
    assert out.block is None
    assert out.request.headers == [(b"Authorization", b"Bearer " + values["github/pat"])]
    assert out.injected == {"github/pat": 1}


def test_reference_not_injected_in_other_header(values):
    out = make_engine(values).process_request(
        req("api.github.com", headers=[(b"X-Debug", b"{{secret:github/pat}}")])
    )
    assert out.block is None  # not an auth position: forwarded as the reference
    assert values["github/pat"] not in flat(out.request)


def test_reference_in_auth_header_toward_unbound_host_blocks(values):
    out = make_engine(values).process_request(
        req("api.gitlab.com", headers=[(b"Authorization", b"Bearer {{secret:github/pat}}")])
    )
    assert out.block.code == "unbound_reference"
    assert out.block.status == 403
    assert "api.gitlab.com" in out.block.message and "github/pat" in out.block.message
    assert values["github/pat"] not in out.block.message.encode()


def test_value_toward_unbound_host_blocks(values):
    v = values["github/pat"]
    out = make_engine(values).process_request(req("evil.example", body=b'{"x": "' + v + b'"}'))
    assert out.block.code == "plaintext_egress"
    assert "evil.example" in out.block.message and "github/pat" in out.block.message
    assert v not in out.block.message.encode()


@pytest.mark.parametrize("policy,expect", [("seal", "sealed"), ("allow", "original")])
def test_plaintext_elsewhere_seal_and_allow(values, policy, expect):
    v = values["github/pat"]
    rules = RULES + f"policy: {{plaintext_elsewhere: {policy}}}\n"
    body = b'{"x": "' + v + b'"}'
    out = make_engine(values, rules).process_request(req("evil.example", body=body))
    assert out.block is None
    if expect == "sealed":
        assert out.request.body == b'{"x": "{{secret:github/pat}}"}'
    else:
        assert out.request.body == body


def test_provider_gets_everything_sealed_and_never_blocks(values):
    v = values["github/pat"]
    body = json.dumps({"messages": [{"content": f"token {v.decode()} and {{{{secret:github/pat}}}}"}]}).encode()
    out = make_engine(values).process_request(
        req("api.anthropic.com", path=b"/v1/messages", headers=[(b"x-api-key", b"{{secret:anthropic/key}}")], body=body, method="POST", ct="application/json")
    )
    assert out.block is None
    assert v not in flat(out.request)
    assert b"{{secret:github/pat}}" in out.request.body
    # the vendor's own key, bound to its host, is injected
    assert (b"x-api-key", values["anthropic/key"]) in out.request.headers


def test_provider_signed_fields_are_never_changed(values):
    import base64 as b64

    v = values["github/pat"]
    # Vendor-signed fields, at their place in each vendor's request schema,
    # are left as the vendor wrote them (SPEC §6). The blob is made to hold
    # a value's base64 only so that a rewrite would show.
    blob = b64.b64encode(b"\x07" * 30 + v + b"\x01" * 30).decode()
    body = json.dumps(
        {
            "messages": [
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "see " + v.decode(), "signature": blob},
                    {"type": "redacted_thinking", "data": blob},
                ]},
            ],
            "input": [{"type": "reasoning", "encrypted_content": blob}],
            "contents": [{"role": "model", "parts": [{"text": "ok", "thoughtSignature": blob}]}],
        }
    ).encode()
    assert len(protected_spans(body)) == 4
    out = make_engine(values).process_request(req("api.anthropic.com", body=body, method="POST", ct="application/json"))
    doc = json.loads(out.request.body)
    blocks = doc["messages"][0]["content"]
    assert blocks[0]["thinking"] == "see {{secret:github/pat}}"
    assert blocks[0]["signature"] == blob and blocks[1]["data"] == blob
    assert doc["input"][0]["encrypted_content"] == blob
    assert doc["contents"][0]["parts"][0]["thoughtSignature"] == blob


def test_a_field_named_like_a_signed_one_elsewhere_is_sealed(values):
    import base64 as b64

    v = values["github/pat"]
    blob = b64.b64encode(b"user:" + v).decode()
    # A user's own JSON (a tool result) with a `signature` field, and a
    # `data` field outside a redacted_thinking block: not the vendor's.
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": [
                {"type": "tool_result", "content": json.dumps({"signature": blob})},
                {"type": "text", "text": "x", "signature": blob},
                {"type": "document", "data": blob},
            ]}],
            "signature": blob,
        }
    ).encode()
    assert protected_spans(body) == []
    out = make_engine(values).process_request(req("api.anthropic.com", body=body, method="POST", ct="application/json"))
    assert v not in out.request.body
    assert b64.b64encode(b"user:{{secret:github/pat}}") in out.request.body.replace(b"\\/", b"/")


def test_raw_value_in_a_field_named_like_a_signed_field_is_sealed(values):
    # ...but a raw value there was not written by the vendor.
    v = values["github/pat"].decode()
    body = json.dumps({"tool_input": {"signature": v}}).encode()
    out = make_engine(values).process_request(req("api.anthropic.com", body=body, method="POST", ct="application/json"))
    assert json.loads(out.request.body) == {"tool_input": {"signature": "{{secret:github/pat}}"}}


def test_value_spanning_query_pieces_is_sealed(values):
    tok = values["gitlab/token"] + b"&x=" + b"y" * 8  # a raw value holding '&'
    engine = make_engine({**values, "gitlab/token": tok})
    out = engine.process_request(req("api.openai.com", query=b"a=1&t=" + tok + b"&b=2"))
    assert tok not in flat(out.request)
    out = engine.process_request(req("evil.example", query=b"t=" + tok))
    assert out.block.code == "plaintext_egress"


def test_value_as_header_name(values):
    v = values["github/pat"]
    out = make_engine(values).process_request(req("evil.example", headers=[(v, b"1")]))
    assert out.block.code == "plaintext_egress" and "a header name" in out.block.message
    out = make_engine(values).process_request(req("api.openai.com", headers=[(b"a", b"b"), (v, b"1")]))
    assert out.block is None and out.request.headers == [(b"a", b"b")]


def test_basic_auth_injection_git_style(values):
    creds = base64.b64encode(b"x-access-token:{{secret:github/pat}}")
    out = make_engine(values).process_request(req("github.com", path=b"/o/r.git/info/refs", headers=[(b"Authorization", b"Basic " + creds)]))
    assert out.block is None
    (_, v), = out.request.headers
    assert base64.b64decode(v.split()[1]) == b"x-access-token:" + values["github/pat"]


def test_plaintext_basic_to_bound_host_is_forwarded_as_is(values):
    header = b"Basic " + base64.b64encode(b"me:" + values["github/pat"])
    out = make_engine(values).process_request(req("github.com", headers=[(b"Authorization", header)]))
    assert out.block is None
    assert out.request.headers == [(b"Authorization", header)]


def test_query_path_and_body_injection_encoded_for_place(values):
    tok = values["gitlab/token"]
    out = make_engine(values).process_request(
        req(
            "gitlab.example.com",
            path=b"/api/%7B%7Bsecret:gitlab%2Ftoken%7D%7D/x",
            query=b"private_token=%7B%7Bsecret%3Agitlab%2Ftoken%7D%7D&page=2",
            body=b'{"t": "{{secret:gitlab/token}}"}',
            method="POST",
            ct="application/json",
        )
    )
    assert out.block is None
    from urllib.parse import quote

    assert out.request.path == b"/api/" + quote(tok, safe="").encode() + b"/x"
    assert out.request.query == b"private_token=" + quote(tok, safe="").encode() + b"&page=2"
    assert json.loads(out.request.body) == {"t": tok.decode()}


def test_method_restriction(values):
    out = make_engine(values).process_request(
        req("gitlab.example.com", query=b"private_token={{secret:gitlab/token}}", method="DELETE")
    )
    assert out.block.code == "unbound_reference"


def test_insecure_scheme_blocks_and_allow_http_injects(values):
    out = make_engine(values).process_request(
        req("api.github.com", scheme="http", port=80, headers=[(b"Authorization", b"token {{secret:github/pat}}")])
    )
    assert out.block.code == "insecure_scheme"
    out = make_engine(values).process_request(
        req("intranet.example.com", scheme="http", port=80, headers=[(b"Authorization", b"token {{secret:plain/http}}")])
    )
    assert out.block is None
    assert out.request.headers == [(b"Authorization", b"token " + values["plain/http"])]


def test_header_value_with_crlf_is_never_injected(values):
    values = dict(values, **{"github/pat": b"abc\r\nX-Evil: 1"})
    out = make_engine(values).process_request(req("api.github.com", headers=[(b"Authorization", b"Bearer {{secret:github/pat}}")]))
    assert out.block is not None
    assert b"X-Evil" not in flat(out.request)


def test_unknown_reference_is_plain_text_and_reported(values):
    out = make_engine(values).process_request(req("api.gitlab.com", headers=[(b"Authorization", b"Bearer {{secret:nope/x}}")]))
    assert out.block is None
    assert out.unknown == {"nope/x"}


def test_previous_value_is_sealed_not_injected(values):
    old = b"ghp_old_" + secrets.token_hex(10).encode()
    engine = make_engine(values, previous={"github/pat": (old,)})
    out = engine.process_request(req("api.anthropic.com", body=b"old " + old, method="POST"))
    assert out.request.body == b"old {{secret:github/pat}}"
    out = engine.process_request(req("api.github.com", headers=[(b"Authorization", b"Bearer {{secret:github/pat}}")]))
    assert old not in flat(out.request)


def test_unchanged_request_is_the_same_bytes(values):
    body = b'{"hello": "world"}'
    out = make_engine(values).process_request(req("example.com", body=body, method="POST"))
    assert out.block is None
    assert out.request.body is body


def test_bound_secret_without_a_value_blocks_with_a_fix(values):
    del values["github/pat"]
    out = make_engine(values).process_request(
        req("api.github.com", headers=[(b"Authorization", b"Bearer {{secret:github/pat}}")])
    )
    assert out.block.code == "vault_unavailable" and out.block.status == 502
    assert "keyveil secret set github/pat" in out.block.message
    # a name in no rule and no vault is plain text
    out = make_engine(values).process_request(req("api.github.com", headers=[(b"X-Note", b"{{secret:nobody/knows}}")]))
    assert out.block is None and out.unknown == {"nobody/knows"}


def test_references_hidden_in_base64_are_found_from_any_character_in_either_alphabet():
    # _base64_tokens looks into a header token only when it holds the base64 of
    # "sec", "cre" or "ecr" (every reference marker holds "secret"): that
    # shortcut must never hide a reference, whatever is glued before it.
    import base64
    import random
    from urllib.parse import quote

    from keyveil._pipeline import _base64_tokens
    from keyveil._references import may_hold_reference

    rng = random.Random(5)
    for _ in range(2000):
        ref = rng.choice(["{{secret:github/pat}}", quote("{{secret:a/b}}", safe=""), "\\u007b\\u007bsecret:x/y}}"])
        payload = rng.randbytes(rng.randrange(6)) + rng.choice([b"x-access-token:", b"", b"u:"]) + ref.encode() + rng.randbytes(rng.randrange(4))
        text = (base64.urlsafe_b64encode if rng.random() < 0.5 else base64.b64encode)(payload)
        if rng.random() < 0.5:
            text = text.rstrip(b"=")
        glued = rng.choice([b"", b"tok_", b"Basic ", b"x"]) + text
        assert any(may_hold_reference(d) for d in _base64_tokens(glued)), (ref, glued)


# -- the memo of short seals (headers, paths) -------------------------------------------


def test_memo_seals_as_the_sealer_does(values):
    engine = make_engine(values)
    pat = values["github/pat"]
    fields = (
        (b"content-type", b"application/json"),
        (b"authorization", b"Bearer " + pat),
        (b"x-forwarded", base64.b64encode(b"u:" + pat)),
        (b"x-ref", b"{{secret:github/pat}}"),
    )
    for batch in (fields[:1], fields, fields[::-1], fields[:1] + fields[3:]):
        for _ in range(2):  # the second time from the memo
            assert engine.memo.seal_fields(batch) == engine.sealer.seal_fields(batch)
    for data, url, plus in ((b"/repos/" + pat, True, False), (b"q=" + pat.replace(b"_", b"%5F"), True, True), (b"/x", True, False)):
        for _ in range(2):
            got, want = engine.memo.seal(data, url=url, plus=plus), engine.sealer.seal(data, url=url, plus=plus)
            assert (got.data, got.counts) == (want.data, want.counts)
        assert engine.memo.find_names(data) == engine.sealer.find_names(data)
    unchanged = b"/nothing/here"
    assert engine.memo.seal(unchanged).data is unchanged


def test_a_header_seen_before_a_value_was_registered_is_sealed_after(values):
    """The memo belongs to one engine: a new value (a rotation) is sealed in headers already seen."""
    new = b"rot-" + secrets.token_hex(16).encode()
    header = [(b"X-Note", b"token " + new)]
    before = make_engine(values).process_request(req("api.anthropic.com", headers=header))
    assert before.request.headers == header
    after = make_engine({**values, "anthropic/key": new}).process_request(req("api.anthropic.com", headers=header))
    assert after.request.headers == [(b"X-Note", b"token {{secret:anthropic/key}}")]
    assert after.sealed == {"anthropic/key": 1}


def test_the_same_headers_twice_get_the_same_decision(values):
    """What a header holds is kept per engine: the second request is judged as the first."""
    engine = make_engine(values)
    hidden = base64.b64encode(base64.b64encode(b"u:{{secret:github/pat}}"))
    cases = [
        ("api.gitlab.com", [(b"Authorization", b"Bearer {{secret:github/pat}}")], "unbound_reference"),
        ("api.gitlab.com", [(b"X-Api-Token", hidden)], "unbound_reference"),
        ("api.github.com", [(b"X-Note", b"{{secret:no/such}}")], None),
        ("api.github.com", [(b"Authorization", b"Bearer {{secret:github/pat}}")], None),
    ]
    for host, headers, code in cases:
        first, second = (engine.process_request(req(host, headers=headers)) for _ in range(2))
        assert (first.block and first.block.code) == (second.block and second.block.code) == code
        assert first.unknown == second.unknown
        assert first.injected == second.injected
    assert engine.process_request(req("api.github.com", headers=[(b"X-Note", b"{{secret:no/such}}")])).unknown == {"no/such"}


def test_the_memo_stays_bounded_and_right_under_ever_new_headers(values):
    engine = make_engine(values)
    pat = values["github/pat"]
    for i in range(2_500):  # 5,000 distinct fields: the memo is emptied once
        fields = ((b"x-n", b"%d" % i), (b"x-v", b"%d " % i + pat))
        sealed, counts = engine.memo.seal_fields(fields)
        assert sealed == ((b"x-n", b"%d" % i), (b"x-v", b"%d {{secret:github/pat}}" % i)) and counts == {"github/pat": 1}
    assert len(engine.memo._fields) <= 4096
