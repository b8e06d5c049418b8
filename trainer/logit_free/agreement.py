"""How far a black-box teacher's continuations agree with the student's chunk of text: logit-free OPD's phi and k
(trainer/logit_free/audit.py's docstring: the method, and which parts are the paper's).

Each continuation is cut to the student chunk's character length (the two tokenizers count tokens differently, the
characters are the same), then compared: by default 1 - Levenshtein(a, b) / max(len a, len b) on characters
(rapidfuzz's distance, each string capped at TEXT_CAP characters), ROUGE-1 F on whitespace tokens, or exact equality.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rapidfuzz.distance import Levenshtein

TEXT_CAP = 4000     # characters of each string that `similarity` compares
SIMILARITIES = ("levenshtein", "rouge1", "exact")


def similarity(a: str, b: str, kind: str = "levenshtein") -> float:
    """phi(a, b) in [0, 1], symmetric; 1 for equal strings. Each string is first cut to its first TEXT_CAP
    characters.

    levenshtein: 1 - Levenshtein(a, b) / max(len a, len b) on characters (unit insert / delete / substitute costs,
        rapidfuzz); two empty strings 1.0.
    rouge1: ROUGE-1 F on whitespace tokens (str.split): overlap = sum over tokens of min(count in a, count in b),
        F = 2 * overlap / (tokens in a + tokens in b) (the harmonic mean of precision and recall); both without
        tokens (empty or whitespace only) 1.0, exactly one without tokens 0.0.
    exact: 1.0 for equal strings, else 0.0: no partial credit, for answers where one wrong character is a wrong
        answer (a digit of a sum: "8=15" against "8=14" is 0.75 by Levenshtein).
    """
    a, b = a[:TEXT_CAP], b[:TEXT_CAP]
    if kind == "levenshtein":
        longest = max(len(a), len(b))
        return 1.0 if longest == 0 else 1.0 - Levenshtein.distance(a, b) / longest
    if kind == "rouge1":
        ta, tb = a.split(), b.split()
        if not ta and not tb:
            return 1.0
        overlap = sum((Counter(ta) & Counter(tb)).values())
        return 2.0 * overlap / (len(ta) + len(tb))
    if kind == "exact":
        return float(a == b)
    raise ValueError(f"similarity kind must be one of {SIMILARITIES}, got {kind!r}")


def agreement(student_text: str, continuations: Sequence[str], kind: str = "levenshtein") -> float:
    """k = sum over the teacher's continuations of similarity(student_text, continuation cut to len(student_text)
    characters), in [0, len(continuations)]. A continuation shorter than the student's text (the teacher stopped) is
    compared as it is."""
    n = len(student_text)
    return float(sum(similarity(student_text, c[:n], kind) for c in continuations))
