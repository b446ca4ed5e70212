"""The multimodal model families hybridkv runs, and what differs between them.

Every family is loaded through the transformers auto classes (image-text-to-text model + its own
processor and chat template); the compression layer sees the same per-layer post-RoPE queries
and keys of a GQA text decoder in all of them. What a family decides here:

* which ``config.model_type`` values belong to it (:data:`FAMILIES`, :func:`family_for_type`);
* which prompt tokens are visual (:func:`visual_token_ids`: the processor's own image and video
  placeholder tokens, which the model replaces by vision features; LLaVA-OneVision's image
  newline features sit on such placeholders too; Qwen3-VL's frame timestamps are text);
* how frames the media layer already sampled and sized reach the processor
  (:func:`media_kwargs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FAMILIES", "Family", "family_for_type", "media_kwargs", "repeats_video_groups", "supported_line",
           "visual_token_ids"]


@dataclass(frozen=True)
class Family:
    """One multimodal family: its user-facing name, its ``model_type`` and its tiny random model name."""

    name: str
    model_type: str
    tiny: str  # ``--model`` name of its tiny random model (hybridkv_cli.models.tiny_models)


FAMILIES: tuple[Family, ...] = (
    Family("Qwen2.5-VL", "qwen2_5_vl", "demo-random"),
    Family("Qwen2-VL", "qwen2_vl", "demo-random:qwen2vl"),
    Family("Qwen3-VL", "qwen3_vl", "demo-random:qwen3vl"),
    Family("LLaVA-OneVision", "llava_onevision", "demo-random:llava-ov"),
)
VL_MODEL_TYPES = tuple(f.model_type for f in FAMILIES)
QWEN_FACTOR = 28  # patch 14 x merge 2: the grid the media layer sizes frames to (media/geometry.py)


def family_for_type(model_type: str | None) -> Family | None:
    return next((f for f in FAMILIES if f.model_type == model_type), None)


def supported_line(text_types: tuple[str, ...] = ()) -> str:
    """The supported families, for one-line errors."""
    vl = ", ".join(f"{f.name} ({f.model_type})" for f in FAMILIES)
    return f"hybridkv runs {vl}" + (f", or text decoders of the {', '.join(text_types)} families" if text_types else "")


def visual_token_ids(processor) -> list[int]:
    """The ids of ``processor``'s image and video placeholder tokens (Qwen's ``<|image_pad|>`` /
    ``<|video_pad|>``, LLaVA's ``<image>`` / ``<video>``)."""
    tokenizer = processor.tokenizer
    ids = []
    for attr, default in (("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>")):
        token = getattr(processor, attr, None) or default
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is not None and tid != tokenizer.unk_token_id and tid not in ids:
            ids.append(tid)
    return ids


def repeats_video_groups(processor) -> bool:
    """Whether a video's prompt is one temporal group's run of tokens repeated (Qwen2-VL /
    Qwen2.5-VL: the media layer's grid, no timestamps in the text), so it can be built a group
    at a time (:mod:`~hybridkv_cli.models.streamed_video`)."""
    return _grid_factor(processor.video_processor) == QWEN_FACTOR


def _grid_factor(sub) -> int | None:
    """The pixel grid of a Qwen-style image / video processor (patch x merge), else None."""
    patch, merge = getattr(sub, "patch_size", None), getattr(sub, "merge_size", None)
    return int(patch) * int(merge) if patch and merge else None


def _at_most(factor: int, pixels: int) -> dict[str, int]:
    """A Qwen processor ``size`` whose resize only moves to its own grid, never above ``pixels``
    (a clip: frames x height x width; an image: the largest image's area), i.e. the pixel limits
    the media layer applied (``--max-pixels``) hold for the processor too."""
    return {"shortest_edge": factor * factor, "longest_edge": int(pixels)}


def media_kwargs(processor, kind: str, pixels: int, video_metadata: list | None = None) -> dict[str, Any]:
    """Processor keyword arguments for frames / images the media layer already sampled and sized.

    ``pixels``: a clip's frames x height x width, or the largest image's area. Frames are never
    sampled again (``do_sample_frames=False``). Qwen2-VL / Qwen2.5-VL processors (grid 28, the
    media layer's) keep the size (``do_resize=False``: no second resize, no upscaling of small
    clips to their 100k-pixel minimum); Qwen3-VL (grid 32) moves to its grid within ``pixels``
    (its own minimum and maximum do not apply: the media layer's bounds did); LLaVA-OneVision
    resizes to its own vision tower's size (anyres tiles for a single image) as it always does.
    """
    sub = processor.video_processor if kind == "video" else processor.image_processor
    factor = _grid_factor(sub)
    kw: dict[str, Any] = {}
    if kind == "video":
        kw["do_sample_frames"] = False
        if video_metadata is not None:
            kw["video_metadata"] = video_metadata
    if factor is None:  # not a Qwen-style processor (LLaVA-OneVision): its own resize
        return kw
    if factor == QWEN_FACTOR:
        kw["do_resize"] = False
    else:
        kw["size"] = _at_most(factor, pixels)
    if kind == "video" and "cap_pixels_per_frame" in getattr(getattr(sub, "valid_kwargs", None), "__annotations__", {}):
        kw["cap_pixels_per_frame"] = False  # silences a transformers 5.x deprecation warning
    return kw
