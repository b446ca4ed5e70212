"""Every registered method through the same checks, then each method's own rules.

Shared matrix (every name in ``METHODS``) over ten inputs: an image set and a video on the demo
Qwen2.5-VL and on the tiny random Qwen2-VL, Qwen3-VL and LLaVA-OneVision models
(:mod:`hybridkv_cli.models.tiny_models`), and a text prompt (context + question) on tiny Llama and
Qwen2 decoders. At b = 1
the tokens equal ``full``'s (and ``full``'s equal stock ``generate``'s); at b = 0.1 the device
bytes after prefill are within the budget (quest: honestly the full KV plus metadata, and a
per-step read set within the budget); ``ask`` works on each input and its record is
JSON-serialisable. Method-specific tests use constructed tensors.
"""

from __future__ import annotations

import json
import math

import av
import numpy as np
import pytest
import torch
from method_options import needed
from PIL import Image

from hybridkv_cli.api import ask
from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.lookm import LookM, cumulative_attention, pivot_merge
from hybridkv_cli.compression.madakv import MadaKV, plan_modalities
from hybridkv_cli.compression.quest import Quest, page_bounds
from hybridkv_cli.compression.scoring import proportional_split, snap_keep
from hybridkv_cli.compression.selection import keep_top_tiered
from hybridkv_cli.compression.snapkv import SnapKV
from hybridkv_cli.compression.sparsemm import SparseMM, head_budgets
from hybridkv_cli.compression.streamingllm import StreamingLLM
from hybridkv_cli.engine import generate
from hybridkv_cli.io.errors import HybridKVError
from hybridkv_cli.media import load_media
from hybridkv_cli.models.demo import build_demo
from hybridkv_cli.models.loaded import LoadedModel
from hybridkv_cli.models.prompt import build_prompt, build_text_prompt
from hybridkv_cli.models.tiny_models import TINY_FAMILIES, build_tiny

NAMES = sorted(METHODS)


def low(name: str) -> float | None:
    """The low test budget, or None for ``full`` (which takes only budget 1)."""
    return None if name == "full" else LOW


# FAMILY/MEDIA: the same image set / video on the tiny model of another multimodal family
FAMILY_KINDS = [f"{family}/{m}" for family in sorted(TINY_FAMILIES) for m in ("images", "video")]
FAMILY_VIDEOS = [k for k in FAMILY_KINDS if k.endswith("/video")]
KINDS = ["images", "video", "llama", "qwen2", *FAMILY_KINDS]
TEXT_KINDS = {"llama", "qwen2"}
QUESTION = "What happens?"
CONTEXT = " ".join(f"Line {i}: the {c} box is on shelf {i % 7}." for i, c in
                   zip(range(60), ["red", "blue", "green", "yellow", "black"] * 12))
NEW_TOKENS = 6
LOW = 0.1
# Device bytes after prefill at b = LOW, as a share of the full cache: the budget plus at most
# 0.01 of rounding (round(b·N) per head) and indices; landmarks and detectors are paid from it.
SLACK = 0.01
FULL_BY_DESIGN = {"full", "quest"}


# ----------------------------------------------------------------------------------------------
# shared fixtures: the demo model, an image set (~420 tokens) and a video (~1.2k tokens)
# ----------------------------------------------------------------------------------------------


def _blocky(rng, w: int, h: int, cell: int) -> np.ndarray:
    """Random colour blocks: varied tokens, so the demo's greedy output is not one repeated id."""
    return rng.integers(0, 256, (h // cell, w // cell, 3), dtype=np.uint8).repeat(cell, 0).repeat(cell, 1)


@pytest.fixture(scope="module")
def demo():
    return build_demo()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods_media")
    rng = np.random.default_rng(0)
    images = []
    for i, (w, h) in enumerate([(448, 336), (336, 448)]):
        images.append(root / f"image{i}.png")
        Image.fromarray(_blocky(rng, w, h, 16)).save(images[-1])
    video = root / "blocks.mp4"
    rng = np.random.default_rng(1)
    with av.open(str(video), "w") as c:
        s = c.add_stream("libx264", rate=4)
        s.width, s.height, s.pix_fmt = 224, 168, "yuv420p"
        s.options = {"preset": "ultrafast", "crf": "20"}
        for _ in range(32):
            frame = av.VideoFrame.from_ndarray(_blocky(rng, 224, 168, 16), format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return {"images": load_media(images), "video": load_media(video, frames=16)}


def tiny_text_model(kind: str, tokenizer) -> LoadedModel:
    """A random Llama / Qwen2 decoder (RoPE, GQA 4 query / 2 KV heads) speaking the demo tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    model_class, config_class = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[kind]
    config = config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=len(tokenizer), attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config).eval()
    return LoadedModel(model=model, processor=tokenizer, name=f"tiny-{kind}", device=torch.device("cpu"),
                       dtype=torch.float32, random_weights=False)


@pytest.fixture(scope="module")
def models(demo):
    tiny = {family: build_tiny(family) for family in TINY_FAMILIES}
    return {"images": demo, "video": demo, **{k: tiny_text_model(k, demo.tokenizer) for k in TEXT_KINDS},
            **{kind: tiny[kind.split("/")[0]] for kind in FAMILY_KINDS}}


def media_of(kind: str) -> str:
    return kind.split("/")[-1]


@pytest.fixture(scope="module")
def prompts(models, media):
    return {kind: build_text_prompt(models[kind].tokenizer, CONTEXT, QUESTION) if kind in TEXT_KINDS
            else build_prompt(models[kind].processor, media[media_of(kind)], QUESTION) for kind in KINDS}


@pytest.fixture(scope="module")
def reference(models, prompts):
    """``full`` at every kind: the tokens and device bytes the others are compared with."""
    full = make_policy("full")
    return {kind: generate(models[kind].model, p, full, max_new_tokens=NEW_TOKENS) for kind, p in prompts.items()}


def test_fixture_prompts_are_mixed_and_long_enough(prompts, reference):
    assert 300 < prompts["images"].length < 600 and 1000 < prompts["video"].length < 2000
    assert all(500 < prompts[kind].length < 1000 for kind in TEXT_KINDS)
    for kind, p in prompts.items():
        assert 0 < p.visual_tokens < p.length  # visual / context tokens and text tokens
        tokens = reference[kind].tokens
        assert len(tokens) == NEW_TOKENS and len(set(tokens)) > 1  # a repeated id would prove little


@pytest.mark.parametrize("kind", sorted(TEXT_KINDS))
def test_full_on_text_models_is_stock_generate(models, prompts, reference, kind):
    """The policy cache and attention switch work on plain decoder LMs: ``full`` is stock ``generate``."""
    prompt = prompts[kind]
    with torch.inference_mode():
        stock = models[kind].model.generate(**prompt.inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert stock[0, prompt.length:].tolist() == reference[kind].tokens


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_full_on_other_families_is_stock_generate(models, prompts, reference, kind):
    """Qwen2-VL, Qwen3-VL, LLaVA-OneVision: ``full`` is stock ``generate`` (mRoPE variants, deepstack,
    anyres images and pooled video frames included)."""
    prompt = prompts[kind]
    assert 30 < prompt.length < 2000 and 0 < prompt.visual_tokens < prompt.length
    with torch.inference_mode():
        stock = models[kind].model.generate(**prompt.inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert stock[0, prompt.length:].tolist() == reference[kind].tokens


# ----------------------------------------------------------------------------------------------
# the shared matrix
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_budget_one_reproduces_full(models, prompts, reference, name, kind):
    policy = make_policy(name, budget=1.0, **needed(name))
    run = generate(models[kind].model, prompts[kind], policy, max_new_tokens=NEW_TOKENS)
    assert run.tokens == reference[kind].tokens
    # ... because nothing was dropped: at least the full cache's bytes are on the device.
    assert run.device_bytes_after_prefill >= reference[kind].device_bytes_after_prefill


@pytest.mark.parametrize("kind", ["video", "llama", *FAMILY_VIDEOS])
@pytest.mark.parametrize("name", NAMES)
def test_question_after_compression_at_budget_one_reproduces_full(models, prompts, reference, name, kind):
    # the question goes through the compressed cache in one forward pass: same tokens as full
    prompt = prompts[kind]
    run = generate(models[kind].model, prompt, make_policy(name, budget=1.0, **needed(name)), max_new_tokens=NEW_TOKENS,
                   defer_question=True)
    assert run.tokens == reference[kind].tokens
    assert run.cache.get_seq_length() == prompt.length + NEW_TOKENS - 1  # every prompt token went in
    assert 0 < (prompt.length - prompt.question_start) < 40


@pytest.mark.parametrize("name", NAMES)
def test_one_policy_serves_many_generations(models, prompts, name):
    """A policy is configuration: reusing it gives every generation the same tokens and report."""
    policy = make_policy(name, budget=low(name), **needed(name))
    runs = [generate(models["llama"].model, prompts["llama"], policy, max_new_tokens=NEW_TOKENS) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    assert json.dumps(runs[0].cache.summary()) == json.dumps(runs[1].cache.summary())


@pytest.mark.parametrize("kind", ["video", "llama", *FAMILY_VIDEOS])
@pytest.mark.parametrize("name", NAMES)
def test_low_budget_device_bytes(models, prompts, reference, name, kind):
    prompt, loaded = prompts[kind], models[kind]
    policy = make_policy(name, budget=low(name), **needed(name))
    run = generate(loaded.model, prompt, policy, max_new_tokens=NEW_TOKENS)
    full = reference[kind].device_bytes_after_prefill
    if name not in FULL_BY_DESIGN:
        assert run.device_bytes_after_prefill <= (LOW + SLACK) * full
        return
    if name == "full":
        assert run.device_bytes_after_prefill == full
        return
    # quest keeps every entry on the device, and says so: full store + page min/max metadata.
    n, page = prompt.length, policy.page_size
    metadata = 2 * loaded.num_layers * loaded.num_kv_heads * ((n - 1) // page) * loaded.head_dim * loaded.dtype.itemsize
    assert run.device_bytes_after_prefill == full + metadata
    layers = [layer.kv for layer in run.cache.layers]
    assert all(kv.steps == len(run.tokens) - 1 for kv in layers)
    assert all(0 < kv.max_read <= round(LOW * n) for kv in layers)
    assert run.cache.summary()["read_entries_per_head"] == [kv.max_read for kv in layers]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_ask_reports_json(models, media, name, kind):
    if kind in TEXT_KINDS:
        result = ask(models[kind], None, QUESTION, context=CONTEXT, method=name, budget=low(name), max_new_tokens=4,
                     **needed(name))
        assert result["input"]["kind"] == "text" and result["input"]["context_tokens"] > 500
    else:
        result = ask(models[kind], media[media_of(kind)], QUESTION, method=name, budget=low(name), max_new_tokens=4,
                     **needed(name))
    assert isinstance(result["answer"], str)
    assert result["method"] == name and result["decode"]["tokens"] >= 1
    json.dumps(result, allow_nan=False)  # heads / summary included


# ----------------------------------------------------------------------------------------------
# constructed layers
# ----------------------------------------------------------------------------------------------


def make_layer(n=64, heads=2, group=2, dim=16, visual=None, index=0, seed=0, num_layers=4) -> PrefillLayer:
    g = torch.Generator().manual_seed(seed)
    if visual is None:
        visual = torch.zeros(n, dtype=torch.bool)
        visual[4 : n - 12] = True
    return PrefillLayer(
        index=index,
        num_layers=num_layers,
        query=torch.randn(heads, group, n, dim, generator=g),
        keys=torch.randn(heads, n, dim, generator=g),
        values=torch.randn(heads, n, dim, generator=g),
        visual=visual,
        scale=dim**-0.5,
    )


def kept_rows(store, layer) -> list[list[int]]:
    """Positions of each head's store rows, found by matching keys against the layer's keys."""
    out = []
    for h in range(store.num_heads):
        rows = store.keys[int(store.offsets[h]) : int(store.offsets[h] + store.lengths[h])]
        match = (rows[:, None] == layer.keys[h][None]).all(-1)
        assert (match.sum(1) == 1).all()
        out.append(match.float().argmax(1).tolist())
    return out


def test_keep_top_tiered_is_lexicographic():
    priority = torch.tensor([[5.0, 1e6, 3.0, 2.0, 4.0]])
    tier = torch.tensor([1.0, 0.0, 1.0, 2.0, 0.0])
    assert keep_top_tiered(priority, tier, torch.tensor([3])).nonzero()[:, 1].tolist() == [0, 2, 3]
    assert keep_top_tiered(priority, tier, torch.tensor([4])).nonzero()[:, 1].tolist() == [0, 1, 2, 3]
    assert keep_top_tiered(priority, tier, torch.tensor([9])).all()


def test_proportional_split_water_fills_and_sums_exactly():
    caps = torch.tensor([100, 100, 5, 100])
    counts = proportional_split(90, torch.tensor([1.0, 2.0, 6.0, 0.0]), caps)
    assert counts.tolist() == [28, 57, 5, 0]  # head 2 capped; its excess shared 1:2
    assert proportional_split(1000, torch.rand(4), caps).tolist() == caps.tolist()
    assert sorted(proportional_split(10, torch.zeros(3), torch.tensor([9, 9, 9])).tolist()) == [3, 3, 4]
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        w, c = torch.rand(5, generator=g), torch.randint(0, 40, (5,), generator=g)
        total = int(torch.randint(0, 150, (1,), generator=g))
        out = proportional_split(total, w, c)
        assert int(out.sum()) == min(total, int(c.sum())) and (out <= c).all() and (out >= 0).all()


def test_snap_keep_window_then_scores_within_allowed():
    pooled = torch.tensor([[0.9, 0.1, 0.8, 0.2, 0.05, 0.0, 0.01]])
    assert snap_keep(pooled, 2, torch.tensor([4])).nonzero()[:, 1].tolist() == [0, 2, 5, 6]
    visual = torch.tensor([False, True, False, True, True, False, False])
    assert snap_keep(pooled, 2, torch.tensor([9]), allowed=visual).nonzero()[:, 1].tolist() == [1, 3, 4]


def test_snapkv_keeps_window_plus_top_pooled_scores():
    layer = make_layer(n=80)
    layer.keys[:, 20] = layer.query[:, :, -8:].mean(dim=(1, 2)) * 8  # what the window attends to
    store = SnapKV(budget=0.5, window=8).compress(layer).kv
    assert store.lengths.tolist() == [40, 40]
    for rows in kept_rows(store, layer):
        assert set(range(72, 80)) <= set(rows) and 20 in rows


def test_streamingllm_keeps_exactly_sinks_and_recent():
    layer = make_layer(n=50)
    store = StreamingLLM(budget=0.2).compress(layer).kv
    assert kept_rows(store, layer) == [[0, 1, 2, 3, 44, 45, 46, 47, 48, 49]] * 2
    assert torch.equal(store.values[:4], layer.values[0, :4])
    tiny = StreamingLLM(budget=0.05, sinks=4).compress(layer).kv  # 2 entries: both sinks
    assert kept_rows(tiny, layer) == [[0, 1]] * 2


@pytest.mark.parametrize("block_elements", [1, 300, 1 << 24])
def test_cumulative_attention_matches_full_matrix(block_elements):
    layer = make_layer(n=37)
    s = torch.einsum("hgid,hjd->hgij", layer.query, layer.keys) * layer.scale
    s.masked_fill_(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    expected = s.softmax(-1).sum(2).mean(1)
    got = cumulative_attention(layer.query, layer.keys, layer.scale, block_elements=block_elements)
    torch.testing.assert_close(got, expected)
    assert got.sum(1).tolist() == pytest.approx([37.0, 37.0], rel=1e-5)  # every query row sums to 1


def test_lookm_merge_averages_into_most_similar_kept_key():
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.1, 0.9], [1.0, 0.05]]])
    values = torch.arange(10.0).view(1, 5, 2)
    keep = torch.tensor([[True, True, False, False, False]])
    k, v = pivot_merge(keys, values, keep)
    torch.testing.assert_close(k[0, 0], keys[0, [0, 2, 4]].mean(0))
    torch.testing.assert_close(k[0, 1], keys[0, [1, 3]].mean(0))
    torch.testing.assert_close(v[0, 0], values[0, [0, 2, 4]].mean(0))  # values follow the keys
    torch.testing.assert_close(v[0, 1], values[0, [1, 3]].mean(0))
    k1, v1 = pivot_merge(keys, values, torch.ones(1, 5, dtype=torch.bool))
    assert torch.equal(k1, keys) and torch.equal(v1, values)
    with pytest.raises(ValueError):
        uneven = torch.tensor([[True] * 2 + [False] * 3, [True] * 5])
        pivot_merge(keys.expand(2, -1, -1), values.expand(2, -1, -1), uneven)


def test_lookm_keeps_recent_half_then_text_before_visual():
    visual = torch.zeros(60, dtype=torch.bool)
    visual[4:54] = True  # text: 0..3 and 54..59
    layer = make_layer(n=60, visual=visual)
    policy = LookM(budget=0.2)  # 12 entries: the 6 most recent, then the 4 early text tokens, then 2 visual
    keep = policy.keep(layer)
    assert keep.sum(1).tolist() == [12, 12]
    for h in range(2):
        kept = keep[h].nonzero().flatten().tolist()
        assert kept[:4] == [0, 1, 2, 3] and kept[-6:] == list(range(54, 60))
        assert all(layer.visual[p] for p in kept[4:6])
    store = policy.compress(layer).kv
    assert store.lengths.tolist() == [12, 12]
    assert not torch.equal(store.keys[:12], layer.keys[0, keep[0]])  # evicted entries were merged in


def test_sparsemm_budgets_follow_scores_with_floor():
    counts = head_budgets(torch.tensor([0.0, 1.0, 2.0]), Budget(0.1, length=1000, heads=3, entry_bytes=512), 0.1)
    assert counts.tolist() == [10, 100, 190] and int(counts.sum()) == 300
    at_one = Budget(1.0, length=100, heads=3, entry_bytes=512)
    assert head_budgets(torch.tensor([0.0, 1.0, 30.0]), at_one, 0.1).tolist() == [100, 100, 100]


def test_sparsemm_reads_score_file_and_reports_on_the_fly(tmp_path):
    path = tmp_path / "scores.json"
    path.write_text(json.dumps({"scores": [[0.0, 9.0]]}))
    layer = make_layer(n=100)
    store = SparseMM(budget=0.2, head_scores=str(path)).compress(layer).kv
    assert store.lengths.tolist() == [2, 38]
    on_the_fly = SparseMM(budget=0.2)
    summary = on_the_fly.summary([on_the_fly.compress(layer).report])
    assert "on the fly" in summary["head_scores"]
    visual_mass = summary["per_layer"]["scores"][0]
    assert len(visual_mass) == 2 and all(0 < s < 1 for s in visual_mass)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("{not json", "not JSON"),
        (json.dumps([[1, 2]]), "expected"),
        (json.dumps({"scores": []}), "expected"),
        (json.dumps({"scores": [[1, "a"]]}), "non-negative"),
        (json.dumps({"scores": [[1, -1]]}), "non-negative"),
        ('{"scores": [[1, NaN]]}', "non-negative"),
        (json.dumps({"scores": [[1, 2], [1]]}), "layer 1 has 1 scores"),
    ],
)
def test_sparsemm_score_file_errors(tmp_path, content, message):
    path = tmp_path / "scores.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(HybridKVError, match=message):
        make_policy("sparsemm", head_scores=str(path))


def test_sparsemm_score_file_shape_must_match_model(tmp_path):
    path = tmp_path / "scores.json"
    path.write_text(json.dumps({"scores": [[1.0, 2.0, 3.0]]}))
    with pytest.raises(HybridKVError, match="3 scores, the model has 2 KV heads"):
        SparseMM(head_scores=str(path)).compress(make_layer())
    path.write_text(json.dumps({"scores": [[1.0, 2.0]]}))
    with pytest.raises(HybridKVError, match="scores for 1 layers"):
        SparseMM(head_scores=str(path)).compress(make_layer(index=1))


def test_madakv_splits_by_preference_and_carries_unused_budget():
    visual = torch.zeros(100, dtype=torch.bool)
    visual[10:] = True  # 10 text tokens
    plan = plan_modalities(torch.tensor([0.9, 0.2]), visual, budget=40, carry_in=0)
    # Head 0 wants 18 text entries but only 10 exist: 8 carried; head 1 splits 4 / 16.
    assert plan.text.tolist() == [10, 4] and plan.visual.tolist() == [2, 16] and plan.carry_out == 8
    nxt = plan_modalities(torch.tensor([0.2, 0.3]), visual, budget=40, carry_in=plan.carry_out)
    assert int(nxt.text.sum() + nxt.visual.sum()) == 48 and nxt.carry_out == 0
    # Near b = 1 the next layer cannot place the carry: it goes to the other modality instead.
    tight = plan_modalities(torch.tensor([0.9, 0.2]), visual, budget=195, carry_in=0)
    assert tight.carry_out == 5 and int(tight.text.sum() + tight.visual.sum()) == 195 - 5
    full = plan_modalities(torch.tensor([0.9, 0.2]), visual, budget=200, carry_in=0)
    assert full.text.tolist() == [10, 10] and full.visual.tolist() == [90, 90] and full.carry_out == 0
    # The last layer carries nothing out: its spare goes to the other modality, none is lost.
    last = plan_modalities(torch.tensor([0.9, 0.2]), visual, budget=40, carry_in=0, last=True)
    assert last.carry_out == 0 and int(last.text.sum() + last.visual.sum()) == 40


def test_madakv_policy_carries_between_layers_of_one_generation():
    policy = MadaKV(budget=0.1, window=8)
    visual = torch.zeros(200, dtype=torch.bool)
    visual[3:190] = True  # 13 text tokens, the last 10 in the window
    sizes = []
    for _ in range(2):  # reused for a second generation (a fresh ``run``): same result
        run, layers = {}, []
        for i in range(3):
            layer = make_layer(n=200, visual=visual, index=i, seed=i, num_layers=3)
            layer.run = run
            shared = torch.nn.functional.normalize(torch.ones(16), dim=0) * 6  # text-preferring heads:
            layer.query[:, :, -8:] += shared  # the window queries and the text keys share a direction
            layer.keys[:, ~visual] += shared
            layers.append(policy.compress(layer))
        sizes.append([int(c.kv.lengths.sum()) for c in layers])
        summary = policy.summary([c.report for c in layers])
    assert sizes[0] == sizes[1]
    carry_in = summary["per_layer"]["carry_in"]
    assert carry_in[0] == 0 and carry_in[1] > 0
    carry_out = [*carry_in[1:], 0]  # the last layer uses what it is given
    assert sizes[0] == [40 + c_in - c_out for c_in, c_out in zip(carry_in, carry_out)]
    assert sum(sizes[0]) == 3 * 40
    json.dumps(summary)


def test_quest_page_bound_is_the_direct_formula_and_an_upper_bound():
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(2, 3, 16, generator=g), torch.randn(2, 5, 8, 16, generator=g)
    lo, hi = keys.amin(2), keys.amax(2)
    direct = torch.maximum(q[:, :, None] * lo[:, None], q[:, :, None] * hi[:, None]).sum(-1).amax(1)
    bound = page_bounds(q, lo, hi)
    torch.testing.assert_close(bound, direct)
    true_max = torch.einsum("hgd,hpcd->hgpc", q, keys).amax(dim=(1, 3))
    assert (bound >= true_max - 1e-5).all()


def test_quest_reads_top_pages_and_the_last_page():
    layer = make_layer(n=83, heads=1, group=2)  # 10 selectable pages + a last page of 3
    kv = Quest(budget=0.3).compress(layer).kv  # round(24.9) = 25 entries: 2 pages + the last 3
    assert kv.pages == 2 and kv.read_entries == 19
    q = torch.randn(1, 2, 16, generator=torch.Generator().manual_seed(1))
    layer.keys[0, 42] = q[0, 0] * 10  # page 5 holds the best key
    kv = Quest(budget=0.3).compress(layer).kv
    chosen = page_bounds(q, kv.kmin, kv.kmax).topk(2).indices.sort().values[0].tolist()
    assert 5 in chosen
    rows = [p * 8 + i for p in chosen for i in range(8)] + [80, 81, 82]
    s = (q[0] @ layer.keys[0, rows].T) * layer.scale
    expected = s.softmax(-1) @ layer.values[0, rows]
    torch.testing.assert_close(kv.attend(q, layer.scale)[0], expected)
    assert kv.max_read == 19 and kv.device_bytes() > kv.store.device_bytes()
    assert math.isclose(kv.device_bytes() - kv.store.device_bytes(), 2 * 10 * 16 * 4)


def test_method_options_are_the_options_the_methods_take():
    """The typed options a run carries are exactly the union of the registered methods' fields, and
    one given to a method that does not take it stays a usage error naming its flag."""
    from dataclasses import fields

    from hybridkv_cli.compression import MethodOptions
    from hybridkv_cli.io.errors import UsageError

    taken = set().union(*(cls.options() for cls in METHODS.values()))
    assert {f.name for f in fields(MethodOptions)} == taken
    assert MethodOptions(window=8, sinks=None).given() == {"window": 8}
    assert MethodOptions(window=8).policy("snapkv", budget=0.2).window == 8
    with pytest.raises(UsageError, match="does not apply to method 'snapkv'") as e:
        MethodOptions(sinks=2).policy("snapkv")
    assert e.value.source == "--sinks"
    with pytest.raises(UsageError, match="not an option of any method"):
        MethodOptions.of({"budget": 0.1, "windw": 8})
    assert MethodOptions(sinks=2, window=4).per_method(["snapkv", "streamingllm"]) == {
        "snapkv": {"window": 4}, "streamingllm": {"sinks": 2}}
