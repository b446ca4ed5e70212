"""One compression, many questions: every method's answers from one compressed prefix equal
separate --defer-question runs, in any order (nothing of one question reaches the next); the
CLI's -Q / --questions give one record per question with the shared prefill reported once."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridkv_cli import cli
from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.engine import Job, Limits, decode, generate
from hybridkv_cli.models.prompt import QuestionTemplate, build_prompt, build_text_prompt

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import SAMPLE, cached_demo, demo, video  # noqa: E402,F401 - fixtures
from media_fixtures import make_video  # noqa: E402
from method_options import needed  # noqa: E402
from shared_prefix import TEMPLATE_QUESTION, answer, answer_all, compress_prefix  # noqa: E402

QUESTIONS = ["What happens in the video?", "What colour is the square?", "How many shapes are there?"]
NEW = 8
FAST = ["--model", "demo", "--frames", "4", "--max-pixels", str(28 * 28 * 6), "--max-new-tokens", "3"]


def deferred(demo, video, question, method):
    prompt = build_prompt(demo.processor, video, question)
    policy = make_policy(method, **needed(method))
    return generate(demo.model, prompt, policy, max_new_tokens=NEW, defer_question=True).tokens


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_question_equals_its_own_deferred_run(demo, video, method):
    tok = demo.processor.tokenizer
    template_prompt = build_prompt(demo.processor, video, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(tok, template_prompt, TEMPLATE_QUESTION)
    prefix = compress_prefix(demo.model, template_prompt, make_policy(method, **needed(method)), template)
    expected = {q: deferred(demo, video, q, method) for q in QUESTIONS}
    # Order and repetition must not matter: each question starts from the same compressed state.
    for q in [*QUESTIONS, QUESTIONS[0], *reversed(QUESTIONS)]:
        suffix = template.suffix(tok, q)
        full_ids = build_prompt(demo.processor, video, q).inputs["input_ids"][0].tolist()
        assert full_ids[prefix.seen:] == suffix  # the prompt is token for token the one a separate run builds
        generation = answer(demo.model, prefix, suffix, max_new_tokens=NEW)
        assert generation.tokens == expected[q], (method, q)
        assert generation.device_bytes_after_prefill == prefix.device_bytes
    # not one constant answer (the untrained demo's full cache answers these three alike, as in one pass)
    assert len({tuple(v) for v in expected.values()}) > 1 or method in ("full", "hybridkv", "rcr")


@pytest.mark.parametrize("budget", [1.0, 0.1])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_questions_decoded_together_equal_one_by_one(demo, video, method, budget):
    """-Q with --batch-size: one prefix, its questions decoded together (suffixes of different
    lengths, fed on the device while others already generate) give the tokens of one by one."""
    if method == "full" and budget != 1.0:
        pytest.skip("full keeps the whole cache")
    assert_together_equals_alone(demo, video, make_policy(method, budget=budget, **needed(method)))


def test_host_keys_decoded_together_equal_one_by_one(demo, video):
    """At b = 0.05 (fp32) ``auto`` keeps the 2-bit keys in host memory with every head dynamic;
    a batch's members are ranked in one pass over their host codes, and answer, and count the
    host bytes their rankings read and their slots copied, as one by one."""
    policy = make_policy("hybridkv", budget=0.05)
    prefix = assert_together_equals_alone(demo, video, policy, same_bytes=True)
    assert {type(kv.dynamic.landmarks).__name__ for kv in prefix.state[0]} == {"HostKeys"}


def test_a_batch_ranks_host_keys_in_one_pass(demo, video, monkeypatch):
    """The members' host-key heads go through ``chunk_retrieve`` together (one ranking for the
    batch), not one sequence at a time."""
    import hybridkv_cli.compression.retrieval as retrieval

    passes = []
    original = retrieval.chunk_retrieve
    monkeypatch.setattr(retrieval, "chunk_retrieve", lambda queries, parts, *a, **k: (
        passes.append(len(parts)), original(queries, parts, *a, **k))[1])
    assert_together_equals_alone(demo, video, make_policy("hybridkv", budget=0.05))
    assert max(passes) == 3


def test_questions_that_start_together_read_their_suffixes_in_one_pass(demo, video, monkeypatch):
    """Members admitted together read their questions in one forward pass, side by side, each
    over its own copy of the prefix; the tokens stay those of one by one."""
    from hybridkv_cli.engine.decoder import Decoder

    reads = []
    original = Decoder.read
    monkeypatch.setattr(Decoder, "read", lambda self, caches, suffixes, ropes: (
        reads.append([len(s) for s in suffixes]), original(self, caches, suffixes, ropes))[1])
    assert_together_equals_alone(demo, video, make_policy("hybridkv", budget=0.1))
    alone, together = reads[:4], reads[4:]
    assert all(len(r) == 1 for r in alone)
    assert len(together[0]) == 3 and len(set(together[0])) > 1  # three questions of different lengths at once
    assert sorted(n for r in together for n in r) == sorted(r[0] for r in alone)
    reads.clear()  # a pass reads at most PACK_TOKENS: here the longest question alone
    monkeypatch.setattr("hybridkv_cli.engine.jobs.PACK_TOKENS", max(r[0] for r in alone))
    assert_together_equals_alone(demo, video, make_policy("hybridkv", budget=0.1))
    assert all(sum(r) <= max(r[0] for r in alone) for r in reads) and len(reads) > 4 + 1


def test_a_job_that_cannot_start_fails_alone_in_its_group(demo, video, monkeypatch):
    """Jobs start together: one whose cache cannot be taken is its own error and the others
    answer as alone; a packed read that fails is the error of the jobs it read, and the jobs
    after them go on."""
    from hybridkv_cli.engine.decoder import Decoder

    tok = demo.processor.tokenizer
    p = build_prompt(demo.processor, video, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(tok, p, TEMPLATE_QUESTION)
    prefix = compress_prefix(demo.model, p, make_policy("snapkv", budget=0.1), template)
    suffixes = [template.suffix(tok, q) for q in QUESTIONS]
    alone = answer_all(demo.model, prefix, suffixes, NEW)

    def broken(device):
        raise ValueError("no copy")

    unusable = SimpleNamespace(take=broken, logits=None, seen=prefix.seen)
    jobs = [(0, lambda: Job(0, suffixes[0], prefix=prefix)), (1, lambda: Job(1, suffixes[1], prefix=unusable)),
            (2, lambda: Job(2, suffixes[2], prefix=prefix))]
    outcomes = {o.job.tag: o for o in decode(lambda: demo.model, jobs, max_new_tokens=NEW, limits=Limits(batch_size=3))}
    assert str(outcomes[1].error) == "no copy"
    assert [outcomes[i].generation.tokens for i in (0, 2)] == [alone[0].tokens, alone[2].tokens]

    original, reads = Decoder.read, []

    def read(self, caches, suffixes, ropes):
        reads.append(len(suffixes))
        if len(reads) == 1:
            raise RuntimeError("out of memory")
        return original(self, caches, suffixes, ropes)

    monkeypatch.setattr(Decoder, "read", read)
    jobs = [(i, lambda i=i: Job(i, suffixes[i % 3], prefix=prefix)) for i in range(4)]
    outcomes = {o.job.tag: o for o in decode(lambda: demo.model, jobs, max_new_tokens=NEW, limits=Limits(batch_size=2))}
    assert reads[0] == 2 and [str(outcomes[i].error) for i in (0, 1)] == ["out of memory"] * 2
    assert [outcomes[i].generation.tokens for i in (2, 3)] == [alone[2].tokens, alone[0].tokens]


def test_jobs_that_prefill_their_own_media_start_one_at_a_time(demo, video, monkeypatch):
    """A job whose prefix is still to be prefilled starts alone: the members before it do not
    wait on its prefill for their first token. The answers are the deferred runs'."""
    from hybridkv_cli.engine import prompt_job
    from hybridkv_cli.engine.decoder import Decoder

    reads, original = [], Decoder.read
    monkeypatch.setattr(Decoder, "read", lambda self, caches, suffixes, ropes: (
        reads.append(len(suffixes)), original(self, caches, suffixes, ropes))[1])
    policy = make_policy("snapkv", **needed("snapkv"))
    jobs = [(i, lambda i=i, q=q: prompt_job(demo.model, build_prompt(demo.processor, video, q), policy, True, tag=i))
            for i, q in enumerate(QUESTIONS)]
    outcomes = {o.job.tag: o for o in decode(lambda: demo.model, jobs, max_new_tokens=NEW, limits=Limits(batch_size=3))}
    assert reads == [1, 1, 1]
    expected = [deferred(demo, video, q, "snapkv") for q in QUESTIONS]
    assert [outcomes[i].generation.tokens for i in range(3)] == expected
    assert max(o.batch["size_max"] for o in outcomes.values()) > 1  # they still decode together


def assert_together_equals_alone(demo, video, policy, same_bytes=False):
    """Questions of different lengths over one compressed prefix, decoded 3 at a time, give the
    tokens (``same_bytes``: and the host bytes) of one by one; returns the prefix."""
    tok = demo.processor.tokenizer
    p = build_prompt(demo.processor, video, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(tok, p, TEMPLATE_QUESTION)
    prefix = compress_prefix(demo.model, p, policy, template)
    suffixes = [template.suffix(tok, q) for q in [*QUESTIONS, "Is there a circle? Answer yes or no."]]
    assert len({len(s) for s in suffixes}) > 1
    alone = answer_all(demo.model, prefix, suffixes, NEW)
    together = answer_all(demo.model, prefix, suffixes, NEW, Limits(batch_size=3))
    assert [g.tokens for g in together] == [g.tokens for g in alone], policy
    assert all(len(g.tokens) == NEW for g in together)
    if same_bytes:
        moved = [g.cache.transferred_bytes() for g in alone]
        assert [g.cache.transferred_bytes() for g in together] == moved and min(moved) > 0
    return prefix


def test_the_snapshot_is_not_touched_by_answering(demo, video):
    """The compressed state a prefix keeps is copied per question: decoding grows the copy only."""
    tok = demo.processor.tokenizer
    p = build_prompt(demo.processor, video, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(tok, p, TEMPLATE_QUESTION)
    prefix = compress_prefix(demo.model, p, make_policy("hybridkv", budget=0.2), template)
    stores = [kv for kv in prefix.state[0]]
    before = [kv.device_bytes() for kv in stores]
    generation = answer(demo.model, prefix, template.suffix(tok, QUESTIONS[0]), max_new_tokens=NEW)
    assert [kv.device_bytes() for kv in stores] == before
    assert generation.cache.device_bytes() > sum(before)  # the copy holds the question and answer tokens
    assert all(a is not b for a, b in zip(stores, [layer.kv for layer in generation.cache.layers]))


def test_text_context_prefix(demo):
    """A text prompt (--context) compresses its context once the same way."""
    tok = demo.processor.tokenizer
    context = "The red square moves left. The blue circle stays. " * 6
    p = build_text_prompt(tok, context, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(tok, p, TEMPLATE_QUESTION)
    prefix = compress_prefix(demo.model, p, make_policy("snapkv", budget=0.3), template)
    for q in QUESTIONS[:2]:
        ref = generate(demo.model, build_text_prompt(tok, context, q), make_policy("snapkv", budget=0.3),
                       max_new_tokens=NEW, defer_question=True).tokens
        assert answer(demo.model, prefix, template.suffix(tok, q), max_new_tokens=NEW).tokens == ref


# --- the command line ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return make_video(tmp_path_factory.mktemp("clip") / "clip.mp4", n=8)


def lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_cli_questions_one_record_each_equal_to_separate_runs(clip, capsys):
    assert cli.run(["ask", str(clip), "-Q", QUESTIONS[0], "--question", QUESTIONS[1], "--jsonl", "--quiet",
                    *FAST]) == 0
    records = lines(capsys.readouterr().out)
    assert [r["question"] for r in records] == QUESTIONS[:2]
    assert [r["shared"]["index"] for r in records] == [0, 1]
    assert records[0]["shared"]["prefill_s"] > 0 and records[1]["shared"]["prefill_s"] is None  # reported once
    assert all(r["defer_question"] and r["prefill_s"] > 0 for r in records)
    for r in records:
        assert cli.run(["ask", str(clip), r["question"], "--defer-question", "--json", "--quiet", *FAST]) == 0
        single = json.loads(capsys.readouterr().out)
        assert single["answer"] == r["answer"] and single["decode"]["tokens"] == r["decode"]["tokens"]
        assert single["kv"]["device_bytes_after_prefill"] == r["kv"]["device_bytes_after_prefill"]
        assert single["input"] == r["input"]


def test_cli_questions_file_jsonl_with_answers(clip, tmp_path, capsys):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question": QUESTIONS[0], "answer": ["zzz-never"]}) + "\n\n"
                     + json.dumps({"question": QUESTIONS[2]}) + "\n")
    assert cli.run(["ask", str(clip), "--questions", str(qfile), "--jsonl", "--quiet", *FAST]) == 0
    records = lines(capsys.readouterr().out)
    assert [r["question"] for r in records] == [QUESTIONS[0], QUESTIONS[2]]
    assert records[0]["expected"] == ["zzz-never"] and records[0]["correct"] is False
    assert "expected" not in records[1]
    plain = tmp_path / "q.txt"
    plain.write_text(f"{QUESTIONS[1]}\n\n{QUESTIONS[2]}\n")
    assert cli.run(["ask", str(clip), "--questions", str(plain), "--jsonl", "--quiet", *FAST]) == 0
    assert [r["question"] for r in lines(capsys.readouterr().out)] == [QUESTIONS[1], QUESTIONS[2]]


def test_cli_questions_file_errors(clip, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok?"}\n{"nope": 1}\n')
    assert cli.run(["ask", str(clip), "--questions", str(bad), *FAST]) == 2
    assert capsys.readouterr().err == f"error: {bad}: line 2: expected {{\"question\": TEXT, \"answer\"?: TEXT or [TEXT]}}\n"
    assert cli.run(["ask", str(clip), "--questions", str(tmp_path / "none.txt"), *FAST]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_questions_resume_per_question(clip, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert cli.run(["ask", str(clip), "-Q", QUESTIONS[0], "-o", str(out), "--quiet", *FAST]) == 0
    assert cli.run(["ask", str(clip), "-Q", QUESTIONS[0], "-Q", QUESTIONS[1], "-o", str(out), "--resume",
                    "--quiet", *FAST]) == 0
    records = lines(out.read_text())
    assert [r["question"] for r in records] == [QUESTIONS[0], QUESTIONS[1]]  # the first not asked again
    assert cli.run(["ask", str(clip), "-Q", QUESTIONS[0], "-Q", QUESTIONS[1], "-o", str(out), "--resume",
                    *FAST]) == 0
    assert len(lines(out.read_text())) == 2
    assert "skipping 1 input" in capsys.readouterr().err


def test_cli_questions_with_batch_size_answer_as_one_by_one(clip, capsys):
    """-Q with --batch-size: the questions of one compressed input decode together, same answers."""
    argv = ["ask", str(clip), *(a for q in QUESTIONS for a in ("-Q", q)), "--jsonl", *FAST]
    assert cli.run(argv) == 0
    alone = {r["question"]: r["answer"] for r in lines(capsys.readouterr().out)}
    assert cli.run([*argv, "--batch-size", "3"]) == 0
    records = lines(capsys.readouterr().out)
    assert {r["question"]: r["answer"] for r in records} == alone and len(records) == 3
    assert max(r["batch"]["size_max"] for r in records) == 3


def test_cli_a_failing_question_is_its_own_error_record(clip, tmp_path, capsys):
    long = " ".join(["why"] * 17000)  # 34k tokens: more than the model's context
    out = tmp_path / "out.jsonl"
    argv = ["ask", str(clip), "-Q", QUESTIONS[0], "-Q", long, "-Q", QUESTIONS[1], "-o", str(out), *FAST]
    assert cli.run(argv) == 1
    records = lines(out.read_text())
    assert [r["question"] for r in records] == [QUESTIONS[0], long, QUESTIONS[1]]
    assert records[1]["input"] == str(clip) and records[1]["error"]["type"] == "ContextLengthError"
    assert "more than the model's context" in records[1]["error"]["message"]
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"error: {clip} · why why" in err
    assert f"[1/1] failed: {clip}" in err and "done: 0 answered, 1 failed" in err
    assert all(r["answer"] and r["shared"]["questions"] == 3 for r in (records[0], records[2]))
    assert cli.run([*argv, "--resume"]) == 1  # only the failed question is asked again
    again = lines(out.read_text())[3:]
    assert [r["question"] for r in again] == [long] and "error" in again[0]


# --- bench --per-video ------------------------------------------------------------------------------
def test_bench_per_video_equals_one_by_one_deferred(clip, tmp_path, capsys):
    images = Path(__file__).resolve().parents[1] / "sample_media" / "images"
    rows = [{"id": f"v{i}", "media": str(clip), "question": q, "answer": a}
            for i, (q, a) in enumerate(zip(QUESTIONS, ["square", "red", "two"]))]
    rows.insert(1, {"id": "img", "media": [str(images / "red_circle.png"), str(images / "blue_square.jpg")],
                    "question": "Which shape?", "answer": "circle"})
    rows.append({"id": "img2", "media": [str(images / "red_circle.png"), str(images / "blue_square.jpg")],
                 "question": "Which colour?", "answer": "red"})
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    common = ["bench", "--tasks", str(tasks), "--methods", "hybridkv,snapkv,quest", "--budgets", "0.1,1.0",
              "--json", "-q", *FAST]
    assert cli.run([*common, "--defer-question"]) == 0
    one_by_one = json.loads(capsys.readouterr().out)
    assert cli.run([*common, "--per-video"]) == 0
    grouped = json.loads(capsys.readouterr().out)
    assert grouped["config"]["options"]["per_video"] is True
    assert len(grouped["items"]) == len(one_by_one["items"]) == 5 * 7
    for a, b in zip(one_by_one["items"], grouped["items"]):
        assert (a["id"], a["method"], a["budget"]) == (b["id"], b["method"], b["budget"])
        assert (a["answer"], a["correct"], a["fidelity"], a["error"]) == (b["answer"], b["correct"], b["fidelity"],
                                                                          b["error"])
        assert a["kv_ratio"] == pytest.approx(b["kv_ratio"])
    for a, b in zip(one_by_one["aggregates"], grouped["aggregates"]):
        assert (a["method"], a["budget"], a["accuracy"], a["fidelity"]) == (b["method"], b["budget"], b["accuracy"],
                                                                            b["fidelity"])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_copy_shares_the_offloaded_kv_and_no_question_writes_the_kept_state(demo, video, method):
    """A question decodes a copy of the kept state that shares what nothing writes (the offloaded
    KV, the landmarks) and copies the rest: after questions every byte the prefix holds is as it
    was, and the shared storages are the prefix's own memory."""
    from hybridkv_cli.engine.graph import flatten

    tok = demo.processor.tokenizer
    p = build_prompt(demo.processor, video, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(tok, p, TEMPLATE_QUESTION)
    budget = 1.0 if method == "full" else 0.2
    prefix = compress_prefix(demo.model, p, make_policy(method, budget=budget, **needed(method)), template)
    storages, info, _ = flatten(prefix.state)
    before = {key: data.clone() for key, data in storages.items()}
    generations = [answer(demo.model, prefix, template.suffix(tok, q), max_new_tokens=NEW) for q in QUESTIONS]
    assert all(torch.equal(storages[key], data) for key, data in before.items())
    copied, _, _ = flatten([layer.kv for layer in generations[-1].cache.layers])
    ours = {data.data_ptr() for key, data in storages.items() if info[key]["fixed"] and data.numel()}
    theirs = {data.data_ptr() for data in copied.values() if data.numel()}
    assert ours <= theirs  # shared, not copied
    assert {data.data_ptr() for key, data in storages.items() if not info[key]["fixed"] and data.numel()}.isdisjoint(
        theirs)
    if method in ("hybridkv", "rcr", "retentivekv"):  # methods that offload: their host KV is shared
        assert ours


@pytest.mark.parametrize("method", ["hybridkv", "snapkv"])
@pytest.mark.parametrize("buffer_bytes", [None, 4096])
def test_a_question_copy_of_the_kept_state_is_one_allocation_of_its_own(demo, video, method, buffer_bytes,
                                                                         monkeypatch):
    """Each question's copy puts what decoding writes in one buffer of its own (one copy, not one a
    tensor; several where it outgrows a buffer's bytes), apart from the prefix's and every other
    copy's, shares the rest, and answers as the prefix does."""
    from hybridkv_cli.engine import graph
    from hybridkv_cli.engine.graph import flatten

    tok = demo.processor.tokenizer
    p = build_prompt(demo.processor, video, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(tok, p, TEMPLATE_QUESTION)
    prefix = compress_prefix(demo.model, p, make_policy(method, budget=0.2), template)
    want = answer(demo.model, prefix, template.suffix(tok, QUESTIONS[1]), max_new_tokens=NEW).tokens
    if buffer_bytes is not None:  # a kept prefix copied again, over buffers of this size
        monkeypatch.setattr(graph, "BUFFER_BYTES", buffer_bytes)
        prefix = compress_prefix(demo.model, p, make_policy(method, budget=0.2), template)
    assert answer(demo.model, prefix, template.suffix(tok, QUESTIONS[1]), max_new_tokens=NEW).tokens == want
    storages, info, _ = flatten(prefix.state)
    kept = {key: data.data_ptr() for key, data in storages.items() if data.numel()}
    fixed = {kept[key] for key in kept if info[key]["fixed"]}
    copies = [flatten([layer.kv for layer in prefix.take(torch.device("cpu"))[0].layers])[0] for _ in range(2)]
    written = [{data.data_ptr() for data in copy.values() if data.numel()} - fixed for copy in copies]
    assert all(len(w) == 1 for w in written) if buffer_bytes is None else all(len(w) > 1 for w in written)
    assert written[0].isdisjoint(written[1]) and written[0].isdisjoint(kept.values())
    assert all(fixed <= {data.data_ptr() for data in copy.values()} for copy in copies)
