"""Performance cliffs found by the black-box attack (tests/test_attack.py).

Standalone: ``.venv/bin/python bench/attack_cliffs.py``. Prints seconds and
seconds per MiB for inputs that make the sealer slower than 1 s/MiB. Not part
of ``bench/run.py``; numbers are absolute (shared 2-core machine: noisy).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import string
import time

from keyveil._engine import Sealer

MiB = 1 << 20


def stream(s: Sealer, data: bytes, chunk: int) -> None:
    st = s.stream()
    for i in range(0, len(data), chunk):
        st.feed(data[i : i + chunk])
    st.feed(b"", final=True)


def main() -> None:
    value = "tok_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(28))
    s = Sealer({"github/pat": [value.encode()]})
    cases = []
    for kib in (256, 512, 1024):
        e = base64.b64encode(os.urandom(kib * 1024 * 3 // 4))
        gh = json.dumps({"content": "\n".join(e[i : i + 60].decode() for i in range(0, len(e), 60))}).encode()
        for chunk in (1024, 4096, 16384):
            cases.append((f"stream one base64 run, {kib} KiB, {chunk} B chunks", lambda d=e, c=chunk: stream(s, d, c), len(e)))
        cases.append((f"stream contents-API JSON (base64 wrapped at 60), {kib} KiB, 1024 B chunks", lambda d=gh: stream(s, d, 1024), len(gh)))
    for mib in (1, 2):
        pct = b"q=" + b"%41" * (mib * MiB // 3)
        cases.append((f"seal a query of %41 escapes, {mib} MiB", lambda d=pct: s.seal(d), len(pct)))
        cases.append((f"stream a query of %41 escapes, {mib} MiB, 4096 B chunks", lambda d=pct: stream(s, d, 4096), len(pct)))
    for name, run, size in cases:
        t = time.perf_counter()
        run()
        dt = time.perf_counter() - t
        print(f"{name:70s} {size / MiB:5.2f} MiB {dt:7.2f} s {dt / (size / MiB):7.2f} s/MiB", flush=True)


if __name__ == "__main__":
    main()
