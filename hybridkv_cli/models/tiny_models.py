"""Tiny random models of the other multimodal families, built in process (no files, no network).

``--model demo-random:FAMILY`` (FAMILY: ``qwen2vl``, ``qwen3vl``, ``llava-ov``; ``qwen25vl`` is
``demo-random``) gives the real transformers model class of that family with a tiny config,
seeded random weights (token embeddings at std 1 and small residual-branch outputs, so greedy
answers vary with the input), and the family's real processor classes built from parameters
around the demo's byte-level BPE tokenizer (:func:`hybridkv_cli.models.demo.build_demo_tokenizer`).
Text decoders share one geometry: 4 layers, GQA 4 query / 2 KV heads, head dim 32. Their answers
are noise; they exist so that every family runs offline in the tests.
"""

from __future__ import annotations

import copy

import torch

from hybridkv_cli.io.errors import ModelError
from hybridkv_cli.models import demo
from hybridkv_cli.models.loaded import LoadedModel

__all__ = ["TINY_FAMILIES", "build_tiny", "load_tiny"]

PREFIX = demo.RANDOM_NAME + ":"
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
            initializer_range=0.1)
MROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]}

# The Qwen2-VL / Qwen3-VL instruct templates mark media the way Qwen2.5-VL's does.
QWEN_TEMPLATE = demo.QWEN25VL_CHAT_TEMPLATE
# The LLaVA-OneVision (Qwen2 chat) template as shipped with the llava-hf checkpoints.
LLAVA_OV_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>\n' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _qwen_processor(processor_class, patch: int, video_min: int):
    from transformers import Qwen2VLImageProcessor

    common = dict(patch_size=patch, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD)
    factor = patch * 2
    image = Qwen2VLImageProcessor(min_pixels=4 * factor * factor, max_pixels=factor * factor * 1280, **common)
    video_class = _video_class(processor_class)
    video = video_class(size={"shortest_edge": video_min, "longest_edge": factor * factor * 768 * 64}, **common)
    return processor_class(image_processor=image, tokenizer=demo.build_demo_tokenizer(), video_processor=video,
                           chat_template=QWEN_TEMPLATE)


def _video_class(processor_class):
    from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor if processor_class.__name__.startswith("Qwen3") else Qwen2VLVideoProcessor


def _ids(tok, *tokens):
    return {t: tok.convert_tokens_to_ids(t) for t in tokens}


def _qwen2vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    processor = _qwen_processor(Qwen2VLProcessor, 14, 56 * 56)
    tok = processor.tokenizer
    ids = _ids(tok, demo.ENDOFTEXT, *demo.DEMO_SPECIAL_TOKENS)
    text = dict(copy.deepcopy(TEXT), rope_parameters=dict(MROPE), vocab_size=len(tok),
                bos_token_id=ids[demo.ENDOFTEXT], eos_token_id=ids["<|im_end|>"], pad_token_id=ids[demo.ENDOFTEXT])
    text.pop("head_dim")  # Qwen2-VL's head dim is hidden_size // heads (32)
    vision = dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.1)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    return Qwen2VLForConditionalGeneration, config, processor


def _qwen3vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    processor = _qwen_processor(Qwen3VLProcessor, 16, 64 * 64)
    tok = processor.tokenizer
    ids = _ids(tok, demo.ENDOFTEXT, *demo.DEMO_SPECIAL_TOKENS)
    text = dict(copy.deepcopy(TEXT), vocab_size=len(tok), bos_token_id=ids[demo.ENDOFTEXT],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids[demo.ENDOFTEXT],
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 6, 6],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=128, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0], initializer_range=0.1)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    return Qwen3VLForConditionalGeneration, config, processor


LLAVA_SIZE = 56  # vision tower input: 4 x 4 patches of 14 -> 16 features per tile / frame


def _llava_ov():
    from tokenizers import AddedToken
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor)

    tok = demo.build_demo_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<image>", "<video>")])
    tok.chat_template = LLAVA_OV_TEMPLATE
    s = LLAVA_SIZE
    pinpoints = [[s, s], [s, 2 * s], [2 * s, s], [2 * s, 2 * s], [s, 3 * s], [3 * s, s]]
    image = LlavaOnevisionImageProcessor(size={"height": s, "width": s}, image_grid_pinpoints=pinpoints,
                                         image_mean=CLIP_MEAN, image_std=CLIP_STD)
    video = LlavaOnevisionVideoProcessor(size={"height": s, "width": s}, image_mean=CLIP_MEAN, image_std=CLIP_STD)
    processor = LlavaOnevisionProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                                        num_image_tokens=(s // 14) ** 2, vision_feature_select_strategy="full",
                                        chat_template=LLAVA_OV_TEMPLATE, vision_aspect_ratio="anyres_max_9")
    ids = _ids(tok, demo.ENDOFTEXT, "<|im_end|>", "<image>", "<video>")
    text = dict(copy.deepcopy(TEXT), model_type="qwen2", vocab_size=len(tok), bos_token_id=ids[demo.ENDOFTEXT],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids[demo.ENDOFTEXT],
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    vision = dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, image_size=s, patch_size=14, vision_use_head=False)
    config = LlavaOnevisionConfig(text_config=text, vision_config=vision, image_token_index=ids["<image>"],
                                  video_token_index=ids["<video>"], vision_feature_select_strategy="full",
                                  vision_feature_layer=-1, image_grid_pinpoints=pinpoints, tie_word_embeddings=False)
    return LlavaOnevisionForConditionalGeneration, config, processor


TINY_FAMILIES = {"qwen2vl": _qwen2vl, "qwen3vl": _qwen3vl, "llava-ov": _llava_ov}
EMBED_STD, RESIDUAL_OUT_STD = 1.0, 0.02


@torch.no_grad()
def _shape(model) -> None:
    """Token identity survives the residual stream (varied greedy answers), as in the demo."""
    text = model.get_decoder()
    text.embed_tokens.weight.normal_(0.0, EMBED_STD)
    for layer in text.layers:
        layer.self_attn.o_proj.weight.normal_(0.0, RESIDUAL_OUT_STD)
        layer.mlp.down_proj.weight.normal_(0.0, RESIDUAL_OUT_STD)


def build_tiny(family: str, seed: int = demo.DEMO_SEED, *, device="cpu", dtype=torch.float32) -> LoadedModel:
    """The tiny random model of ``family`` (a key of :data:`TINY_FAMILIES`) with its processor.

    Deterministic for a given seed; the global torch RNG state is left untouched.
    """
    from hybridkv_cli.models.loaded import resolve_device, resolve_dtype

    if family not in TINY_FAMILIES:
        raise ModelError(f"no tiny model of family {family!r} (there are: {', '.join(TINY_FAMILIES)})",
                         source=PREFIX + family)
    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    dt = resolve_dtype(dtype, dev)
    model_class, config, processor = TINY_FAMILIES[family]()
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        _shape(model)
    model.generation_config = demo._generation_config(config, processor.tokenizer)
    model.to(device=dev, dtype=dt).eval()
    return LoadedModel(model=model, processor=processor, name=PREFIX + family, device=dev, dtype=dt,
                       random_weights=True)


def load_tiny(name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """``demo-random:FAMILY``; ``demo-random:qwen25vl`` is the demo's own random Qwen2.5-VL."""
    family = name.removeprefix(PREFIX)
    if family in ("qwen25vl", "qwen2.5vl", "qwen2_5_vl"):
        loaded = demo.build_demo(device=device, dtype=dtype)
        loaded.name = name
        return loaded
    return build_tiny(family, device=device, dtype=dtype)
