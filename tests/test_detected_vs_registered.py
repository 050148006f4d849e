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
