"""A suffix (a question read after compression) goes through a compressed cache as one chunk.

At the layer: the step's work runs once, with the chunk's queries as one query group, so a
chunk's last position attends what a decode step of that group attends, for every method; with no
per-step work every position is the step of its own token. In the engine: the suffix costs one forward pass, its
first answer token comes from it (the time to it is the record's ``prefill_s``), and at b = 1 it
gives full's tokens (``tests/test_methods.py``, every method and model family).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.compression.batch_cache import step_parts
from hybridkv_cli.engine import generate
from hybridkv_cli.models.prompt import build_prompt
from hybridkv_kernels import chunk_decode_attention

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import cached_demo, demo, video  # noqa: E402,F401 - fixtures
from method_options import needed  # noqa: E402

HEADS, GROUP, DIM, N, CHUNK = 2, 3, 16, 256, 5
CASES = {name: (name, {**needed(name), **({} if name == "full" else {"budget": 0.2})}) for name in sorted(METHODS)}
CASES["hybridkv, dynamic heads"] = ("hybridkv", {"budget": 0.2, "theta": 1.0})


def compressed(name: str, options: dict, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    visual = torch.zeros(N, dtype=torch.bool)
    visual[4:N - 16] = True
    layer = PrefillLayer(index=0, num_layers=2, query=torch.randn(HEADS, GROUP, N, DIM, generator=g),
                         keys=torch.randn(HEADS, N, DIM, generator=g), values=torch.randn(HEADS, N, DIM, generator=g),
                         visual=visual, scale=DIM ** -0.5)
    return make_policy(name, **options).compress(layer).kv, layer.scale


def chunk(seed: int = 1):
    """A chunk's queries [H, G * CHUNK, d] (row g * CHUNK + t) and its keys and values [H, CHUNK, d]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(HEADS, n, DIM, generator=g) for n in (GROUP * CHUNK, CHUNK, CHUNK)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_chunks_last_position_is_a_decode_step_of_its_queries_as_one_group(case):
    kv, scale = compressed(*CASES[case])
    step = copy.deepcopy(kv)
    q, k, v = chunk()
    kv.append(k, v)
    out = kv.attend(q, scale, CHUNK).unflatten(1, (GROUP, CHUNK))
    step.append(k, v)
    group = step.attend(q, scale).unflatten(1, (GROUP, CHUNK))  # every row sees every generated row
    torch.testing.assert_close(out[:, :, -1], group[:, :, -1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[:, :, 0], group[:, :, 0])  # the first position does not see the later ones
    assert kv.store.n_gen == CHUNK and torch.equal(kv.store.gen_k[:, :CHUNK], k)


@pytest.mark.parametrize("case", ["full", "snapkv", "streamingllm"])
def test_without_step_work_every_position_is_the_step_of_its_own_token(case):
    """Causal within the chunk: position t sees the kept prompt entries and the chunk's tokens up to t."""
    kv, scale = compressed(*CASES[case])
    steps = copy.deepcopy(kv)
    q, k, v = chunk(2)
    kv.append(k, v)
    out = kv.attend(q, scale, CHUNK).unflatten(1, (GROUP, CHUNK))
    for t in range(CHUNK):
        steps.append(k[:, t:t + 1], v[:, t:t + 1])
        one = steps.attend(q.unflatten(1, (GROUP, CHUNK))[:, :, t], scale)
        torch.testing.assert_close(out[:, :, t], one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("copied", [True, False], ids=["padded-copy", "in-place"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_chunks_of_several_members_attended_together_are_each_alone(case, copied, monkeypatch):
    """A packed read's layer: the members' step work in one pass (their retrieval queries of
    different group sizes padded to one) and their chunks in one attention (small stores from a
    padded copy, larger ones in place: here forced) give each member the output and the state its
    own :meth:`LayerKV.attend` gives."""
    if not copied:
        monkeypatch.setattr(sys.modules["hybridkv_kernels.decode_attention_torch"], "COPIED_BYTES", 0)
    lengths = [5, 1, 8]
    layers = [compressed(*CASES[case], seed=i)[0] for i in range(len(lengths))]
    alone = copy.deepcopy(layers)
    scale = DIM ** -0.5
    g = torch.Generator().manual_seed(3)
    queries = [torch.randn(HEADS, GROUP * n, DIM, generator=g) for n in lengths]
    for kv, other, n in zip(layers, alone, lengths):
        k, v = torch.randn(2, HEADS, n, DIM, generator=g)
        kv.append(k, v)
        other.append(k, v)
    outs = chunk_decode_attention(queries, step_parts(layers, queries, scale), lengths, scale)
    for kv, other, q, n, out in zip(layers, alone, queries, lengths, outs):
        torch.testing.assert_close(out, other.attend(q, scale, n), rtol=1e-5, atol=1e-5)
        assert torch.equal(kv.store.keys, other.store.keys) and torch.equal(kv.store.values, other.store.values)
        if kv.dynamic is not None:
            assert torch.equal(kv.dynamic.resident, other.dynamic.resident)


@pytest.mark.parametrize("method", ["hybridkv", "snapkv"])
def test_a_deferred_question_is_one_forward_pass_and_its_first_token_comes_from_it(demo, video, method):
    prompt = build_prompt(demo.processor, video, "What colour is the square?")
    suffix = prompt.length - prompt.question_start
    calls = []
    hook = demo.model.register_forward_hook(lambda module, args, kwargs, out: calls.append(
        kwargs["input_ids"].shape[1] if kwargs.get("input_ids") is not None else args[0].shape[1]), with_kwargs=True)
    try:
        run = generate(demo.model, prompt, make_policy(method, budget=0.1), max_new_tokens=6, defer_question=True)
    finally:
        hook.remove()
    # the media prefilled, the question and template tail in one pass, then one step per later token
    assert suffix > 10 and calls == [prompt.question_start, suffix] + [1] * (len(run.tokens) - 1)
    assert len(run.step_s) == len(run.tokens) - 1 and run.prefill_s > 0
    assert run.cache.get_seq_length() == prompt.length + len(run.tokens) - 1


def test_a_question_after_a_long_clip_sits_where_the_whole_prompt_puts_it(demo):
    """Qwen's text after a video starts past the video's height and width, while its time steps
    run further (here to 52, the text from 36): a question read after compression must take the
    whole prompt's positions; and where time runs past the whole prompt (64 frames, a short
    question), the answer's tokens go on from the prompt's last one, as the model's own forward
    pass over prompt and answer puts them -- every answer token's log probability and best
    alternatives are that pass's, one pass or deferred."""
    from hybridkv_cli.engine import decode, prompt_job
    from hybridkv_cli.engine.stream import positions
    from hybridkv_cli.media import load_media

    clip = load_media([Path(__file__).resolve().parents[1] / "sample_media" / "needle.mp4"], frames=16)
    prompt = build_prompt(demo.processor, clip, "What colour is the needle?")
    pos, _ = positions(demo.model, prompt.inputs)
    q = prompt.question_start
    assert int(pos[0, 0, :q].max()) > int(pos[0, 0, q])  # the case: time runs past the text's start
    for name in ("full", "snapkv"):
        policy = make_policy(name, budget=1.0)
        assert generate(demo.model, prompt, policy, 6, defer_question=True).tokens == \
            generate(demo.model, prompt, policy, 6).tokens
    clip = load_media([Path(__file__).resolve().parents[1] / "sample_media" / "needle.mp4"], frames=64)
    prompt = build_prompt(demo.processor, clip, "Colour?")
    pos, _ = positions(demo.model, prompt.inputs)
    assert int(pos[0, 0].max()) > int(pos[0, 0, -1])  # the case: time runs past the whole prompt's text
    for defer in (False, True):
        job = prompt_job(demo.model, prompt, make_policy("full"), defer)
        job.logprobs = 5
        [outcome] = decode(lambda: demo.model, [(0, lambda: job)], max_new_tokens=6)
        answer = outcome.generation.tokens
        whole = dict(prompt.inputs)  # the model reads prompt and answer in one pass, at its own positions
        extra = torch.tensor([answer[:-1]])
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            if key in whole:
                whole[key] = torch.cat([whole[key], extra if key == "input_ids" else torch.ones_like(extra) * (
                    key == "attention_mask")], dim=1)
        demo.model.model.rope_deltas = None
        with torch.inference_mode():
            logits = demo.model(**whole).logits[0, prompt.length - 1:].float().log_softmax(-1)
        for row, token, (logprob, best) in zip(logits, answer, outcome.generation.logprobs):
            top = row.topk(5)
            assert abs(logprob - row[token].item()) < 1e-4 and [i for i, _ in best] == top.indices.tolist()
            assert max(abs(v - w) for (_, v), w in zip(best, top.values.tolist())) < 1e-4, (defer, best, top)
