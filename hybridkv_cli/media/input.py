"""The media of one prompt, decoded and sized for Qwen2.5-VL."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from hybridkv_cli.media.frame_stream import VideoStream
from hybridkv_cli.media.paths import set_label


@dataclass(frozen=True, eq=False)
class MediaInput:
    """One prompt's visual input, ready for the Qwen2.5-VL processor.

    ``eq=False``: instances compare by identity (a field-wise ``==`` on tensors is ambiguous).
    The fields after ``sample_fps`` are informational and optional.
    """

    kind: str  # "video" or "images"
    sources: tuple[Path, ...]
    video: torch.Tensor | None  # uint8 (T, 3, H, W); T even >= 2; H, W multiples of 28
    images: tuple[Image.Image, ...]  # RGB, H and W multiples of 28
    frames_total: int | None
    frames_used: int
    sample_fps: float | None
    origin: str | None = None  # what the user typed (video path, directory), for the label
    decoder: str | None = None  # "decord" / "pyav" (video) or "pillow" (images)
    frame_indices: tuple[int, ...] | None = None  # source frame index of each video frame
    rotation: int = 0  # degrees counter-clockwise turned to show a video upright (its display matrix)
    stream: VideoStream | None = None  # a video decoded while its prompt is read (``video`` is then None)

    @property
    def label(self) -> str:
        return self.origin or set_label(self.sources)

    @property
    def frame_size(self) -> list[int] | None:
        """[width, height] of the frames / images the model sees (None: images of several sizes)."""
        if self.stream is not None:
            return [self.stream.size[1], self.stream.size[0]]
        sizes = {(int(self.video.shape[-1]), int(self.video.shape[-2]))} if self.video is not None else \
            {im.size for im in self.images}
        return list(sizes.pop()) if len(sizes) == 1 else None

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of every frame / of the first image."""
        if self.stream is not None:
            return self.stream.size
        if self.video is not None:
            return int(self.video.shape[-2]), int(self.video.shape[-1])
        w, h = self.images[0].size
        return h, w
