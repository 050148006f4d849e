"""Shared pieces of the benchmarks: result rows, statistics, machine facts, fake values.

Every speed claim a benchmark makes is a ratio against a baseline measured in
the same run, interleaved with it, because the machine is shared and noisy;
an absolute figure (MB/s, seconds) is reported next to a baseline measured
the same way. Values are fake, generated per run, and never printed.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import statistics
import string
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"  # scratch: logs, profiles (git-ignored)

MiB = 1 << 20


@dataclasses.dataclass
class Row:
    """One measured figure, its target, and whether the target is met (None: no target)."""

    section: str
    name: str
    value: str
    target: str
    met: bool | None
    detail: str = ""

    def show(self) -> None:
        verdict = {True: "MET", False: "MISSED", None: "—"}[self.met]
        print(f"  [{verdict:6}] {self.name}: {self.value}  (target {self.target})", flush=True)
        if self.detail:
            print(f"           {self.detail}", flush=True)


def stop_process(proc: subprocess.Popen, grace: float = 10) -> None:
    """End PROC (one this bench started): SIGTERM, then SIGKILL after GRACE seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fmt_ms(s: float) -> str:
    return f"{s * 1000:.2f} ms"


def fmt_mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


# -- fake values ------------------------------------------------------------------

_ALNUM = string.ascii_letters + string.digits
# One each of '/', '"' and '+': the JSON, percent and base64 forms then all differ
# from the raw form, and every value has the same number of forms (11). A fixed
# count keeps runs comparable: the literal matcher Hyperscan picks, and its speed,
# change with the number of patterns (see the engine notes in RESULTS.md).
_SPECIAL = '/"+'


def fake_value(rng: random.Random) -> bytes:
    """A random 32-40 character token holding one of each character of _SPECIAL."""
    n = rng.randint(32, 40)
    chars = [rng.choice(_ALNUM) for _ in range(n)]
    for pos, ch in zip(rng.sample(range(1, n - 1), len(_SPECIAL)), _SPECIAL, strict=True):
        chars[pos] = ch
    return "".join(chars).encode()


def new_rng() -> tuple[random.Random, int]:
    seed = int.from_bytes(os.urandom(4), "big")
    return random.Random(seed), seed


# -- machine facts --------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, str]:
    from importlib.metadata import version

    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "src", "addons"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        if dirty:
            commit += " (+ uncommitted changes in src/ or addons/)"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "mitmproxy": version("mitmproxy"),
        "hyperscan": version("hyperscan"),
        "httpx": version("httpx"),
        "kernel": platform.release(),
        "commit": commit,
    }


# -- process memory (psutil is not installed) -----------------------------------------------


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM of PID in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, val = line.split(":", 1)
            out[key] = int(val.split()[0]) * 1024
    return out


def reset_peak(pid: int | str = "self") -> bool:
    """Reset VmHWM of PID to its current RSS (Linux clear_refs); False when not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False
