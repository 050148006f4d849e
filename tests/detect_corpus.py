"""Corpora for the detector: non-secret text found on this machine, and generated tokens.

The false-positive corpus is built at run time from what is installed, never
committed: the Python source and package metadata of the venv, minified
JavaScript and a lock file from a few npm packages (installed into a cache
directory when missing), git object ids of this repository, UUIDs, and images
written as base64. Everything in it is public text, so every detection in it
is a false positive unless it was planted.

tests/test_detect.py runs a small corpus (the precision check can fail);
bench/detect_bench.py a larger one, and reports detections per MiB by source.
Only kinds, sources and offsets are ever printed: never a detected value.
"""

from __future__ import annotations

import base64
import os
import random
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20

#: npm packages whose minified builds and lock file join the corpus
NPM_PACKAGES = ["jquery", "lodash", "react-dom", "d3", "bootstrap", "moment", "vue", "chart.js", "axios", "@babel/standalone", "webpack", "eslint"]
NPM_CACHE = Path(os.environ.get("KEYVEIL_TEST_CACHE", Path.home() / ".cache" / "keyveil-tests")) / "detect-npm"


@dataclass(frozen=True)
class Part:
    source: str  # what it is: python, minified-js, lock, metadata, git-ids, uuids, base64-image
    origin: str  # where it came from (a path, or a description)
    data: bytes


def npm_modules(cache: Path = NPM_CACHE) -> Path:
    """node_modules holding NPM_PACKAGES, installed into CACHE on first use."""
    modules = cache / "node_modules"
    if all((modules / name / "package.json").is_file() for name in NPM_PACKAGES):
        return modules
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error", *NPM_PACKAGES],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"npm install of the corpus packages into {cache} failed (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-500:]}; check that npm can reach its registry"
        )
    return modules


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _take(paths: list[Path], budget: int, source: str, rng: random.Random) -> Iterator[Part]:
    """Whole files from PATHS in a random order until BUDGET bytes are taken."""
    paths = sorted(paths)
    rng.shuffle(paths)
    taken = 0
    for path in paths:
        if taken >= budget:
            return
        data = _read(path)
        if data:
            taken += len(data)
            yield Part(source, str(path), data)


def _python(budget: int, rng: random.Random) -> Iterator[Part]:
    site = _site_packages()
    paths = [p for p in site.rglob("*.py") if "/tests/" not in str(p) and "/test/" not in str(p)]
    yield from _take(paths, budget, "python", rng)


def _metadata(modules: Path, budget: int, rng: random.Random) -> Iterator[Part]:
    site = _site_packages()
    paths = [p for p in site.glob("*.dist-info/*") if p.name in ("RECORD", "METADATA", "WHEEL", "entry_points.txt")]
    paths += [p for p in modules.rglob("package.json") if p.is_file()]
    yield from _take(paths, budget, "metadata", rng)


def _minified_js(modules: Path, budget: int, rng: random.Random) -> Iterator[Part]:
    paths = [p for p in modules.rglob("*.min.js") if p.is_file()]
    paths += [p for p in _site_packages().rglob("*.js") if "static" in p.parts and p.stat().st_size > 20_000]
    yield from _take(paths, budget, "minified-js", rng)


def _locks(modules: Path, budget: int, rng: random.Random) -> Iterator[Part]:
    paths = [modules.parent / "package-lock.json", modules / ".package-lock.json", REPO / "uv.lock", REPO / "poetry.lock"]
    paths += list(_site_packages().rglob("*.lock"))
    yield from _take([p for p in paths if p.is_file()], budget, "lock", rng)


def _git_ids() -> Iterator[Part]:
    out = []
    for args in (["rev-list", "--all"], ["ls-tree", "-r", "--format=%(objectname)", "HEAD"]):
        proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, timeout=60)
        if proc.returncode == 0:
            out.append(proc.stdout)
    if not out:
        raise RuntimeError(f"git could not list the objects of {REPO}")
    yield Part("git-ids", "git rev-list --all and ls-tree of this repository", b"".join(out))


def _uuids(n: int, rng: random.Random) -> Iterator[Part]:
    lines = []
    for i in range(n):
        u = uuid.UUID(int=rng.getrandbits(128), version=4)
        text = (str(u), u.hex, str(u).upper(), "{" + str(u) + "}")[i % 4]
        lines.append(f'"id": "{text}", "request_id": {text}\n' if i % 3 == 0 else f"{text}\n")
    yield Part("uuids", f"{n} UUIDs in four spellings", "".join(lines).encode())


def _images(modules: Path, budget: int, rng: random.Random) -> Iterator[Part]:
    roots = [_site_packages(), modules, Path("/usr/share/icons"), Path("/usr/share/pixmaps")]
    paths = [p for r in roots if r.is_dir() for ext in ("*.png", "*.jpg", "*.gif", "*.ico") for p in r.rglob(ext)]
    taken = 0
    for part in _take(paths, budget * 3 // 4, "base64-image", rng):
        encoded = base64.b64encode(part.data)
        if taken % 2:  # also as MIME wraps it, and as a data: URI in JSON
            encoded = b"\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
        else:
            encoded = b'{"type":"image","source":{"data":"data:image/png;base64,' + encoded + b'"}}'
        taken += 1
        yield Part("base64-image", part.origin, encoded)


def fp_corpus(total: int, seed: int = 1) -> list[Part]:
    """About TOTAL bytes of non-secret text from this machine, mixed across sources."""
    rng = random.Random(seed)
    modules = npm_modules()
    share = {"python": 0.35, "minified-js": 0.25, "lock": 0.1, "metadata": 0.08, "base64-image": 0.14}
    parts: list[Part] = []
    parts += _python(int(total * share["python"]), rng)
    parts += _minified_js(modules, int(total * share["minified-js"]), rng)
    parts += _locks(modules, int(total * share["lock"]), rng)
    parts += _metadata(modules, int(total * share["metadata"]), rng)
    parts += _images(modules, int(total * share["base64-image"]), rng)
    parts += _git_ids()
    parts += _uuids(max(1000, total // (64 * 40)), rng)
    return parts


def plant_at(data: bytes) -> int:
    """Where to plant a token in DATA: at a line break past the middle, so the plant does
    not cut a line (of MIME-wrapped base64, say) into a piece that looks like a token."""
    cut = data.find(b"\n", len(data) // 2)
    return cut if cut >= 0 else len(data)


def is_real_private_key(pem: bytes) -> bool:
    """True when PEM really is a private key (a true detection), not text shaped like one."""
    from cryptography.hazmat.primitives import serialization

    for load in (serialization.load_pem_private_key, serialization.load_ssh_private_key):
        try:
            load(pem, password=None)
            return True
        except (ValueError, TypeError):
            continue
        except Exception:  # unsupported algorithms are still keys
            return True
    return False


def describe(parts: list[Part]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for p in parts:
        sizes[p.source] = sizes.get(p.source, 0) + len(p.data)
    return sizes


if __name__ == "__main__":  # a quick look: sizes by source
    corpus = fp_corpus(int(sys.argv[1]) * MiB if len(sys.argv) > 1 else 8 * MiB)
    for source, size in describe(corpus).items():
        print(f"{source:14} {size / MiB:6.2f} MiB")
