"""One video file -> a :class:`MediaInput`: probe, count, sample frames, decode (decord, PyAV fallback).

The eager loader is a :class:`~hybridkv_cli.media.frame_stream.VideoStream` read in one chunk, with
the eager sampling rule (``fps`` capped at Qwen's ``FPS_MAX_FRAMES``) and Qwen's per-frame pixel
bound for that many frames.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from hybridkv_cli.io.errors import MediaWarning
from hybridkv_cli.media.decoders import DECODERS
from hybridkv_cli.media.frame_stream import open_planned, spread
from hybridkv_cli.media.geometry import FPS_MAX_FRAMES, FRAME_FACTOR, pixel_bounds, target_size
from hybridkv_cli.media.input import MediaInput


def sample_indices(total: int, duration: float, frames: int, fps: float | None, shown: str) -> list[int]:
    """Source frames to keep: ``frames`` (or ``duration * fps``, capped at Qwen's maximum) spread
    uniformly, made even (at least 2) for Qwen's 2-frame temporal patch."""
    if fps is not None:
        n = max(1, int(round(duration * fps)))
        if n > FPS_MAX_FRAMES and total > FPS_MAX_FRAMES:
            warnings.warn(f"{shown}: fps={fps:g} over {duration:.1f} s asks for {n} frames; capped at "
                          f"{FPS_MAX_FRAMES} (Qwen's FPS_MAX_FRAMES)", MediaWarning, stacklevel=3)
            n = FPS_MAX_FRAMES
    else:
        n = frames
    return spread(total, n)


def load_video(path: Path, frames: int, fps: float | None, min_pixels: int | None, max_pixels: int | None
               ) -> MediaInput:
    """Load one video (see :func:`hybridkv_cli.media.load_media`); every failure is a MediaError."""
    shown = str(path)

    def plan(total: int, duration: float, source_size: tuple[int, int]):
        indices = sample_indices(total, duration, frames, fps, shown)
        lo, hi = pixel_bounds("video", max(len(indices), FRAME_FACTOR), min_pixels=min_pixels, max_pixels=max_pixels)
        return indices, target_size(*source_size, lo, hi, source=shown)

    stream = open_planned(path, plan, DECODERS)
    video = stream.read_all()
    used = int(video.shape[0])
    sample_fps = used / stream.duration if stream.duration > 0 else None
    return MediaInput(kind="video", sources=(path,), video=video, images=(), frames_total=stream.frames_total,
                      frames_used=used, sample_fps=sample_fps, origin=shown, decoder=stream.decoder,
                      frame_indices=stream.indices, rotation=stream.rotation)
