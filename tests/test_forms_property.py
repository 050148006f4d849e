"""Properties of the sealer under forms made by the standard library's encoders (SPEC §3).

The forms come from tests/stdlib_forms.py (stdlib encoders, random valid
choices, up to two layers); the judgement from tests/stdlib_oracle.py
(stdlib decoders, three layers deep). Neither reads keyveil's code, so an
encoding keyveil does not decode is a failing example here, not a blind spot.

(a) a sealed buffer holds no recoverable value, and each form counts once;
(b) a buffer holding no value comes back as the same bytes;
(c) any chunking of a stream scrubs like the whole buffer, leaving no value;
(d) each sealed form still decodes, layer by layer with the decoders that
    made it, to what it held with the value replaced by ``{{secret:NAME}}``,
    in requests (seal) and responses (scrub) alike; references written
    through layers are left alone.

``make test`` runs a few hundred examples; ``make soak`` many thousands.
"""

from __future__ import annotations

import json
from collections import Counter
from random import Random

import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from keyveil._engine import Sealer
from tests import stdlib_forms as sf
from tests.stdlib_oracle import Oracle, check_round_trip, split_carrier

# `make test` runs the same examples every time (derandomize): CI is reproducible;
# `make soak` draws new ones on every run.
FAST = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
SOAK = settings(max_examples=4000, deadline=None, suppress_health_check=list(HealthCheck))


def soak(test):
    """A `make soak` property: 4,000 examples take minutes, past the suite's 120 s per test."""
    return pytest.mark.timeout(3600)(pytest.mark.soak(test))


NAMES = ("github/pat", "s1", "team/a.b-c_d")


def ref(name: str) -> bytes:
    return b"{{secret:" + name.encode() + b"}}"


class Scenario:
    """Secrets (name -> [current, *previous]) and a buffer of forms of them, with noise between."""

    def __init__(self, secrets: dict[str, list[bytes]], forms: list[sf.Form], noise: list[bytes]) -> None:
        self.secrets = secrets
        self.buffer = sf.join_forms(forms, noise)
        self.oracle = Oracle(secrets)

    @property
    def data(self) -> bytes:
        return self.buffer.data

    def expected_counts(self) -> Counter[str]:
        return Counter(f.name for f in self.buffer.forms if f.name)

    def describe(self) -> str:
        return "; ".join(f"{f.name}: {f.label} = {f.describe()}" for f in self.buffer.forms)


def _distinct(values: list[bytes]) -> bool:
    return all(a == b or a not in b for a in values for b in values)


@st.composite
def secrets_strategy(draw) -> dict[str, list[bytes]]:
    n = draw(st.integers(1, len(NAMES)))
    values = draw(st.lists(sf.values_strategy(), min_size=n, max_size=n + 2, unique=True))
    assume(_distinct(values))
    secrets = {NAMES[i]: [values[i]] for i in range(n)}
    for v in values[n:]:  # previous values of a rotated secret
        secrets[NAMES[draw(st.integers(0, n - 1))]].append(v)
    return secrets


@st.composite
def scenarios(draw, max_forms: int = 3) -> Scenario:
    secrets = draw(secrets_strategy())
    entries = [(name, v) for name, vs in secrets.items() for v in vs]
    oracle = Oracle(secrets)
    forms = []
    for _ in range(draw(st.integers(1, max_forms))):
        name, value = entries[draw(st.integers(0, len(entries) - 1))]
        form = draw(sf.forms_strategy(value, name=name))
        # a form of one value must expose that value only (no value hides in another's slot)
        assume(set(oracle.find(form.in_carrier())) == {name})
        # In a buffer of several kinds, a `+` cannot be told to be a space or a base64
        # character: a query or form is sealed as one (the pipeline says `plus=True`),
        # which test_every_chain_seals_and_round_trips covers.
        assume(not (form.layers and form.layers[-1].plus))
        forms.append(form)
    noise = draw(st.lists(sf.noise_strategy, min_size=len(forms) + 1, max_size=len(forms) + 1))
    return Scenario(secrets, forms, noise)


@st.composite
def clean_scenarios(draw) -> Scenario:
    """Forms of near misses of the values, of other values, and of the references, through any chain."""
    secrets = draw(secrets_strategy())
    entries = [(name, v) for name, vs in secrets.items() for v in vs]
    forms = []
    for _ in range(draw(st.integers(1, 4))):
        rng = draw(st.randoms(use_true_random=False))
        name, value = entries[draw(st.integers(0, len(entries) - 1))]
        kind = draw(st.sampled_from(("near", "other", "reference", "reference-escaped")))
        if kind == "near":
            decoy = sf.near_miss(value, rng)
        elif kind == "other":
            decoy = draw(sf.values_strategy())
        elif kind == "reference":
            decoy = ref(name)
        else:
            decoy = ref(name).replace(b"/", b"\\/")  # as PHP's and some Java encoders write it in JSON
        forms.append(sf.make_form(decoy, draw(sf.chains_strategy), rng))
    noise = draw(st.lists(st.one_of(sf.noise_strategy, st.binary(max_size=40)), min_size=len(forms) + 1, max_size=len(forms) + 1))
    scenario = Scenario(secrets, forms, noise)
    assume(not scenario.oracle.find(scenario.data))
    return scenario


def _leaks(oracle: Oracle, data: bytes) -> dict[str, str]:
    return oracle.explain(data)  # name -> decodings that exposed it; never the bytes


# --- (a) sealed output holds no value, counted right -------------------------------------------


def _prop_a(scenario: Scenario) -> None:
    note(scenario.describe())
    result = Sealer(scenario.secrets).seal(scenario.data)
    leaks = _leaks(scenario.oracle, result.data)
    assert not leaks, f"recoverable after seal: {leaks}"
    assert dict(result.counts) == dict(scenario.expected_counts())
    assert result.changed


test_a_sealed_output_holds_no_value = FAST(given(scenarios())(_prop_a))
test_a_soak_sealed_output_holds_no_value = soak(SOAK(given(scenarios(max_forms=4))(_prop_a)))


# --- (b) a clean buffer comes back unchanged ---------------------------------------------------


def _prop_b(scenario: Scenario) -> None:
    note(scenario.describe())
    sealer = Sealer(scenario.secrets)
    result = sealer.seal(scenario.data)
    assert result.data == scenario.data, "a buffer holding no value was changed by seal"
    assert not result.changed
    scrubbed = sealer.scrub(scenario.data)
    assert scrubbed.data == scenario.data, "a buffer holding no value was changed by scrub"
    assert not scrubbed.changed


test_b_clean_buffer_is_unchanged = FAST(given(clean_scenarios())(_prop_b))
test_b_soak_clean_buffer_is_unchanged = soak(SOAK(given(clean_scenarios())(_prop_b)))


# --- (c) a stream in any chunks scrubs like the whole buffer -----------------------------------


def _prop_c(scenario: Scenario, cuts: list[int]) -> None:
    note(scenario.describe())
    sealer = Sealer(scenario.secrets)
    data = scenario.data
    whole = sealer.scrub(data)
    stream = sealer.stream()
    out, last = [], 0
    for cut in sorted({c % (len(data) + 1) for c in cuts}):
        out.append(stream.feed(data[last:cut]))
        last = cut
    out.append(stream.feed(data[last:]))
    out.append(stream.feed(b"", final=True))
    streamed = b"".join(out)
    leaks = _leaks(scenario.oracle, streamed)
    assert not leaks, f"recoverable from the stream output: {leaks}"
    assert streamed == whole.data, "a chunked stream scrubbed otherwise than the whole buffer"
    assert dict(stream.counts) == dict(whole.counts) == dict(scenario.expected_counts())


_cuts = st.lists(st.integers(0, 1 << 16), max_size=16)
test_c_any_chunking_scrubs_like_whole = FAST(given(scenarios(), _cuts)(_prop_c))
test_c_soak_any_chunking_scrubs_like_whole = soak(SOAK(given(scenarios(max_forms=4), _cuts)(_prop_c)))


# --- (d) the carrier round trip ----------------------------------------------------------------


def round_trip_problems(scenario: Scenario, sealed: bytes) -> list[str]:
    """Everything wrong with SEALED as SCENARIO's buffer with each value replaced by its reference."""
    parts = sealed.split(sf.SEPARATOR)
    buf = scenario.buffer
    if len(parts) != 2 * len(buf.forms) + 1:
        return ["the separators between forms were changed"]
    problems = []
    for i, piece in enumerate(buf.pieces):
        if parts[2 * i] != piece:
            problems.append(f"the text between forms changed (piece {i})")
    for i, form in enumerate(buf.forms):
        span = split_carrier(parts[2 * i + 1], *form.carrier)
        if span is None:
            problems.append(f"form {i} ({form.label}): the carrier around it changed")
            continue
        problems += [f"form {i} ({form.label}): {p}" for p in check_round_trip(form, span, ref(form.name))]
    return problems


def _prop_d(scenario: Scenario) -> None:
    note(scenario.describe())
    sealer = Sealer(scenario.secrets)
    for what, result in (("seal", sealer.seal(scenario.data)), ("scrub", sealer.scrub(scenario.data))):
        problems = round_trip_problems(scenario, result.data)
        assert not problems, f"{what}: " + "; ".join(problems)


test_d_sealed_carrier_decodes_to_the_reference = FAST(given(scenarios())(_prop_d))
test_d_soak_sealed_carrier_decodes_to_the_reference = soak(SOAK(given(scenarios(max_forms=4))(_prop_d)))


# --- the generator and the oracle themselves (these hold whatever the engine does) ----------


@FAST
@given(st.data())
def test_the_oracle_recovers_every_generated_form(data):
    value = data.draw(sf.values_strategy())
    form = data.draw(sf.forms_strategy(value, name="a/b"))
    note(form.describe())
    assert Oracle({"a/b": [value]}).find(form.in_carrier()) == ["a/b"]
    assert check_round_trip(form, form.data, value) == []  # the form is its own round trip


@FAST
@given(st.data())
def test_the_checker_accepts_a_correct_seal_and_refuses_the_unsealed_form(data):
    value = data.draw(sf.values_strategy())
    form = data.draw(sf.forms_strategy(value, name="github/pat"))
    note(form.describe())
    sealed = sf.rewrite(form, ref("github/pat"))
    assert check_round_trip(form, sealed, ref("github/pat")) == []
    assert check_round_trip(form, form.data, ref("github/pat")) != []
    assert Oracle({"github/pat": [value]}).find(form.carrier[0] + sealed + form.carrier[1]) == []


def test_a_percent_layer_that_escaped_nothing_may_be_read_as_absent_and_nothing_else_is_let_through():
    # pct(b64) in a form slot: the base64 held no '+', '/' or '=' to escape, so the percent
    # layer left no trace (the soak's 32:1655). A seal that writes the reference's base64 as
    # plain base64 ('+' and '/' raw) is a round trip of the layer below; one that is neither
    # the layer's nor plain base64 is refused, and so is the same output under a layer that showed.
    import base64

    from tests.stdlib_forms import Form, Layer

    reference = ref("github/pat")
    value, pre, post = b"Zz9" + b"x" * 29, b"user:", b">!"
    inner = base64.b64encode(pre + value + post)
    assert not set(inner) & set(b"+/=")  # nothing for the percent layer to escape
    sealed_plain = base64.b64encode(pre + reference + post)
    assert b"+" in sealed_plain  # a space, read through the form layer
    b64 = Layer("b64", pre, post, padded=True, marked=False, pad_shown=False)

    def form(escaped: bool) -> Form:
        pct = Layer("pct", b"", b"", slot="form", safe="", escaped=escaped)
        return Form(value, (b64, pct), inner, (b"", b""), "github/pat")

    assert check_round_trip(form(False), sealed_plain, reference) == []
    assert check_round_trip(form(True), sealed_plain, reference) != []
    assert check_round_trip(form(True), sealed_plain.replace(b"+", b"%2B"), reference) == []
    assert check_round_trip(form(False), sealed_plain[:10] + b"!" + sealed_plain[11:], reference) != []


# --- every chain, by name (a table of what holds, for whoever works on the engine) -------------


@pytest.mark.parametrize("chain", sf.CHAINS, ids=[sf.chain_label(c) for c in sf.CHAINS])
def test_every_chain_seals_and_round_trips(chain):
    """Each chain, 40 seeded examples with values of every kind: (a) and (d) at once."""
    rng = Random(f"chain-{chain}")
    failures = Counter()
    for i in range(40):
        value = sf.random_value(rng, ("token", "rich", "unicode")[i % 3])
        form = sf.make_form(value, chain, rng, name="github/pat")
        data = form.in_carrier()
        # A percent-encoded carrier is a URL or form: the pipeline says so (url=True).
        outer = form.layers[-1] if form.layers else None
        url = outer is not None and outer.kind == "pct"
        result = Sealer({"github/pat": [value]}).seal(data, url=url, plus=url and outer.plus)
        if leaks := Oracle({"github/pat": [value]}).explain(result.data):
            failures[f"leak via {leaks['github/pat']}: {form.describe()}"] += 1
            continue
        span = split_carrier(result.data, *form.carrier)
        problems = ["the carrier changed"] if span is None else check_round_trip(form, span, ref("github/pat"))
        if problems:
            failures[f"{problems[0]}: {form.describe()}"] += 1
    leaked = sum(n for k, n in failures.items() if k.startswith("leak"))
    assert not failures, (
        f"{sum(failures.values())} of 40 failed ({leaked} leaked, {sum(failures.values()) - leaked} sealed "
        "but did not round-trip):\n" + "\n".join(list(failures)[:12])
    )


# --- references through layers are references, not values --------------------------------------


def test_references_through_layers_are_left_alone():
    value = b"tk_" + bytes(Random().choice(sf.TOKEN_ALPHABET.encode()) for _ in range(30))
    sealer = Sealer({"github/pat": [value]})
    for data in (
        json.dumps({"text": "use {{secret:github/pat}} here"}).replace("/", "\\/").encode(),
        b'{"text":"{{secret:github\\/pat}}"}',
        b"/search?q=%7B%7Bsecret%3Agithub%2Fpat%7D%7D&x=1",
        b"note=%7b%7bsecret%3agithub%2fpat%7d%7d",
        b'{"k":"{\\"inner\\":\\"{{secret:github\\\\/pat}}\\"}"}',
    ):
        result = sealer.seal(data)
        assert result.data == data and not result.changed
        assert sealer.scrub(data).data == data
