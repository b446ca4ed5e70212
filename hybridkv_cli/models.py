"""Load Qwen2.5-VL (hub id or local directory) or build the offline demo model.

``load_model(name)`` returns a :class:`LoadedModel`: the model in eval mode on its device and dtype,
its processor, and where they came from. ``name`` is one of

* ``"demo"``: a tiny randomly initialised Qwen2.5-VL (the real transformers class, 4 text layers,
  GQA 4 query / 2 KV heads, a 2-block vision tower) with an offline processor (a byte-level BPE
  tokenizer trained at build time on a small embedded corpus, the real Qwen2-VL image and video
  processors, a Qwen2.5-VL chat template). Deterministic, built in well under two seconds, no
  network, no files. Its answers are noise.
* a local directory holding a Qwen2.5-VL checkpoint (``config.json`` + weights + processor files);
* a Hugging Face hub id (downloaded into / read from the local hub cache).

The text attention is loaded as ``"sdpa"``; switch it later with
``model.set_attn_implementation({"text_config": NAME, "vision_config": "sdpa"})``.

Processor call for media that are already sized (see :data:`IMAGE_KWARGS` / :func:`video_kwargs`)::

    prompt = lm.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = lm.processor(text=[prompt], images=images, videos=[video], return_tensors="pt",
                          images_kwargs=IMAGE_KWARGS,
                          videos_kwargs=video_kwargs(fps=[2.0], num_frames=[len(video)]))

``inputs`` holds ``mm_token_type_ids``; pass all of it to the model (``model(**inputs)`` /
``model.generate(**inputs)``) or 3-D mRoPE silently degrades to 1-D positions.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import ModelError, UsageError

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

__all__ = [
    "DEFAULT_MODEL",
    "DEMO_NAME",
    "IMAGE_KWARGS",
    "LoadedModel",
    "build_demo",
    "build_demo_processor",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "video_kwargs",
]

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
DEMO_NAME = "demo"
DEMO_SEED = 0

#: ``images_kwargs`` for images already resized to multiples of 28 (patch 14 x merge 2): no second
#: resize by the image processor.
IMAGE_KWARGS: dict[str, Any] = {"do_resize": False}


def video_kwargs(
    fps: float | Sequence[float] | None = None, num_frames: int | Sequence[int] | None = None
) -> dict[str, Any]:
    """``videos_kwargs`` for ``(T, 3, H, W)`` uint8 clips that media.py already sampled and sized.

    ``do_sample_frames=False`` keeps every frame given; ``do_resize=False`` keeps the size (the
    Qwen2-VL video processor would otherwise resize again and *upscale* small clips to its
    100k-pixel minimum, e.g. 112x112 -> 336x336); ``cap_pixels_per_frame=False`` silences a
    transformers 5.x deprecation warning.

    ``fps`` is the rate of the frames *given* (frames kept per second of source video, e.g. 64
    frames from a 32 s clip -> 2.0), one value per clip, with ``num_frames`` (T per clip). They
    become ``video_metadata``, from which the processor computes ``second_per_grid_ts``
    (= temporal_patch_size / fps, the temporal spacing of 3-D mRoPE). Without them transformers
    assumes 24 fps. (A bare ``fps=`` processor kwarg does *not* do this: it is a sampling rate,
    ignored when ``do_sample_frames=False``.)
    """
    kw: dict[str, Any] = {"do_sample_frames": False, "do_resize": False, "cap_pixels_per_frame": False}
    if fps is not None:
        fps_list = [float(fps)] if isinstance(fps, numbers.Real) else [float(f) for f in fps]
        if num_frames is None:
            raise ValueError("video_kwargs: pass num_frames together with fps")
        if isinstance(num_frames, numbers.Integral):
            frames = [int(num_frames)] * len(fps_list)
        else:
            frames = [int(n) for n in num_frames]
        if len(frames) != len(fps_list):
            raise ValueError("video_kwargs: one fps and one num_frames per clip")
        kw["video_metadata"] = [
            {"total_num_frames": n, "fps": f, "frames_indices": list(range(n)), "duration": n / f}
            for f, n in zip(fps_list, frames)
        ]
    return kw


@dataclass
class LoadedModel:
    """A Qwen2.5-VL model ready for inference, with its processor."""

    model: "Qwen2_5_VLForConditionalGeneration"
    processor: "Qwen2_5_VLProcessor"
    name: str
    device: torch.device
    dtype: torch.dtype
    is_demo: bool

    @property
    def text_config(self):
        """The text (language model) config: layers, heads, hidden size."""
        return self.model.config.text_config

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(self.text_config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        # The text attention of transformers 5.x uses hidden_size // num_heads, whatever head_dim says.
        return int(self.text_config.hidden_size // self.text_config.num_attention_heads)


# --------------------------------------------------------------------------------------------
# device / dtype
# --------------------------------------------------------------------------------------------

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when CUDA is available, else ``cpu``. ``cuda[:N]`` needs CUDA."""
    if isinstance(device, torch.device):
        device = str(device)
    text = (device or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)", source="--device") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise UsageError(f"unsupported device {device!r} (use auto, cpu, cuda or cuda:N)", source="--device")
    if not torch.cuda.is_available():
        raise UsageError(f"{device!r} requested but CUDA is not available here (use --device cpu)", source="--device")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(
            f"{device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist", source="--device"
        )
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 on CPU; else one of bfloat16 | float16 | float32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise UsageError(f"unsupported dtype {dtype} (use bfloat16, float16 or float32)", source="--dtype")
        return dtype
    text = (dtype or "auto").strip().lower().removeprefix("torch.")
    if text == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if text not in _DTYPES:
        raise UsageError(f"unknown dtype {dtype!r} (use auto, bfloat16, float16 or float32)", source="--dtype")
    return _DTYPES[text]


# --------------------------------------------------------------------------------------------
# the demo processor
# --------------------------------------------------------------------------------------------

# Qwen chat special tokens, in Qwen's own order. <|endoftext|> gets id 0 (trained with the BPE);
# the others follow the BPE vocabulary (demo vocabulary: 1900 BPE entries + these 7 = 1907).
ENDOFTEXT = "<|endoftext|>"
DEMO_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

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

# Qwen2's pre-tokenisation regex (the same one transformers' Qwen2Tokenizer uses).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CORPUS_TEXT = """\
You are a helpful assistant. Answer the question about the video or the images. Describe what
happens in the video. What is the man holding in his right hand? Which image shows a dog? How many
people are in the room? What color is the car that drives past the house? Where does the woman go
after she leaves the kitchen? Why does the child start to laugh? When does the light turn green?
The video shows a person walking along a river at sunset. A small dog runs after a red ball and
brings it back to the boy. Two men are playing chess in a quiet park while birds sit on the bench.
A woman opens the door, takes off her coat, and sits down at the table to read a letter. The camera
moves slowly from the left to the right and then zooms in on the face of an old man who is smiling.
In the first image there is a cat sleeping on a blue sofa; in the second image a bicycle leans
against a wall; in the third image three children are building a sand castle on the beach.
The answer is yes. The answer is no. The answer is A. The answer is B. The answer is C. The answer
is D. There are two cars, four trees, one house and seven birds in the picture. The scene takes
place at night in a busy city street with bright lights, tall buildings and many people. First the
chef cuts the onions, then he heats the oil in a pan, adds the vegetables and stirs them for five
minutes before he serves the food on a white plate. The weather is cold and it is raining. The
train arrives at the station, the doors open and the passengers get off with their bags.
Please watch the whole clip carefully before you answer. Look at each frame and find the moment
when the ball hits the window. The key is hidden under the green box next to the lamp. The number
written on the board is 42981. The sign says "Closed on Sunday". The video is about cooking, sports,
travel, music, animals, science, history, and everyday life. Summarize the main events in order.
Is the statement true or false? Choose the best option from the list below and answer with the
letter only. Options: (A) a kitchen (B) a garden (C) an office (D) a classroom. The speaker explains
how the machine works, points at the screen, and asks the audience a question. At the end of the
video everyone claps and the music stops. It was a sunny morning; the market was full of fruit,
bread, fish, cheese, flowers and noisy sellers. She wrote 3 words, 15 numbers, and 1,024 lines.
"""

_SUBJECTS = (
    "the man", "the woman", "a child", "the dog", "a cat", "the player", "the driver", "the teacher",
    "a bird", "the camera", "the robot", "my friend", "our team", "the girl", "the boy", "a horse",
)
_VERBS = (
    "walks", "runs", "jumps", "looks", "points", "waits", "sits", "stands", "drives", "turns",
    "opens", "closes", "throws", "catches", "pushes", "pulls", "reads", "writes", "sings", "dances",
)
_PLACES = (
    "in the kitchen", "near the window", "on the street", "at the station", "in the garden",
    "behind the door", "under the table", "across the bridge", "on the beach", "in the office",
    "at the market", "inside the car", "on the stage", "in the forest", "by the river", "on the roof",
)
_TIMES = ("at first", "then", "after that", "finally", "suddenly", "later", "again", "slowly")
_COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple", "brown", "gray")
_THINGS = ("ball", "box", "hat", "bag", "book", "cup", "phone", "chair", "lamp", "key", "door", "car")
# Common English words, so that the trained vocabulary reaches ~1.5k entries.
_WORDS = """
about above across action actually add address after afternoon again against age ago agree air all
allow almost alone along already also always among amount and angle animal another answer any
anyone anything appear apple area arm around arrive art article ask attack attention audience
autumn away baby back bad bake balance band bank base basket bath bear beautiful because become
bed before begin behind believe bell below belt bench best better between big bike bill bit bitter
blanket block blood board boat body bone border bottle bottom bowl brain branch brave bread break
breakfast bridge bright bring broad brother brush build burn bus business busy butter button buy
cake call calm camp candle capital captain card care careful carry case castle catch cause ceiling
center certain chain chalk chance change chapter cheap check cheese chicken chief choice choose
church circle city class clean clear climb clock cloth cloud coast coat coffee coin cold collect
college comb come comfort common company compare complete computer condition contain control cook
cool copy corner correct cost cotton count country course cousin cover cow crack crowd cry cup
curtain cut daily damage danger dark date daughter day dead deal dear decide deep degree describe
desert design desk detail develop dictionary different difficult dinner direction dirty discover
dish distance divide doctor dollar double down draw dream dress drink drop dry duck during dust
each ear early earth east easy eat edge egg eight either electric elephant else empty end enemy
energy engine enjoy enough enter equal error evening event every exact example except excite
exercise expect experience explain eye face fact factory fail fair fall false family famous far farm
fast fat father fear feather feel fence few field fight figure fill film find fine finger finish
fire first fish fit five flag flat floor flower fly fold follow food foot force foreign forget fork
form forward four free fresh friend front fruit full fun funny future game garden gate gather
general gentle get gift give glad glass glove goal gold good government grand grass great ground
group grow guard guess guest guide gun hair half hall hammer hand hang happen happy hard head health
hear heart heat heavy help here high hill history hold hole holiday home honest hope horse hospital
hot hotel hour house however huge human hundred hungry hurry husband ice idea important inch
increase indeed information inside instead interest invent iron island jacket job join journey
juice jump just keep kind king kiss kitchen knee knife knock know lady lake land language large
last late laugh law lazy lead leaf learn leave left leg lesson letter level library lie life lift
light like line lion lip list listen little live lock long lose loud love low lucky lunch machine
main make many map mark market marry match matter meal mean measure meat medicine meet member memory
metal middle milk mind minute mirror miss mistake modern moment money monkey month moon more morning
mother mountain mouse mouth move much museum music must name narrow nation nature near neck need
needle neighbor nest net never new news next nice night nine noise none noon north nose note nothing
notice now number nurse object ocean offer often oil old once only open opinion orange order other
outside over own page pain paint pair paper parent park part party pass past path pay peace pen
pencil people pepper perhaps person picture piece pig pink place plan plane plant plate play please
pocket poem point police pool poor popular position possible potato pound powder power present
pretty price print prison private prize problem produce promise proud public pull pupil purple push
put queen quick quiet race radio rain raise reach ready real reason receive record rest rice rich
ride right ring rise road rock roll room root rope rose round row rule run sad safe sail salt same
sand save say school science sea season seat second secret see seed seem sell send sense sentence
serve set seven shade shake shape share sharp sheep shelf shine ship shirt shoe shop short shoulder
shout show shut sick side sign silver simple since sing sister size skin sky sleep slow small smell
smile smoke snake snow soap soft soldier some son song soon sorry sound soup south space speak
special speed spend spoon sport spring square stair stamp star start state stay steal steel step
stick still stone stop store storm story straight strange street strong student study sugar summer
sun supper sure surprise sweet swim table tail take talk tall taste tea teach tear telephone tell
ten tent test than thank thick thin thing think third thirsty thousand three through throw thumb
ticket tidy tie tiger time tiny tired today together tomorrow tongue tonight tool tooth top touch
towel tower town toy traffic travel tree trouble truck true try turn twelve twenty type ugly umbrella
uncle under understand uniform until upon upstairs use useful usual valley value vegetable very
village visit voice wait wake walk wall want war warm wash watch water wave way weak wear week weight
welcome well west wet wheel when where which while whisper wide wife wild win wind wine winter wish
woman wonder wood wool word work world worry write wrong yard year yellow yesterday young zero zoo
""".split()


@functools.lru_cache(maxsize=1)
def _demo_corpus() -> tuple[str, ...]:
    """A deterministic English training corpus: the text above plus generated sentences."""
    prose = [line for line in _CORPUS_TEXT.splitlines() if line.strip()]
    lines = prose * 4  # weight the prompt-like prose over the word lists
    for i, (subject, verb, place) in enumerate(itertools.product(_SUBJECTS, _VERBS, _PLACES)):
        if i % 7:  # a deterministic 1-in-7 subset keeps the corpus small
            continue
        time = _TIMES[i % len(_TIMES)]
        color = _COLORS[i % len(_COLORS)]
        thing = _THINGS[(i // 3) % len(_THINGS)]
        lines.append(f"{time.capitalize()} {subject} {verb} {place} with the {color} {thing}.")
        lines.append(f"Question: what does {subject} do {place}? Answer: {subject} {verb}. Frame {i % 97}.")
    n = len(_WORDS)
    for i, word in enumerate(_WORDS):  # every word a few times, in different company
        a, b = _WORDS[(i * 7 + 3) % n], _WORDS[(i * 13 + 5) % n]
        lines.append(f"The {word} and the {a}. A {b} {word}s near the {word}. {word.capitalize()}, {a}, {b}!")
    return tuple(lines)


DEMO_BPE_VOCAB = 1900


@functools.lru_cache(maxsize=1)
def _demo_bpe() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Train the demo byte-level BPE (cached per process; deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_BPE_VOCAB,
        min_frequency=2,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_demo_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = tuple(tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"])
    return dict(model["vocab"]), merges


def build_demo_tokenizer():
    """The demo ``Qwen2Tokenizer``: trained BPE + the Qwen chat special tokens as added tokens."""
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


def demo_config(tokenizer) -> "Any":
    """The tiny ``Qwen2_5_VLConfig`` whose token ids match ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, *DEMO_SPECIAL_TOKENS)}
    text = dict(
        copy.deepcopy(DEMO_TEXT),
        vocab_size=len(tokenizer),
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids[ENDOFTEXT],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=copy.deepcopy(DEMO_VISION),
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
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    dt = resolve_dtype(dtype, dev)
    processor = build_demo_processor()
    tok = processor.tokenizer
    config = demo_config(tok)
    config._attn_implementation = "sdpa"  # propagates to the text and vision sub-configs
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
        _shape_demo_weights(model, tok)
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id,
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids(ENDOFTEXT)],
        pad_token_id=config.text_config.pad_token_id,
        do_sample=False,
    )
    model.to(device=dev, dtype=dt).eval()
    return LoadedModel(model=model, processor=processor, name=DEMO_NAME, device=dev, dtype=dt, is_demo=True)


# --------------------------------------------------------------------------------------------
# loading real checkpoints
# --------------------------------------------------------------------------------------------

_FIX_HINT = (
    "download it first (`hf download {name}` while online), pass a local checkpoint directory "
    "to --model, or use --model demo"
)
_HUB_PROBE_TIMEOUT_S = 5.0


def load_model(name: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load ``name``: ``"demo"``, a local Qwen2.5-VL checkpoint directory, or a hub id.

    The model comes back in eval mode on ``device`` in ``dtype`` with text and vision attention
    ``"sdpa"``.

    Raises
    ------
    UsageError
        Bad ``device`` / ``dtype``.
    ModelError
        The path is not a Qwen2.5-VL checkpoint directory; the hub id is not cached locally and the
        hub is offline or unreachable; or loading failed (one line, no traceback).
    """
    name = str(name).strip()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name == DEMO_NAME:
        return build_demo(DEMO_SEED, device=dev, dtype=dt)

    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError("not a directory (a model is a checkpoint directory or a hub id)", source=name)
        _check_local_checkpoint(path, name)
        return _from_pretrained(str(path), name, dev, dt, local_files_only=True)

    if _looks_like_path(name):
        raise ModelError("no such directory", source=name)
    _validate_hub_id(name)
    return _load_hub(name, dev, dt)


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a filesystem path rather than a hub id (org/name)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")


def _validate_hub_id(name: str) -> None:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except Exception:  # HFValidationError
        raise ModelError("no such directory, and not a valid hub id (expected org/name)", source=name) from None


def _check_local_checkpoint(path: Path, name: str) -> None:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError("no config.json in this directory: not a Hugging Face model checkpoint", source=name)
    _check_model_type(_read_model_type(config_file, name), name)


def _read_model_type(config_file: Path, name: str) -> str | None:
    try:
        return json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as exc:
        raise ModelError(f"config.json is unreadable ({_first_line(exc)})", source=name) from None


def _check_model_type(model_type: str | None, name: str) -> None:
    if model_type is not None and model_type != "qwen2_5_vl":
        raise ModelError(
            f"is a {model_type!r} model; hybridkv needs a Qwen2.5-VL checkpoint (model_type qwen2_5_vl)", source=name
        )


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (the variable is re-read: it may change at run time)."""
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in {"1", "ON", "YES", "TRUE"}
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover
        return False


def _cached_config(name: str) -> Path | None:
    """The cached ``config.json`` of hub repo ``name`` (no network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:
        return None
    return Path(found) if isinstance(found, str) else None


def _hub_reachable() -> bool:
    """A cheap reachability probe (a HEAD on the hub endpoint, a few seconds at most)."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session

        get_session().head(constants.ENDPOINT, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001
        return not _is_network_failure(exc)
    return True


def _load_hub(name: str, dev: torch.device, dt: torch.dtype) -> LoadedModel:
    offline = _hub_offline()
    cached = _cached_config(name)
    if cached is not None:
        _check_model_type(_read_model_type(cached, name), name)
        try:  # everything cached: no network at all
            return _from_pretrained(name, name, dev, dt, local_files_only=True)
        except _NotCached:
            pass
    state = "is only partly cached locally" if cached is not None else "is not cached locally"
    if offline:
        raise ModelError(
            f"{state} and the Hugging Face hub is offline (HF_HUB_OFFLINE is set); {_FIX_HINT.format(name=name)}",
            source=name,
        )
    unreachable = f"{state} and the Hugging Face hub is unreachable; {_FIX_HINT.format(name=name)}"
    if not _hub_reachable():
        raise ModelError(unreachable, source=name)
    try:
        return _from_pretrained(name, name, dev, dt, local_files_only=False)
    except _NotCached:
        raise ModelError(unreachable, source=name) from None


class _NotCached(Exception):
    """Files missing locally and the hub not reachable (internal signal)."""


_NETWORK_ERROR_NAMES = {
    "LocalEntryNotFoundError",
    "OfflineModeIsEnabled",
    "ConnectionError",
    "ConnectError",
    "ConnectTimeout",
    "ReadTimeout",
    "Timeout",
    "TimeoutException",
    "NetworkError",
    "TransportError",
    "ProxyError",
}


def _is_network_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or its cause chain) says: hub unreachable / file not in the local cache."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ in _NETWORK_ERROR_NAMES for cls in type(exc).__mro__):
            return True
        text = str(exc)
        if (
            "couldn't connect to" in text
            or "offline mode" in text.lower()
            or "Cannot find the requested files" in text
            or "local_files_only" in text
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _from_pretrained(
    source: str, name: str, dev: torch.device, dt: torch.dtype, *, local_files_only: bool
) -> LoadedModel:
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    is_dir = os.path.isdir(source)
    try:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            source,
            dtype=dt,
            attn_implementation="sdpa",
            local_files_only=local_files_only,
        )
        processor = AutoProcessor.from_pretrained(source, local_files_only=local_files_only)
        # device_map= would need `accelerate` (not a dependency): load on CPU, then move.
        model.to(dev).eval()
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - the user gets one line, not a traceback
        # A hub id read from the cache only: a missing file means "not (completely) cached".
        missing_locally = local_files_only and isinstance(exc, OSError)
        if not is_dir and (missing_locally or _is_network_failure(exc)):
            raise _NotCached(str(exc)) from None
        raise ModelError(f"could not load the model: {_first_line(exc)}", source=name) from None
    return LoadedModel(model=model, processor=processor, name=name, device=dev, dtype=dt, is_demo=False)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]
