#!/usr/bin/env python
"""Train the demo model (``--model demo``) from scratch on the synthetic tasks, on CPU.

    python -m training.train_demo [--steps 3800] [--seed 0] [--threads 2] [--out hybridkv_cli/models/weights/demo.safetensors]

The model is the real ``Qwen2_5_VLForConditionalGeneration`` with the tiny config
``hybridkv_cli.models.demo.TRAINED_TEXT`` / ``TRAINED_VISION`` and the offline demo processor. Every
training example goes through :func:`hybridkv_cli.models.prompt.build_prompt`, the exact inference prompt,
and the loss covers only the answer tokens and the closing ``<|im_end|>``.

One step = up to eight scenes of one geometry (image sets, or 16-, 32- or 64-frame clips of 112 x
112 pixels; see :func:`draw_batch`) with *all* the questions each scene answers. The visual prefixes
(system turn, user header, visual tokens) run once; each question then runs on a copy of its
scene's KV cache (:func:`scene_loss`), which gives exactly the loss of its full inference prompt.

Three training-only aids, none shipped, make the retrieval circuit learnable in minutes:

* an auxiliary linear head on the vision tower's output tokens predicts what each token shows
  (shape x colour, scoreboard digit, background) and, for videos, the scoreboard digit and the
  number of squares in its frames, so the star's tokens can tell the digit and a square's the count;
* attention guidance (:data:`GUIDES`) on three of the eight KV-head groups: image tokens -> their
  "Picture k:" number, the question's key word -> the evidence tokens, the answer position -> the
  key word;
* an answer probe: a linear head reads the answer off the key word's residual stream where the
  answer position's guided heads read it.

Deterministic for a seed on a given machine, torch build and thread count. docs/demo_model.md has
the measured time and the held-out accuracy.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from hybridkv_cli.media import MediaInput
from hybridkv_cli.models import demo as D
from hybridkv_cli.models.prompt import build_prompt, question_ids
from training import synthetic as S

ROOT = Path(__file__).resolve().parent.parent
IGNORE = -100


def augment(pixels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Brightness jitter and pixel noise, so video-codec artifacts at inference are nothing new."""
    shift = int(rng.integers(-12, 13))
    noise = rng.integers(-4, 5, size=pixels.shape[-3:], dtype=np.int16)  # one noise field per clip
    return np.clip(pixels.astype(np.int16) + noise + shift, 0, 255).astype(np.uint8)


def to_media(scene: S.Scene, rng: np.random.Generator) -> MediaInput:
    """The scene as the MediaInput that load_media would give for its files."""
    if scene.video is not None:
        video = torch.from_numpy(augment(scene.video, rng)).permute(0, 3, 1, 2).contiguous()
        n = video.shape[0]
        return MediaInput(kind="video", sources=(), video=video, images=(), frames_total=n, frames_used=n,
                          sample_fps=S.VIDEO_FPS)
    images = tuple(Image.fromarray(augment(im, rng)) for im in scene.images)
    return MediaInput(kind="images", sources=(), video=None, images=images, frames_total=None,
                      frames_used=len(images), sample_fps=None)


def encode(processor, medias: list[MediaInput], qa_lists: list[list[S.QA]]):
    """A batch of scenes of one geometry (so their prefixes have one length).

    Returns the processor inputs of the prefixes (system turn, user header, visual tokens) stacked
    over scenes, and one (ids, labels) row per question: question + chat-template tail + answer +
    ``<|im_end|>`` (labels on the last two), with the index of its scene and of its key word
    (:func:`key_position`).
    """
    tok = processor.tokenizer
    vision_end = tok.convert_tokens_to_ids("<|vision_end|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    parts, rows, owner, keys = [], [], [], []
    for b, (media, qas) in enumerate(zip(medias, qa_lists)):
        inputs = build_prompt(processor, media, qas[0].question).inputs
        ids = inputs["input_ids"][0]
        prefix = int((ids == vision_end).nonzero().max()) + 1  # the question starts right after the visuals
        tail = ids[prefix + len(question_ids(tok, qas[0].question)):].tolist()
        parts.append({k: v[:, :prefix] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                      for k, v in inputs.items()})
        for qa in qas:
            q = question_ids(tok, qa.question) + tail
            a = tok(qa.answer, add_special_tokens=False)["input_ids"] + [im_end]
            rows.append((q + a, [IGNORE] * len(q) + a))
            owner.append(b)
            keys.append(key_position(tok, qa.question))
    batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}  # fails loudly on unequal prefixes
    width = max(len(r[0]) for r in rows)
    suffix = torch.tensor([r[0] + [tok.pad_token_id] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [IGNORE] * (width - len(r[1])) for r in rows])
    return batch, suffix, labels, torch.tensor(owner), keys


def key_position(tokenizer, question: str) -> int:
    """The question's key word: the last token of its last shape word ("circle", "star", "squares"),
    else of the word before "?" ("first"). Its query is what finds the evidence."""
    words = question.rstrip("?").split(" ")
    named = [i for i, w in enumerate(words) if w.startswith(S.SHAPES)]
    end = named[-1] if named else len(words) - 1
    return len(question_ids(tokenizer, " ".join(words[:end + 1]))) - 1


def token_labels(maps: list[np.ndarray], temporal: int = 2, px: int = 28, min_share: float = 0.08) -> torch.Tensor:
    """The dominant pixel label (:data:`training.synthetic.N_LABELS`) of every visual token
    (a temporal patch x 28 x 28 pixels), 0 where objects cover less than ``min_share`` of it, in the
    vision tower's output order (time, row, column). An image is one patch of two copies."""
    out = []
    for m in maps:
        if m.ndim == 2:
            m = np.repeat(m[None], temporal, axis=0)
        t, h, w = m.shape
        blocks = m.reshape(t // temporal, temporal, h // px, px, w // px, px).transpose(0, 2, 4, 1, 3, 5)
        blocks = blocks.reshape(-1, temporal * px * px)
        classes = np.unique(blocks)
        classes = classes[classes > 0]
        labels = np.zeros(len(blocks), np.int64)
        if len(classes):
            counts = np.stack([(blocks == c).sum(-1) for c in classes], -1)
            big = counts.max(-1) >= min_share * blocks.shape[1]
            labels[big] = classes[counts.argmax(-1)][big]
        out.append(labels)
    return torch.from_numpy(np.concatenate(out))


def frame_targets(per_scene: list[torch.Tensor], per_patch: int, video: bool):
    """Per visual token of a video: the scoreboard digit and the number of squares (0-3) in its
    temporal patch, so every token can tell them (what "the digit when the star appears" and
    "how many squares" read off the star's and the squares' tokens). None for image sets."""
    if not video:
        return None, None
    digits, counts = [], []
    square = torch.tensor([S.object_label("square", c) for c in S.COLOURS])
    for labels in per_scene:
        patches = labels.view(-1, per_patch)
        digit = patches[:, 0] - S.digit_label(0)  # the scoreboard is the top-left token
        count = torch.isin(patches, square).sum(1).clamp(max=3)
        digits.append(digit.repeat_interleave(per_patch))
        counts.append(count.repeat_interleave(per_patch))
    return torch.cat(digits), torch.cat(counts)


def evidence_tokens(qa: S.QA, labels: torch.Tensor, per_patch: int) -> torch.Tensor:
    """Which of a scene's visual tokens hold ``qa``'s evidence: its pixel labels, within its
    frames (videos: temporal patch = frame // 2) or its image (image sets: ``per_patch`` tokens each)."""
    hit = torch.isin(labels, torch.tensor(qa.pixel_labels, dtype=labels.dtype))
    if qa.evidence:
        unit = torch.arange(len(labels)) // per_patch
        units = torch.tensor(sorted({f // 2 for f in qa.evidence}) if qa.kind != "which_image" else qa.evidence)
        hit &= torch.isin(unit, units)
    return hit


# Attention guidance: a retrieval circuit, taught directly. Each guide pulls one KV group of heads
# (its query heads), read at given positions, onto given keys; the other heads are free, so the
# model keeps a mix of focused and spread-out heads.
#   picture:  layer 0, image sets: every visual token -> the number of its "Picture k:" label;
#   evidence: layer 1, the question's key word (:func:`key_position`: "circle", "star", "first")
#             -> the visual tokens that hold the evidence;
#   word:     layer 2, the last prompt position (it predicts the answer) -> the key word.
GUIDES = {"picture": (0, 1), "evidence": (1, 0), "word": (2, 1)}  # name -> (layer, KV head)
_PROBE: dict = {}


def guided_sdpa(module, query, key, value, attention_mask, **kwargs):
    """``sdpa`` attention that also records, when ``_PROBE`` is armed for this layer with
    ``(name, kv, at, target)``, the guided heads' attention mass at query positions ``at``
    (rows x Q, indices into this call's queries) on the keys in ``target`` (rows x Q x keys)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if module.layer_idx in _PROBE:
        name, kv, at, target = _PROBE[module.layer_idx]
        rows, group = query.shape[0], query.shape[1] // key.shape[1]
        heads = torch.arange(kv * group, (kv + 1) * group)
        q = query[torch.arange(rows)[:, None, None], heads[None, :, None], at[:, None, :]].float()  # (R, g, Q, d)
        logits = torch.einsum("rgqd,rkd->rgqk", q, key[:, kv].float()) * module.scaling
        offset = key.shape[2] - query.shape[2]  # cached keys before this call's queries
        future = torch.arange(key.shape[2])[None, None, :] > offset + at[:, :, None]  # causal
        probs = logits.masked_fill(future[:, None], float("-inf")).softmax(-1)
        _PROBE["mass"][name] = (probs * target[:, None]).sum(-1).mean(1)  # (R, Q)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _arm(name: str, at: torch.Tensor, target: torch.Tensor) -> None:
    layer, kv = GUIDES[name]
    _PROBE[layer] = (name, kv, at, target)


def picture_targets(input_ids: torch.Tensor, tokenizer):
    """For image-set prefixes: (positions of the visual tokens, each one's label-number position)
    as (B x Q) indices, or None when fewer than two images carry labels."""
    start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    if int((input_ids[0] == start).sum()) < 2:
        return None
    at, label = [], []
    for ids in input_ids:
        visual = (ids == pad).nonzero()[:, 0]
        starts = (ids == start).nonzero()[:, 0]
        owner = torch.searchsorted(starts, visual, right=True) - 1  # the image each visual token is in
        at.append(visual)
        label.append(starts[owner] - 3)  # "Picture", " ", "k", ":", " ", <|vision_start|>: k is 3 back
    return torch.stack(at), torch.stack(label)


def scene_loss(model, inputs: dict, suffix: torch.Tensor, labels: torch.Tensor, owner: torch.Tensor,
               evidence: torch.Tensor | None = None, key_index: list[int] | None = None,
               picture: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Mean answer-token cross-entropy, the per-question exact match (teacher-forced argmax), the
    vision tower's output tokens (for the auxiliary loss), the guided heads' attention mass and
    the key word's residual stream where the "word" heads read it (for the answer probe).

    The prefixes run once; each question row then runs on a copy of its scene's cache. Text after
    the visuals continues from the prefix's last token (``<|vision_end|>``), the same on all three
    mRoPE axes, as ``get_rope_index`` numbers the full prompt. (Not one past the largest position:
    a video's time axis runs past its height and width, and the text resumes after the latter.)
    Right padding is harmless under the causal mask. With ``evidence`` (rows x prefix positions)
    and ``key_index`` (each row's key-word position) it also returns the guided heads' attention
    mass ``{"evidence": rows, "word": rows}``, plus ``"picture"`` (scenes x visual tokens) with
    ``picture`` (:func:`picture_targets`); see :data:`GUIDES`.
    """
    from transformers import DynamicCache

    inner = model.model
    pos, _ = inner.get_rope_index(
        inputs["input_ids"], image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"), attention_mask=inputs["attention_mask"],
        second_per_grid_ts=inputs.get("second_per_grid_ts"), mm_token_type_ids=inputs["mm_token_type_ids"])
    if "pixel_values_videos" in inputs:
        kind, vis = "video", inner.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                                      return_dict=True)
    else:
        kind, vis = "image", inner.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                                      return_dict=True)
    cache = DynamicCache(config=model.config)
    _PROBE["mass"] = {}
    if picture is not None:
        at, label = picture
        target = torch.zeros(*at.shape, inputs["input_ids"].shape[1], dtype=torch.bool)
        target.scatter_(2, label[..., None], True)
        _arm("picture", at, target)
    try:
        inner(input_ids=inputs["input_ids"], position_ids=pos, cache=cache, use_cache=True,
              mm_encoder_outputs={kind: vis})
    finally:
        _PROBE.pop(GUIDES["picture"][0], None)
    cache.batch_select_indices(owner)
    rows, width = suffix.shape
    start = pos[0, :, -1][owner] + 1  # per row: one past its prefix's last token
    spos = (start[:, None] + torch.arange(width)).unsqueeze(0).expand(3, rows, width)
    # An explicit mask: with none, transformers lets SDPA use is_causal, whose top-left alignment
    # would hide the cached prefix from the questions (query i would see keys 0..i only).
    prefix = inputs["input_ids"].shape[1]
    mask = torch.arange(prefix + width)[None, :] <= prefix + torch.arange(width)[:, None]
    mask = mask.expand(rows, 1, width, prefix + width)
    if evidence is not None:  # layer 2: key word -> visual evidence; layer 3: last prompt position -> key word
        last = (labels != IGNORE).int().argmax(1) - 1
        key_word = torch.tensor(key_index)
        to_visual = torch.cat([evidence, torch.zeros(rows, width, dtype=torch.bool)], 1)
        to_word = torch.zeros_like(to_visual)
        to_word[torch.arange(rows), prefix + key_word] = True
        _arm("evidence", key_word[:, None], to_visual[:, None])
        _arm("word", last[:, None], to_word[:, None])
    try:
        out = inner.language_model(inputs_embeds=inner.get_input_embeddings()(suffix), position_ids=spos,
                                   attention_mask=mask, cache=cache, use_cache=True,
                                   output_hidden_states=evidence is not None)
        hidden = out.last_hidden_state
    finally:
        mass = {name: m[:, 0] if name != "picture" else m for name, m in _PROBE.pop("mass").items()}
        _PROBE.clear()
    target = labels[:, 1:]
    keep = target != IGNORE  # logits only where an answer token is predicted
    logits = model.lm_head(hidden[:, :-1][keep])
    loss = torch.nn.functional.cross_entropy(logits.float(), target[keep])
    hit = torch.ones_like(target, dtype=torch.bool)
    hit[keep] = logits.argmax(-1) == target[keep]
    # what the "word" heads read at the key word: the residual stream entering their layer
    retrieved = (out.hidden_states[GUIDES["word"][0]][torch.arange(rows), key_word]
                 if evidence is not None else None)
    return loss, hit.all(dim=1), torch.cat(vis.pooler_output), mass, retrieved


def draw_batch(rng: np.random.Generator, progress: float) -> list[S.Scene]:
    """One step's scenes, all of one geometry: eight image sets (a fifth of the steps), or eight
    16-frame, four 32-frame or two 64-frame clips (128 / 256 / 512 visual tokens each), the long
    ones more often as training goes on. Most clips have a star, a third of them a needle star."""
    stage = 0 if progress < 0.3 else (1 if progress < 0.6 else 2)
    if rng.random() < 0.2:
        n = int(rng.integers(2, 5))
        return [S.make_image_set(rng, n) for _ in range(8)]
    options = [(16, 8), (32, 4), (64, 2)]
    p = ([0.6, 0.3, 0.1], [0.3, 0.4, 0.3], [0.1, 0.3, 0.6])[stage]
    frames, count = options[int(rng.choice(len(options), p=p))]
    needles = [(True, False, None)[int(rng.choice(3, p=[0.35, 0.35, 0.3]))] for _ in range(count)]
    return [S.make_scene(rng, frames, needle=needle) for needle in needles]


def build_model(seed: int):
    from transformers import AttentionInterface, Qwen2_5_VLForConditionalGeneration

    processor = D.build_demo_processor()
    config = D.demo_config(processor.tokenizer, trained=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    AttentionInterface.register("guided_sdpa", guided_sdpa)
    model.set_attn_implementation({"text_config": "guided_sdpa", "vision_config": "sdpa"})
    return model, processor


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3800, help="optimizer steps (2-8 scenes each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2, help="1 is faster when other jobs share the cores")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false",
                    help="train in fp32 (default: bf16 autocast, fp32 master weights; ~1.4x faster on CPU)")
    ap.add_argument("--aux", type=float, default=0.5, help="weight of the auxiliary per-token label loss")
    ap.add_argument("--guide", type=float, default=0.3, help="weight of the attention-guidance loss")
    ap.add_argument("--probe", type=float, default=0.5, help="weight of the answer-probe loss at the key word")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--out", type=Path, default=D.trained_weights_path())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, processor = build_model(args.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f} M; steps {args.steps}; lr {args.lr}; seed {args.seed}", flush=True)
    # Auxiliary head (not shipped): what each vision-tower output token shows. It gives the vision
    # tower a dense signal from the first step, instead of only what trickles back through the
    # text model's (at first uniform) attention over thousands of visual tokens.
    aux_head = torch.nn.Linear(model.config.vision_config.out_hidden_size, S.N_LABELS + 10 + 4)
    # Answer probe (not shipped): the key word's residual stream, after the evidence heads, should
    # already hold the answer, so the "word" heads only have to copy it to the answer position.
    answer_list = sorted(S.ANSWERS)
    probe = torch.nn.Linear(model.config.text_config.hidden_size, len(answer_list))
    aux_weight = torch.ones(S.N_LABELS)
    aux_weight[0] = 0.1  # background tokens dominate
    params = [*model.named_parameters(), *(("aux." + n, p) for n, p in aux_head.named_parameters()),
              *(("probe." + n, p) for n, p in probe.named_parameters())]
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 5%
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        a = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * a)))

    wall0, cpu0 = time.perf_counter(), time.process_time()
    stats: dict[str, list[float]] = {"loss": [], "acc": [], "aux": [], "guide": [], "word": [], "picture": []}
    per_kind: dict[str, list[bool]] = {}
    kind_mass: dict[str, list[float]] = {}
    for step in range(args.steps):
        rng = np.random.default_rng([args.seed, step])
        scenes = [sc for sc in draw_batch(rng, step / args.steps) if sc.qas]
        qas = [qa for sc in scenes for qa in sc.qas]  # one row each, in encode's order
        inputs, suffix, labels, owner, key_index = encode(processor, [to_media(sc, rng) for sc in scenes],
                                                          [sc.qas for sc in scenes])
        per_scene = [token_labels(sc.label_maps) for sc in scenes]
        targets = torch.cat(per_scene)
        grid = inputs.get("video_grid_thw", inputs.get("image_grid_thw"))
        per_patch = int(grid[0, 1] * grid[0, 2]) // 4  # visual tokens per temporal patch / per image
        digit_t, count_t = frame_targets(per_scene, per_patch, scenes[0].video is not None)
        visual = inputs["mm_token_type_ids"] != 0
        evidence = torch.zeros(len(owner), visual.shape[1], dtype=torch.bool)
        for r, qa in enumerate(qas):
            b = int(owner[r])
            evidence[r, visual[b]] = evidence_tokens(qa, per_scene[b], per_patch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            picture = picture_targets(inputs["input_ids"], processor.tokenizer) if scenes[0].video is None else None
            qa_loss, hits, tokens, mass, retrieved = scene_loss(model, inputs, suffix, labels, owner, evidence,
                                                                key_index, picture)
            out = aux_head(tokens).float()
            aux = torch.nn.functional.cross_entropy(out[:, :S.N_LABELS], targets, weight=aux_weight)
            if digit_t is not None:
                aux = aux + torch.nn.functional.cross_entropy(out[:, S.N_LABELS:S.N_LABELS + 10], digit_t) \
                    + torch.nn.functional.cross_entropy(out[:, S.N_LABELS + 10:], count_t)
            answers = torch.tensor([answer_list.index(qa.answer) for qa in qas])
            probe_loss = torch.nn.functional.cross_entropy(probe(retrieved).float(), answers)
        has = evidence.any(1)
        guide = sum(-torch.log(m + 1e-4).mean() for m in (mass["evidence"][has], mass["word"], mass.get("picture"))
                    if m is not None) / 2
        opt.zero_grad(set_to_none=True)
        (qa_loss + args.aux * aux + args.guide * guide + args.probe * probe_loss).backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        stats["loss"].append(qa_loss.item())
        stats["aux"].append(aux.item())
        stats["guide"].append(mass["evidence"][has].mean().item())
        stats["word"].append(mass["word"].mean().item())
        if "picture" in mass:
            stats["picture"].append(mass["picture"].mean().item())
        for qa, h, m in zip(qas, hits.tolist(), mass["evidence"].tolist()):
            per_kind.setdefault(qa.kind, []).append(h)
            kind_mass.setdefault(qa.kind, []).append(m)
            stats["acc"].append(h)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            kinds = " ".join(f"{k} {np.mean(v[-100:]):.2f}/{np.mean(kind_mass[k][-100:]):.2f}"
                             for k, v in sorted(per_kind.items()))
            print(f"step {step + 1:5d}  loss {np.mean(stats['loss'][-args.log_every:]):.3f}  "
                  f"aux {np.mean(stats['aux'][-args.log_every:]):.3f}  "
                  f"mass: evidence {np.nanmean(stats['guide'][-args.log_every:]):.2f} "
                  f"word {np.mean(stats['word'][-args.log_every:]):.2f} "
                  f"picture {np.mean(stats['picture'][-args.log_every:] or [0]):.2f}  "
                  f"acc {np.mean(stats['acc'][-300:]):.2f}  [{kinds}]  lr {lr_at(step):.2e}  "
                  f"wall {time.perf_counter() - wall0:6.0f} s  cpu {time.process_time() - cpu0:6.0f} s", flush=True)

    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    print(f"training done: wall {wall:.0f} s ({wall / 60:.1f} min), cpu {cpu:.0f} s ({cpu / 60:.1f} min)", flush=True)
    save(model, args.out)
    return 0


def save(model, path: Path) -> None:
    """fp16 safetensors (the model loads them into its own dtype); ~3 MB."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt", "trained_by": "training/train_demo.py"})
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
