"""``hybridkv_cli.compress``: compression around the caller's own ``model.generate``.

Inputs are built the way a user builds them (the processor called directly): an image set and a
video on the demo Qwen2.5-VL and on the tiny random Qwen2-VL, Qwen3-VL and LLaVA-OneVision models
(:mod:`hybridkv_cli.models.tiny_models`), and a text prompt on tiny Llama and Qwen2 decoders. At b = 1
every method gives exactly the tokens of the same stock ``generate`` call; the report carries the CLI
record's fields and, for the same prompt, the same KV numbers; the model is restored on exit,
also after an exception; the documented example runs as written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.generation.streamers import BaseStreamer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hybridkv_cli
from hybridkv_cli.api import ask
from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.compression.cache import ATTENTION_NAME
from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.library import roles_from_ids
from hybridkv_cli.media import load_media
from hybridkv_cli.models.demo import build_demo
from hybridkv_cli.models.prompt import build_prompt
from hybridkv_cli.models.tiny_models import TINY_FAMILIES, build_tiny

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import make_noise_video  # noqa: E402
from method_options import needed  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NAMES = sorted(METHODS)
# FAMILY/MEDIA: the same image set / video on the tiny model of another multimodal family
FAMILY_KINDS = [f"{family}/{m}" for family in sorted(TINY_FAMILIES) for m in ("images", "video")]
KINDS = ["images", "video", "llama", "qwen2", *FAMILY_KINDS]
TEXT_KINDS = {"llama", "qwen2"}
NEW_TOKENS = 6
QUESTION = "What happens?"
CONTEXT = " ".join(f"Line {i}: the {c} box is on shelf {i % 7}." for i, c in
                   zip(range(40), ["red", "blue", "green", "yellow", "black"] * 8))


def _blocky(seed: int, w: int, h: int) -> Image.Image:
    """Random colour blocks: varied tokens, so greedy output is not one repeated id."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8).repeat(16, 0).repeat(16, 1))


@pytest.fixture(scope="module")
def demo():
    return build_demo()


def text_model(kind: str, tokenizer):
    """A random Llama / Qwen2 decoder (GQA 4 query / 2 KV heads) speaking the demo tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}
    model_class, config_class = classes[kind]
    config = config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=len(tokenizer), attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_class(config).eval()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return make_noise_video(tmp_path_factory.mktemp("library") / "clip.mp4", n=16, w=112, h=84)


def user_inputs(processor, content: list[dict], **media) -> dict:
    """What a user's own script hands ``generate``: the chat template, then the processor."""
    text = processor.apply_chat_template([{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}],
                                         add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], return_tensors="pt", **media))


@pytest.fixture(scope="module")
def cases(demo):
    """kind -> (model, inputs, stock tokens)."""
    images = [_blocky(0, 224, 168), _blocky(1, 168, 224)]
    # A video as frames in memory ((T, 3, H, W) uint8), as a user's own decoder hands them over.
    frames = torch.stack([torch.from_numpy(np.array(_blocky(10 + t, 224, 168))).permute(2, 0, 1) for t in range(8)])
    # kind prefix -> a multimodal model: "" the demo Qwen2.5-VL, "FAMILY/" a tiny random one
    multimodal = {"": demo, **{f"{family}/": build_tiny(family) for family in TINY_FAMILIES}}
    inputs = {kind: dict(demo.tokenizer(CONTEXT + "\n\n" + QUESTION, return_tensors="pt")) for kind in TEXT_KINDS}
    models = {kind: text_model(kind, demo.tokenizer) for kind in TEXT_KINDS}
    for prefix, loaded in multimodal.items():
        inputs[prefix + "images"] = user_inputs(loaded.processor, [{"type": "image"}] * 2, images=images)
        inputs[prefix + "video"] = user_inputs(loaded.processor, [{"type": "video"}], videos=[frames])
        models[prefix + "images"] = models[prefix + "video"] = loaded.model
    out = {}
    for kind in KINDS:
        with torch.inference_mode():
            stock = models[kind].generate(**inputs[kind], max_new_tokens=NEW_TOKENS, do_sample=False)
        out[kind] = (models[kind], inputs[kind], stock[0, inputs[kind]["input_ids"].shape[1]:].tolist())
    return out


def compressed(model, inputs, method, **kwargs):
    with hybridkv_cli.compress(model, method, **kwargs) as run:
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist(), run


def test_fixture_inputs_are_mixed_and_answers_varied(cases):
    for kind, (model, inputs, stock) in cases.items():
        roles = roles_from_ids(inputs["input_ids"], model.config)
        assert 0 < int(roles.sum()) < roles.numel() or (kind in TEXT_KINDS and bool(roles.all()))
        assert len(stock) == NEW_TOKENS and len(set(stock)) > 1  # a repeated id would prove little


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_budget_one_is_stock_generate(cases, name, kind):
    model, inputs, stock = cases[kind]
    tokens, run = compressed(model, inputs, name, budget=1.0, **needed(name))
    assert tokens == stock
    report = run.report()
    assert report["method"] == name and report["decode"]["tokens"] == NEW_TOKENS
    assert report["kv"]["device_bytes_after_prefill"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_text_model_with_given_roles_at_budget_one(cases, name):
    """A question marked as text (roles=): still the stock tokens at b = 1."""
    model, inputs, stock = cases["llama"]
    n = inputs["input_ids"].shape[1]
    roles = torch.ones(n, dtype=torch.bool)
    roles[-8:] = False
    tokens, run = compressed(model, inputs, name, budget=1.0, roles=roles, **needed(name))
    assert tokens == stock
    assert run.report()["input"] == {"visual_tokens": n - 8, "text_tokens": 8}


@pytest.mark.parametrize("name", sorted(set(NAMES) - {"full", "quest"}))
def test_low_budget_evicts(cases, name):
    """At b = 0.1 the device holds about a tenth of the prompt KV (quest and full keep it all)."""
    model, inputs, _ = cases["video"]
    _, run = compressed(model, inputs, name, budget=0.1, **needed(name))
    assert run.report()["kv"]["prompt_ratio"] <= 0.11


def test_report_has_the_cli_record_fields_and_numbers(demo, tmp_path):
    """Same prompt as ``ask`` builds (build_prompt): the report's kv and heads are the record's."""
    paths = []
    for i, image in enumerate([_blocky(2, 224, 168), _blocky(3, 168, 224)]):
        paths.append(tmp_path / f"image{i}.png")
        image.save(paths[-1])
    media = load_media(paths)
    record = ask(demo, media, QUESTION, method="hybridkv", budget=0.1, max_new_tokens=NEW_TOKENS)
    prompt = build_prompt(demo.processor, media, QUESTION)
    tokens, run = compressed(demo.model, prompt.inputs, "hybridkv", budget=0.1)
    report = run.report()
    assert demo.tokenizer.decode(tokens, skip_special_tokens=True).strip() == record["answer"]
    for field in ("method", "budget", "kv", "traffic", "heads"):
        assert report[field] == record[field], field
    assert report["decode"].keys() == record["decode"].keys()
    assert report["decode"]["tokens"] == record["decode"]["tokens"]
    assert report["input"] == {"visual_tokens": prompt.visual_tokens, "text_tokens": prompt.text_tokens}
    brief = ask(demo, media, QUESTION, budget=0.1, max_new_tokens=NEW_TOKENS, system="Be brief.")  # as --system
    with_system = build_prompt(demo.processor, media, QUESTION, "Be brief.")
    assert brief["input"]["system"] == "Be brief." and "system" not in record["input"]
    assert brief["input"]["text_tokens"] == with_system.text_tokens != prompt.text_tokens


def _attention(model) -> dict:
    return {key: getattr(model.config, key)._attn_implementation for key in model.config.sub_configs}


def test_model_restored_on_exit_and_on_exceptions(cases):
    model, inputs, stock = cases["video"]
    before = _attention(model)
    with pytest.raises(ZeroDivisionError):
        with hybridkv_cli.compress(model, "snapkv", budget=0.5):
            assert _attention(model)["text_config"] == ATTENTION_NAME and "generate" in vars(model)
            1 / 0
    with pytest.raises(UsageError):  # raised inside generate: a cache of the caller's is refused
        with hybridkv_cli.compress(model, "snapkv", budget=0.5):
            model.generate(**inputs, cache=object(), max_new_tokens=2)
    for _ in range(2):
        assert _attention(model) == before and "generate" not in vars(model)
        assert ATTENTION_NAME not in ALL_ATTENTION_FUNCTIONS
        with torch.inference_mode():
            again = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert again[0, inputs["input_ids"].shape[1]:].tolist() == stock
        _, run = compressed(model, inputs, "hybridkv", budget=0.1)  # a normal exit restores too


def test_refusals(cases):
    model, inputs, _ = cases["llama"]
    with pytest.raises(UsageError, match="does not apply"):
        hybridkv_cli.compress(model, "snapkv", theta=0.3).__enter__()
    with hybridkv_cli.compress(model, "snapkv", budget=0.5) as run:
        with pytest.raises(UsageError, match="already inside"):
            hybridkv_cli.compress(model, "snapkv").__enter__()
        with pytest.raises(UsageError, match="batch size 1"):
            model.generate(input_ids=inputs["input_ids"].repeat(2, 1), max_new_tokens=2)
        with pytest.raises(UsageError, match="num_beams"):
            model.generate(**inputs, num_beams=2, max_new_tokens=2)
        with pytest.raises(UsageError, match="nothing was generated"):
            run.report()
        model.generate(**inputs, past_key_values=None, max_new_tokens=2)  # an empty cache argument is fine
        assert run.report()["decode"]["tokens"] == 2
    with pytest.raises(UsageError, match="roles has 3 entries"):
        compressed(model, inputs, "snapkv", roles=[True, False, True])
    assert "generate" not in vars(model)


def test_ready_policy_streamer_and_several_generations(cases):
    """A policy object works as ``method``; the caller's streamer still sees every token; one
    report per generate call."""
    model, inputs, stock = cases["images"]

    class Collect(BaseStreamer):
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.append(value.reshape(-1).tolist())

        def end(self):
            self.seen.append("end")

    streamer = Collect()
    with hybridkv_cli.compress(model, make_policy("rcr", budget=1.0)) as run:
        model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=streamer)
    assert out[0, inputs["input_ids"].shape[1]:].tolist() == stock
    assert [t[0] for t in streamer.seen[1:-1]] == stock and streamer.seen[-1] == "end"
    assert [r["method"] for r in run.reports()] == ["rcr", "rcr"]


@pytest.mark.parametrize("kind", ["images", "llama"])
def test_own_loop_with_new_cache(cases, kind):
    """A greedy loop of the caller's own through ``run.new_cache`` at b = 1 is stock generate."""
    model, inputs, stock = cases[kind]
    with hybridkv_cli.compress(model, "snapkv", budget=1.0) as run, torch.inference_mode():
        cache = run.new_cache(inputs["input_ids"])
        token = model(**inputs, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tokens = [int(token)]
        for _ in range(NEW_TOKENS - 1):
            token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tokens.append(int(token))
    assert tokens == stock
    assert run.report()["decode"]["tokens"] == NEW_TOKENS - 1  # tokens fed back after the prompt


def test_documented_example_runs(demo, clip, tmp_path, monkeypatch, capsys):
    """The example of docs/library.md marked as tested, on the demo model with a clip.mp4 at hand."""
    text = (REPO / "docs" / "library.md").read_text()
    block = re.search(r"<!-- tested: tests/test_library.py -->\n```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "clip.mp4").write_bytes(Path(clip).read_bytes())
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/library.md", "exec"), {"model": demo.model, "processor": demo.processor})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and "bytes on the device" in printed[1] and "static heads" in printed[2]
    assert "generate" not in vars(demo.model)
