"""Image decoding: EXIF orientation, RGB conversion, first frame, Qwen's size."""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image, ImageOps

from hybridkv_cli.io.errors import HybridKVError, MediaError, MediaWarning
from hybridkv_cli.media.geometry import pixel_bounds, target_size
from hybridkv_cli.media.sniff import check_file, one_line, sniff

#: Source images above this many pixels (after JPEG draft reduction) are refused before decoding.
MAX_SOURCE_PIXELS = 100_000_000

_PIL_OPEN_LOCK = threading.Lock()


def refuse_oversized(what: str, width: int, height: int, shown: str, decoded: int | None = None) -> None:
    """Refuse a ``width`` x ``height`` source of more than :data:`MAX_SOURCE_PIXELS` (``decoded``:
    the pixels it would decode at, when less) before it is decoded: a small file of huge frames
    (an image or "video bomb") would take gigabytes and minutes before it is resized."""
    if (width * height if decoded is None else decoded) > MAX_SOURCE_PIXELS:
        each = "" if what == "image" else " a frame"
        raise MediaError(f"{what} too large: {width}x{height} = {width * height / 1e6:.0f} megapixels{each} "
                         f"(limit {MAX_SOURCE_PIXELS / 1e6:.0f} MP); downscale it first", source=shown)


@contextmanager
def pil_image(path: Path) -> Iterator[Image.Image]:
    """Image.open without Pillow's decompression-bomb refusal (we check sizes ourselves,
    after JPEG draft reduction). Only the header is read here."""
    with _PIL_OPEN_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            im = Image.open(path)
        finally:
            Image.MAX_IMAGE_PIXELS = saved
    try:
        yield im
    finally:
        im.close()


def _exif_orientation(im: Image.Image) -> int:
    try:
        return int(im.getexif().get(0x0112, 1) or 1)
    except Exception:
        return 1


def to_rgb(im: Image.Image) -> Image.Image:
    mode = im.mode
    if mode == "RGB":
        return im
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(im)
        if mode.startswith("I;16"):
            arr8 = (arr.astype(np.uint32) >> 8).astype(np.uint8)
        elif mode == "I":
            mx = int(arr.max()) if arr.size else 0
            mn = int(arr.min()) if arr.size else 0
            if mn >= 0 and mx <= 255:
                arr8 = arr.astype(np.uint8)
            elif mn >= 0 and mx <= 65535:  # 16-bit data stored as 32-bit
                arr8 = (arr.astype(np.int64) >> 8).astype(np.uint8)
            else:
                span = max(mx - mn, 1)
                arr8 = ((arr.astype(np.float64) - mn) * (255.0 / span)).round().astype(np.uint8)
        else:  # float
            arr = np.nan_to_num(arr.astype(np.float64))
            scale = 255.0 if arr.size and float(arr.max()) <= 1.0 else 1.0
            arr8 = np.clip(arr * scale, 0, 255).round().astype(np.uint8)
        return Image.fromarray(arr8, mode="L").convert("RGB")
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode in ("P", "L", "RGB") and "transparency" in im.info)
    if has_alpha:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


def load_image(path: Path, min_pixels: int | None, max_pixels: int | None, *, in_set: bool = False) -> Image.Image:
    """One image, upright, RGB, at Qwen's size. ``in_set``: part of an image set of several files,
    where an animation gives its first frame (with a warning; alone it is read as a video)."""
    shown = str(path)
    head = check_file(path, shown)
    guess = sniff(head)
    try:
        with pil_image(path) as im:
            fmt = im.format or "image"
            width, height = im.size
            orientation = _exif_orientation(im)
            oh, ow = (width, height) if orientation in (5, 6, 7, 8) else (height, width)
            lo, hi = pixel_bounds("images", min_pixels=min_pixels, max_pixels=max_pixels)
            th, tw = target_size(oh, ow, lo, hi, source=shown)
            if fmt == "JPEG" and width * height > th * tw:
                # decode at 1/2, 1/4 or 1/8 scale straight from the DCT, never below the target size
                dw, dh = (th, tw) if orientation in (5, 6, 7, 8) else (tw, th)
                im.draft(None, (dw, dh))
            dw, dh = im.size
            refuse_oversized("image", width, height, shown, decoded=dw * dh)
            if in_set and getattr(im, "is_animated", False):
                warnings.warn(f"{shown}: an animated {fmt} in an image set: only its first frame is used (give it "
                              "alone, or use --each, to read its frames as a video)", MediaWarning, stacklevel=3)
            im.seek(0)  # animated GIF / WebP / APNG in an image set: first frame
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                im.load()
            try:
                oriented = ImageOps.exif_transpose(im)
            except Exception:  # malformed EXIF: keep the stored orientation
                oriented = im.copy()
            try:
                rgb = to_rgb(oriented)
            except (ValueError, OSError) as e:  # e.g. LAB / exotic TIFF modes Pillow cannot convert
                raise MediaError(f"cannot convert image mode {oriented.mode} to RGB ({one_line(e)})",
                                 source=shown) from None
            if rgb.size != (tw, th):
                rgb = rgb.resize((tw, th), Image.Resampling.BICUBIC)
            elif rgb is im:
                rgb = rgb.copy()
            return rgb
    except HybridKVError:
        raise
    except Image.DecompressionBombError as e:  # pragma: no cover - we disable Pillow's check
        raise MediaError(f"image too large ({one_line(e)})", source=shown) from None
    except MemoryError:
        raise MediaError("out of memory while decoding the image", source=shown) from None
    except Exception as e:
        if type(e).__name__ == "UnidentifiedImageError" or "cannot identify image file" in str(e):
            if guess is not None and guess[0] != "image":
                hint = " (wrong extension?)" if guess[0] == "video" else ""
                raise MediaError(f"file content is {guess[1]}, not an image{hint}", source=shown) from None
            if guess is not None:  # an image format Pillow cannot read (HEIF without a plugin, ...)
                raise MediaError(f"cannot decode {guess[1]} (format not supported by Pillow, or corrupt)",
                                 source=shown) from None
            raise MediaError("not a recognised image file (corrupt, truncated or unsupported format)",
                             source=shown) from None
        raise MediaError(f"corrupt or truncated image ({one_line(e)})", source=shown) from None
