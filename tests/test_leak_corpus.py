"""The leak corpus (tests/leak_corpus.py) through a real mitmdump running keyveil.

``make test`` runs 2,000 cases through one proxy; ``make soak`` runs 20,000
(``KEYVEIL_SOAK_CASES``). Both print their seed: ``KEYVEIL_CORPUS_SEED=N``
replays a run (values included), ``KEYVEIL_CORPUS_CASES=12,57`` only those
cases. Forms come from the standard-library generator (tests/stdlib_forms.py),
verdicts from the standard-library oracle (tests/stdlib_oracle.py).
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import time
from random import Random

import pytest
from mitmproxy import io as mitm_io

from tests import leak_corpus as lc
from tests import stdlib_forms as sf
from tests.conftest import keyveil_proxy
from tests.stdlib_oracle import Oracle

FAST_CASES = int(os.environ.get("KEYVEIL_CORPUS_FAST_CASES", "2000"))
SOAK_CASES = int(os.environ.get("KEYVEIL_SOAK_CASES", "20000"))


#: `make test` replays one seed (CI is reproducible); `make soak` draws a new one
#: each run (KEYVEIL_CORPUS_SEED replays either). The seed is issue 8's number,
#: fixed before it was ever run: not picked among seeds for passing. Seed 16,
#: the one before, was picked when 3-9 of 2,000 cases of other seeds failed.
FAST_SEED = 8


@pytest.fixture(scope="module")
def seed(request) -> int:
    markers = request.config.getoption("-m", default="") or ""
    if os.environ.get(lc.SEED_ENV) or ("soak" in markers and "not soak" not in markers):
        return lc.corpus_seed()
    return FAST_SEED


@pytest.fixture(scope="module")
def corpus_kv(tmp_path_factory, seed):
    return lc.make_corpus_home(tmp_path_factory.mktemp("corpus"), seed)


def _proxy(upstream, kv, work):
    return keyveil_proxy(upstream, work, kv, flowfile=work / "flows.mitm", flow_detail=1)


def _cases(seed, n, values):
    """The first N cases of SEED, or only those named in KEYVEIL_CORPUS_CASES (whatever their number)."""
    only = lc.selected_cases()
    if only is None:
        return lc.generate(seed, n, values)
    return [c for c in lc.generate(seed, max(only) + 1, values) if c.id in only]


def _flow_records(data: bytes) -> list[bytes]:
    """The flow file cut into its flows: each is one top-level tnetstring (LENGTH ':' PAYLOAD TYPE).

    Decoding flow by flow finds what decoding the whole file finds (no
    encoding spans two flows) at a fraction of the cost.
    """
    records, i = [], 0
    while i < len(data):
        colon = data.index(b":", i)
        end = colon + 1 + int(data[i:colon]) + 1
        records.append(data[i:end])
        i = end
    assert i == len(data), "the flow file does not end with a whole flow"
    return records


def _assert_quiet(proxy, kv, oracle: Oracle) -> None:
    """I5: nothing the proxy wrote (console, flow file, audit log) holds a recoverable value."""
    time.sleep(0.5)
    proxy.stop()
    flow_file = proxy.flowfile.read_bytes()
    assert len(flow_file) > 1000
    outputs = {"console": proxy.output().encode()}
    for p in (kv.home / "audit").glob("*.jsonl"):
        outputs[f"audit {p.name}"] = p.read_bytes()
    for i, record in enumerate(_flow_records(flow_file)):
        outputs[f"flow file, flow {i}"] = record
    with proxy.flowfile.open("rb") as f:  # bodies stored content-encoded, decoded as a reader would
        for i, flow in enumerate(mitm_io.FlowReader(f).stream()):
            for part in ("request", "response"):
                message = getattr(flow, part, None)
                if message is not None and message.raw_content and message.headers.get("content-encoding"):
                    outputs[f"flow file, flow {i}, decoded {part} body"] = message.get_content(strict=False) or b""
    leaks = {where: found for where, data in outputs.items() if (found := oracle.find(data))}
    assert leaks == {}


def _run(proxy, up, kv, seed, n, capsys, workers):
    cases = _cases(seed, n, kv.values)
    report = lc.Report(seed)
    with capsys.disabled():
        print(f"\nleak corpus: {lc.SEED_ENV}={seed}, {len(cases)} cases, {workers} clients")
    started = time.monotonic()
    lc.run(proxy, up, kv.values, cases, report, workers=workers)
    elapsed = time.monotonic() - started
    with capsys.disabled():
        print(report.render())
        print(f"  time: {elapsed:.1f} s ({report.cases / max(elapsed, 1e-9):.0f} cases/s)")
    assert report.cases == len(cases), "some cases were not judged"
    shown = "\n".join(report.failures[: int(os.environ.get("KEYVEIL_CORPUS_SHOW", "40"))])
    assert not report.failures, (
        f"{len(report.failures)} failures with {lc.SEED_ENV}={seed} "
        f"(replay one with {lc.CASES_ENV}=ID):\n{report.render(kinds=False)}\n{shown}"
    )
    return report


# --- the generator and the oracle themselves -------------------------------------------


def test_oracle_sees_every_form_and_not_the_reference(seed):
    values = lc.make_values(seed)
    oracle = Oracle(values)
    rng = Random(seed)
    for name, value in values.items():
        for form in lc.FORMS:
            for location in ("header", "query", "body"):
                for _ in range(4):
                    made, prefix = lc.make_case_form(value, form, rng, location, "form")
                    assert oracle.find(b"x " + prefix + made.data + b" y") == [name], (name, form, made.describe())
        # Basic credentials and base64 payloads at every offset, both alphabets, any padding, wrapped
        for offset in range(6):
            run = base64.b64encode(b"u" * offset + value + b"tail")
            for variant in (run, run.rstrip(b"="), run.replace(b"+", b"-").replace(b"/", b"_"), base64.encodebytes(run)):
                assert oracle.find(variant) == [name]
        # escaped twice, percent-encoded twice, base64 of a JSON document
        doc = json.dumps({"k": value.decode()})
        assert oracle.find(json.dumps({"outer": doc}).encode()) == [name]
        assert oracle.find(base64.b64encode(doc.encode())) == [name]
        ref = lc.reference(name)
        sealed = b"Bearer " + ref + b" " + base64.b64encode(b"u:" + ref) + json.dumps(ref.decode()).encode()
        assert oracle.find(sealed) == []
        # a near miss is no value
        assert oracle.find(sf.near_miss(value, rng)) == []
    # the corpus decoders see through a second gzip member
    two = gzip.compress(b"hello ") + gzip.compress(values["github/pat"])
    assert any(oracle.find(b) for b in lc.decodings(two, "gzip"))


def test_generator_is_reproducible_and_covers_every_dimension(seed):
    values = lc.make_values(seed)
    assert lc.make_values(seed) == values
    cases = lc.generate(seed, FAST_CASES, values)
    again = lc.generate(seed, FAST_CASES, values)
    assert [(c.describe(), c.path, c.headers, c.body, c.message) for c in cases] == [
        (c.describe(), c.path, c.headers, c.body, c.message) for c in again
    ]
    seen = {
        "host": {c.host for c in cases},
        "transport": {c.transport for c in cases},
        "location": {c.location for c in cases},
        "header": {c.header for c in cases if c.location == "header"},
        "form": {c.form for c in cases if c.name},
        "body kind": {c.body_kind for c in cases if c.location == "body" and c.name},
        "encoding": {c.encoding for c in cases if c.location == "body" and c.transport != "ws"},
        "value": {c.name for c in cases if c.name},
        "ref": {c.ref for c in cases},
        "decoy": {c.decoy for c in cases},
    }
    assert seen == {
        "host": set(lc.HOSTS),
        "transport": set(lc.TRANSPORTS),
        "location": set(lc.LOCATIONS),
        "header": set(lc.HEADERS),
        "form": set(lc.FORMS),
        "body kind": set(lc.BODY_KINDS),
        "encoding": set(lc.ENCODINGS),
        "value": set(values),
        "ref": set(lc.REFS),
        "decoy": set(lc.DECOYS),
    }
    outcomes = {c.expected() for c in cases}
    assert {(200, None), (101, None), (403, "plaintext_egress"), (403, "unbound_reference")} <= outcomes
    assert any(c.bound_leak for c in cases) and any(c.ws_message_blocked for c in cases)
    # every form travels in every location it fits, to providers (sealed in place) and elsewhere
    assert {c.form for c in cases if c.sealed_in_place} == set(lc.FORMS)
    assert {c.decoy for c in cases if c.decoy != "none" and c.expected()[1] is None} == {"near", "ref"}


# --- through the proxy ---------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_leak_corpus_fast(upstream, up, corpus_kv, seed, capsys, tmp_path):
    with _proxy(upstream, corpus_kv, tmp_path) as proxy:
        _run(proxy, up, corpus_kv, seed, FAST_CASES, capsys, workers=12)
        _assert_quiet(proxy, corpus_kv, Oracle(corpus_kv.values))


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_leak_corpus_soak(upstream, up, corpus_kv, seed, capsys, tmp_path):
    with _proxy(upstream, corpus_kv, tmp_path) as proxy:
        _run(proxy, up, corpus_kv, seed, SOAK_CASES, capsys, workers=12)
        assert proxy.returncode is None, "the proxy died during the soak"
        _assert_quiet(proxy, corpus_kv, Oracle(corpus_kv.values))
