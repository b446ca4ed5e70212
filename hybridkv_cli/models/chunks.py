"""A prompt's model inputs cut into chunks a streamed prefill reads one at a time.

A chunk never splits a *visual unit*: an image, or one temporal group of a video (the frames
Qwen's 2-frame temporal patch merges into one grid slice). The vision tower attends within a
unit only (Qwen2/2.5-VL's vision attention is windowed per frame group), so encoding a chunk's
units on their own gives the one-shot prefill's visual tokens. Each chunk carries its pixel rows
and grids; the caller gives it its positions (the whole prompt's, computed once).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from hybridkv_cli.io.errors import UsageError

#: Model types whose visual inputs :func:`chunk_inputs` knows how to cut (flat patch rows with a
#: (t, h, w) grid per image / video).
STREAMABLE = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class Unit:
    """One visual unit: its tokens ``start:end`` in the prompt, its pixel rows ``rows`` of the
    ``kind``'s pixel tensor, and its grid (t, h, w) in patches."""

    kind: str  # "image" or "video"
    start: int
    end: int
    rows: tuple[int, int]
    grid: tuple[int, int, int]


def _runs(ids: torch.Tensor, token: int) -> list[tuple[int, int]]:
    """The maximal runs ``(start, end)`` of ``token`` in the 1-D ``ids``."""
    hit = torch.cat([torch.zeros(1, dtype=torch.bool), ids == token, torch.zeros(1, dtype=torch.bool)])
    edges = (hit[1:].int() - hit[:-1].int()).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def visual_units(config, inputs: dict) -> list[Unit]:
    """The visual units of ``inputs`` (a processor's output for one prompt), in prompt order."""
    has_pixels = inputs.get("pixel_values") is not None or inputs.get("pixel_values_videos") is not None
    if not has_pixels:
        return []
    if config.model_type not in STREAMABLE:
        raise UsageError(f"streamed prefill of media needs a Qwen2-VL or Qwen2.5-VL model, not {config.model_type}",
                         "--stream")
    merge = config.vision_config.spatial_merge_size ** 2
    ids = inputs["input_ids"][0].cpu()
    units = []
    for kind, token, grid_key in (("image", config.image_token_id, "image_grid_thw"),
                                  ("video", config.video_token_id, "video_grid_thw")):
        grids = inputs.get(grid_key)
        runs = _runs(ids, token)
        if grids is None:
            continue
        row = 0
        for (start, end), (t, h, w) in zip(runs, grids.tolist()):
            # An image is one unit; a video one unit per temporal slice (h * w patch rows each).
            slices = 1 if kind == "image" else t
            rows, tokens = t * h * w // slices, t * h * w // merge // slices
            if end - start != tokens * slices:
                raise ValueError(f"{kind} tokens do not match the grid")
            for i in range(slices):
                units.append(Unit(kind, start + i * tokens, start + (i + 1) * tokens, (row, row + rows),
                                  (t // slices, h, w)))
                row += rows
    return sorted(units, key=lambda u: u.start)


def chunk_bounds(units: list[Unit], length: int, tokens: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of a prompt of ``length`` tokens: as close to ``tokens``
    as a cut outside every visual unit allows (a unit longer than that is a chunk of its own)."""
    inside = torch.zeros(length + 1, dtype=torch.bool)
    for unit in units:
        inside[unit.start + 1:unit.end] = True
    allowed = (~inside).nonzero().flatten().tolist()  # positions a chunk may end at
    bounds = [0]
    while bounds[-1] < length:
        start = bounds[-1]
        i = bisect.bisect_right(allowed, start + tokens) - 1
        bounds.append(allowed[i] if allowed[i] > start else allowed[bisect.bisect_right(allowed, start)])
    return list(zip(bounds[:-1], bounds[1:]))


def chunk_inputs(inputs: dict, units: list[Unit], start: int, end: int) -> dict:
    """The model keyword arguments of the chunk ``start:end``: its token ids and the pixel rows
    and grids of the visual units inside it (every unit is wholly inside or outside), on the token ids' device."""
    out = {"input_ids": inputs["input_ids"][:, start:end]}
    for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                               ("video", "pixel_values_videos", "video_grid_thw")):
        inside = [u for u in units if u.kind == kind and start <= u.start < end]
        if not inside:
            continue
        # A chunk's units of one kind are consecutive: one slice of rows (a lazy video's
        # pixels, :class:`~hybridkv_cli.models.streamed_video.FramePixels`, decode it then).
        out[pixels] = inputs[pixels][inside[0].rows[0]:inside[-1].rows[1]].to(inputs["input_ids"].device)
        # Consecutive slices of one video share (h, w): one grid row per unit is what the vision
        # tower needs (its attention is per slice either way).
        out[grid] = torch.tensor([list(u.grid) for u in inside], dtype=inputs[grid].dtype, device=inputs[grid].device)
    return out
