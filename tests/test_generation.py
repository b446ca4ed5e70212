"""End-to-end on the demo model: exactness of `full` and `hybridkv` at b = 1, memory at b = 0.1."""

from pathlib import Path

import pytest
import torch

from hybridkv_cli.api import ask
from hybridkv_cli.compression import make_policy
from hybridkv_cli.engine import generate
from hybridkv_cli.media import load_media
from hybridkv_cli.models.demo import build_demo
from hybridkv_cli.models.prompt import build_prompt

SAMPLES = Path(__file__).resolve().parents[1] / "sample_media"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def demo():
    return build_demo()


@pytest.fixture(scope="module")
def prompts(demo):
    images = load_media(sorted((SAMPLES / "images").iterdir()))
    video = load_media([SAMPLES / "shapes.mp4"], frames=64)
    assert video.frames_used == 64
    return {
        "images": build_prompt(demo.processor, images, "Which image shows a square?"),
        "video": build_prompt(demo.processor, video, "What happens in the video?"),
    }


def stock_tokens(model, prompt) -> list[int]:
    with torch.inference_mode():
        out = model.generate(**prompt.inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, prompt.length:].tolist()


def policy_tokens(model, prompt, method, **options) -> list[int]:
    return generate(model, prompt, make_policy(method, **options), max_new_tokens=NEW_TOKENS).tokens


@pytest.mark.parametrize("kind", ["images", "video"])
def test_full_reproduces_stock_generate(demo, prompts, kind):
    prompt = prompts[kind]
    expected = stock_tokens(demo.model, prompt)
    assert len(expected) == NEW_TOKENS
    assert policy_tokens(demo.model, prompt, "full") == expected


@pytest.mark.parametrize("kind", ["images", "video"])
def test_hybridkv_at_budget_one_reproduces_full(demo, prompts, kind):
    prompt = prompts[kind]
    full = generate(demo.model, prompt, make_policy("full"), max_new_tokens=NEW_TOKENS)
    run = generate(demo.model, prompt, make_policy("hybridkv", budget=1.0), max_new_tokens=NEW_TOKENS)
    assert run.tokens == full.tokens
    # Every head keeps its whole prompt on the device: the full cache's bytes, nothing offloaded
    # (dynamic heads would add landmarks and a host copy, and move it back while decoding).
    assert run.device_bytes_after_prefill == full.device_bytes_after_prefill
    assert run.cache.summary()["dynamic"] == 0
    assert run.cache.host_bytes() == 0 and run.cache.transferred_bytes() == 0


def test_memory_at_budget_point_one(demo, prompts):
    prompt = prompts["video"]
    assert prompt.length >= 2000
    # The paper's setting: only dynamic heads offload (refreshed static heads would add theirs).
    result = ask(demo, load_media([SAMPLES / "shapes.mp4"]), "What happens in the video?",
                 method="hybridkv", budget=0.1, max_new_tokens=4, sink_aware=False, chunk_size=8, refresh="none",
                 window=32, landmark="mean")
    kv, heads = result["kv"], result["heads"]
    cfg = demo.model.config.get_text_config()
    dim = cfg.hidden_size // cfg.num_attention_heads
    entry = 2 * dim * demo.dtype.itemsize  # one key + one value of one head
    n = prompt.length
    full_after_prefill = cfg.num_hidden_layers * cfg.num_key_value_heads * n * entry
    # Store + landmarks + indices + padding, measured from the tensors themselves.
    assert kv["device_bytes_after_prefill"] <= 0.13 * full_after_prefill
    assert kv["device_bytes"] <= 0.13 * kv["full_bytes"]
    # Host: every dynamic head's prompt KV before its resident tail (whole chunks).
    chunked = (n - 32) // 8 * 8
    assert kv["host_bytes"] == heads["dynamic"] * chunked * entry
    # Prefill peak: about one layer of full KV beside the compressed ones.
    one_layer = cfg.num_key_value_heads * n * entry
    assert one_layer <= kv["prefill_peak_bytes"] <= one_layer + kv["device_bytes_after_prefill"]
    assert result["traffic"]["h2d_bytes_per_step_mean"] > 0
    assert result["decode"]["tokens"] == 4


def test_generation_leaves_the_model_as_it_was(demo, prompts):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    text, vision = demo.model.config.text_config, demo.model.config.vision_config
    before = (text._attn_implementation, vision._attn_implementation)
    policy_tokens(demo.model, prompts["images"], "hybridkv", budget=0.5)
    assert (text._attn_implementation, vision._attn_implementation) == before == ("sdpa", "sdpa")
    assert "hybridkv" not in ALL_ATTENTION_FUNCTIONS
