"""The offline demo: its processor (a byte-level BPE tokenizer shipped as a file, the real Qwen2-VL
image and video processors, the Qwen2.5-VL chat template) and its two tiny Qwen2.5-VL models.

* :func:`build_trained_demo`: the trained-demo config (:data:`TRAINED_TEXT`, :data:`TRAINED_VISION`)
  with weights trained from scratch by ``python -m training.train_demo`` on the synthetic video /
  image-set questions of ``training/synthetic.py``, read from ``weights/demo.safetensors`` in this
  package (see docs/demo_model.md). ``--model demo`` loads it when that file is present.
* :func:`build_demo`: the deterministic random model with shaped attention heads (no files; used
  by the tests; ``--model demo-random``, and ``--model demo`` while no trained weights are
  shipped); see :func:`build_demo` for what the weights look like. Its answers are noise.

Both read the tokenizer from ``weights/demo_tokenizer.json`` (vocabulary and merges, written by
``python -m training.demo_tokenizer``).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridkv_cli.io.errors import ModelError
from hybridkv_cli.models.loaded import LoadedModel, resolve_device, resolve_dtype

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from transformers import Qwen2_5_VLProcessor

DEMO_NAME = "demo"  # the trained demo while its weights ship, else the random one
RANDOM_NAME = "demo-random"
WEIGHTS = Path(__file__).resolve().parent / "weights"
DEMO_TOKENIZER = WEIGHTS / "demo_tokenizer.json"
DEMO_SEED = 0
# --------------------------------------------------------------------------------------------
# the demo processor
# --------------------------------------------------------------------------------------------

# Qwen chat special tokens, in Qwen's own order. <|endoftext|> gets id 0 (trained with the BPE);
# the others follow the BPE vocabulary (demo vocabulary: 1900 BPE entries + these 7 = 1907).
ENDOFTEXT = "<|endoftext|>"
DEMO_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                       "<|image_pad|>", "<|video_pad|>")

# The Qwen2.5-VL-Instruct chat template (as shipped with the hub checkpoints).
QWEN25VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def _demo_bpe() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """The shipped BPE: (vocabulary, merges), read once per process."""
    data = json.loads(DEMO_TOKENIZER.read_text(encoding="utf-8"))
    return data["vocab"], tuple(tuple(m) for m in data["merges"])


def build_demo_tokenizer():
    """The demo ``Qwen2Tokenizer``: the shipped BPE + the Qwen chat special tokens as added tokens."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _demo_bpe()
    tokenizer = Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=[tuple(m) for m in merges],
        unk_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        model_max_length=32768,
    )
    # Added in Qwen's order (ids len(bpe) .. len(bpe)+6), then <|im_end|> becomes the EOS token as in
    # the Qwen2.5-VL-Instruct tokenizer_config.json.
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in DEMO_SPECIAL_TOKENS])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN25VL_CHAT_TEMPLATE
    return tokenizer


def build_demo_processor() -> "Qwen2_5_VLProcessor":
    """The offline demo processor: demo tokenizer + real Qwen2-VL image/video processors."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    # Same settings as the Qwen2.5-VL hub checkpoints (preprocessor_config.json).
    common = dict(
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, **common)
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768, cap_pixels_per_frame=False, **common
    )
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=build_demo_tokenizer(),
        video_processor=video_processor,
        chat_template=QWEN25VL_CHAT_TEMPLATE,
    )


# --------------------------------------------------------------------------------------------
# the demo model
# --------------------------------------------------------------------------------------------

DEMO_TEXT = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]},
    initializer_range=0.1,
)
DEMO_VISION = dict(
    depth=2,
    hidden_size=64,
    num_heads=4,
    intermediate_size=128,
    out_hidden_size=128,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[1],
    tokens_per_second=2,
    initializer_range=0.1,
)


# The trained demo (``--model demo``): same processor and model class, its own config, weights
# trained by training/train_demo.py on training/synthetic.py tasks (docs/demo_model.md). The text
# model keeps the random demo's geometry (GQA 4 query / 2 KV heads, head dim 32, mRoPE sections
# summing to 16) with a wider MLP; the vision tower has three blocks (two windowed, one full).
TRAINED_TEXT = dict(
    DEMO_TEXT,
    intermediate_size=384,
    initializer_range=0.02,
)
TRAINED_VISION = dict(
    DEMO_VISION,
    depth=3,
    intermediate_size=192,
    fullatt_block_indexes=[2],
    initializer_range=0.02,
)
TRAINED_WEIGHTS = "weights/demo.safetensors"  # relative to this package
TRAINED_MAX_PIXELS = 112 * 112  # its frames and images (training/synthetic.py): 16 visual tokens each


def demo_config(tokenizer, *, trained: bool = False) -> "Any":
    """The tiny ``Qwen2_5_VLConfig`` whose token ids match ``tokenizer`` (random or trained demo)."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, *DEMO_SPECIAL_TOKENS)}
    text = dict(
        copy.deepcopy(TRAINED_TEXT if trained else DEMO_TEXT),
        vocab_size=len(tokenizer),
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids[ENDOFTEXT],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=copy.deepcopy(TRAINED_VISION if trained else DEMO_VISION),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


# Demo weight shaping (applied after the standard init, from the same seeded RNG stream).
#
# With plain random weights every text head attends almost uniformly (top-5% mass ~0.1-0.2 at
# initializer_range 0.1, ~0.05 at the HF default 0.02), so head-level methods would see eight
# identical heads. The demo gives its heads distinct characters instead:
# * token embeddings at std 1.0 and residual-branch outputs (o_proj, down_proj) at std 0.02, so
#   the residual stream keeps token identity through the four layers;
# * a per-KV-head key scale (attention temperature) -> some heads sharper, some flatter;
# * "sink" heads: the key projection reads the direction of one special token's embedding into
#   the two rotation-free RoPE channels (the lowest frequency pair, 15 and 31 of 32), and the
#   query bias of the group points there, so those heads put most of their mass on that text
#   token (text-centric / static-like heads, top-5% mass > 0.9), while the others stay spread out
#   (dynamic-like). Everything is deterministic and stays well inside fp32 / bf16 range.
DEMO_EMBED_STD = 1.0
DEMO_RESIDUAL_OUT_STD = 0.02
DEMO_KEY_SCALE = ((1.0, 3.0), (2.0, 1.0), (3.0, 1.5), (1.0, 2.0))  # [layer][kv head]
DEMO_SINKS = {  # (layer, kv head) -> sink token
    (0, 0): "<|im_start|>",
    (1, 1): "<|im_start|>",
    (2, 0): "<|vision_start|>",
    (3, 1): "<|vision_end|>",
}
DEMO_SINK_GAIN = 2.5
_ROTATION_FREE_CHANNELS = (15, 31)  # head_dim 32: rotate_half pairs (i, i + 16); i = 15 rotates slowest


@torch.no_grad()
def _shape_demo_weights(model, tokenizer) -> None:
    """Give the demo's text heads distinct attention characters (see the comment above)."""
    text = model.model.language_model
    cfg = model.config.text_config
    d = cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    emb = text.embed_tokens.weight
    emb.normal_(0.0, DEMO_EMBED_STD)
    for layer_idx, layer in enumerate(text.layers):
        attn = layer.self_attn
        attn.o_proj.weight.normal_(0.0, DEMO_RESIDUAL_OUT_STD)
        layer.mlp.down_proj.weight.normal_(0.0, DEMO_RESIDUAL_OUT_STD)
        for kv in range(cfg.num_key_value_heads):
            rows = slice(kv * d, (kv + 1) * d)
            attn.k_proj.weight[rows] *= DEMO_KEY_SCALE[layer_idx % len(DEMO_KEY_SCALE)][kv % 2]
            token = DEMO_SINKS.get((layer_idx, kv))
            if token is None:
                continue
            e = emb[tokenizer.convert_tokens_to_ids(token)]
            e = e / e.norm()
            for ch in _ROTATION_FREE_CHANNELS:
                attn.k_proj.weight[kv * d + ch] += DEMO_SINK_GAIN * e
                for q in range(kv * group, (kv + 1) * group):
                    attn.q_proj.bias[q * d + ch] = DEMO_SINK_GAIN


def build_demo(
    seed: int = DEMO_SEED,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
) -> LoadedModel:
    """Build the tiny random Qwen2.5-VL + offline processor (deterministic for a given seed).

    The global torch RNG state is left untouched. ``device`` / ``dtype`` accept the same strings
    as :func:`resolve_device` / :func:`resolve_dtype` (or torch objects).
    """
    return _assemble(False, device, dtype, seed, _shape_demo_weights)


def _assemble(trained: bool, device, dtype, seed: int, set_weights) -> LoadedModel:
    """A demo model (random or trained config) with the demo processor on ``device`` in ``dtype``;
    ``set_weights(model, tokenizer)`` runs right after the seeded init, which leaves the caller's
    RNG untouched."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    dt = resolve_dtype(dtype, dev)
    processor = build_demo_processor()
    tok = processor.tokenizer
    config = demo_config(tok, trained=trained)
    config._attn_implementation = "sdpa"  # propagates to the text and vision sub-configs
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
        set_weights(model, tok)
    model.generation_config = _generation_config(config, tok)
    model.to(device=dev, dtype=dt).eval()
    # The trained demo's answers are real; the "answers are noise" note is for the random one.
    return LoadedModel(model=model, processor=processor, name=DEMO_NAME, device=dev, dtype=dt, random_weights=not trained)


def _generation_config(config, tok):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids(ENDOFTEXT)],
        pad_token_id=config.text_config.pad_token_id,
        do_sample=False,
    )


def build_trained_demo(
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    weights: str | Path | None = None,
) -> LoadedModel:
    """The trained demo: :data:`TRAINED_TEXT` / :data:`TRAINED_VISION` + the shipped weights.

    ``random_weights`` is False: its answers are real (the "answers are noise" note is for
    ``demo-random``). The global torch RNG state is left untouched.
    """
    from safetensors.torch import load_file

    path = Path(weights) if weights is not None else trained_weights_path()
    if not path.is_file():
        raise ModelError(f"trained demo weights missing ({path}); run training/train_demo.py, "
                         "or use --model demo-random", source=DEMO_NAME)
    # fp16 on disk, cast into the fp32 parameters; the random init it replaces is seeded anyway
    return _assemble(True, device, dtype, DEMO_SEED,
                     lambda model, tok: model.load_state_dict(load_file(str(path)), strict=True))


def trained_weights_path() -> Path:
    return Path(__file__).resolve().parent / TRAINED_WEIGHTS


def serves_trained(name: str) -> bool:
    """Whether model ``name`` is the trained demo: ``demo`` while its weights ship."""
    return name == DEMO_NAME and trained_weights_path().is_file()


def frame_pixels(name: str) -> int | None:
    """The pixels per frame the demo ``name`` reads unless told otherwise: the trained demo learned
    on 112 x 112 frames, which Qwen's video minimum would upscale 3x; None for the random one."""
    return TRAINED_MAX_PIXELS if serves_trained(name) else None


def load_demo(name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """``demo``: the trained demo when its weights ship with the package, else the random one;
    ``demo-random``: the random one."""
    if serves_trained(name):
        return build_trained_demo(device=device, dtype=dtype)
    loaded = build_demo(device=device, dtype=dtype)
    loaded.name = name
    return loaded
