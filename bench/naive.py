"""The naive sealer the engine is compared against: one ``bytes.replace`` per listed form of every value.

It is the design keyveil gave up: a list of what common encoders write
(raw; JSON with every character escaped and with `ensure_ascii`;
percent-encoded; the value-only middle of its base64 at each byte offset,
both alphabets), each searched with ``bytes.replace``. It does not decode
anything. Only for benchmarks.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from urllib.parse import quote

from keyveil._references import format_reference


def listed_forms(value: bytes) -> list[bytes]:
    text = value.decode("utf-8", "replace")
    forms = {value, json.dumps(text)[1:-1].encode(), "".join(f"\\u{ord(c):04x}" for c in text).encode(), quote(value, safe="").encode()}
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + value)
        stable = encoded[4 if offset else 0 : (offset + len(value)) // 3 * 4]
        forms.update((stable, stable.translate(bytes.maketrans(b"+/", b"-_"))))
    return sorted(f for f in forms if len(f) >= 8)


class NaiveSealer:
    def __init__(self, values: Mapping[str, Sequence[bytes]]) -> None:
        self.pairs: list[tuple[bytes, bytes]] = []
        for name in sorted(values):
            ref = format_reference(name).encode("ascii")
            for value in values[name]:
                self.pairs += [(form, ref) for form in listed_forms(value)]

    def seal(self, data: bytes) -> bytes:
        for pattern, replacement in self.pairs:
            data = data.replace(pattern, replacement)
        return data
