"""Run keyveil's benchmarks and record them in bench/RESULTS.md (`make bench`).

    .venv/bin/python bench/run.py [--quick] [--only engine|proxy|detect]

``engine`` times the sealer in-process; ``proxy`` runs plain mitmdump and
mitmdump + keyveil side by side over loopback TLS; ``detect`` measures the
precision, recall and speed of the detector of unregistered values. Each figure is printed with
its target as it is measured. The figures are kept in bench/results.json and
RESULTS.md is rewritten from it, so ``--only`` refreshes one section and keeps
the other. Text below the notes marker in RESULTS.md is kept as it is.
The exit code is 0 even when a target is missed (the table says so); it is
non-zero only when a benchmark could not run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import BENCH, Row, machine  # noqa: E402

RESULTS_MD = BENCH / "RESULTS.md"
RESULTS_JSON = BENCH / "results.json"
NOTES_MARKER = "<!-- notes: everything below this line is kept by bench/run.py -->"
TITLES = {
    "engine": "Engine (`keyveil._engine.Sealer`, in-process)",
    "proxy": "Proxy (plain mitmdump vs mitmdump + keyveil, loopback TLS both sides)",
    "detect": "Detector of unregistered values (`keyveil._detect`, in-process)",
}
ABOUT = {
    "engine": (
        "Fake values are 32-40 random characters with one each of `/`, `\"` and `+` (11 forms per value: "
        "1,000 values give 11,000 forms), new every run. The naive baseline loops "
        "`bytes.replace` over every form from `keyveil._forms.forms_of`, timed in the same rounds as "
        "the sealer. MB = 10^6 bytes. Seal times are medians of repeated runs."
    ),
    "proxy": (
        "Both proxies: `mitmdump -q`, `connection_strategy=lazy`, `ssl_verify_upstream_trusted_ca` = the "
        "bench upstream's trustme CA, a private confdir, and bench/route_addon.py sending every connection "
        "to the bench upstream (its own process, HTTP/1.1, TLS) with the original Host and SNI. *plain* "
        "also streams every response (plain mitmproxy otherwise buffers SSE: mitmproxy issue 4469); "
        "*keyveil* adds `-s addons/keyveil.py` with a home made by `keyveil init` and 10 fake secrets set "
        "by `keyveil secret set` (`PYTHON_KEYRING_BACKEND=keyring.backends.fail.Keyring`). Requests "
        "alternate between the two proxies. Peak RSS growth = VmHWM after the transfer − VmRSS before it, "
        "with VmHWM reset through /proc/PID/clear_refs; neither proxy sets stream_large_bodies."
    ),
    "detect": (
        "The false-positive corpus is built at run time from this machine (tests/detect_corpus.py): the venv's "
        "Python source and dist-info metadata, minified JavaScript and package.json/lock files of a few npm "
        "packages (installed into ~/.cache/keyveil-tests/detect-npm), git object ids of this repository, UUIDs, "
        "and images as base64; one generated token is planted in every file and not counted. Tokens are built "
        "from documented prefixes and random pieces, new every run. Speed: medians of CPU time (process_time: the "
        "machine is shared), detector and Sealer.seal() "
        "interleaved on the same body (1,000 and 10 fake values of 32-40 characters)."
    ),
}


def load_results() -> dict:
    try:
        return json.loads(RESULTS_JSON.read_text())
    except (OSError, ValueError):
        return {"sections": {}}


def render(results: dict) -> str:
    lines = [
        "# keyveil benchmarks",
        "",
        "Written by `make bench` (`.venv/bin/python bench/run.py`; `--quick` for fewer repetitions, "
        "`--only engine|proxy|detect` for one section). Do not edit the tables by hand: run the benchmarks.",
        "Every speed figure is a ratio against a baseline measured in the same run, interleaved with it, "
        "because the machine is shared and noisy; absolute figures come with their baseline.",
        "",
    ]
    for section in ("engine", "proxy", "detect"):
        data = results["sections"].get(section)
        if not data:
            continue
        m = data["machine"]
        met = sum(1 for r in data["rows"] if r["met"] is True)
        targets = sum(1 for r in data["rows"] if r["met"] is not None)
        lines += [
            f"## {TITLES[section]}",
            "",
            f"- date: {data['date']} ({data['mode']} run, {data['seconds']:.0f} s); commit {m['commit']}",
            f"- machine: {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}",
            f"- Python {m['python']}, mitmproxy {m['mitmproxy']}, ahocorasick_rs {m['ahocorasick_rs']}, httpx {m['httpx']}",
            f"- targets met: {met} of {targets}",
            "",
            ABOUT[section],
            "",
            "| Benchmark | Result | Target | Met | Details |",
            "|---|---|---|---|---|",
        ]
        for r in data["rows"]:
            verdict = {True: "yes", False: "**NO**", None: "—"}[r["met"]]
            cells = [r["name"], f"**{r['value']}**", r["target"], verdict, r["detail"]]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_results(results: dict) -> None:
    RESULTS_JSON.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    notes = ""
    if RESULTS_MD.exists():
        old = RESULTS_MD.read_text()
        if NOTES_MARKER in old:
            notes = old.split(NOTES_MARKER, 1)[1]
    RESULTS_MD.write_text(render(results) + "\n" + NOTES_MARKER + (notes or "\n"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, noisier)")
    parser.add_argument("--only", choices=("engine", "proxy", "detect"), help="run one section, keep the others' results")
    args = parser.parse_args(argv)

    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; Python {info['python']}, mitmproxy {info['mitmproxy']}", flush=True)
    results = load_results()
    sections = [args.only] if args.only else ["engine", "proxy", "detect"]
    for section in sections:
        print(f"\n== {section} ==", flush=True)
        t0 = time.monotonic()
        if section == "engine":
            import engine_bench

            rows: list[Row] = engine_bench.run(args.quick)
        elif section == "detect":
            import detect_bench

            rows = detect_bench.run(args.quick)
        else:
            import proxy_bench

            rows = proxy_bench.run(args.quick)
        results["sections"][section] = {
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "mode": "quick" if args.quick else "full",
            "seconds": time.monotonic() - t0,
            "machine": info,
            "rows": [asdict(r) for r in rows],
        }
        write_results(results)  # after each section, so a failure later keeps what was measured
    missed = [r for s in sections for r in results["sections"][s]["rows"] if r["met"] is False]
    print(f"\nwrote {RESULTS_MD.relative_to(BENCH.parent)}; {len(missed)} target(s) missed", flush=True)
    for r in missed:
        print(f"  missed: {r['name']}: {r['value']} (target {r['target']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
