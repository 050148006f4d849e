"""The leak corpus (tests/leak_corpus.py) through a real mitmdump running keyveil.

A fast subset runs in the normal suite; ``make soak`` runs ten thousand cases
through one proxy. Both print their seed: ``KEYVEIL_CORPUS_SEED=N`` replays a
run (values included), ``KEYVEIL_CORPUS_CASES=12,57`` only those cases.
"""

from __future__ import annotations

import base64
import gzip
import os
import time
from random import Random

import pytest

from tests.conftest import keyveil_proxy
from tests import leak_corpus as lc

FAST_CASES = 240
SOAK_CASES = int(os.environ.get("KEYVEIL_SOAK_CASES", "10000"))


@pytest.fixture(scope="module")
def seed() -> int:
    return lc.corpus_seed()


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


def _assert_quiet(proxy, kv, det: lc.Detector) -> None:
    """I5: nothing the proxy wrote (console, flow file, audit log) holds a form of a value."""
    time.sleep(0.5)
    proxy.stop()
    outputs = {"console": proxy.output().encode(), "flow file": proxy.flowfile.read_bytes()}
    for p in (kv.home / "audit").glob("*.jsonl"):
        outputs[f"audit {p.name}"] = p.read_bytes()
    assert len(outputs["flow file"]) > 1000
    leaks = {where: found for where, data in outputs.items() if (found := det.find(data))}
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
    shown = "\n".join(report.failures[:40])
    assert not report.failures, (
        f"{len(report.failures)} failures with {lc.SEED_ENV}={seed} "
        f"(replay one with {lc.CASES_ENV}=ID):\n{shown}"
    )
    return report


# --- the generator and the oracle themselves -------------------------------------------


def test_detector_sees_every_form_and_not_the_reference(seed):
    values = lc.make_values(seed)
    det = lc.Detector(values)
    rng = Random(seed)
    for name, value in values.items():
        for form in lc.FORMS:
            for _ in range(6):
                sent, detail = lc.encode_value(value, form, rng)
                assert det.find(b"x " + sent + b" y") != [], (name, form, detail)
        # Basic credentials and base64 payloads at every offset, both alphabets, any padding
        for offset in range(6):
            run = base64.b64encode(b"u" * offset + value + b"tail")
            assert det.find(run) and det.find(run.rstrip(b"=")) and det.find(run.replace(b"+", b"-").replace(b"/", b"_"))
        sealed = b"Bearer {{secret:" + name.encode() + b"}} " + base64.b64encode(b"u:{{secret:" + name.encode() + b"}}")
        assert det.find(sealed) == []
    # the oracle's decoders see through a second gzip member
    two = gzip.compress(b"hello ") + gzip.compress(values["github/pat"])
    assert any(det.find(b) for b in lc.decodings(two, "gzip"))


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
    }
    outcomes = {c.expected() for c in cases}
    assert {(200, None), (101, None), (403, "plaintext_egress"), (403, "unbound_reference")} <= outcomes
    assert any(c.bound_leak for c in cases) and any(c.ws_message_blocked for c in cases)


# --- through the proxy ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_leak_corpus_fast(upstream, up, corpus_kv, seed, capsys, tmp_path):
    with _proxy(upstream, corpus_kv, tmp_path) as proxy:
        _run(proxy, up, corpus_kv, seed, FAST_CASES, capsys, workers=12)
        _assert_quiet(proxy, corpus_kv, lc.Detector(corpus_kv.values))


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_leak_corpus_soak(upstream, up, corpus_kv, seed, capsys, tmp_path):
    with _proxy(upstream, corpus_kv, tmp_path) as proxy:
        report = _run(proxy, up, corpus_kv, seed, SOAK_CASES, capsys, workers=12)
        assert report.cases == len(_cases(seed, SOAK_CASES, corpus_kv.values))
        assert proxy.returncode is None, "the proxy died during the soak"
        _assert_quiet(proxy, corpus_kv, lc.Detector(corpus_kv.values))
