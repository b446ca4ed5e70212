"""Whether an output holds the expected answer: the accuracy rule of ``bench``, ``ask
--questions`` with answers and ``route``."""

from __future__ import annotations

import re

_ENDS = re.compile(r"^[\W_]+|[\W_]+$")


def normalise(text: str) -> str:
    """Lowercase, whitespace collapsed, punctuation (any non-word character) stripped at the ends."""
    return _ENDS.sub("", " ".join(text.lower().split()))


def is_correct(output: str, answers: tuple[str, ...] | list[str]) -> bool | None:
    """Whether any normalised answer occurs in the normalised output (None without answers)."""
    if not answers:
        return None
    out = normalise(output)
    return any(normalise(a) in out for a in answers)
