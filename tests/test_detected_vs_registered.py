"""A detected value never gets in a registered value's way (SPEC §3a on top of §3).

Found in the leak corpus (seed 8, case 324): a wrapped base64 block holding a
registered value, whose first line the assignment detector had taken for a
token. The registered value's run is re-encoded with its unchanged first line
kept as written, and the detected "value" must not then take that line.
"""

from __future__ import annotations

import base64
import json
import secrets

from keyveil._engine import Sealer
from tests.stdlib_oracle import Oracle


def test_a_detected_first_line_of_a_registered_values_run_is_left_to_the_run():
    value = b"sk-test-" + secrets.token_urlsafe(30).encode()
    doc = json.dumps({"text": "x" * 90 + " " + value.decode()}).encode()
    b64 = base64.urlsafe_b64encode(doc).rstrip(b"=")
    lines = [b64[i : i + 78] for i in range(0, len(b64), 78)]
    assert value not in base64.urlsafe_b64decode(lines[0] + b"=" * (-len(lines[0]) % 4))
    sealer = Sealer({"reg/key": [value], "detected/assignment-abc": [lines[0]]})
    body = b"KEY_DATA=" + b"\n".join(lines) + b"\n"
    sealed = sealer.seal(body).data
    run = sealed[len(b"KEY_DATA=") :].rstrip(b"\n").split(b"\n")
    assert all(len(line) == 78 for line in run[:-1]), "the run is no longer wrapped as it was"
    joined = b"".join(run)
    decoded = json.loads(base64.urlsafe_b64decode(joined + b"=" * (-len(joined) % 4)))
    assert decoded == {"text": "x" * 90 + " {{secret:reg/key}}"}


def test_a_registered_value_wins_over_an_overlapping_detected_one():
    value = b"reg_" + secrets.token_urlsafe(24).encode()
    detected = value[-10:] + b"_tail_" + secrets.token_hex(8).encode()  # touches the value's end
    sealer = Sealer({"reg/key": [value], "detected/token-abc": [detected]})
    sealed = sealer.seal(b"x " + value + detected[10:] + b" y").data
    assert value not in sealed
    assert sealed.startswith(b"x {{secret:reg/key}}")


def test_a_detected_value_starting_before_a_registered_one_does_not_hide_it():
    """Found by the soak leak corpus (seed 1953768134, case 6631): the proxy had learned
    `user:` and the first half of a registered token (read from one line of a wrapped
    base64 block). Starting earlier, the literal scan took it and skipped the registered
    value it overlaps, in every layer: base64 of base64 of `user:V` toward an unbound host
    was then found holding a detected value only, and forwarded."""
    value = b"ghp_" + secrets.token_urlsafe(27).encode()[:36]
    detected = b"user:" + value[:23]
    sealer = Sealer({"github/pat": [value], "detected/assignment-abc": [detected]})
    inner = base64.b64encode(b"\x10E" + b"user:" + value + b"|end")
    carriers = (
        b"x user:" + value + b" y",
        json.dumps({"t": "user:" + value.decode()}, ensure_ascii=True).encode().replace(b"u", b"\\u0075"),
        base64.urlsafe_b64encode(b"data:;base64," + inner),
    )
    for carrier in carriers:
        assert sealer.find_names(carrier) == {"github/pat": 1}, carrier
        sealed = sealer.seal(carrier).data
        decoded = b"\n".join(view for _, view in Oracle({"github/pat": value}).views(sealed))
        assert value[:23] not in sealed and value[23:] not in decoded, carrier


def test_a_run_read_at_two_offsets_gives_the_registered_value_the_way():
    """A short base64 run is decoded from each of its first four characters: when one
    reading holds only a detected value and a later one a registered value, the
    registered value is the one sealed (and found)."""
    value = b"reg_" + secrets.token_urlsafe(24).encode()
    detected = b"det_" + secrets.token_urlsafe(24).encode()
    first = base64.b64encode(b"a: " + detected + b" ok!").rstrip(b"=")
    assert len(first) % 4  # the second payload is read from another offset than the first
    run = first + base64.b64encode(b"b: " + value + b" end")
    sealer = Sealer({"reg/key": [value], "detected/token-abc": [detected]})
    assert sealer.find_names(b"blob " + run + b" x")["reg/key"] == 1
    sealed = sealer.seal(b"blob " + run + b" x").data
    assert Oracle({"reg/key": value}).find(sealed) == []

