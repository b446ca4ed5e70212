"""The multimodal families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision) on their tiny random models.

Token roles (the visual mask is exactly where the model puts vision features), ``full`` equals
stock ``generate`` on an image set and a video, loading a saved checkpoint directory through the
auto classes, the unsupported-architecture error, and ``profile`` / ``bench`` smoke runs. The
method matrix over these families is in tests/test_methods.py.
"""

from __future__ import annotations

import json

import av
import numpy as np
import pytest
import torch
from PIL import Image

from hybridkv_cli import cli
from hybridkv_cli.compression import make_policy
from hybridkv_cli.engine import generate
from hybridkv_cli.io.errors import ModelError
from hybridkv_cli.media import load_media
from hybridkv_cli.models.demo import build_demo
from hybridkv_cli.models.families import FAMILIES
from hybridkv_cli.models.registry import load_model
from hybridkv_cli.models.prompt import build_prompt
from hybridkv_cli.models.tiny_models import TINY_FAMILIES, build_tiny

NEW_TOKENS = 5
QUESTION = "What happens?"


def _blocky(rng, w, h, cell=16):
    return rng.integers(0, 256, (h // cell, w // cell, 3), dtype=np.uint8).repeat(cell, 0).repeat(cell, 1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("families_media")
    rng = np.random.default_rng(3)
    images = []
    for i, (w, h) in enumerate([(224, 168), (168, 224)]):
        images.append(root / f"image{i}.png")
        Image.fromarray(_blocky(rng, w, h)).save(images[-1])
    video = root / "clip.mp4"
    with av.open(str(video), "w") as c:
        s = c.add_stream("libx264", rate=4)
        s.width, s.height, s.pix_fmt = 224, 168, "yuv420p"
        s.options = {"preset": "ultrafast", "crf": "20"}
        for _ in range(8):
            for p in s.encode(av.VideoFrame.from_ndarray(_blocky(rng, 224, 168), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return {"images": images, "video": video}


@pytest.fixture(scope="module")
def media(files):
    return {"images": load_media(files["images"]), "image": load_media(files["images"][:1]),
            "video": load_media(files["video"], frames=4)}


@pytest.fixture(scope="module")
def tiny():
    """The tiny model of every family; ``qwen25vl`` is the demo's random Qwen2.5-VL."""
    return {"qwen25vl": build_demo(), **{family: build_tiny(family) for family in TINY_FAMILIES}}


def test_every_family_has_a_tiny_model_by_name():
    assert {f.tiny for f in FAMILIES} == {"demo-random", *(f"demo-random:{k}" for k in TINY_FAMILIES)}
    for family in FAMILIES:
        loaded = load_model(family.tiny, device="cpu")
        assert loaded.model.config.model_type == family.model_type and loaded.random_weights
        assert loaded.num_kv_heads == 2 and loaded.num_heads == 4 and loaded.head_dim == 32


def _vision_positions(loaded, prompt) -> torch.Tensor:
    """Prompt positions whose input embedding is not the token's own: where the model put vision
    features (read off the language model's ``inputs_embeds``)."""
    seen = {}
    decoder = loaded.model.get_decoder()

    def grab(module, args, kwargs):
        seen["e"] = kwargs["inputs_embeds"]

    hook = decoder.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            loaded.model(**prompt.inputs)
    finally:
        hook.remove()
    own = decoder.embed_tokens(prompt.inputs["input_ids"])
    return (seen["e"] != own).any(-1)[0]


@pytest.mark.parametrize("kind", ["images", "image", "video"])
@pytest.mark.parametrize("family", ["qwen25vl", *sorted(TINY_FAMILIES)])
def test_visual_mask_is_exactly_the_vision_tokens(tiny, media, family, kind):
    loaded = tiny[family]
    prompt = build_prompt(loaded.processor, media[kind], QUESTION)
    assert 0 < prompt.visual_tokens < prompt.length
    assert torch.equal(_vision_positions(loaded, prompt), prompt.visual)


def test_llava_ov_image_modes(tiny, media):
    """One image: anyres tiles (base + unpadded grid + a newline feature per row); several images:
    the base features + one newline each (LLaVA-OneVision's multi-image mode)."""
    processor = tiny["llava-ov"].processor
    base = processor.num_image_tokens
    several = build_prompt(processor, media["images"], QUESTION)
    assert several.visual_tokens == 2 * (base + 1)
    one = build_prompt(processor, media["image"], QUESTION)
    assert one.visual_tokens > base + 1


def test_qwen3vl_frame_timestamps_are_text(tiny, media):
    loaded = tiny["qwen3vl"]
    prompt = build_prompt(loaded.processor, media["video"], QUESTION)
    text = loaded.tokenizer.decode(prompt.inputs["input_ids"][0][~prompt.visual])
    assert text.count(" seconds>") == 2  # 4 frames, temporal patch 2: one timestamp per grid frame


@pytest.mark.parametrize("family", ["qwen2vl", "qwen3vl"])
def test_qwen_processors_keep_the_media_layers_pixels(tiny, media, family):
    """Qwen2-VL keeps the media layer's size (grid 28); Qwen3-VL (grid 32) moves to its grid within
    the same pixels, so --max-pixels bounds both."""
    loaded = tiny[family]
    for kind, grid_key in (("images", "image_grid_thw"), ("video", "video_grid_thw")):
        prompt = build_prompt(loaded.processor, media[kind], QUESTION)
        sub = loaded.processor.video_processor if kind == "video" else loaded.processor.image_processor
        patch = sub.patch_size
        grids = prompt.inputs[grid_key]
        if kind == "video":
            clip = media["video"].video
            pixels = [clip.shape[0] * clip.shape[2] * clip.shape[3]]
            got = [int(g[0] * sub.temporal_patch_size * g[1] * g[2]) * patch * patch for g in grids]
        else:
            pixels = [im.size[0] * im.size[1] for im in media["images"].images]
            got = [int(g[1] * g[2]) * patch * patch for g in grids]
        if family == "qwen2vl":
            assert got == pixels
        else:
            assert all(0.5 * max(pixels) < g <= max(pixels) for g in got)


@pytest.mark.parametrize("frames", [4, 6, 8])
@pytest.mark.parametrize("family", ["qwen25vl", *sorted(TINY_FAMILIES)])
def test_a_clips_prompt_is_the_processors_own(tiny, files, family, frames, monkeypatch):
    """A decoded clip's inputs, built a temporal group at a time where the family allows
    (Qwen2/2.5-VL: its pixels a few frames at a time), equal the processor's own run on the
    whole clip: every tensor, the pixels bit for bit."""
    from hybridkv_cli.models import families

    processor = tiny[family].processor
    clip = load_media(files["video"], frames=frames)
    grouped = build_prompt(processor, clip, QUESTION).inputs
    assert families.repeats_video_groups(processor) == (family in ("qwen25vl", "qwen2vl"))
    monkeypatch.setattr(families, "repeats_video_groups", lambda processor: False)  # the processor, whole clip
    whole = build_prompt(processor, clip, QUESTION).inputs
    assert set(grouped) == set(whole)
    for key, value in whole.items():
        assert torch.equal(grouped[key], value) if torch.is_tensor(value) else grouped[key] == value, key


@pytest.mark.parametrize("kind", ["images", "video"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_full_is_stock_generate(tiny, media, family, kind):
    loaded = tiny[family]
    prompt = build_prompt(loaded.processor, media[kind], QUESTION)
    with torch.inference_mode():
        stock = loaded.model.generate(**prompt.inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    full = generate(loaded.model, prompt, make_policy("full"), max_new_tokens=NEW_TOKENS)
    assert full.tokens == stock[0, prompt.length:].tolist() and len(full.tokens) == NEW_TOKENS


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_saved_checkpoint_directory_loads_through_the_auto_classes(tiny, media, family, tmp_path):
    loaded = tiny[family]
    loaded.model.save_pretrained(tmp_path)
    loaded.processor.save_pretrained(tmp_path)
    again = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert type(again.model) is type(loaded.model) and type(again.processor) is type(loaded.processor)
    prompt = build_prompt(loaded.processor, media["images"], QUESTION)
    assert torch.equal(build_prompt(again.processor, media["images"], QUESTION).inputs["input_ids"],
                       prompt.inputs["input_ids"])
    ours = generate(loaded.model, prompt, make_policy("full"), max_new_tokens=3).tokens
    assert generate(again.model, prompt, make_policy("full"), max_new_tokens=3).tokens == ours


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_cached_hub_id_loads_offline(tiny, family, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / f"models--hybridkv-test--tiny-{family}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    tiny[family].model.save_pretrained(snapshot)
    tiny[family].processor.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    loaded = load_model(f"hybridkv-test/tiny-{family}", device="cpu")
    assert type(loaded.model) is type(tiny[family].model) and loaded.multimodal


def test_unsupported_architecture_is_one_line_listing_the_families(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "idefics3"}')
    with pytest.raises(ModelError) as err:
        load_model(str(tmp_path), device="cpu")
    message = str(err.value)
    assert "\n" not in message and "'idefics3'" in message
    for family in FAMILIES:
        assert f"{family.name} ({family.model_type})" in message


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_ask_profile_and_bench_run(files, family, tmp_path, capsys):
    fast = ["--model", f"demo-random:{family}", "--max-new-tokens", "3", "-q"]
    video = str(files["video"])
    assert cli.run(["ask", video, "What?", "--frames", "4", "--method", "snapkv", "--budget", "0.1",
                    "--defer-question", "--json", *fast]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["input"]["visual_tokens"] > 0 and record["decode"]["tokens"] >= 1
    assert cli.run(["profile", video, "What?", "--frames", "4", "--budgets", "0.5", "--json", *fast]) == 0
    assert "sweep" in json.loads(capsys.readouterr().out)
    out = tmp_path / "bench"
    assert cli.run(["bench", *map(str, files["images"]), "Which?", "--answer", "x", "--methods", "snapkv",
                    "--budgets", "0.1,1.0", "--out", str(out), *fast]) == 0
    capsys.readouterr()
    assert any(out.iterdir())
