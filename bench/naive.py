"""The naive sealer the engine is compared against: one ``bytes.replace`` per form of every value.

It uses the same forms as keyveil (``keyveil._forms.forms_of``), so the
comparison is about the search, not about which forms are looked for. It does
not decode base64 runs: a base64 form is replaced by the base64 of the
reference, which is good enough to time it. Only for benchmarks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from keyveil._forms import Kind, b64encode, forms_of, percent_reference
from keyveil._references import format_reference


class NaiveSealer:
    def __init__(self, values: Mapping[str, Sequence[bytes]]) -> None:
        self.pairs: list[tuple[bytes, bytes]] = []
        for name in sorted(values):
            ref = format_reference(name).encode("ascii")
            for value in values[name]:
                for form in forms_of(value):
                    if form.kind is Kind.PERCENT:
                        replacement = percent_reference(ref, form.upper_hex)
                    elif form.kind is Kind.B64:
                        replacement = b64encode(ref, form.urlsafe)
                    else:
                        replacement = ref
                    self.pairs.append((form.pattern, replacement))

    def seal(self, data: bytes) -> bytes:
        for pattern, replacement in self.pairs:
            data = data.replace(pattern, replacement)
        return data
