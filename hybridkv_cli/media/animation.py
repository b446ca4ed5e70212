"""Animated images (GIF, WebP, APNG) as videos: a user who gives an animation expects its frames.

An animation given alone is sampled like a video (``frames`` uniformly, or ``fps`` per second
of its play time) and comes back as ``kind == "video"``; a still image in the same formats, or
an animation inside an image set of several files, stays an image (its first frame).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hybridkv_cli.io.errors import HybridKVError, MediaError
from hybridkv_cli.media.decoders import resize_chunk
from hybridkv_cli.media.geometry import FRAME_FACTOR, pixel_bounds, target_size
from hybridkv_cli.media.images import pil_image, refuse_oversized, to_rgb
from hybridkv_cli.media.input import MediaInput
from hybridkv_cli.media.sniff import check_file, one_line
from hybridkv_cli.media.video import sample_indices

#: Play time of a frame that states none (GIF's common 0 means "as fast as possible"; browsers use 100 ms).
DEFAULT_FRAME_MS = 100


def is_animation(path: Path) -> bool:
    """True when ``path`` is an image with more than one frame (header only; False for anything
    Pillow cannot open: the image loader reports that)."""
    try:
        with pil_image(path) as im:
            return bool(getattr(im, "is_animated", False))
    except Exception:
        return False


def load_animation(path: Path, frames: int, fps: float | None, min_pixels: int | None,
                   max_pixels: int | None, origin: str | None = None) -> MediaInput:
    """Sample the frames of an animated image like a video's; every failure is a MediaError."""
    shown = str(path)
    check_file(path, shown)
    try:
        with pil_image(path) as im:
            total = int(getattr(im, "n_frames", 1))
            durations = []
            for i in range(total):  # seeking composes each frame (GIF disposal, APNG blending)
                im.seek(i)
                durations.append(int(im.info.get("duration") or 0) or DEFAULT_FRAME_MS)
            duration = sum(durations) / 1000.0
            indices = sample_indices(total, duration, frames, fps, shown)
            lo, hi = pixel_bounds("video", max(len(indices), FRAME_FACTOR), min_pixels=min_pixels,
                                  max_pixels=max_pixels)
            width, height = im.size
            refuse_oversized("animation", width, height, shown)
            size = target_size(height, width, lo, hi, source=shown)
            picked = {}
            for i in sorted(set(indices)):
                im.seek(i)
                rgb = np.asarray(to_rgb(im))
                picked[i] = resize_chunk(torch.from_numpy(rgb.copy()).permute(2, 0, 1).unsqueeze(0), size)[0]
    except HybridKVError:
        raise
    except MemoryError:
        raise MediaError("out of memory while decoding the animation", source=shown) from None
    except Exception as e:  # a truncated or corrupt frame: one line, like a broken video
        raise MediaError(f"corrupt or truncated animation ({one_line(e)})", source=shown) from None
    video = torch.stack([picked[i] for i in indices]).contiguous()
    return MediaInput(kind="video", sources=(path,), video=video, images=(), frames_total=total,
                      frames_used=int(video.shape[0]), sample_fps=len(indices) / duration, origin=origin or shown,
                      decoder="pillow", frame_indices=tuple(indices))
