"""The offline demo: its processor (a BPE tokenizer trained at build time, the real Qwen2-VL image
and video processors, the Qwen2.5-VL chat template) and its two tiny Qwen2.5-VL models.

* :func:`build_trained_demo`: the trained-demo config (:data:`TRAINED_TEXT`, :data:`TRAINED_VISION`)
  with weights trained from scratch by ``scripts/train_demo.py`` on the synthetic video / image-set
  questions of :mod:`hybridkv_cli.synthetic`, read from ``weights/demo.safetensors`` in this
  package (see docs/demo_model.md). ``--model demo`` loads it when that file is present.
* :func:`build_demo`: the deterministic random model with shaped attention heads (no files; used
  by the tests; ``--model demo-random``, and ``--model demo`` while no trained weights are
  shipped); see :func:`build_demo` for what the weights look like. Its answers are noise.
"""

from __future__ import annotations

import copy
import json
import functools
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import ModelError
from .models import DEMO_NAME, LoadedModel, resolve_device, resolve_dtype

if TYPE_CHECKING:  # pragma: no cover - imports for annotations only
    from transformers import Qwen2_5_VLProcessor

DEMO_SEED = 0
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


# The trained demo (``--model demo``): same processor and model class, its own config, weights
# trained by scripts/train_demo.py on hybridkv_cli.synthetic tasks (docs/demo_model.md). The text
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
TRAINED_MAX_PIXELS = 112 * 112  # its frames and images (hybridkv_cli.synthetic): 16 visual tokens each


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
    return LoadedModel(model=model, processor=processor, name=DEMO_NAME, device=dev, dtype=dt, is_demo=not trained)


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

    ``is_demo`` is False: its answers are real (the "answers are noise" note is for
    ``demo-random``). The global torch RNG state is left untouched.
    """
    from safetensors.torch import load_file

    path = Path(weights) if weights is not None else trained_weights_path()
    if not path.is_file():
        raise ModelError(f"trained demo weights missing ({path}); run scripts/train_demo.py, "
                         "or use --model demo-random", source=DEMO_NAME)
    # fp16 on disk, cast into the fp32 parameters; the random init it replaces is seeded anyway
    return _assemble(True, device, dtype, DEMO_SEED,
                     lambda model, tok: model.load_state_dict(load_file(str(path)), strict=True))


def trained_weights_path() -> Path:
    return Path(__file__).resolve().parent / TRAINED_WEIGHTS


def serves_trained(name: str) -> bool:
    """Whether model ``name`` is the trained demo: ``demo`` while its weights ship."""
    return name == DEMO_NAME and trained_weights_path().is_file()


def load_demo(name: str, *, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """``demo``: the trained demo when its weights ship with the package, else the random one;
    ``demo-random``: the random one (see :data:`hybridkv_cli.models.DEMO_NAMES`)."""
    if serves_trained(name):
        return build_trained_demo(device=device, dtype=dtype)
    loaded = build_demo(device=device, dtype=dtype)
    loaded.name = name
    return loaded


