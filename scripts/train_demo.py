#!/usr/bin/env python
"""Train the demo model (``--model demo``) from scratch on the synthetic tasks, on CPU.

    python scripts/train_demo.py [--steps 900] [--seed 0] [--threads 2] [--out hybridkv_cli/weights/demo.safetensors]

The model is the real ``Qwen2_5_VLForConditionalGeneration`` with the tiny config
``hybridkv_cli.demo.TRAINED_TEXT`` / ``TRAINED_VISION`` and the offline demo processor. Every
training example goes through :func:`hybridkv_cli.prompt.build_prompt`, the exact inference prompt,
and the loss covers only the answer tokens and the closing ``<|im_end|>``.

One step = a few scenes of one geometry (videos of 16, 32 or 64 frames, or image sets; see
:func:`draw_batch`) with *all* the questions each scene answers. The visual prefixes (system turn,
user header, visual tokens) are the expensive part, so they run once; each question then runs on a
copy of its scene's KV cache (:func:`scene_loss`). Every question thus sees exactly its own
inference prompt while the vision tower and the up-to-4.6k-token prefix are paid once per scene.
Two training-only aids, neither shipped: an auxiliary linear head predicts what each vision-tower
output token shows (a dense signal for the vision tower from the first step), and attention
guidance teaches two of the eight KV-head groups a two-step retrieval (:data:`GUIDED_LAYERS`).
Deterministic for a seed on a given machine, torch build and thread count. docs/demo_model.md
has the measured time and the held-out accuracy.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hybridkv_cli import demo as D  # noqa: E402
from hybridkv_cli import synthetic as S  # noqa: E402
from hybridkv_cli.media import MediaInput  # noqa: E402
from hybridkv_cli.prompt import build_prompt, question_ids  # noqa: E402

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
    ``<|im_end|>`` (labels on the last two), with the index of its scene and of its key word.
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
            keys.append(len(question_ids(tok, qa.question)) - 2)  # the token before "?"
    batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}  # fails loudly on unequal prefixes
    width = max(len(r[0]) for r in rows)
    suffix = torch.tensor([r[0] + [tok.pad_token_id] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [IGNORE] * (width - len(r[1])) for r in rows])
    return batch, suffix, labels, torch.tensor(owner), keys


def token_labels(maps: list[np.ndarray], temporal: int = 2, px: int = 28, min_share: float = 0.08) -> torch.Tensor:
    """The dominant pixel label (:data:`hybridkv_cli.synthetic.N_LABELS`) of every visual token
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


def evidence_tokens(qa: S.QA, labels: torch.Tensor, per_patch: int) -> torch.Tensor:
    """Which of a scene's visual tokens hold ``qa``'s evidence: its pixel labels, within its
    frames (videos: temporal patch = frame // 2) or its image (image sets: ``per_patch`` tokens each)."""
    hit = torch.isin(labels, torch.tensor(qa.pixel_labels, dtype=labels.dtype))
    if qa.evidence:
        unit = torch.arange(len(labels)) // per_patch
        units = torch.tensor(sorted({f // 2 for f in qa.evidence}) if qa.kind != "which_image" else qa.evidence)
        hit &= torch.isin(unit, units)
    return hit


# Attention guidance: a two-step retrieval circuit, taught directly. In layer 2 one KV group of
# heads, read at the question's key word (the token before "?": "circle", "square", "first", ...),
# is pulled onto the visual tokens that hold the evidence; in layer 3 one KV group, read at the last
# prompt position (the one that predicts the answer), is pulled onto that key-word position. The
# other heads are free, so the model keeps a mix of focused and spread-out heads.
GUIDED_LAYERS = {2: 0, 3: 1}  # layer -> KV head whose query group is guided
_PROBE: dict = {}


def guided_sdpa(module, query, key, value, attention_mask, **kwargs):
    """``sdpa`` attention that also records, when ``_PROBE`` is armed for this layer, the guided
    heads' attention mass on ``_PROBE[layer] = (query index per row, bool mask over all keys)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kv = GUIDED_LAYERS.get(module.layer_idx)
    if module.layer_idx in _PROBE:
        at, target = _PROBE[module.layer_idx]
        rows, group = query.shape[0], query.shape[1] // key.shape[1]
        heads = torch.arange(kv * group, (kv + 1) * group)
        q = query[torch.arange(rows)[:, None], heads[None, :], at[:, None]].float()  # (R, g, d)
        logits = torch.einsum("rgd,rkd->rgk", q, key[:, kv].float()) * module.scaling
        prefix = key.shape[2] - query.shape[2]
        future = torch.arange(key.shape[2])[None, :] > prefix + at[:, None]  # causal
        probs = logits.masked_fill(future[:, None], float("-inf")).softmax(-1)
        _PROBE["mass"].append((probs * target[:, None]).sum(-1).mean(-1))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def scene_loss(model, inputs: dict, suffix: torch.Tensor, labels: torch.Tensor, owner: torch.Tensor,
               evidence: torch.Tensor | None = None, key_index: list[int] | None = None):
    """Mean answer-token cross-entropy, the per-question exact match (teacher-forced argmax), and
    the vision tower's output tokens (for the auxiliary loss).

    The prefixes run once; each question row then runs on a copy of its scene's cache. Text after
    the visuals has the same position on all three mRoPE axes (one past the prefix's largest), and
    right padding is harmless under the causal mask. With ``evidence`` (rows x prefix positions)
    and ``key_index`` (each row's key-word position) it also returns the guided heads' attention
    mass (layers x rows; see :data:`GUIDED_LAYERS`).
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
    inner(input_ids=inputs["input_ids"], position_ids=pos, cache=cache, use_cache=True,
          mm_encoder_outputs={kind: vis})
    cache.batch_select_indices(owner)
    rows, width = suffix.shape
    start = pos.amax(dim=(0, 2))[owner] + 1  # per row: one past its prefix's largest position
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
        _PROBE.update({2: (key_word, to_visual), 3: (last, to_word), "mass": []})
    try:
        hidden = inner.language_model(inputs_embeds=inner.get_input_embeddings()(suffix), position_ids=spos,
                                      attention_mask=mask, cache=cache, use_cache=True).last_hidden_state
    finally:
        mass = torch.stack(_PROBE.pop("mass")) if evidence is not None else None
        _PROBE.clear()
    target = labels[:, 1:]
    keep = target != IGNORE  # logits only where an answer token is predicted
    logits = model.lm_head(hidden[:, :-1][keep])
    loss = torch.nn.functional.cross_entropy(logits.float(), target[keep])
    hit = torch.ones_like(target, dtype=torch.bool)
    hit[keep] = logits.argmax(-1) == target[keep]
    return loss, hit.all(dim=1), torch.cat(vis.pooler_output), mass


def draw_batch(rng: np.random.Generator, progress: float) -> list[S.Scene]:
    """One step's scenes, all of one geometry: a curriculum of visual-sequence length. First image
    sets and 16/32-frame clips on a 224-pixel canvas (256-512 visual tokens), then 336-pixel clips
    (the inference size), 64-frame ones most often at the end. Most clips have a star, a third of
    them a needle star."""
    stage = 0 if progress < 0.5 else (1 if progress < 0.8 else 2)
    if rng.random() < (0.3, 0.15, 0.1)[stage]:
        n = int(rng.integers(2, 5))
        return [S.make_image_set(rng, n) for _ in range(4)]
    size = 224 if stage == 0 else S.VIDEO_SIZE
    options = [(16, 3), (32, 2)] if stage == 0 else [(16, 2), (32, 1), (64, 1)]
    p = ([0.6, 0.4], [0.4, 0.35, 0.25], [0.2, 0.3, 0.5])[stage]
    frames, count = options[int(rng.choice(len(options), p=p))]
    needles = [(True, False, None)[int(rng.choice(3, p=[0.35, 0.35, 0.3]))] for _ in range(count)]
    return [S.make_scene(rng, frames, needle=needle, size=size) for needle in needles]


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
    ap.add_argument("--steps", type=int, default=900, help="optimizer steps (1-4 scenes each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2, help="1 is faster when other jobs share the cores")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false",
                    help="train in fp32 (default: bf16 autocast, fp32 master weights; ~1.4x faster on CPU)")
    ap.add_argument("--aux", type=float, default=0.5, help="weight of the auxiliary per-token label loss")
    ap.add_argument("--guide", type=float, default=0.3, help="weight of the attention-guidance loss")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--out", type=Path, default=ROOT / "hybridkv_cli" / D.TRAINED_WEIGHTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, processor = build_model(args.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f} M; steps {args.steps}; lr {args.lr}; seed {args.seed}", flush=True)
    # Auxiliary head (not shipped): what each vision-tower output token shows. It gives the vision
    # tower a dense signal from the first step, instead of only what trickles back through the
    # text model's (at first uniform) attention over thousands of visual tokens.
    aux_head = torch.nn.Linear(model.config.vision_config.out_hidden_size, S.N_LABELS)
    aux_weight = torch.ones(S.N_LABELS)
    aux_weight[0] = 0.1  # background tokens dominate
    params = [*model.named_parameters(), *(("aux." + n, p) for n, p in aux_head.named_parameters())]
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
    stats: dict[str, list[float]] = {"loss": [], "acc": [], "aux": [], "guide": [], "word": []}
    per_kind: dict[str, list[bool]] = {}
    for step in range(args.steps):
        rng = np.random.default_rng([args.seed, step])
        scenes = [sc for sc in draw_batch(rng, step / args.steps) if sc.qas]
        inputs, suffix, labels, owner, key_index = encode(processor, [to_media(sc, rng) for sc in scenes],
                                                          [sc.qas for sc in scenes])
        per_scene = [token_labels(sc.label_maps) for sc in scenes]
        targets = torch.cat(per_scene)
        visual = inputs["mm_token_type_ids"] != 0
        evidence = torch.zeros(len(owner), visual.shape[1], dtype=torch.bool)
        grid = inputs.get("video_grid_thw", inputs.get("image_grid_thw"))
        per_patch = int(grid[0, 1] * grid[0, 2]) // 4  # visual tokens per temporal patch / per image
        for r, qa in enumerate(qa for sc in scenes for qa in sc.qas):
            b = int(owner[r])
            evidence[r, visual[b]] = evidence_tokens(qa, per_scene[b], per_patch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            qa_loss, hits, tokens, mass = scene_loss(model, inputs, suffix, labels, owner, evidence, key_index)
            aux = torch.nn.functional.cross_entropy(aux_head(tokens).float(), targets, weight=aux_weight)
        has = evidence.any(1)
        guide = -(torch.log(mass[0, has] + 1e-4).mean() + torch.log(mass[1] + 1e-4).mean()) / 2
        opt.zero_grad(set_to_none=True)
        (qa_loss + args.aux * aux + args.guide * guide).backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        stats["loss"].append(qa_loss.item())
        stats["aux"].append(aux.item())
        stats["guide"].append(mass[0, has].mean().item())
        stats["word"].append(mass[1].mean().item())
        for qa, h in zip((qa for sc in scenes for qa in sc.qas), hits.tolist()):
            per_kind.setdefault(qa.kind, []).append(h)
            stats["acc"].append(h)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            kinds = " ".join(f"{k} {np.mean(v[-100:]):.2f}" for k, v in sorted(per_kind.items()))
            print(f"step {step + 1:5d}  loss {np.mean(stats['loss'][-args.log_every:]):.3f}  "
                  f"aux {np.mean(stats['aux'][-args.log_every:]):.3f}  "
                  f"mass: evidence {np.nanmean(stats['guide'][-args.log_every:]):.2f} "
                  f"word {np.mean(stats['word'][-args.log_every:]):.2f}  "
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
    save_file(state, str(path), metadata={"format": "pt", "trained_by": "scripts/train_demo.py"})
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
