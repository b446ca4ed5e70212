"""The dev/test text task sets (scripts/make_text_tasks.py): sizes, disjoint prose and keys, needles
that occur once, token counts near their targets, reproducibility."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from hybridkv_cli.runs.bench import read_tasks

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "benchmarks" / "tasks"
NEEDLES = re.compile(r" The pass key is \d{5}\. Remember it\.| The secret code for the [a-z ]+ is \d{5}\.")
SIZES = {"dev": {"passkey": 9, "multikey": 6, "summary": 3}, "test": {"passkey": 15, "multikey": 15, "summary": 6}}


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("make_text_tasks", REPO / "scripts" / "make_text_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def committed() -> dict[str, list[dict]]:
    return {split: [json.loads(line) for line in (TASKS / f"text_{split}.jsonl").read_text("utf-8").splitlines()]
            for split in SIZES}


def test_split_topics_share_no_paragraph(generator):
    splits = generator.split_topics()
    dev = {p for ps in splits["dev"].values() for p in ps}
    test = {p for ps in splits["test"].values() for p in ps}
    assert dev and test and not dev & test and not set(splits["dev"]) & set(splits["test"])
    assert 0.25 < sum(map(len, dev)) / sum(map(len, dev | test)) < 0.4


def test_generated_splits_are_deterministic(generator):
    for split in SIZES:
        assert generator.make_split(split) == generator.make_split(split)


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the help topics differ between Python versions")
def test_committed_files_are_what_the_generator_writes(generator, committed):
    for split, rows in committed.items():
        assert [{k: v for k, v in r.items() if k != "tokens"} for r in rows] == generator.make_split(split)


@pytest.mark.parametrize("split", list(SIZES))
def test_rows(committed, split):
    rows = committed[split]
    assert len(read_tasks(TASKS / f"text_{split}.jsonl")) == len(rows)
    assert len({r["id"] for r in rows}) == len(rows) and all(r["id"].startswith(f"{split}-") for r in rows)
    assert {k: sum(r["kind"] == k for r in rows) for k in SIZES[split]} == SIZES[split]
    for r in rows:
        if r["kind"] == "summary":
            assert "answer" not in r and r["max_new_tokens"] == 64 and r["target_tokens"] == 1000
            continue
        assert r["target_tokens"] in (1000, 2000, 4000) and f"-{r['target_tokens'] // 1000}k-" in r["id"]
        keys = re.findall(r"\d{5}", "".join(NEEDLES.findall(r["context"])))
        assert len(keys) == len(set(keys)) == (1 if r["kind"] == "passkey" else 3)
        assert r["answer"] in keys and all(r["context"].count(k) == 1 for k in keys)
        assert abs(r["depth"] - int(r["id"][-2:]) / 100) < 0.15  # the real depth near the nominal one
        if r["kind"] == "multikey":
            name = re.fullmatch(r"What is the secret code for the ([a-z ]+)\? Answer with the number only\.",
                                r["question"]).group(1)
            assert f"The secret code for the {name} is {r['answer']}." in r["context"]
            assert all(abs(d - r["depth"]) >= 0.1 for d in r["distractor_depths"])


def test_splits_share_no_key_and_no_prose(generator, committed):
    keys = {split: {k for r in rows for k in re.findall(r"\d{5}", " ".join(NEEDLES.findall(r["context"])))}
            for split, rows in committed.items()}
    assert len(keys["dev"]) == 3 * (3 + 2 * 3) and len(keys["test"]) == 3 * (5 + 5 * 3)  # unique within a split
    assert not keys["dev"] & keys["test"]
    corpus = {split: [p for ps in topics.values() for p in ps] for split, topics in generator.split_topics().items()}
    for split, rows in committed.items():
        other = "test" if split == "dev" else "dev"
        for r in rows:
            for chunk in NEEDLES.sub("", r["context"]).split("\n\n"):  # the last one may be cut short
                assert any(p.startswith(chunk) for p in corpus[split])
                assert not any(p.startswith(chunk) for p in corpus[other])


def test_token_counts_near_their_targets(committed):
    rows = [r for rows in committed.values() for r in rows]
    if not all("tokens" in r for r in rows):
        pytest.skip("written without the SmolLM2 tokenizer")
    assert all(0.85 <= r["tokens"] / r["target_tokens"] <= 1.15 for r in rows)
