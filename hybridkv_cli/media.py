"""Media loading: one video, or one image set, made ready for Qwen2.5-VL.

``load_media(paths)`` turns what the user typed into a :class:`MediaInput`:

* one video file -> ``kind == "video"``: ``frames`` indices spread uniformly over the whole
  video (or ``duration * fps`` of them), decoded with decord, or with PyAV when decord cannot
  open or decode the file (or is not installed, or the file carries a rotation matrix, which
  decord mishandles); the count is made even (Qwen2.5-VL's temporal patch is 2 frames) and every
  frame is resized with Qwen's ``smart_resize`` (multiples of 28) using qwen-vl-utils' per-frame
  pixel limits;
* one or more image files, or one directory of images -> ``kind == "images"``: EXIF orientation
  applied, converted to RGB (alpha composited on white, 16-bit scaled down, CMYK/palette/grey
  converted), first frame of animations, resized with ``smart_resize``.

Every failure is a :class:`~hybridkv_cli.errors.MediaError` (exit 1) or, for bad arguments, a
:class:`~hybridkv_cli.errors.UsageError` (exit 2), one line naming the path as the user typed it.
No exception from decord, PyAV or Pillow escapes. Non-fatal notices (skipped files in a
directory, capped frame counts) are emitted with ``warnings.warn(..., MediaWarning)``.
"""

from __future__ import annotations

import math
import os
import stat
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps

from .errors import HybridKVError, MediaError, UsageError

__all__ = [
    "VIDEO_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "MediaInput",
    "MediaWarning",
    "ExpandedInputs",
    "expand_inputs",
    "load_media",
    "target_size",
    "pixel_bounds",
]

VIDEO_EXTENSIONS = {".mp4", ".mov", ".avi", ".mkv", ".webm"}
IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif"}

# --- Qwen2.5-VL geometry, taken from qwen-vl-utils where it defines it ------------------------
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

#: Source images above this many pixels (after JPEG draft reduction) are refused before decoding.
MAX_SOURCE_PIXELS = 100_000_000
#: Video frames are decoded and resized this many at a time (bounds peak memory on 4K input).
DECODE_CHUNK = 16


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


class MediaWarning(UserWarning):
    """A non-fatal media notice (skipped file, capped frame count). Message: ``<path>: <what>``."""


# --- the result ---------------------------------------------------------------------------------
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

    @property
    def label(self) -> str:
        if self.origin:
            return self.origin
        if not self.sources:
            return "<no input>"
        first = str(self.sources[0])
        extra = len(self.sources) - 1
        return first if extra == 0 else f"{first} + {extra} more"

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of every frame / of the first image."""
        if self.video is not None:
            return int(self.video.shape[-2]), int(self.video.shape[-1])
        w, h = self.images[0].size
        return h, w


# --- input expansion ----------------------------------------------------------------------------
class ExpandedInputs(NamedTuple):
    kind: str  # "video" or "images"
    sources: tuple[Path, ...]
    origin: str  # label: the video / directory as typed, or "a.jpg + 2 more"


def _supported_list() -> str:
    return ", ".join(sorted(VIDEO_EXTENSIONS | IMAGE_EXTENSIONS))


def _shown(p: str | os.PathLike) -> str:
    return os.fspath(p)


def _lstat_checked(path: Path, shown: str) -> os.stat_result:
    """stat() a path, turning every failure into a one-line MediaError."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise MediaError("no such file or directory", source=shown) from None
    except PermissionError:
        raise MediaError("permission denied", source=shown) from None
    except OSError as e:
        raise MediaError(f"cannot access: {e.strerror or e}", source=shown) from None
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise MediaError(f"dangling symbolic link (target '{target}' does not exist)", source=shown) from None
        except PermissionError:
            raise MediaError("permission denied", source=shown) from None
        except OSError as e:  # e.g. a symlink loop
            raise MediaError(f"cannot follow symbolic link: {e.strerror or e}", source=shown) from None
    return st


def _list_directory(path: Path, shown: str) -> list[Path]:
    import natsort

    try:
        entries = list(os.scandir(path))
    except PermissionError:
        raise MediaError("permission denied (cannot list directory)", source=shown) from None
    except OSError as e:
        raise MediaError(f"cannot list directory: {e.strerror or e}", source=shown) from None
    images: list[str] = []
    skipped: list[str] = []
    videos = 0
    for entry in entries:
        name = entry.name
        if name.startswith("."):  # .DS_Store, AppleDouble "._x.jpg", editor files: silently ignored
            continue
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        ext = os.path.splitext(name)[1].lower()
        if is_dir:
            skipped.append(name + "/")
        elif ext in IMAGE_EXTENSIONS:
            images.append(name)
        else:
            videos += ext in VIDEO_EXTENSIONS
            skipped.append(name)
    if not images:
        hint = ""
        if videos:
            hint = f"; it holds {videos} video file{'s' if videos > 1 else ''}: pass a video file directly"
        elif not entries:
            hint = "; the directory is empty"
        raise MediaError(f"no image files in directory (supported: {', '.join(sorted(IMAGE_EXTENSIONS))}{hint})",
                         source=shown)
    if skipped:
        skipped = natsort.natsorted(skipped, alg=natsort.ns.PATH | natsort.ns.IGNORECASE)
        listed = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        warnings.warn(f"{shown}: skipped {len(skipped)} non-image entr{'ies' if len(skipped) > 1 else 'y'}: {listed}",
                      MediaWarning, stacklevel=4)
    images = natsort.natsorted(images, alg=natsort.ns.PATH | natsort.ns.IGNORECASE)
    return [path / name for name in images]


def expand_inputs(paths: Sequence[str | os.PathLike] | str | os.PathLike) -> ExpandedInputs:
    """Classify the user's paths into one video or one ordered image set.

    Checks existence (missing file, dangling symlink, permissions) and extensions; does not
    decode anything. Directories expand to their image files in natural order.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise UsageError("no media input given (pass a video, image files, or a directory of images)")
    videos: list[str] = []
    images: list[Path] = []
    for raw in paths:
        if not isinstance(raw, (str, os.PathLike)):
            raise UsageError(f"media paths must be strings or paths, got {type(raw).__name__}")
        shown = _shown(raw)
        if shown == "":
            raise UsageError("empty media path")
        path = Path(raw)
        st = _lstat_checked(path, shown)
        if stat.S_ISDIR(st.st_mode):
            images.extend(_list_directory(path, shown))
            continue
        ext = path.suffix.lower()
        if ext in VIDEO_EXTENSIONS:
            videos.append(shown)
        elif ext in IMAGE_EXTENSIONS:
            images.append(path)
        elif ext:
            raise MediaError(f"unsupported file type '{ext}' (supported: {_supported_list()})", source=shown)
        else:
            raise MediaError(f"unsupported file type (no extension; supported: {_supported_list()})", source=shown)
    if videos and (len(videos) > 1 or images or len(paths) > 1):
        other = videos[1] if len(videos) > 1 else _shown(next(p for p in paths if _shown(p) != videos[0]))
        raise UsageError(f"one video per prompt: got '{videos[0]}' together with '{other}' "
                         "(a video cannot be combined with other media)")
    if videos:
        return ExpandedInputs("video", (Path(videos[0]),), videos[0])
    if len(paths) == 1 and len(images) >= 1 and os.path.isdir(paths[0]):
        origin = _shown(paths[0])
    else:
        origin = _shown(images[0]) if len(images) == 1 else f"{_shown(images[0])} + {len(images) - 1} more"
    return ExpandedInputs("images", tuple(images), origin)


# --- file checks and content sniffing -----------------------------------------------------------
def _open_binary(path: Path):  # indirection point for tests (root ignores permission bits)
    return open(path, "rb")


def _check_file(path: Path, shown: str) -> bytes:
    """Existence / type / size / readability; returns the first 64 bytes for sniffing."""
    st = _lstat_checked(path, shown)
    if stat.S_ISDIR(st.st_mode):
        raise MediaError("is a directory, expected a file", source=shown)
    if not stat.S_ISREG(st.st_mode):
        raise MediaError("not a regular file", source=shown)
    if st.st_size == 0:
        raise MediaError("empty file (0 bytes)", source=shown)
    try:
        with _open_binary(path) as f:
            return f.read(64)
    except PermissionError:
        raise MediaError("permission denied (file is not readable)", source=shown) from None
    except OSError as e:
        raise MediaError(f"cannot read: {e.strerror or e}", source=shown) from None


def _sniff(head: bytes) -> tuple[str, str] | None:
    """Guess (kind, description) from magic bytes; kind in {"image", "video", "audio", "text", "other"}."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image", "a PNG image"
    if head.startswith(b"\xff\xd8\xff"):
        return "image", "a JPEG image"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image", "a GIF image"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image", "a WebP image"
    if head[:2] == b"BM":
        return "image", "a BMP image"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "image", "a TIFF image"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"M4A ", b"M4B ", b"M4P "):
            return "audio", "an MPEG-4 audio file"
        if brand in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1"):
            return "image", "a HEIF/AVIF image"
        return "video", "an MP4/MOV video"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "video", "a Matroska/WebM video"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "video", "an AVI video"
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "audio", "a WAV audio file"
    if head[:3] == b"ID3" or head[:4] in (b"fLaC", b"OggS"):
        return "audio", "an audio file"
    if head[:5] == b"%PDF-":
        return "other", "a PDF document"
    if head[:4] == b"PK\x03\x04":
        return "other", "a ZIP archive"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        try:  # a multi-byte character may be cut at byte 64
            text = head[:-3].decode("utf-8")
        except UnicodeDecodeError:
            return None
    if text and all(c.isprintable() or c in "\r\n\t\f" for c in text):
        return "text", "text"
    return None


def _one_line(e: BaseException | str) -> str:
    if isinstance(e, BaseException) and isinstance(getattr(e, "strerror", None), str) and e.strerror:
        msg = e.strerror  # PyAV / OSError: drop the "[Errno N]" prefix and the C function name
    else:
        msg = str(e)
    msg = " ".join(msg.split())
    if not msg:
        msg = type(e).__name__
    return msg if len(msg) <= 160 else msg[:157] + "..."


# --- sizes --------------------------------------------------------------------------------------
def _check_pixel_arg(name: str, value) -> int | None:
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
        raise MediaError(f"cannot size {width}x{height} for the model: {_one_line(e)}", source=source) from None
    h, w = max(PATCH_FACTOR, int(h)), max(PATCH_FACTOR, int(w))
    while h * w > max_pixels and max(h, w) > PATCH_FACTOR:  # smart_resize floors a side to 0 / rounds up
        if h >= w:
            h -= PATCH_FACTOR
        else:
            w -= PATCH_FACTOR
    return h, w


# --- images -------------------------------------------------------------------------------------
_PIL_OPEN_LOCK = threading.Lock()


@contextmanager
def _pil_image(path: Path) -> Iterator[Image.Image]:
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


def _to_rgb(im: Image.Image) -> Image.Image:
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


def _load_image(path: Path, min_pixels: int | None, max_pixels: int | None) -> Image.Image:
    shown = _shown(path)
    head = _check_file(path, shown)
    guess = _sniff(head)
    try:
        with _pil_image(path) as im:
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
            if dw * dh > MAX_SOURCE_PIXELS:
                raise MediaError(f"image too large: {width}x{height} = {width * height / 1e6:.0f} megapixels "
                                 f"(limit {MAX_SOURCE_PIXELS / 1e6:.0f} MP); downscale it first", source=shown)
            im.seek(0)  # animated GIF / WebP / APNG: first frame
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                im.load()
            try:
                oriented = ImageOps.exif_transpose(im)
            except Exception:  # malformed EXIF: keep the stored orientation
                oriented = im.copy()
            try:
                rgb = _to_rgb(oriented)
            except (ValueError, OSError) as e:  # e.g. LAB / exotic TIFF modes Pillow cannot convert
                raise MediaError(f"cannot convert image mode {oriented.mode} to RGB ({_one_line(e)})",
                                 source=shown) from None
            if rgb.size != (tw, th):
                rgb = rgb.resize((tw, th), Image.Resampling.BICUBIC)
            elif rgb is im:
                rgb = rgb.copy()
            return rgb
    except HybridKVError:
        raise
    except Image.DecompressionBombError as e:  # pragma: no cover - we disable Pillow's check
        raise MediaError(f"image too large ({_one_line(e)})", source=shown) from None
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
        raise MediaError(f"corrupt or truncated image ({_one_line(e)})", source=shown) from None


# --- videos -------------------------------------------------------------------------------------
class _Probe(NamedTuple):
    width: int
    height: int
    frames: int  # from the container header; 0 if unknown
    fps: float | None  # average frame rate
    duration: float | None  # seconds
    rotation: int  # degrees counter-clockwise to apply for display (multiple of 90)
    codec: str


def _av_error_reason(e: BaseException) -> str:
    msg = getattr(e, "strerror", None) or str(e)
    msg = " ".join(str(msg).split())
    low = msg.lower()
    if "invalid data" in low:
        return "cannot open video: invalid data (corrupt, truncated, or not a video file)"
    if "permission" in low:
        return "permission denied"
    return f"cannot open video: {_one_line(msg)}"


def _probe_video(path: Path, shown: str, head: bytes) -> _Probe:
    import av

    guess = _sniff(head)
    if guess is not None and guess[0] in ("image", "text", "other"):
        hint = " (wrong extension?)" if guess[0] == "image" else ""
        raise MediaError(f"file content is {guess[1]}, not a video{hint}", source=shown)
    try:
        container = av.open(str(path), metadata_errors="ignore")
    except Exception as e:
        raise MediaError(_av_error_reason(e), source=shown) from None
    try:
        fmt = container.format.name or ""
        if fmt == "image2" or fmt.endswith("_pipe"):
            raise MediaError(f"file content is an image ({fmt}), not a video (wrong extension?)", source=shown)
        if not container.streams.video:
            if container.streams.audio:
                raise MediaError("no video stream (audio-only container)", source=shown)
            raise MediaError("no video stream", source=shown)
        stream = container.streams.video[0]
        cc = stream.codec_context
        if cc is None:
            raise MediaError("video codec not supported by this ffmpeg build", source=shown)
        width, height = int(cc.width or 0), int(cc.height or 0)
        fps = None
        for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
            if rate and float(rate) > 0:
                fps = float(rate)
                break
        duration = None
        if stream.duration and stream.time_base:
            duration = float(stream.duration * stream.time_base)
        elif container.duration:
            duration = container.duration / 1_000_000
        if duration is not None and not (math.isfinite(duration) and duration > 0):
            duration = None
        rotation = 0
        try:  # the display matrix only shows on decoded frames in PyAV; one frame is cheap
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                width, height = frame.width, frame.height
                rotation = int(round(float(getattr(frame, "rotation", 0) or 0) / 90.0)) * 90 % 360
                break
        except Exception:
            pass  # the decoders report it
        if width <= 0 or height <= 0:
            raise MediaError("video stream has no frame size (corrupt header?)", source=shown)
        return _Probe(width, height, int(stream.frames or 0), fps, duration, rotation, cc.name or "?")
    except HybridKVError:
        raise
    except Exception as e:
        raise MediaError(_av_error_reason(e), source=shown) from None
    finally:
        try:
            container.close()
        except Exception:
            pass


def _sample_indices(total: int, duration: float, frames: int, fps: float | None, shown: str) -> list[int]:
    if fps is not None:
        n = max(1, int(round(duration * fps)))
        if n > FPS_MAX_FRAMES and total > FPS_MAX_FRAMES:
            warnings.warn(f"{shown}: fps={fps:g} over {duration:.1f} s asks for {n} frames; capped at "
                          f"{FPS_MAX_FRAMES} (Qwen's FPS_MAX_FRAMES)", MediaWarning, stacklevel=5)
            n = FPS_MAX_FRAMES
    else:
        n = frames
    n = min(n, total)
    if total >= 2:
        n = max(2, n - n % FRAME_FACTOR)
    else:
        n = 1
    return torch.linspace(0, total - 1, n).round().long().tolist()


def _to_display(chunk: torch.Tensor, rotation: int) -> torch.Tensor:
    k = (rotation // 90) % 4
    return torch.rot90(chunk, k, dims=(-2, -1)) if k else chunk


def _resize_chunk(chunk: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(chunk.shape[-2:]) == size:
        return chunk.contiguous()
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    return TF.resize(chunk, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)


class _DecodeFailed(Exception):
    pass


_decord_quiet = False


def _decode_decord(path: Path, probe: _Probe, frames: int, fps: float | None, shown: str, bounds
                   ) -> tuple[torch.Tensor, int, list[int], float]:
    global _decord_quiet
    try:
        import decord
    except Exception as e:
        raise _DecodeFailed(f"decord unavailable ({_one_line(e)})") from None
    if not _decord_quiet:
        try:
            decord.logging.set_level(decord.logging.QUIET)
        except Exception:
            pass
        _decord_quiet = True
    try:
        vr = decord.VideoReader(str(path), ctx=decord.cpu(0))
        total = len(vr)
        if total <= 0:
            raise _DecodeFailed("decord found no frames")
        avg_fps = float(vr.get_avg_fps() or 0)
        duration = None
        try:  # the span of the frames actually there (headers lie for truncated files)
            ts = vr.get_frame_timestamp([0, total - 1])
            span = float(ts[1][1]) - float(ts[0][0])
            if math.isfinite(span) and span > 0:
                duration = span
        except Exception:
            pass
        duration = duration or probe.duration or (total / avg_fps if avg_fps > 0 else total / 2.0)
        indices = _sample_indices(total, duration, frames, fps, shown)
        lo, hi = bounds(len(indices))
        size = target_size(probe.height, probe.width, lo, hi, source=shown)
        out = []
        for start in range(0, len(indices), DECODE_CHUNK):
            idx = indices[start:start + DECODE_CHUNK]
            arr = vr.get_batch(idx).asnumpy()
            if arr.ndim != 4 or arr.shape != (len(idx), probe.height, probe.width, 3) or arr.dtype != np.uint8:
                raise _DecodeFailed(f"decord returned frames of shape {tuple(arr.shape)}, expected "
                                    f"({len(idx)}, {probe.height}, {probe.width}, 3)")
            chunk = torch.from_numpy(np.ascontiguousarray(arr)).permute(0, 3, 1, 2)
            out.append(_resize_chunk(chunk, size))
            del arr, chunk
        return torch.cat(out), total, indices, duration
    except (_DecodeFailed, HybridKVError):
        raise
    except Exception as e:
        raise _DecodeFailed(f"decord: {_one_line(e)}") from None


def _count_packets(path: Path) -> int:
    import av

    with av.open(str(path), metadata_errors="ignore") as c:
        s = c.streams.video[0]
        return sum(1 for p in c.demux(s) if p.size)


def _decode_pyav(path: Path, probe: _Probe, frames: int, fps: float | None, shown: str, bounds
                 ) -> tuple[torch.Tensor, int, list[int], float]:
    import av

    total = probe.frames
    if total <= 0:
        try:
            total = _count_packets(path)
        except Exception as e:
            raise MediaError(f"cannot read video packets: {_one_line(e)}", source=shown) from None
    if total <= 0:
        raise MediaError("no decodable video frames (the video stream is empty)", source=shown)
    duration = probe.duration or (total / probe.fps if probe.fps else total / 2.0)
    indices = _sample_indices(total, duration, frames, fps, shown)
    first_time = last_time = None
    rot_h, rot_w = (probe.width, probe.height) if probe.rotation in (90, 270) else (probe.height, probe.width)
    lo, hi = bounds(len(indices))
    size = target_size(rot_h, rot_w, lo, hi, source=shown)

    wanted: dict[int, list[int]] = {}
    for pos, i in enumerate(indices):
        wanted.setdefault(i, []).append(pos)
    last_wanted = indices[-1]
    results: list[torch.Tensor | None] = [None] * len(indices)
    pending: list[tuple[int, torch.Tensor]] = []
    last_frame: torch.Tensor | None = None
    decoded = 0
    error: str | None = None

    def flush():
        nonlocal pending
        if not pending:
            return
        chunk = torch.stack([t for _, t in pending])
        chunk = _resize_chunk(_to_display(chunk, probe.rotation), size)
        for (i, _), t in zip(pending, chunk):
            for pos in wanted[i]:
                results[pos] = t
        pending = []

    try:
        with av.open(str(path), metadata_errors="ignore") as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                i = decoded
                decoded += 1
                if frame.time is not None:
                    first_time = frame.time if first_time is None else first_time
                    last_time = frame.time
                if i in wanted:
                    arr = frame.to_ndarray(format="rgb24")
                    if arr.shape[:2] != (probe.height, probe.width):  # mid-stream size change
                        t = torch.from_numpy(arr).permute(2, 0, 1)
                        t = _resize_chunk(t.unsqueeze(0), (probe.height, probe.width))[0]
                    else:
                        t = torch.from_numpy(arr).permute(2, 0, 1)
                    pending.append((i, t))
                    last_frame = t
                    if len(pending) >= DECODE_CHUNK:
                        flush()
                if i >= last_wanted:
                    break
    except HybridKVError:
        raise
    except Exception as e:
        error = _one_line(e)
    flush()

    if decoded == 0:
        reason = "no decodable video frames"
        raise MediaError(reason + (f": {error[:1].lower() + error[1:]}" if error else ""), source=shown)
    missing = [pos for pos, t in enumerate(results) if t is None]
    if missing:
        # Headers often over-count by a frame or two; a bigger shortfall is a damaged file.
        if total - decoded <= max(2, math.ceil(0.01 * total)) and last_frame is not None:
            filler = _resize_chunk(_to_display(last_frame.unsqueeze(0), probe.rotation), size)[0]
            for pos in missing:
                results[pos] = filler
        else:
            detail = f": {error}" if error else ""
            raise MediaError(f"truncated or corrupt video: only {decoded} of {total} frames could be decoded{detail}",
                             source=shown)
    if decoded >= total and first_time is not None and last_time is not None and probe.fps:
        span = last_time - first_time + 1.0 / probe.fps  # decoded to the end: measure, like decord
        if math.isfinite(span) and span > 0:
            duration = span
    return torch.stack(results), total, indices, duration


def _load_video(path: Path, frames: int, fps: float | None, min_pixels: int | None, max_pixels: int | None
                ) -> MediaInput:
    try:
        return _load_video_unchecked(path, frames, fps, min_pixels, max_pixels)
    except HybridKVError:
        raise
    except MemoryError:
        raise MediaError("out of memory while decoding the video", source=_shown(path)) from None
    except Exception as e:  # a last guard: nothing from decord / PyAV / torchvision escapes raw
        raise MediaError(f"cannot load video ({_one_line(e)})", source=_shown(path)) from None


def _load_video_unchecked(path: Path, frames: int, fps: float | None, min_pixels: int | None,
                          max_pixels: int | None) -> MediaInput:
    shown = _shown(path)
    head = _check_file(path, shown)
    probe = _probe_video(path, shown, head)

    def bounds(n: int) -> tuple[int, int]:
        n_used = max(n, FRAME_FACTOR)
        return pixel_bounds("video", n_used, min_pixels=min_pixels, max_pixels=max_pixels)

    decoder = "decord"
    decord_error = None
    try:
        if probe.rotation:
            raise _DecodeFailed(f"rotation {probe.rotation} (decord ignores display matrices)")
        video, total, indices, duration = _decode_decord(path, probe, frames, fps, shown, bounds)
    except _DecodeFailed as e:
        decord_error = str(e)
        decoder = "pyav"
        try:
            video, total, indices, duration = _decode_pyav(path, probe, frames, fps, shown, bounds)
        except MediaError as me:
            if decord_error and not probe.rotation and "decord unavailable" not in decord_error:
                me.reason = f"{me.reason} (decord failed too)"
            raise
    if video.shape[0] == 1:  # a 1-frame video: Qwen's temporal patch needs 2 frames
        video = video.repeat(FRAME_FACTOR, 1, 1, 1)
        indices = indices * FRAME_FACTOR
    video = video.contiguous()
    used = int(video.shape[0])
    sample_fps = used / duration if duration and duration > 0 else None
    return MediaInput(kind="video", sources=(path,), video=video, images=(), frames_total=int(total),
                      frames_used=used, sample_fps=sample_fps, origin=shown, decoder=decoder,
                      frame_indices=tuple(int(i) for i in indices))


# --- entry point --------------------------------------------------------------------------------
def load_media(paths: Sequence[str | os.PathLike] | str | os.PathLike, *, frames: int = 64,
               fps: float | None = None, max_pixels: int | None = None, min_pixels: int | None = None
               ) -> MediaInput:
    """Load one video or one image set (see the module docstring)."""
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)):
        if isinstance(frames, float) and frames.is_integer():
            frames = int(frames)
        else:
            raise UsageError(f"frames must be a whole number, got {frames!r}")
    if frames <= 0:
        raise UsageError(f"frames must be positive, got {frames}")
    if fps is not None:
        if isinstance(fps, bool) or not isinstance(fps, (int, float, np.integer, np.floating)):
            raise UsageError(f"fps must be a number, got {fps!r}")
        if not math.isfinite(fps) or fps <= 0:
            raise UsageError(f"fps must be positive, got {fps!r}")
        fps = float(fps)
    max_pixels = _check_pixel_arg("max_pixels", max_pixels)
    min_pixels = _check_pixel_arg("min_pixels", min_pixels)
    # validate the pixel arguments once, up front, for either kind
    pixel_bounds("images", min_pixels=min_pixels, max_pixels=max_pixels)

    expanded = expand_inputs(paths)
    if expanded.kind == "video":
        return _load_video(expanded.sources[0], int(frames), fps, min_pixels, max_pixels)
    images = tuple(_load_image(p, min_pixels, max_pixels) for p in expanded.sources)
    return MediaInput(kind="images", sources=expanded.sources, video=None, images=images, frames_total=None,
                      frames_used=len(images), sample_fps=None, origin=expanded.origin, decoder="pillow")
