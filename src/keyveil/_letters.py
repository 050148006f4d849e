"""Whether letters read like the words of code and prose or like random characters.

One table of letter pairs, counted on the Python standard library's source:
detection asks it of an assigned value (`looks_random`), the sealer of a short
line of letters after a line of base64 (a word of text, or the block's last line).
"""

from __future__ import annotations

# How much more often each pair of letters occurs inside the words of code and
# prose than in random letters: log2 of the ratio, rounded and clamped to
# [-8, +4], written '0' (-8) to 'c' (+4); row = first letter, column = second.
# Counted on the Python standard library's source (tests/letter_pairs.py rebuilds
# it; tests/test_detect.py checks that it still does).
_PAIRS_LOW = -8
PAIR_TABLE = """
39a95683927bab191bab877672
84659321780943850764803083
a465a539819955b5387a842070
9548b562a31734931886822361
a7aa8a74626b9b697cbb587a83
83568831a00744a51867803050
6232a267800758630895730003
a123b102903444910748600040
88998a90505a9ca828bb380708
30007000201000620030500000
61239242700505331462406010
a658bb42a13a45a60599944082
a725b511803674990475703041
a4aaa8a4817747a7349b872061
789a597271799b890b9a978734
a255a435903933981969744070
10000000000203110230800000
a588c693a0778aa6099a865180
8384c568a167859955ab935280
a577b62cb06765a71a9aa36494
78759760702999680a99300300
9110a201700032510221301000
82257208900537711862104100
65847502600450270248110541
23436221600556580678225021
40008102600221510000000010
"""
_PAIR_SCORE: dict[bytes, int] = {
    bytes((97 + i, 97 + j)): int(c, 16) + _PAIRS_LOW
    for i, row in enumerate(PAIR_TABLE.split())
    for j, c in enumerate(row)
}
# Words score about +1.8 bits a pair, random letters about -3.5: a value whose
# in-word pairs average below this reads as random however its letters are grouped.
_WORDLIKE_PAIRS = -0.25


def reads_as_words(runs: list[bytes], at_least: float = _WORDLIKE_PAIRS) -> bool:
    """True when the letter pairs inside RUNS score, on average, like words (`PAIR_TABLE`):
    AT_LEAST bits a pair."""
    score = pairs = 0
    for run in runs:
        run = run.lower()
        pairs += len(run) - 1
        score += sum(_PAIR_SCORE[run[i : i + 2]] for i in range(len(run) - 1))
    return pairs > 0 and score >= at_least * pairs
