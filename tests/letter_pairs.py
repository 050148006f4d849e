"""The letter-pair table of keyveil._letters, rebuilt from the Python standard library.

`looks_random` asks whether the letters of an assigned value read like the
words of code and prose (`self._private_key`, `ThisIsMyConfigName`) or like
random characters. It scores each pair of adjacent letters inside a word by
how much more often that pair occurs in words than in random text (log2 of
the ratio, rounded, clamped to [-8, +4]). The counts come from the words of
the standard library's own source (identifiers split at case changes,
comments, docstrings), lower-cased; tests and site-packages are left out so
that the table depends only on the Python release.

    python -m tests.letter_pairs     # prints the table as _letters.py holds it

tests/test_detect.py checks that the shipped table is (nearly) what this
module computes on the running Python, so the table can always be explained.
"""

from __future__ import annotations

import math
import re
import string
import sysconfig
from collections import Counter
from pathlib import Path

LOW, HIGH = -8, 4  # clamp: a pair never seen in words is not infinitely damning (abbreviations, names)
LETTERS = string.ascii_lowercase
_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")  # the letter runs _detect reads


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib"}
    return [p for p in sorted(root.rglob("*.py")) if not skip & set(p.relative_to(root).parts)]


def pair_counts(paths: list[Path]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for path in paths:
        for word in _WORDS.findall(path.read_text("utf-8", "replace")):
            word = word.lower()
            counts.update(a + b for a, b in zip(word, word[1:]))
    return counts


def scores(counts: Counter[str]) -> dict[str, int]:
    """log2(P(pair in words) / P(pair in random letters)), rounded and clamped."""
    total = sum(counts[a + b] for a in LETTERS for b in LETTERS)
    out = {}
    for a in LETTERS:
        for b in LETTERS:
            p = (counts[a + b] + 0.5) / (total + 0.5 * 26 * 26)  # a pair never seen gets half a count
            out[a + b] = max(LOW, min(HIGH, round(math.log2(p * 26 * 26))))
    return out


def table(pair_scores: dict[str, int]) -> str:
    """26 rows (first letter a..z) of 26 characters (second letter a..z): '0' is LOW, one step per bit."""
    digits = "0123456789abc"
    return "\n".join("".join(digits[pair_scores[a + b] - LOW] for b in LETTERS) for a in LETTERS)


def rebuild() -> str:
    return table(scores(pair_counts(stdlib_sources())))


if __name__ == "__main__":
    print(rebuild())
