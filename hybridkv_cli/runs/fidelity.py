"""ROUGE-L F1: how much of the full-cache answer a compressed answer keeps, in order."""

from __future__ import annotations


def _lcs(a: list, b: list) -> int:
    # One row of the LCS table at a time: O(len(a)·len(b)) time, O(len(b)) memory.
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str | list, reference: str | list) -> float:
    """ROUGE-L F1 over whitespace words (strings) or any token sequences (lists).

    Two empty sequences agree perfectly (1.0); one empty sequence scores 0.0.
    """
    a = candidate.split() if isinstance(candidate, str) else list(candidate)
    b = reference.split() if isinstance(reference, str) else list(reference)
    if not a and not b:
        return 1.0
    lcs = _lcs(a, b)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)
