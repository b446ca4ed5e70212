"""One video file -> a :class:`MediaInput`: probe, sample frames, decode (decord, PyAV fallback)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from hybridkv_cli.io.errors import HybridKVError, MediaError, MediaWarning
from hybridkv_cli.media.decoders import DECODERS, DecodeFailed
from hybridkv_cli.media.geometry import FPS_MAX_FRAMES, FRAME_FACTOR, pixel_bounds, target_size
from hybridkv_cli.media.input import MediaInput
from hybridkv_cli.media.probe import probe_video
from hybridkv_cli.media.sniff import check_file, one_line


def sample_indices(total: int, duration: float, frames: int, fps: float | None, shown: str) -> list[int]:
    """Source frames to keep: ``frames`` (or ``duration * fps``, capped at Qwen's maximum) spread
    uniformly, made even for Qwen's 2-frame temporal patch."""
    if fps is not None:
        n = max(1, int(round(duration * fps)))
        if n > FPS_MAX_FRAMES and total > FPS_MAX_FRAMES:
            warnings.warn(f"{shown}: fps={fps:g} over {duration:.1f} s asks for {n} frames; capped at "
                          f"{FPS_MAX_FRAMES} (Qwen's FPS_MAX_FRAMES)", MediaWarning, stacklevel=2)
            n = FPS_MAX_FRAMES
    else:
        n = frames
    n = min(n, total)
    if total >= 2:
        n = max(2, n - n % FRAME_FACTOR)
    else:
        n = 1
    return torch.linspace(0, total - 1, n).round().long().tolist()


def load_video(path: Path, frames: int, fps: float | None, min_pixels: int | None, max_pixels: int | None
               ) -> MediaInput:
    """Load one video (see :func:`hybridkv_cli.media.load_media`); every failure is a MediaError."""
    try:
        return _load_video(path, frames, fps, min_pixels, max_pixels)
    except HybridKVError:
        raise
    except MemoryError:
        raise MediaError("out of memory while decoding the video", source=str(path)) from None
    except Exception as e:  # a last guard: nothing from decord / PyAV / torchvision escapes raw
        raise MediaError(f"cannot load video ({one_line(e)})", source=str(path)) from None


def _load_video(path: Path, frames: int, fps: float | None, min_pixels: int | None,
                max_pixels: int | None) -> MediaInput:
    shown = str(path)
    probe = probe_video(path, shown, check_file(path, shown))

    def plan(total: int, duration: float, source_size: tuple[int, int]):
        indices = sample_indices(total, duration, frames, fps, shown)
        lo, hi = pixel_bounds("video", max(len(indices), FRAME_FACTOR), min_pixels=min_pixels, max_pixels=max_pixels)
        return indices, target_size(*source_size, lo, hi, source=shown)

    failures = []
    for name, decode in DECODERS:
        try:
            decoded = decode(path, probe, plan, shown)
            break
        except DecodeFailed as e:
            failures.append(str(e))
        except MediaError as e:
            if failures and "decord unavailable" not in failures[0]:
                e.reason = f"{e.reason} (decord failed too)"
            raise
    video, indices = decoded.video, decoded.indices
    if video.shape[0] == 1:  # a 1-frame video: Qwen's temporal patch needs 2 frames
        video = video.repeat(FRAME_FACTOR, 1, 1, 1)
        indices = indices * FRAME_FACTOR
    video = video.contiguous()
    used = int(video.shape[0])
    sample_fps = used / decoded.duration if decoded.duration and decoded.duration > 0 else None
    return MediaInput(kind="video", sources=(path,), video=video, images=(), frames_total=int(decoded.total),
                      frames_used=used, sample_fps=sample_fps, origin=shown, decoder=name,
                      frame_indices=tuple(int(i) for i in indices), rotation=probe.rotation)
