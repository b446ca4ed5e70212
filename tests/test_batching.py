"""Batched decoding (the engine's one decode loop, hybridkv_cli.engine): every input gets the
tokens of its own single run, for every method, while members of different lengths join, finish
at different steps and leave."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from method_options import needed

from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.engine import Limits, decode, generate, prompt_job
from hybridkv_cli.media import load_media
from hybridkv_cli.models.demo import build_demo
from hybridkv_cli.models.prompt import build_prompt, build_text_prompt

SAMPLES = Path(__file__).resolve().parents[1] / "sample_media"
NEW = 10


@pytest.fixture(scope="module")
def vlm():
    """demo-random (a Qwen2.5-VL) and three prompts of different lengths."""
    loaded = build_demo()
    proc = loaded.processor
    prompts = [
        build_prompt(proc, load_media([SAMPLES / "shapes.mp4"], frames=16), "What happens in the video?"),
        build_prompt(proc, load_media(sorted((SAMPLES / "images").iterdir())), "Which image shows a square?"),
        build_prompt(proc, load_media([SAMPLES / "needle.mp4"], frames=8), "What is the hidden word?"),
    ]
    return loaded, prompts


def single(model, prompt, policy, max_new=NEW, defer=False) -> list[int]:
    return generate(model, prompt, policy, max_new_tokens=max_new, defer_question=defer).tokens


def batched(model, prompts, policy, limits=Limits(batch_size=8), max_new=NEW, defer=False) -> dict:
    jobs = [(i, lambda i=i, p=p: prompt_job(model, p, policy, defer, tag=i)) for i, p in enumerate(prompts)]
    return {o.job.tag: o for o in decode(lambda: model, jobs, max_new_tokens=max_new, limits=limits)}


@pytest.fixture(scope="module")
def stop_token(vlm) -> int:
    """A token that ends the three prompts' full-cache runs at different steps (random weights
    never choose the model's own end of sequence): worked out once for the module."""
    loaded, prompts = vlm
    runs = [single(loaded.model, p, make_policy("full", budget=1.0)) for p in prompts]
    return next(t for t in runs[1][4:] if all(t not in r[:4] for r in runs))


@pytest.fixture
def stops(vlm, stop_token):
    """:func:`stop_token` as the model's end of sequence, for the test."""
    config = vlm[0].model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = [stop_token]
    yield
    config.eos_token_id = saved


@pytest.mark.parametrize("method,budget", [(m, b) for m in sorted(METHODS) for b in (1.0, 0.1)
                                           if m != "full" or b == 1.0])
def test_batched_tokens_are_single_run_tokens(vlm, stops, method, budget):
    loaded, prompts = vlm
    policy = make_policy(method, budget=budget, **needed(method))
    expected = [single(loaded.model, p, policy) for p in prompts]
    assert len({len(t) for t in expected}) > 1 or method != "full"  # they finish at different steps
    got = batched(loaded.model, prompts, policy)
    assert [got[i].generation.tokens for i in range(3)] == expected
    assert max(o.batch["size_max"] for o in got.values()) == 3


def test_retrieval_of_every_members_dynamic_heads(vlm):
    """Every head dynamic (theta 1): the members' chunk retrieval runs as one pass per layer and
    each input moves the bytes, and gets the tokens, of its single run."""
    loaded, prompts = vlm
    policy = make_policy("hybridkv", budget=0.2, theta=1.0)
    alone = [generate(loaded.model, p, policy, max_new_tokens=NEW) for p in prompts]
    assert all(g.cache.summary()["dynamic"] > 0 for g in alone)
    got = batched(loaded.model, prompts, policy)
    for i, g in enumerate(alone):
        assert got[i].generation.tokens == g.tokens
        assert got[i].generation.cache.transferred_bytes() == g.cache.transferred_bytes() > 0


def test_deferred_question_batched(vlm):
    loaded, prompts = vlm
    policy = make_policy("hybridkv", budget=0.1)
    expected = [single(loaded.model, p, policy, defer=True) for p in prompts]
    got = batched(loaded.model, prompts, policy, defer=True)
    assert [got[i].generation.tokens for i in range(3)] == expected


def test_the_models_logits_processors_apply_per_member(vlm, monkeypatch):
    """A generation config with a repetition penalty (Qwen2.5-VL's own has one) and a banned
    repeated bigram: each member's processors read its own tokens."""
    loaded, prompts = vlm
    config = loaded.model.generation_config
    monkeypatch.setattr(config, "repetition_penalty", 1.5)
    monkeypatch.setattr(config, "no_repeat_ngram_size", 2)
    policy = make_policy("hybridkv", budget=0.1)
    expected = [single(loaded.model, p, policy) for p in prompts]
    assert len(set(expected[0])) > 2  # without them this random model repeats one token
    got = batched(loaded.model, prompts, policy)
    assert [got[i].generation.tokens for i in range(3)] == expected


def test_batch_size_caps_the_members_and_later_inputs_join(vlm):
    loaded, prompts = vlm
    policy = make_policy("snapkv", budget=0.1)
    got = batched(loaded.model, prompts * 2, policy, Limits(batch_size=2))
    assert max(o.batch["size_max"] for o in got.values()) == 2
    assert max(o.batch["joined_step"] for o in got.values()) > 0  # continuous: joined a running batch
    assert [got[i].generation.tokens for i in range(6)] == [single(loaded.model, p, policy) for p in prompts * 2]


def test_kv_memory_cap_is_never_exceeded_and_admits_more_when_compressed(vlm):
    loaded, prompts = vlm
    full = make_policy("full", budget=1.0)
    # under a cap every row a member will write is allocated when it joins: measured so, alone
    one = batched(loaded.model, prompts[:1], full, Limits(batch_size=1, kv_memory=2**62))[0]
    cap = int(one.batch["kv_device_bytes_peak"] * 2.5)  # room for two full caches of the longest prompt
    limits = Limits(kv_memory=cap)
    runs = {}
    for name in ("full", "hybridkv"):
        policy = make_policy(name, budget=1.0 if name == "full" else 0.1)
        got = batched(loaded.model, [prompts[0]] * 8, policy, limits)
        assert all(o.error is None for o in got.values())
        assert max(o.batch["kv_device_bytes_peak"] for o in got.values()) <= cap  # measured bytes
        runs[name] = max(o.batch["size_max"] for o in got.values())
    assert runs["full"] == 2 and runs["hybridkv"] >= 6


def test_input_over_the_cap_alone_is_an_error_and_the_rest_go_on(vlm):
    loaded, prompts = vlm
    policy = make_policy("full", budget=1.0)
    small = batched(loaded.model, prompts[1:2], policy, Limits(batch_size=1, kv_memory=2**62))[0].batch[
        "kv_device_bytes_peak"]
    got = batched(loaded.model, [prompts[1], prompts[0], prompts[1]], policy, Limits(kv_memory=small))
    assert got[1].error is not None and "--kv-memory" in str(got[1].error)
    assert got[0].error is None and got[2].error is None


def test_a_member_leaving_frees_its_store(vlm):
    loaded, prompts = vlm
    policy = make_policy("hybridkv", budget=0.1)
    refs = []
    for o in batched(loaded.model, prompts, policy).values():
        refs.append(weakref.ref(o.generation.cache.layers[0].kv.store.keys))
        o.generation = None
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.fixture(scope="module")
def text_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_demo().tokenizer
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=len(tok), attn_implementation="sdpa",
                         eos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompts = [build_text_prompt(tok, "word " * n, "Which word?") for n in (40, 90, 150)]
    return model, prompts


@pytest.mark.parametrize("method,budget", [("full", 1.0), ("hybridkv", 0.1), ("snapkv", 0.1), ("quest", 0.1)])
def test_text_model_batched(text_model, method, budget):
    model, prompts = text_model
    policy = make_policy(method, budget=budget)
    got = batched(model, prompts, policy)
    assert [got[i].generation.tokens for i in range(3)] == [single(model, p, policy) for p in prompts]


# --- through the command line ------------------------------------------------------------------
@pytest.fixture
def demo_loads(vlm, monkeypatch):
    monkeypatch.setattr("hybridkv_cli.models.registry.load_model", lambda name, **kw: vlm[0])


def ask_lines(capsys, *extra) -> tuple[int, list[dict], str]:
    from hybridkv_cli import cli

    code = cli.run(["ask", str(SAMPLES / "shapes.mp4"), str(SAMPLES / "needle.mp4"), str(SAMPLES / "images"),
                    "missing.mp4", "What is shown?", "--each", "--jsonl", "--frames", "8", "--max-new-tokens", "6",
                    "--budget", "0.1", "--quiet", *extra])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_ask_each_batched_gives_the_one_by_one_answers(demo_loads, capsys, tmp_path):
    code, alone, _ = ask_lines(capsys)
    assert code == 1  # the missing file
    code, together, err = ask_lines(capsys, "--batch-size", "3", "--output", str(tmp_path / "out.jsonl"))
    assert code == 1 and "missing.mp4" in err and "Traceback" not in err
    key = lambda r: r["input"] if isinstance(r["input"], str) else r["input"]["label"]  # noqa: E731
    answers = {key(r): r.get("answer") for r in alone}
    assert {key(r): r.get("answer") for r in together} == answers and len(answers) == 6
    batched = [r for r in together if "batch" in r]
    assert len(batched) == 5 and max(r["batch"]["size_max"] for r in batched) == 3
    # --resume: the file has every answered input; nothing is asked again
    code, again, err = ask_lines(capsys, "--batch-size", "3", "--output", str(tmp_path / "out.jsonl"), "--resume")
    assert [key(r) for r in again] == ["missing.mp4"]


def test_questions_of_every_input_decode_together(demo_loads, capsys):
    """``-Q`` over many inputs with ``--batch-size``: one request per input, the questions of all
    of them in one batch (2 inputs x 2 questions fill a batch of 4), each answer the one it gets
    one question at a time."""
    from hybridkv_cli import cli

    def run(*extra):
        code = cli.run(["ask", str(SAMPLES / "shapes.mp4"), str(SAMPLES / "needle.mp4"), "-Q", "What is shown?",
                        "-Q", "What colour is the star?", "--each", "--jsonl", "--frames", "8", "--max-new-tokens",
                        "6", "--quiet", *extra])
        out = capsys.readouterr().out
        assert code == 0
        return {(r["input"]["label"], r["question"]): r for r in map(json.loads, out.splitlines())}

    alone, together = run(), run("--batch-size", "4")
    assert len(together) == 4 and {k: r["answer"] for k, r in together.items()} == \
        {k: r["answer"] for k, r in alone.items()}
    assert max(r["batch"]["size_max"] for r in together.values()) == 4


def test_cuda_graphs_flag_answers_as_without_it(demo_loads, capsys):
    """``--cuda-graphs`` takes the batch decoder, for one input too (on the CPU nothing is
    replayed): the same answers, each record saying so."""
    from hybridkv_cli import cli

    _, alone, _ = ask_lines(capsys)
    code, graphed, _ = ask_lines(capsys, "--cuda-graphs")
    key = lambda r: r["input"] if isinstance(r["input"], str) else r["input"]["label"]  # noqa: E731
    assert code == 1 and {key(r): r.get("answer") for r in graphed} == {key(r): r.get("answer") for r in alone}
    assert all(r["batch"]["cuda_graphs"] and r["batch"]["graph_replayed_steps"] == 0 for r in graphed if "answer" in r)
    one = [str(SAMPLES / "needle.mp4"), "What colour is the star?", "--json", "--quiet", "--max-new-tokens", "4"]
    assert cli.run(["ask", *one]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.run(["ask", *one, "--cuda-graphs"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["answer"] == plain["answer"] and record["batch"]["size_max"] == 1


@pytest.mark.parametrize("argv,message", [
    (["--kv-memory", "lots"], "--kv-memory: expected a size such as 4GiB or 512MB, got 'lots'"),
])
def test_bad_batch_options_are_usage_errors(demo_loads, capsys, argv, message):
    from hybridkv_cli import cli

    code = cli.run(["ask", str(SAMPLES / "shapes.mp4"), *(["What?"] if "-Q" not in argv else []), "--each",
                    "--jsonl", *argv])
    assert code == 2 and message in capsys.readouterr().err


def test_bench_batched_matches_bench(demo_loads, capsys):
    from hybridkv_cli import cli

    def bench(*extra):
        assert cli.run(["bench", "--tasks", str(SAMPLES / "questions.jsonl"), "--methods", "hybridkv,snapkv",
                        "--budgets", "0.1", "--max-new-tokens", "6", "--frames", "8", "--json", "--quiet",
                        *extra]) == 0
        items = json.loads(capsys.readouterr().out)["items"]
        return [(i["id"], i["method"], i["answer"], i["fidelity"]) for i in items]

    assert bench("--kv-memory", "64MiB") == bench()


def test_stdin_paths_batched(demo_loads, capsys, monkeypatch):
    import io
    import sys

    from hybridkv_cli import cli

    paths = f"{SAMPLES / 'shapes.mp4'}\n{SAMPLES / 'needle.mp4'}\n".encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(paths)))
    code = cli.run(["ask", "-", "What is shown?", "--jsonl", "--quiet", "--frames", "8", "--max-new-tokens", "4",
                    "--kv-memory", "1GiB"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and len(lines) == 2 and all(r["batch"]["size_max"] == 2 for r in lines)
