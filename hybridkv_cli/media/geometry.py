"""Qwen2.5-VL's image geometry: pixel bounds per image / frame and the ``smart_resize`` target size.

The constants come from qwen-vl-utils where it defines them (older releases name pixel limits,
newer ones count tokens), with the same defaults when it is missing.
"""

from __future__ import annotations

import math

import numpy as np

from hybridkv_cli.io.errors import MediaError, UsageError
from hybridkv_cli.media.sniff import one_line

try:  # pragma: no branch
    from qwen_vl_utils import vision_process as _qvp
except Exception:  # pragma: no cover - qwen-vl-utils is a dependency; keep working without it
    _qvp = None

PATCH_FACTOR = 28  # patch 14 x spatial merge 2
FRAME_FACTOR = int(getattr(_qvp, "FRAME_FACTOR", 2))  # temporal_patch_size
MAX_ASPECT_RATIO = float(getattr(_qvp, "MAX_RATIO", 200))
_PX = PATCH_FACTOR * PATCH_FACTOR


def _qwen_const(old_name: str, token_name: str, default_tokens: float) -> int:
    """qwen-vl-utils <= 0.0.11 names pixel limits (MIN_PIXELS...); newer ones count tokens."""
    if _qvp is not None and hasattr(_qvp, old_name):
        return int(getattr(_qvp, old_name))
    return int(getattr(_qvp, token_name, default_tokens) * _PX)


IMAGE_MIN_PIXELS = _qwen_const("MIN_PIXELS", "IMAGE_MIN_TOKEN_NUM", 4)
IMAGE_MAX_PIXELS = _qwen_const("MAX_PIXELS", "IMAGE_MAX_TOKEN_NUM", 16384)
VIDEO_MIN_PIXELS = _qwen_const("VIDEO_MIN_PIXELS", "VIDEO_MIN_TOKEN_NUM", 128)
VIDEO_MAX_PIXELS = _qwen_const("VIDEO_MAX_PIXELS", "VIDEO_MAX_TOKEN_NUM", 768)
if _qvp is not None and hasattr(_qvp, "VIDEO_TOTAL_PIXELS"):
    VIDEO_TOTAL_PIXELS = int(_qvp.VIDEO_TOTAL_PIXELS)
else:  # newer qwen-vl-utils: total pixels follow the model's sequence length (0.9 of it)
    VIDEO_TOTAL_PIXELS = int(getattr(_qvp, "MODEL_SEQ_LEN", 128000) * _PX * 0.9)
FPS_MAX_FRAMES = int(getattr(_qvp, "FPS_MAX_FRAMES", 768))


def _fallback_smart_resize(height, width, factor, min_pixels=None, max_pixels=None):  # pragma: no cover
    max_pixels = IMAGE_MAX_PIXELS if max_pixels is None else max_pixels
    min_pixels = IMAGE_MIN_PIXELS if min_pixels is None else min_pixels
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError("absolute aspect ratio too large")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


_smart_resize = getattr(_qvp, "smart_resize", None) or _fallback_smart_resize


def check_pixel_arg(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise UsageError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{name} must be a positive number, got {value!r}")
    return int(value)


def pixel_bounds(kind: str, nframes: int = 1, *, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> tuple[int, int]:
    """(min_pixels, max_pixels) per image / per video frame, as qwen-vl-utils computes them.

    Videos: ``max = max(min(VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS / nframes * 2), 1.05 * VIDEO_MIN_PIXELS)``.
    An explicit ``max_pixels`` / ``min_pixels`` replaces the default (a given ``max_pixels``
    below the default minimum lowers the minimum with it; a given ``min_pixels`` above the
    default maximum raises the maximum with it).
    """
    if kind == "video":
        dmin = VIDEO_MIN_PIXELS
        dmax = max(min(VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS / max(nframes, 1) * FRAME_FACTOR), int(dmin * 1.05))
    else:
        dmin, dmax = IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS
    if max_pixels is not None:
        hi = int(max_pixels)
        lo = min(dmin, hi) if min_pixels is None else int(min_pixels)
    else:  # only a minimum given: the default maximum yields to it
        lo = dmin if min_pixels is None else int(min_pixels)
        hi = max(int(dmax), lo)
    if hi < _PX:
        raise UsageError(f"max_pixels must be at least {_PX} (one {PATCH_FACTOR}x{PATCH_FACTOR} patch), got {hi}")
    if lo > hi:
        raise UsageError(f"min_pixels ({lo}) must not exceed max_pixels ({hi})")
    return lo, hi


def target_size(height: int, width: int, min_pixels: int, max_pixels: int, *, source: str | None = None
                ) -> tuple[int, int]:
    """Qwen2.5-VL's ``smart_resize`` (factor 28), made total: (H, W) multiples of 28, >= 28,
    H*W <= max_pixels. Extreme aspect ratios (> 200:1, which Qwen refuses) raise MediaError."""
    if height <= 0 or width <= 0:
        raise MediaError(f"invalid dimensions {width}x{height}", source=source)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise MediaError(f"aspect ratio of {width}x{height} is {ratio:.0f}:1, above Qwen2.5-VL's limit of "
                         f"{MAX_ASPECT_RATIO:.0f}:1", source=source)
    try:
        h, w = _smart_resize(height, width, factor=PATCH_FACTOR, min_pixels=min_pixels, max_pixels=max_pixels)
    except Exception as e:  # ValueError / AssertionError from qwen-vl-utils
        raise MediaError(f"cannot size {width}x{height} for the model: {one_line(e)}", source=source) from None
    h, w = max(PATCH_FACTOR, int(h)), max(PATCH_FACTOR, int(w))
    aspect = math.log(height / width)
    while h * w > max_pixels and max(h, w) > PATCH_FACTOR:  # smart_resize floors a side to 0 / rounds up
        # shrink the side that keeps the shape closest to the source's (a portrait stays portrait)
        if w <= PATCH_FACTOR or (h > PATCH_FACTOR and abs(math.log((h - PATCH_FACTOR) / w) - aspect)
                                 <= abs(math.log(h / (w - PATCH_FACTOR)) - aspect)):
            h -= PATCH_FACTOR
        else:
            w -= PATCH_FACTOR
    return h, w

