"""Write the text task set of ``hybridkv bench --tasks`` (benchmarks/tasks/text_tasks.jsonl).

Deterministic (fixed seed, no network): the text is real prose from Python's own help topics
(``pydoc_data.topics``, the reference manual's sections bundled with the interpreter), stripped
to plain paragraphs (headings, grammar and code blocks dropped, lines unwrapped). The topics differ
between Python versions, so the file is reproducible byte for byte with the same minor version
(the committed file: Python 3.11).

* ``passkey`` rows: a haystack of consecutive paragraphs of about 1k or 2k tokens (estimated at
  4 characters a token; ``approx_tokens``), with "The pass key is NNNNN. Remember it." inserted
  at a sentence boundary near a depth of 10, 30, 50, 70 or 90 % (``depth``: the real share of
  the context before it); ``answer`` is the 5-digit key, which occurs nowhere else.
* ``summary`` rows: about 1k tokens of one topic's prose to summarise; no answer (fidelity only).

Usage: python scripts/make_text_tasks.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SEED = 20260529
CHARS_PER_TOKEN = 4
LENGTHS = (1000, 2000)  # approximate tokens of a pass-key haystack
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
HAYSTACKS_PER_DEPTH = 2  # 5 depths x 2 = 10 items per length
SUMMARIES, SUMMARY_TOKENS = 4, 1000
NEEDLE = "The pass key is {key}. Remember it."
PASSKEY_QUESTION = "What is the pass key? Answer with the number only."
SUMMARY_QUESTION = "Summarize the text above in a few sentences."
OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "tasks" / "text_tasks.jsonl"


def _is_prose(block: str) -> bool:
    lines = block.splitlines()
    if lines[0].startswith((" ", "\t")):  # code, grammar and indented lists
        return False
    if len(lines) > 1 and re.fullmatch(r"[*=\-^~+]+", lines[1].strip()):  # a heading
        return False
    text = " ".join(lines)
    return len(text) >= 200 and sum(c.isalpha() for c in text) > 0.7 * len(text)


def topic_paragraphs() -> dict[str, list[str]]:
    """Each help topic's prose paragraphs (lines joined), topics in sorted order."""
    from pydoc_data.topics import topics

    out = {}
    for name in sorted(topics):
        blocks = re.split(r"\n\s*\n", topics[name])
        paragraphs = [" ".join(line.strip() for line in b.strip().splitlines()) for b in blocks
                      if b.strip() and _is_prose(b.strip("\n"))]
        if paragraphs:
            out[name] = paragraphs
    return out


def take(paragraphs: list[str], start: int, chars: int) -> str:
    """Consecutive paragraphs from ``start`` (wrapping around) until ``chars`` are reached."""
    text: list[str] = []
    i = start
    while sum(map(len, text)) < chars:
        text.append(paragraphs[i % len(paragraphs)])
        i += 1
    return "\n\n".join(text)


def insert_needle(haystack: str, needle: str, depth: float) -> tuple[str, float]:
    """``needle`` inserted after the sentence end nearest to ``depth`` of the haystack."""
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", haystack)]
    cut = min(ends, key=lambda e: abs(e - depth * len(haystack)))
    return f"{haystack[:cut]} {needle}{haystack[cut:]}", round(cut / len(haystack), 3)


def make_tasks() -> list[dict]:
    rng = random.Random(SEED)
    by_topic = topic_paragraphs()
    corpus = [p for paragraphs in by_topic.values() for p in paragraphs]
    rows = []
    for tokens in LENGTHS:
        for depth in DEPTHS:
            for n in range(HAYSTACKS_PER_DEPTH):
                haystack = take(corpus, rng.randrange(len(corpus)), tokens * CHARS_PER_TOKEN)
                key = rng.randrange(10000, 100000)
                while str(key) in haystack:
                    key = rng.randrange(10000, 100000)
                context, real_depth = insert_needle(haystack, NEEDLE.format(key=key), depth)
                rows.append({"id": f"passkey-{tokens // 1000}k-d{round(depth * 100):02d}-{n}",
                             "kind": "passkey", "context": context, "question": PASSKEY_QUESTION,
                             "answer": str(key), "depth": real_depth,
                             "approx_tokens": round(len(context) / CHARS_PER_TOKEN), "chars": len(context)})
    long_topics = [t for t, ps in by_topic.items() if sum(map(len, ps)) >= SUMMARY_TOKENS * CHARS_PER_TOKEN]
    for topic in rng.sample(long_topics, SUMMARIES):
        context = take(by_topic[topic], 0, SUMMARY_TOKENS * CHARS_PER_TOKEN)
        rows.append({"id": f"summary-{topic}", "kind": "summary", "context": context, "question": SUMMARY_QUESTION,
                     "approx_tokens": round(len(context) / CHARS_PER_TOKEN), "chars": len(context)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"output file (default: {OUT})")
    out = parser.parse_args().out
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = make_tasks()
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} tasks to {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
