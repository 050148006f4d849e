"""The detector of values nobody registered (SPEC §3a): the shipped table, the scanner, the names.

Every token is built at run time from a documented prefix and random pieces
(tests/detect_corpus.py and tests/tokens.py); nothing committed looks like a credential.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import textwrap
from pathlib import Path

import pytest

from keyveil._detect import (
    Detection,
    DetectorTableError,
    detected_name,
    entropy,
    load_detectors,
    looks_random,
    parse_detectors,
    shipped_detector,
    shipped_table_path,
)
from keyveil._references import REFERENCE_PATTERN, format_reference
from tests import detect_corpus
from tests.tokens import ALNUM, B64URL, DIGITS, HEX, LETTERS, MAKERS, UPPER, b64, rnd, samples, seeded_tokens  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def detector():
    return shipped_detector()


def _found(detector, data: bytes) -> list[tuple[str, bytes]]:
    return [(d.kind, d.value) for d in detector.find(data)]


# --- the table ---------------------------------------------------------------------------


def test_the_shipped_table_loads_and_every_kind_has_a_generator(detector):
    assert set(detector.kinds) == set(MAKERS), "a kind without a generator here is a kind nobody tests"
    required = {
        "github-pat", "github-oauth-token", "github-user-token", "github-app-token", "github-refresh-token",
        "github-fine-grained-pat", "gitlab-pat", "anthropic-api-key", "openai-project-key",
        "openai-service-account-key", "openai-legacy-key", "google-api-key", "aws-access-key", "aws-secret-key",
        "slack-bot-token", "stripe-secret-key", "stripe-test-secret-key", "stripe-restricted-key",
        "stripe-test-restricted-key", "npm-token", "pypi-token", "huggingface-token", "twilio-api-key",
        "sendgrid-api-key", "digitalocean-token", "shopify-access-token", "azure-storage-key", "private-key",
        "jwt", "assignment",
    }  # fmt: skip
    assert required <= set(detector.kinds)


def test_every_entry_documents_its_provider_and_format(detector):
    for entry in detector.table.detectors:
        assert entry.provider.strip() and len(entry.about) > 20, entry.name
        if entry.hosts:  # a proposal is a valid binding of rules.yaml
            assert entry.inject


def test_a_ghp_token_proposes_github_with_basic_for_git(detector):
    entry = detector.proposal("github-pat")
    assert [str(h) for h in entry.hosts] == ["api.github.com", "github.com"]
    assert {i.location for i in entry.inject} == {"header:authorization", "basic_auth"}
    assert detector.proposal("aws-access-key") is None  # SigV4: sealed, never proposed for injection


# --- every kind, in every carrier ------------------------------------------------------------

CARRIERS = {
    "alone": "{t}",
    "in prose": "the token is {t} and that is all",
    "quoted": 'value "{t}" here',
    "env line": "SOMETHING={t}\nNEXT=1\n",
    "json-escaped lines": "first line\\n{t}\\nlast line",
    "yaml": "entry: '{t}'\n",
    "markdown code": "`{t}`",
    "after a tab and before a comma": "x\t{t}, y",
}


@pytest.mark.parametrize("carrier", list(CARRIERS))
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_every_kind_is_detected_in_every_carrier(detector, kind, carrier):
    for text, value in samples(kind):
        if kind == "private-key" and "\\n" in CARRIERS[carrier] and "\n" in text:
            continue  # covered below: a PEM needs its real line breaks, the sealer decodes JSON first
        data = CARRIERS[carrier].format(t=text).encode()
        assert (kind, value.encode()) in _found(detector, data), f"{kind} missed in {carrier}"


def test_the_reported_span_is_the_value(detector):
    for kind in MAKERS:
        for text, value in samples(kind):
            data = b"<<" + text.encode() + b">>"
            hits = [d for d in detector.find(data) if d.kind == kind]
            assert [d.value for d in hits if d.value == value.encode()], kind
            assert all(data[d.start : d.end] == d.value for d in hits), kind


def test_a_private_key_inside_a_json_string_is_found_in_the_decoded_string(detector):
    (_, pem), *_ = samples("private-key")
    body = json.dumps({"role": "user", "content": f"here:\n{pem}\nbye"}).encode()
    raw = detector.find(body)
    assert all(b"PRIVATE KEY-----" not in d.value for d in raw), "a header alone is not a value"
    decoded = json.loads(body)["content"].encode()
    assert ("private-key", pem.encode()) in _found(detector, decoded)


def test_a_truncated_private_key_is_still_detected(detector):
    (_, pem), *_ = samples("private-key")
    cut = pem[: len(pem) // 2].rstrip()
    (hit,) = detector.find(f"$ head -c 200 key.pem\n{cut}\n$ ".encode())
    assert hit.kind == "private-key" and hit.value == cut.encode()


def test_a_pem_header_without_key_material_is_not_a_value(detector):
    for text in (
        'if line == "-----BEGIN PRIVATE KEY-----":',
        "-----BEGIN RSA PRIVATE KEY-----\n...\n-----END RSA PRIVATE KEY-----",
        "-----BEGIN CERTIFICATE-----\n" + base64.b64encode(secrets.token_bytes(300)).decode() + "\n-----END CERTIFICATE-----",
    ):
        assert detector.find(text.encode()) == [], text[:30]


def test_a_detection_needs_a_boundary_before_and_after(detector):
    token = "ghp_" + rnd(36)
    assert detector.find(("x" + token).encode()) == []
    aws = "AKIA" + rnd(16, UPPER + DIGITS)
    assert detector.find((aws + "Z").encode()) == []  # 21 characters: not a key id
    assert detector.find(("9" + aws).encode()) == []
    # ... but escapes and percent-encoding are boundaries, as clients write them
    assert _found(detector, ("%22" + token + "%22").encode()) == [("github-pat", token.encode())]
    assert _found(detector, ("a\\n" + token).encode()) == [("github-pat", token.encode())]


def test_a_checksum_is_not_required(detector):
    # GitHub's last six characters are a CRC32 of the rest: a made-up one is still sealed.
    token = "ghp_" + "A" * 30 + rnd(6)
    assert _found(detector, token.encode()) == [("github-pat", token.encode())]


def test_the_aws_secret_key_counts_only_beside_its_id_or_name(detector):
    secret = rnd(40, ALNUM + "/+")
    assert detector.find(f"some text {secret} more".encode()) == []
    assert ("aws-secret-key", secret.encode()) in _found(detector, f"aws_secret_access_key = {secret}".encode())
    assert ("aws-secret-key", secret.encode()) in _found(detector, f'"SecretAccessKey": "{secret}"'.encode())
    key_id = "AKIA" + rnd(16, UPPER + DIGITS)
    csv = f"User name,Access key ID,Secret access key\nci,{key_id},{secret}\n".encode()
    assert _found(detector, csv) == [("aws-access-key", key_id.encode()), ("aws-secret-key", secret.encode())]
    # too far after the id, or inside a longer base64 run: not a secret key
    assert [k for k, _ in _found(detector, f"{key_id} {'.' * 300} {secret}".encode())] == ["aws-access-key"]
    session = rnd(300, ALNUM + "/+")
    assert [k for k, _ in _found(detector, f"{key_id},{session}".encode())] == ["aws-access-key"]


def test_a_credentials_file_is_sealed_whole(detector):
    key_id, secret, session = "ASIA" + rnd(16, UPPER + DIGITS), rnd(40, ALNUM + "/+"), rnd(356, ALNUM + "/+")
    text = f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\naws_session_token = {session}\n"
    found = _found(detector, text.encode())
    assert found == [
        ("aws-access-key", key_id.encode()),
        ("aws-secret-key", secret.encode()),
        ("assignment", session.encode()),
    ]


def test_an_assigned_value_of_a_known_shape_keeps_its_kind(detector):
    token = "github_pat_" + rnd(22) + "_" + rnd(59)
    assert _found(detector, f"GITHUB_TOKEN={token}".encode()) == [("github-fine-grained-pat", token.encode())]
    assert _found(detector, f'{{"Authorization": "Bearer {token}"}}'.encode()) == [
        ("github-fine-grained-pat", token.encode())
    ]


# --- assignments -----------------------------------------------------------------------------------

ASSIGNMENTS = [
    "API_KEY={v}",
    "export OPENAI_API_KEY={v}",
    "MY_SERVICE_TOKEN='{v}'",
    'DB_PASSWORD="{v}"',
    '{{"api_key": "{v}"}}',
    '{{\\"client_secret\\": \\"{v}\\"}}',  # a JSON document inside a JSON string, as a body carries it
    "client_secret: {v}",
    "  x-api-key: {v}",
    "authToken := \"{v}\"",
    "'credentials' => '{v}',",
    "--auth-token={v}",
    "Authorization: Bearer {v}",
    "Authorization: Basic {v}",
    'SECRET_KEY: str = "{v}"',
    "aws_session_token = {v}",
    "secretKey={v}&next=1",
    "https://api.example.com/v1/items?access_token={v}&page=2",
]


@pytest.mark.parametrize("form", ASSIGNMENTS)
def test_assignments_to_secret_looking_names_are_detected(detector, form):
    for make in (lambda: rnd(32), lambda: rnd(24, HEX), lambda: b64(30)):
        value = make()
        found = _found(detector, form.format(v=value).encode())
        assert found == [("assignment", value.encode())], form


def test_keywords_are_found_in_the_spellings_names_use(detector):
    value = rnd(32)
    for name in ("password", "PASSWORD", "Password", "dbPassword", "DB_PASSWORD", "db-password", "X-Db-Password"):
        assert _found(detector, f"{name}={value}".encode()) == [("assignment", value.encode())], name
    # Decided and documented (docs/detection.md): a keyword is looked for in lower case,
    # UPPER case and Capitalised, as names are written; not in an arbitrary mix.
    assert detector.find(f"PaSsWoRd={value}".encode()) == []


NOT_SECRETS = [
    "API_KEY=${API_KEY}",
    "token = self.tokenizer.get_next_token()",
    "key = os.environ['API_KEY']",
    "password: changeme-changeme-changeme",
    "SECRET_KEY_PATH=/etc/myapp/secrets/server.key",
    "AUTH_URL=https://auth.example.com/oauth/token",
    "TOKEN_TTL_SECONDS=86400000000000000000",
    'if key == "abcdefghijklmnop1234":',
    "PRIVATE_KEY_FILE=config/private_key_file_name.pem",
    "api_key: <your-api-key-here>",
    "token: xxxxxxxxxxxxxxxxxxxxxxxx",
    "authorization = request.headers.get_authorization_header",
    "key: ThisIsMyConfigurationSectionName",
    "secret = {{secret:github/pat}}",
    "key=sha256",
    "AUTH_BACKEND=django.contrib.auth.backends.ModelBackend",
    "credentials_provider = botocore.credentials.InstanceMetadataProvider",
    "the token budget is 200000 tokens per minute",
    "monkey_name = 'aaaaaaaaaaaaaaaaaaaaaaaa'",
    '            "token_reviewer_jwt": token_reviewer_jwt,',  # hvac passes a variable on
]


@pytest.mark.parametrize("text", NOT_SECRETS)
def test_non_secrets_are_not_detected(detector, text):
    assert detector.find(text.encode()) == []


def test_non_secret_shapes_are_not_detected(detector):
    import hashlib
    import uuid

    lines = []
    for _ in range(200):
        blob = secrets.token_bytes(64)
        lines += [
            str(uuid.uuid4()),
            uuid.uuid4().hex,
            hashlib.sha1(blob).hexdigest(),
            hashlib.sha256(blob).hexdigest(),
            "sha512-" + base64.b64encode(hashlib.sha512(blob).digest()).decode(),
            base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode(),
        ]
    text = "\n".join(lines) + "\n" + base64.b64encode(secrets.token_bytes(300_000)).decode()
    assert detector.find(text.encode()) == []


def test_the_randomness_threshold():
    # recall: random values of the usual alphabets. Measured on 100,000 draws each
    # (docs/detection.md): at most 0.04% rejected at 24 characters, none at 40.
    for alphabet in (ALNUM, HEX, ALNUM + "+/", B64URL, UPPER + "234567", LETTERS):
        values = [rnd(24, alphabet).encode() for _ in range(2000)]
        assert sum(map(looks_random, values)) >= 0.995 * len(values), alphabet
    # precision: words, identifiers, paths, versions, placeholders
    for text in (b"my_secret_key_name_here", b"ThisIsMyConfigName", b"os.environ.get_default", b"python3.12-slim-bookworm",
                 b"aaaaaaaaaaaaaaaaaaaaaaaaaa", b"1234567890123456789", b"https://example.com/x/y", b"$OTHER_VARIABLE_NAME",
                 b"your-api-key-goes-here", b"ssl.TLSVersion.TLSv1_2", b"short1A", b"root_token_pgp_key",
                 b"jwt_validation_pubkeys", b"CertificateIssuerPublicKeyTypes", b"KEY_ALG_RSA_2048",
                 b"my_dummy_key_value_1234", b"myDummyTokenValue8", b"AKIAXXXXXXXXXXXXXXXX"):  # fmt: skip
        assert not looks_random(text), text
    assert entropy(b"") == 0 and entropy(b"ab") == 1 and abs(entropy(bytes(range(16))) - 4) < 1e-9


# Values CI once saw rejected: long lower-case runs with few digits read as words
# by their grouping alone (about one random 40-character value in 600).
GROUPED_LIKE_WORDS = ["3eFpGQMbcraeijPt7FhubtEtkwonvnBNkgbvobcD", "Suveh82inFSKZMEzedgfewPuTFNpzVsIVOS7CTXs",
                      "e5cuwwkhjpAIGarSBIyNyKeoFQHgwqimmJUujGOQ", "jrMrUEzFcacNzdUbzKHIKJVylrfuyuloe5bEqan5",
                      "DeVzjcnzoTCL4TaVjgqLFtcN664aveansooRGhwL"]  # fmt: skip


@pytest.mark.parametrize("value", GROUPED_LIKE_WORDS)
def test_random_letters_grouped_like_words_are_still_random(detector, value):
    assert looks_random(value.encode())
    assert _found(detector, f"MY_SERVICE_API_KEY={value}".encode()) == [("assignment", value.encode())]


RANDOM_DRAWS = 10_000


def test_every_random_value_assigned_to_a_secret_name_is_detected(detector):
    """Property: each of 10,000 random values of the assignment shape is detected.

    The draws come from this test's own seed (tests/tokens.py), so a run
    repeats. Measured on five million values of 40 base62 characters, one was
    rejected (as words): with new draws (KEYVEIL_TOKENS_SEED=random) this test
    fails about once in 500 runs, where the grouping test alone missed about
    17 of these 10,000 values.
    """
    names = ["MY_SERVICE_API_KEY", "GITHUB_TOKEN", "db_password", "clientSecret", "X-Api-Key", "AUTH"]
    forms = ["{n}={v}", 'export {n}="{v}"', '"{n}": "{v}"', "{n}: {v}", "{n} := '{v}'"]
    missed = 0
    for i in range(RANDOM_DRAWS):
        text, value = samples("assignment")[0]  # MY_SERVICE_API_KEY= and 40 base62 characters
        if i % 2:
            text = forms[i % len(forms)].format(n=names[i % len(names)], v=value)
        hits = {d.value for d in detector.find(text.encode())}
        missed += value.encode() not in hits
    assert missed == 0, f"{missed} of {RANDOM_DRAWS} random values not detected"


@pytest.mark.parametrize("alphabet", [ALNUM + "+/", B64URL, HEX, UPPER + "234567", LETTERS], ids=["base64", "base64url", "hex", "base32", "letters"])
def test_random_values_of_other_alphabets_are_detected(detector, alphabet):
    """Property: 2,000 random values of 32-64 characters per alphabet, all detected."""
    missed = 0
    for i in range(2000):
        value = rnd(32 + i % 33, alphabet)
        missed += _found(detector, f"API_SECRET={value}\n".encode()) != [("assignment", value.encode())]
    assert missed == 0, f"{missed} of 2000 not detected"


# --- nothing is capped -------------------------------------------------------------------------------


def test_one_real_token_among_1000_decoys_is_found(detector):
    decoys = []
    for i in range(1000):
        decoys.append(
            (
                "ghp_" + rnd(35),  # one character short
                "AKIA" + rnd(15, UPPER + DIGITS),
                "sk-" + rnd(47),
                "xoxb-" + rnd(5),
                "-----BEGIN PRIVATE KEY-----",
                "eyJ" + rnd(20, B64URL),
                "api_key=my_application_key",
                "glpat-" + rnd(10),
            )[i % 8]
        )
    real = "ghp_" + rnd(36)
    position = secrets.randbelow(1001)
    decoys.insert(position, real)
    data = " ".join(decoys).encode()
    assert _found(detector, data) == [("github-pat", real.encode())]


def test_every_one_of_many_real_tokens_is_found(detector):
    tokens = [(kind, *samples(kind)[0]) for kind in sorted(MAKERS) for _ in range(40)]
    data = "\n".join(text for _, text, _ in tokens).encode()
    found = {(d.kind, d.value) for d in detector.find(data)}
    missed = [kind for kind, _, value in tokens if (kind, value.encode()) not in found]
    assert missed == [], f"{len(missed)} of {len(tokens)} missed, kinds: {sorted(set(missed))}"


def test_a_short_prefix_is_scanned_for_only_where_its_shape_can_start(detector):
    """`SK` (a Twilio API key's) occurs about 260 times in a MiB of random base64: the scan
    looks for the whole shape, so random base64 costs no call into Python, and the key is found."""
    noise = base64.b64encode(secrets.token_bytes(3 << 18))
    hits = [hit for hit in detector.hits(noise) if hit[0] < detector.view_base]
    assert noise.count(b"SK") > 100 and len(hits) < 40, f"{len(hits)} hits in random base64"
    key = "SK" + rnd(32, HEX)
    data = noise[:1000] + b" " + key.encode() + b" " + noise[1000:2000]
    assert ("twilio-api-key", key.encode()) in _found(detector, data)


def test_any_bytes_buffer_works_the_same(detector):
    text, value = samples("slack-bot-token")[0]
    data = f"a {text} b".encode()
    assert detector.find(data) == detector.find(bytearray(data)) == detector.find(memoryview(data))
    assert detector.find(b"") == [] and detector.find(bytes(range(256)) * 100) == []


def test_a_detection_never_shows_its_value(detector):
    text, value = samples("npm-token")[0]
    (hit,) = detector.find(text.encode())
    assert isinstance(hit, Detection)
    for shown in (repr(hit), str(hit), repr([hit])):
        assert value not in shown and "npm-token" in shown


# --- names ---------------------------------------------------------------------------------------------


def test_detected_names_are_stable_keyed_references_that_reveal_nothing():
    key, other_key = secrets.token_bytes(32), secrets.token_bytes(32)
    value = ("ghp_" + rnd(36)).encode()
    name = detected_name("github-pat", value, key)
    assert re.fullmatch(r"detected/github-pat-[a-z2-7]{16}", name)
    assert re.fullmatch(REFERENCE_PATTERN, format_reference(name))
    assert detected_name("github-pat", value, key) == name  # same value, same ID
    assert detected_name("github-pat", bytearray(value), key) == name
    assert detected_name("github-pat", value, other_key) != name  # another home: another ID
    assert detected_name("github-pat", value + b"x", key) != name
    assert detected_name("assignment", value, key).split("-")[-1] == name.split("-")[-1]  # the ID is the value's
    ident = name.rsplit("-", 1)[1]
    for form in (value, value.hex().encode(), base64.b64encode(value), base64.b32encode(value)):
        assert ident.encode() not in form.lower()
    with pytest.raises(ValueError):
        detected_name("github-pat", value, b"short")
    with pytest.raises(ValueError):
        detected_name("Not A Kind", value, key)


def test_ids_do_not_collide_on_many_values():
    key = secrets.token_bytes(32)
    names = {detected_name("jwt", secrets.token_bytes(24), key) for _ in range(20_000)}
    assert len(names) == 20_000


# --- table validation --------------------------------------------------------------------------------

GOOD = """\
version: 1
detectors:
  - name: demo-token
    provider: Demo
    about: demo token, demo_ then 20 letters
    prefixes: [demo_]
    shape: 'demo_[a-z]{20}'
    hosts: [api.demo.example]
    inject: [{header: Authorization}]
assignments:
  keywords: [key, token]
  min_length: 16
  min_entropy: 2.5
"""

FILE_LINE_FIELD = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): (?P<field>[^:]+): (?P<message>.+)$")


def _error(text: str) -> list[tuple[int, str, str]]:
    with pytest.raises(DetectorTableError) as info:
        parse_detectors(text, "my-detectors.yaml")
    out = []
    for line in str(info.value).splitlines():
        m = FILE_LINE_FIELD.match(line)
        assert m and m["file"] == "my-detectors.yaml", line
        out.append((int(m["line"]), m["field"], m["message"]))
    return out


def test_a_good_table_compiles_and_detects():
    detector = parse_detectors(GOOD)
    assert detector.kinds == ["demo-token", "assignment"]
    token = "demo_" + rnd(20, "abcdefghij")
    assert _found(detector, f"x {token} y".encode()) == [("demo-token", token.encode())]


@pytest.mark.parametrize(
    "change, line, field, message",
    [
        (("version: 1", "version: 2"), 1, "version", "unsupported version"),
        (("version: 1\n", ""), 1, "version", "required"),
        (("    about:", "    abuot:"), 5, "detectors[0].abuot", "did you mean 'about'"),
        (("'demo_[a-z]{20}'", "'demo_[a-z'"), 7, "detectors[0].shape", "not a valid regular expression"),
        (("'demo_[a-z]{20}'", "'(demo)?'"), 7, "detectors[0].shape", "matches empty text"),
        (("name: demo-token", "name: Demo_Token"), 3, "detectors[0].name", "not a detector name"),
        (("    prefixes: [demo_]\n", ""), 3, "detectors[0]", "list prefixes"),
        (("    inject: [{header: Authorization}]\n", ""), 3, "detectors[0]", "hosts and inject together"),
        (("[api.demo.example]", '["*.com"]'), 8, "detectors[0].hosts[0]", "would match"),
        (("{header: Authorization}", "{header: Host}"), 9, "detectors[0].inject[0].header", "frames or routes"),
        (("{header: Authorization}", "{hedaer: Authorization}"), 9, "detectors[0].inject[0].hedaer", "did you mean 'header'"),
        (("  min_length: 16", "  min_length: 4"), 12, "assignments.min_length", "at least 8"),
        (("  min_length: 16", "  min_length: sixteen"), 12, "assignments.min_length", "whole number"),
        (("  keywords: [key, token]", "  keywords: []"), 11, "assignments.keywords", "at least one keyword"),
        (("  keywords: [key, token]", "  keywords: [k1]"), 11, "assignments.keywords[0]", "usable keyword"),
        (("    prefixes: [demo_]", "    prefixes: [d]"), 6, "detectors[0].prefixes[0]", "usable prefix"),
        (("assignments:", "assignments: [\n"), 13, "(yaml)", "expected ',' or ']'"),
        (("  min_entropy: 2.5", "  min_entropy: 2.5\n  min_entropy: 3"), 14, "assignments.min_entropy", "duplicate key"),
    ],
)
def test_table_errors_name_file_line_and_field(change, line, field, message):
    old, new = change
    assert old in GOOD
    problems = _error(GOOD.replace(old, new, 1))
    assert any((line, field) == p[:2] and message in p[2] for p in problems), problems


def test_cross_entry_errors_are_found_too():
    second = textwrap.indent(
        "- name: demo-token\n  provider: Demo\n  about: again, with the same name\n  prefixes: [demo2_]\n"
        "  shape: 'demo2_[a-z]{20}'\n"
        "- name: demo-secret\n  provider: Demo\n  about: after an unknown kind\n  shape: '[a-z]{40}'\n"
        "  context: {after: demo-tokn}\n",
        "  ",
    )
    text = GOOD.replace("assignments:", second + "assignments:")
    problems = _error(text)
    assert (10, "detectors[1].name") == problems[0][:2] and "already the name of detectors[0]" in problems[0][2]
    assert problems[1][1] == "detectors[2].context.after" and "did you mean demo-token" in problems[1][2]


def test_an_unreadable_table_says_what_to_do(tmp_path: Path):
    with pytest.raises(DetectorTableError, match=r"missing\.yaml:1: \(file\): cannot read the detector table .*reinstall"):
        load_detectors(tmp_path / "missing.yaml")
    assert load_detectors(shipped_table_path()).kinds == shipped_detector().kinds


# --- precision on real text ------------------------------------------------------------------------------

PRECISION_CORPUS = 12 * detect_corpus.MiB
PRECISION_TARGET = 0.1  # detections per MiB of non-secret text


@pytest.fixture(scope="session")
def fp_corpus():
    return detect_corpus.fp_corpus(PRECISION_CORPUS, seed=7)


def test_precision_on_real_non_secret_text(detector, fp_corpus):
    """Public text from this machine holds no secret: what is found there is a false positive.

    Planted tokens are found and not counted; a PEM private key that really
    parses (mitmproxy ships one on purpose) is a true detection of its shape.
    """
    planted, missed, false, real = 0, [], [], 0
    size = 0
    for part in fp_corpus:
        data = part.data
        token_text, token = samples(sorted(MAKERS)[planted % len(MAKERS)])[0]
        cut = detect_corpus.plant_at(data)
        data = data[:cut] + b"\n" + token_text.encode() + b"\n" + data[cut:]
        planted += 1
        size += len(data)
        found = detector.find(data)
        if not any(d.value == token.encode() for d in found):
            missed.append(part.origin)
        for d in found:
            if d.value == token.encode() or (d.start >= cut and d.end <= cut + len(token_text) + 2):
                continue
            if d.kind == "private-key" and detect_corpus.is_real_private_key(d.value):
                real += 1
                continue
            false.append((part.source, d.kind, part.origin))  # never the value
    per_mib = len(false) / (size / detect_corpus.MiB)
    assert not missed, f"planted tokens missed in {missed[:5]}"
    assert per_mib <= PRECISION_TARGET, f"{per_mib:.2f} false detections per MiB: {false[:10]}"
    assert size >= PRECISION_CORPUS * 0.8, detect_corpus.describe(fp_corpus)


def test_every_kind_is_documented(detector):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "detection.md").read_text()
    assert [k for k in detector.kinds if f"`{k}`" not in doc] == []


def test_the_letter_pair_table_is_what_the_standard_library_gives():
    """The shipped table can be explained: tests/letter_pairs.py rebuilds it from this Python's stdlib.

    Another 3.12 patch release shifts a few counts; a cell may then move by one step.
    """
    from keyveil._letters import PAIR_TABLE
    from tests import letter_pairs

    shipped, rebuilt = PAIR_TABLE.split(), letter_pairs.rebuild().split()
    assert [len(row) for row in shipped] == [26] * 26
    cells = [(a, b) for row_s, row_r in zip(shipped, rebuilt) for a, b in zip(row_s, row_r)]
    off = [(a, b) for a, b in cells if a != b]
    assert all(abs(int(a, 16) - int(b, 16)) == 1 for a, b in off), off
    assert len(off) <= 0.03 * len(cells), f"{len(off)} of {len(cells)} cells differ"


def test_the_detector_has_a_short_repr(detector):
    text = repr(detector)
    assert text.startswith("<Detector kinds=") and "literals=" in text


def _shortest_match(pattern: str) -> int:
    """The fewest characters PATTERN can match, lookaheads counted (`ghs_(?=[…]{36})…` is 40)."""
    import re._constants as sre_constants
    import re._parser as sre_parser

    def width(items, state) -> int:
        total = 0
        for i, (op, av) in enumerate(items):
            if op is sre_constants.ASSERT and av[0] == 1:  # a lookahead: the rest must be at least as long
                return total + max(width(list(av[1]), state), width(items[i + 1 :], state))
            total += sre_parser.SubPattern(state, [(op, av)]).getwidth()[0]
        return total

    parsed = sre_parser.parse(pattern)
    return width(list(parsed), parsed.state)


def test_the_shortest_run_detection_decodes_is_the_base64_of_the_shortest_value_the_table_finds(detector):
    # MIN_RUN decides which base64 runs the detection views decode: one shorter than the base64 of
    # the shortest value any entry or assignment can find holds no detection. A table entry that
    # finds shorter values must lower it.
    from keyveil._detect import MIN_RUN

    table = detector.table
    shapes = {e.name: _shortest_match(e.shape) for e in table.detectors}
    assignment = min(map(len, table.assignments.keywords)) + 1 + table.assignments.min_length  # `key=` and the value
    shortest = min(*shapes.values(), assignment)
    assert shapes["aws-access-key"] == 20 and shapes["github-app-token"] == 40  # lookaheads counted
    assert MIN_RUN == -(-4 * shortest // 3) == 27
