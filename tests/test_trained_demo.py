"""The trained demo model (``--model demo``): shipped weights, offline loading, correct answers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hybridkv_cli.api import ask
from hybridkv_cli.media import MediaInput, load_media
from hybridkv_cli.models import demo as D
from hybridkv_cli.models.registry import load_model, max_pixels_for
from training import synthetic as S

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = D.trained_weights_path()
SAMPLES = ROOT / "sample_media" / "questions.jsonl"


needs_weights = pytest.mark.skipif(not WEIGHTS.is_file(), reason="no trained demo weights shipped "
                                   "(training/train_demo.py writes them)")


@pytest.fixture(scope="module")
def demo():
    start = time.perf_counter()
    loaded = load_model("demo", device="cpu", dtype="float32")
    loaded.load_s = time.perf_counter() - start
    return loaded


@needs_weights
def test_demo_loads_the_shipped_trained_weights(demo):
    assert WEIGHTS.is_file() and WEIGHTS.stat().st_size <= 10 * 2**20
    assert demo.name == "demo" and not demo.random_weights
    text, vision = demo.model.config.text_config, demo.model.config.vision_config
    assert (text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (4, 4, 2)
    assert text.hidden_size // text.num_attention_heads == 32
    assert vision.depth == D.TRAINED_VISION["depth"]
    from safetensors.torch import load_file

    saved = load_file(str(WEIGHTS))
    state = demo.model.state_dict()
    assert saved.keys() == state.keys()
    key = "lm_head.weight"
    assert torch.equal(state[key], saved[key].float())
    assert demo.load_s < 10  # ~1 s on an idle CPU; generous for loaded CI machines


def test_demo_random_is_still_the_random_model():
    rnd = load_model("demo-random", device="cpu", dtype="float32")
    assert rnd.random_weights and rnd.name == "demo-random"
    assert rnd.model.config.vision_config.depth == D.DEMO_VISION["depth"]


def test_missing_weights_say_what_to_do(tmp_path, monkeypatch):
    from hybridkv_cli.io.errors import ModelError

    with pytest.raises(ModelError, match="train_demo.py"):
        D.build_trained_demo(weights=tmp_path / "none.safetensors")
    # without shipped weights, --model demo is the random demo
    monkeypatch.setattr(D, "trained_weights_path", lambda: tmp_path / "none.safetensors")
    loaded = load_model("demo", device="cpu", dtype="float32")
    assert loaded.random_weights and loaded.name == "demo"


def test_the_trained_demo_reads_frames_at_its_training_size(tmp_path, monkeypatch):
    assert max_pixels_for("demo-random", None) is None and max_pixels_for("smollm2", None) is None
    assert max_pixels_for("demo", 50_000) == 50_000  # --max-pixels wins
    monkeypatch.setattr(D, "trained_weights_path", lambda: tmp_path / "none.safetensors")
    assert max_pixels_for("demo", None) is None  # no weights: demo is the random model
    (tmp_path / "none.safetensors").write_bytes(b"")
    assert max_pixels_for("demo", None) == D.TRAINED_MAX_PIXELS == S.VIDEO_SIZE ** 2
    clip = tmp_path / "clip.mp4"
    S.write_mp4(clip, S.make_scene(np.random.default_rng(0), 16).video)
    assert load_media(str(clip), max_pixels=max_pixels_for("demo", None)).video.shape[-2:] == (112, 112)
    assert load_media(str(clip)).video.shape[-2:] == (336, 336)  # Qwen's video minimum


def test_trained_config_keeps_the_head_geometry():
    from hybridkv_cli.models.demo import build_demo_tokenizer

    cfg = D.demo_config(build_demo_tokenizer(), trained=True)
    text = cfg.text_config
    assert (text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (4, 4, 2)
    assert text.hidden_size // text.num_attention_heads == 32
    assert sum(text.rope_parameters["mrope_section"]) == 16


@needs_weights
def test_demo_answers_the_sample_clips(demo):
    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines() if line.strip()]
    assert rows
    for row in rows:
        media = load_media(str(SAMPLES.parent / row["media"]), max_pixels=max_pixels_for("demo", None))
        assert media.video is None or media.video.shape[-1] == S.VIDEO_SIZE  # not Qwen's 3x upscale
        out = ask(demo, media, row["question"], method="full", max_new_tokens=8)
        assert out["answer"] == row["answer"], row
        assert out["note"] is None  # the "answers are noise" note is for demo-random only


def _media(scene: S.Scene) -> MediaInput:
    if scene.video is not None:
        video = torch.from_numpy(scene.video).permute(0, 3, 1, 2).contiguous()
        return MediaInput(kind="video", sources=(), video=video, images=(), frames_total=len(video),
                          frames_used=len(video), sample_fps=S.VIDEO_FPS)
    return MediaInput(kind="images", sources=(), video=None, images=tuple(map(Image.fromarray, scene.images)),
                      frames_total=None, frames_used=len(scene.images), sample_fps=None)


@needs_weights
def test_demo_answers_held_out_items(demo):
    # one held-out item of each kind, generated in memory (the full set goes through mp4 files:
    # training/make_video_tasks.py + training/eval_demo.py, docs/demo_model.md)
    items = S.held_out(quota={kind: 1 for kind in S.HELD_OUT_QUOTA})
    right = [ask(demo, _media(it.scene), it.qa.question, method="full", max_new_tokens=8)["answer"] == it.qa.answer
             for it in items]
    assert sum(right) >= len(items) - 1, right


# --- the training script ------------------------------------------------------------------------
def _train_demo():
    from training import train_demo

    return train_demo


def test_training_loss_equals_the_full_forward_loss():
    # Prefix once + question rows on copies of its cache must give exactly the loss of running
    # every question's full inference prompt. (Without an explicit mask, SDPA's top-left is_causal
    # hides the cached prefix from multi-token continuations: visual input would not matter. And a
    # clip's time axis runs past the positions the text resumes at: the question must not start
    # one past the largest position.)
    TD = _train_demo()
    model, proc = TD.build_model(0)
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(8)  # at the 0.02 init the context barely moves the logits: make it matter
        rng = np.random.default_rng(5)
        for scenes in ([S.make_image_set(rng, 2) for _ in range(2)], [S.make_scene(rng, 32)]):
            loss, total, count = _batch_and_full_losses(TD, model, proc, scenes, rng)
            assert loss == pytest.approx(total / count, rel=1e-4)


def _batch_and_full_losses(TD, model, proc, scenes, rng):
    """The training loss of ``scenes`` as one batch, checked to depend on the pixels, and the summed
    answer cross-entropy and token count of every question's full inference prompt."""
    from hybridkv_cli.models.prompt import build_prompt

    medias = [TD.to_media(sc, rng) for sc in scenes]
    inputs, suffix, labels, owner, _ = TD.encode(proc, medias, [sc.qas for sc in scenes])
    loss = TD.scene_loss(model, inputs, suffix, labels, owner)[0].item()
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    total, count = 0.0, 0
    for media, sc in zip(medias, scenes):
        for qa in sc.qas:
            prompt = build_prompt(proc, media, qa.question).inputs
            n = prompt["input_ids"].shape[1]
            answer = torch.tensor(proc.tokenizer(qa.answer, add_special_tokens=False)["input_ids"] + [im_end])
            full = dict(prompt, input_ids=torch.cat([prompt["input_ids"], answer[None]], 1))
            full["attention_mask"] = torch.ones_like(full["input_ids"])
            full["mm_token_type_ids"] = torch.nn.functional.pad(prompt["mm_token_type_ids"], (0, len(answer)))
            logits = model(**full).logits[0, n - 1:-1]
            total += torch.nn.functional.cross_entropy(logits, answer, reduction="sum").item()
            count += len(answer)
    pixels = "pixel_values" if "pixel_values" in inputs else "pixel_values_videos"
    inputs[pixels] = torch.zeros_like(inputs[pixels])
    assert abs(TD.scene_loss(model, inputs, suffix, labels, owner)[0].item() - loss) > 1e-3
    return loss, total, count


def test_training_script_writes_weights_the_demo_loads(tmp_path):
    TD = _train_demo()
    out = tmp_path / "demo.safetensors"
    assert TD.main(["--steps", "2", "--threads", "1", "--log-every", "1", "--out", str(out)]) == 0
    loaded = D.build_trained_demo(weights=out)
    assert not loaded.random_weights and out.stat().st_size < 10 * 2**20


def test_guidance_targets_the_key_word_and_the_picture_numbers():
    TD = _train_demo()
    proc = D.build_demo_processor()
    tok = proc.tokenizer
    from hybridkv_cli.models.prompt import build_prompt, question_ids

    # the key word is the last token of the shape the question names, else of its last word
    for question, word in [("What digit is shown when the star appears?", "star"),
                           ("How many squares appear?", "squares"), ("Which shape appears first?", "first"),
                           ("Which image has a red triangle?", "triangle")]:
        ids = question_ids(tok, question)
        k = TD.key_position(tok, question)
        assert tok.decode(ids[:k + 1]).endswith(word) and not tok.decode(ids[:k]).endswith(word)
    # every visual token of an image set is pulled onto its own "Picture k:" number
    rng = np.random.default_rng(1)
    scene = S.make_image_set(rng, 3)
    ids = build_prompt(proc, TD.to_media(scene, rng), scene.qas[0].question).inputs["input_ids"]
    at, label = TD.picture_targets(ids, tok)
    assert at.shape == (1, 3 * 16)
    numbers = [tok.decode(ids[0, int(p)]) for p in label[0]]
    assert numbers == [str(1 + i // 16) for i in range(48)]


@needs_weights
def test_hybridkv_finds_the_needle_when_the_question_comes_after_compression(demo):
    # The two-frame star of the sample clip: with the question in the prompt, every method answers
    # from the exact prefill; asked after compression, only retrieval can still find the star.
    media = load_media(str(ROOT / "sample_media" / "needle.mp4"), max_pixels=max_pixels_for("demo", None))
    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines() if line.strip()]
    needle = [r for r in rows if r["kind"].startswith("needle")]
    assert len(needle) == 2
    for row in needle:
        out = ask(demo, media, row["question"], method="hybridkv", budget=0.1, max_new_tokens=4, defer_question=True)
        assert out["answer"] == row["answer"] and out["defer_question"]
        assert out["kv"]["host_bytes"] > 0 and out["kv"]["ratio_vs_full"] < 0.2
