"""Write the text task sets of ``hybridkv bench --tasks`` (benchmarks/tasks/).

Deterministic (fixed seeds, no network): the text is real prose from Python's own help topics
(``pydoc_data.topics``, the reference manual's sections bundled with the interpreter), stripped
to plain paragraphs (headings, grammar and code blocks dropped, lines unwrapped). The topics differ
between Python versions, so the files are reproducible byte for byte with the same minor version
(the committed files: Python 3.11).

``text_tasks.jsonl`` (the first set; earlier results refer to it, so it stays as it was):

* ``passkey`` rows: a haystack of consecutive paragraphs of about 1k or 2k tokens (estimated at
  4 characters a token; ``approx_tokens``), with "The pass key is NNNNN. Remember it." inserted
  at a sentence boundary near a depth of 10, 30, 50, 70 or 90 % (``depth``: the real share of
  the context before it); ``answer`` is the 5-digit key, which occurs nowhere else.
* ``summary`` rows: about 1k tokens of one topic's prose to summarise; no answer (fidelity only).

``text_dev.jsonl`` and ``text_test.jsonl`` (a development split to look at while building methods,
a test split to report): the help topics are split once by a seeded shuffle (about a third of the
prose to dev, the rest to test; a paragraph that several topics share belongs to the first of
them), so no paragraph appears in both; the keys are drawn from disjoint ranges (dev 10000-54999,
test 55000-99999). Per haystack length of about 1k, 2k and 4k SmolLM2 tokens (the text is cut at
the sentence end nearest to the calibrated character count, ``CHARS_PER_TOKEN_SPLITS``):

* ``passkey`` rows: as above, one haystack per depth (dev: 10/50/90 %, test: 10/30/50/70/90 %).
* ``multikey`` rows: three sentences "The secret code for the {name} is NNNNN." with different
  names and keys, the asked one at the row's depth (dev: 30/70 %, test: 10/30/50/70/90 %), the
  two others at scattered depths at least 20 points away; question "What is the secret code for
  the {name}? Answer with the number only."; ``answer``: the asked key. Every key of a row occurs
  once in its context. (Calibrated on dev prose with the full cache: with four sentences and
  plainer names, SmolLM2 answered a distractor's code in over half the rows.)
* ``summary`` rows (dev 3, test 6): about 1k tokens of one topic's prose; no answer; field
  ``max_new_tokens: 64`` (long-form decoding).

Every row has ``id`` (``dev-passkey-2k-d50``, ...), ``kind``, ``context``, ``question``,
``answer`` (not for summaries), ``depth`` (retrieval rows), ``target_tokens``, ``approx_tokens``,
``chars``, and ``tokens``: the exact SmolLM2 token count of the context when the tokenizer is
installed (extra ``smollm2``; ``--no-tokens`` skips it).

Usage: python scripts/make_text_tasks.py [--out FILE | --splits-dir DIR] [--no-tokens]
(no option: all three files into benchmarks/tasks/; ``--out``: the first set only, into FILE;
``--splits-dir``: the dev and test files only, into DIR)
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
TASKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "tasks"
OUT = TASKS_DIR / "text_tasks.jsonl"

# --- the dev/test splits
SPLIT_SEED = 20261201
CHARS_PER_TOKEN_SPLITS = 4.6  # SmolLM2 tokens of this prose, measured (the first set's 4 overshoots)
SPLIT_LENGTHS = (1000, 2000, 4000)
DEV_SHARE = 1 / 3  # of the prose (characters), and of the topics long enough to summarise
SPLITS = {  # split: (passkey depths, multikey depths, summaries, key range)
    "dev": ((0.1, 0.5, 0.9), (0.3, 0.7), 3, (10000, 55000)),
    "test": ((0.1, 0.3, 0.5, 0.7, 0.9), (0.1, 0.3, 0.5, 0.7, 0.9), 6, (55000, 100000)),
    # A second, wider dev set from the dev prose (other depths, other draws): more rows to choose on.
    "dev2": ((0.2, 0.4, 0.6, 0.8), (0.2, 0.4, 0.6, 0.8), 0, (10000, 55000)),
}
PROSE = {"dev": "dev", "dev2": "dev", "test": "test"}  # split -> the prose it is made from
MULTIKEY_NEEDLE = "The secret code for the {name} is {key}."
MULTIKEY_QUESTION = "What is the secret code for the {name}? Answer with the number only."
MULTIKEY_KEYS = 3  # the asked one and two distractors (four: SmolLM2 picked a distractor too often)
MULTIKEY_NAMES = ("purple elephant", "frozen lighthouse", "copper kettle", "midnight bakery", "paper submarine",
                  "velvet umbrella", "thunder canyon", "crystal orchard", "marble staircase", "lemon windmill",
                  "rusty anchor", "golden violin")  # vivid, no word shared, unlike the technical prose
DISTRACTOR_DEPTHS = (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95)
MIN_DEPTH_GAP = 0.2
SUMMARY_MAX_NEW_TOKENS = 64
SUMMARY_MIN_SHARE = 0.85  # a topic to summarise has at least this share of SUMMARY_TOKENS


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


# --- the dev/test splits ------------------------------------------------------------------------
def _summary_chars() -> int:
    return round(SUMMARY_TOKENS * CHARS_PER_TOKEN_SPLITS)


def split_topics() -> dict[str, dict[str, list[str]]]:
    """``{"dev": {topic: paragraphs}, "test": {...}}``: disjoint prose. A paragraph several topics
    share is kept in the first of them (sorted order); the topics long enough to summarise and the
    others are shuffled separately (``SPLIT_SEED``) and dealt so that dev gets about ``DEV_SHARE``
    of each (of the long ones by count, of the others by characters)."""
    seen: set[str] = set()
    unique: dict[str, list[str]] = {}
    for topic, paragraphs in topic_paragraphs().items():
        kept = [p for p in paragraphs if p not in seen]
        seen.update(kept)
        if kept:
            unique[topic] = kept
    rng = random.Random(SPLIT_SEED)
    long = [t for t, ps in unique.items() if sum(map(len, ps)) >= SUMMARY_MIN_SHARE * _summary_chars()]
    short = [t for t in unique if t not in long]
    rng.shuffle(long)
    rng.shuffle(short)
    n_dev = round(len(long) * DEV_SHARE)
    dev, test = long[:n_dev], long[n_dev:]
    dev_chars = total = sum(sum(map(len, unique[t])) for t in dev)
    total += sum(sum(map(len, unique[t])) for t in test)
    for topic in short:
        chars = sum(map(len, unique[topic]))
        total += chars
        if dev_chars + chars <= DEV_SHARE * total:
            dev.append(topic)
            dev_chars += chars
        else:
            test.append(topic)
    return {"dev": {t: unique[t] for t in sorted(dev)}, "test": {t: unique[t] for t in sorted(test)}}


def take_sentences(paragraphs: list[str], start: int, chars: int) -> str:
    """:func:`take`, cut at the sentence end nearest to ``chars``."""
    text = take(paragraphs, start, chars)
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
    return text[:min(ends, key=lambda e: abs(e - chars))]


def _sentence_ends(text: str) -> list[int]:
    return [m.end() for m in re.finditer(r"[.!?](?=\s)", text)]


def insert_needles(haystack: str, needles: list[tuple[str, float]]) -> tuple[str, list[float]]:
    """Each needle inserted after the sentence end nearest to its depth (distinct sentence ends;
    the needles after the first at least ``MIN_DEPTH_GAP`` of the haystack away from it); returns
    the context and each needle's real depth (share of the context's characters before it)."""
    ends = _sentence_ends(haystack)
    cuts: list[int] = []
    for _, depth in needles:
        free = [e for e in ends if not cuts or abs(e - cuts[0]) >= MIN_DEPTH_GAP * len(haystack)]
        cuts.append(min((e for e in free if e not in cuts), key=lambda e: abs(e - depth * len(haystack))))
    context, offset, starts = haystack, 0, {}
    for i in sorted(range(len(needles)), key=lambda i: cuts[i]):
        at = cuts[i] + offset
        context = f"{context[:at]} {needles[i][0]}{context[at:]}"
        starts[i] = at + 1
        offset += len(needles[i][0]) + 1
    return context, [round(starts[i] / len(context), 3) for i in range(len(needles))]


def _draw_key(rng: random.Random, keys: tuple[int, int], text: str, used: set[int]) -> int:
    while True:
        key = rng.randrange(*keys)
        if key not in used and str(key) not in text:
            used.add(key)
            return key


def make_split(split: str) -> list[dict]:
    """The rows of one split (``"dev"`` or ``"test"``), without ``tokens``."""
    passkey_depths, multikey_depths, summaries, keys = SPLITS[split]
    by_topic = split_topics()[PROSE[split]]
    corpus = [p for paragraphs in by_topic.values() for p in paragraphs]
    rng = random.Random(f"{SEED}-{split}")
    used: set[int] = set()
    rows = []

    def row(kind: str, tokens: int, context: str, question: str, **fields) -> dict:
        return {"kind": kind, "context": context, "question": question, **fields, "target_tokens": tokens,
                "approx_tokens": round(len(context) / CHARS_PER_TOKEN_SPLITS), "chars": len(context)}

    for tokens in SPLIT_LENGTHS:
        chars = round(tokens * CHARS_PER_TOKEN_SPLITS)
        for depth in passkey_depths:
            needle_chars = len(NEEDLE.format(key=10000)) + 1
            haystack = take_sentences(corpus, rng.randrange(len(corpus)), chars - needle_chars)
            key = _draw_key(rng, keys, haystack, used)
            context, [real_depth] = insert_needles(haystack, [(NEEDLE.format(key=key), depth)])
            rows.append({"id": f"{split}-passkey-{tokens // 1000}k-d{round(depth * 100):02d}",
                         **row("passkey", tokens, context, PASSKEY_QUESTION, answer=str(key), depth=real_depth)})
        for depth in multikey_depths:
            names = rng.sample(MULTIKEY_NAMES, MULTIKEY_KEYS)
            needle_chars = sum(len(MULTIKEY_NEEDLE.format(name=n, key=10000)) + 1 for n in names)
            haystack = take_sentences(corpus, rng.randrange(len(corpus)), chars - needle_chars)
            at = min(_sentence_ends(haystack), key=lambda e: abs(e - depth * len(haystack))) / len(haystack)
            others = rng.sample([d for d in DISTRACTOR_DEPTHS if abs(d - at) >= MIN_DEPTH_GAP], MULTIKEY_KEYS - 1)
            codes = [_draw_key(rng, keys, haystack, used) for _ in names]
            needles = [(MULTIKEY_NEEDLE.format(name=n, key=k), d) for n, k, d in zip(names, codes, [depth, *others])]
            context, real_depths = insert_needles(haystack, needles)
            rows.append({"id": f"{split}-multikey-{tokens // 1000}k-d{round(depth * 100):02d}",
                         **row("multikey", tokens, context, MULTIKEY_QUESTION.format(name=names[0]),
                               answer=str(codes[0]), depth=real_depths[0],
                               distractor_depths=sorted(real_depths[1:]))})
    long_topics = [t for t, ps in by_topic.items() if sum(map(len, ps)) >= SUMMARY_MIN_SHARE * _summary_chars()]
    for topic in rng.sample(long_topics, summaries):
        context = take_sentences(by_topic[topic], 0, min(_summary_chars(), sum(map(len, by_topic[topic]))))
        rows.append({"id": f"{split}-summary-{topic}", **row("summary", SUMMARY_TOKENS, context, SUMMARY_QUESTION,
                                                              max_new_tokens=SUMMARY_MAX_NEW_TOKENS)})
    return rows


def count_tokens(rows: list[dict]) -> bool:
    """Add ``tokens`` (the context's SmolLM2 token count, no special tokens) to every row; False
    (rows unchanged) where the SmolLM2 tokenizer is not installed."""
    try:
        from hybridkv_cli.models.registry import load_model

        tokenizer = load_model("smollm2", device="cpu").tokenizer
    except Exception as e:  # noqa: BLE001 - optional
        print(f"no token counts (the SmolLM2 tokenizer is not available: {str(e).splitlines()[0]})")
        return False
    for row in rows:
        row["tokens"] = len(tokenizer(row["context"], add_special_tokens=False)["input_ids"])
    return True


def write_rows(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} tasks to {out} ({out.stat().st_size} bytes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help=f"write only the first set, to this file (default: {OUT})")
    where.add_argument("--splits-dir", type=Path, help=f"write only the dev and test files, into this folder "
                                                       f"(default: {TASKS_DIR})")
    parser.add_argument("--no-tokens", action="store_true", help="do not count SmolLM2 tokens (no 'tokens' field)")
    args = parser.parse_args()
    if args.splits_dir is None:
        write_rows(make_tasks(), args.out or OUT)
    if args.out is None:
        splits = {split: make_split(split) for split in SPLITS}
        if not args.no_tokens:
            count_tokens([row for rows in splits.values() for row in rows])
        for split, rows in splits.items():
            write_rows(rows, (args.splits_dir or TASKS_DIR) / f"text_{split}.jsonl")


if __name__ == "__main__":
    main()
