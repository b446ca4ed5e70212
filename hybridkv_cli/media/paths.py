"""What the user typed -> files: path checks, the one directory scan, and the input's label.

A directory is scanned once (:func:`scan_directory`) whether it is one image set (``ask DIR``)
or a folder of inputs (``ask --each DIR``); :func:`set_label` names an input made of several
files the same way everywhere (``first + N more``).
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path
from typing import NamedTuple, Sequence

from hybridkv_cli.io.errors import MediaError, MediaWarning, UsageError
from hybridkv_cli.media.sniff import lstat_checked

VIDEO_EXTENSIONS = {".mp4", ".mov", ".avi", ".mkv", ".webm"}
IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".apng", ".webp", ".bmp", ".tif", ".tiff", ".gif"}
MEDIA_EXTENSIONS = VIDEO_EXTENSIONS | IMAGE_EXTENSIONS


def set_label(paths: Sequence[str | os.PathLike]) -> str:
    """The label of an input made of ``paths``: the path itself, or ``first + N more``."""
    if not paths:
        return "<no input>"
    first = os.fspath(paths[0])
    return first if len(paths) == 1 else f"{first} + {len(paths) - 1} more"


def supported_list(extensions=MEDIA_EXTENSIONS) -> str:
    return ", ".join(sorted(extensions))


class Listing(NamedTuple):
    """A directory's entries by kind (names, natural order; hidden entries left out)."""

    images: list[str]
    videos: list[str]
    others: list[str]  # other files, and sub-directories as ``name/``
    empty: bool


def natural(names: list[str]) -> list[str]:
    import natsort

    return natsort.natsorted(names, alg=natsort.ns.PATH | natsort.ns.IGNORECASE)


def scan_directory(path: str | os.PathLike) -> Listing:
    """List ``path`` once (not recursive). Raises :class:`MediaError` when it cannot be listed."""
    shown = os.fspath(path)
    try:
        entries = list(os.scandir(path))
    except PermissionError:
        raise MediaError("permission denied (cannot list directory)", source=shown) from None
    except OSError as e:
        raise MediaError(f"cannot list directory: {e.strerror or e}", source=shown) from None
    images, videos, others = [], [], []
    for entry in entries:
        if entry.name.startswith("."):  # .DS_Store, AppleDouble "._x.jpg", editor files: silently ignored
            continue
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        ext = os.path.splitext(entry.name)[1].lower()
        if is_dir:
            others.append(entry.name + "/")
        elif ext in IMAGE_EXTENSIONS:
            images.append(entry.name)
        elif ext in VIDEO_EXTENSIONS:
            videos.append(entry.name)
        else:
            others.append(entry.name)
    return Listing(natural(images), natural(videos), natural(others), not entries)


def warn_skipped(shown: str, skipped: list[str], what: str) -> None:
    """One :class:`MediaWarning` listing the first few entries of ``skipped`` (none: no warning)."""
    if not skipped:
        return
    skipped = natural(skipped)
    listed = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    warnings.warn(f"{shown}: skipped {len(skipped)} {what} entr{'ies' if len(skipped) > 1 else 'y'}: {listed}",
                  MediaWarning, stacklevel=3)


def media_in_directory(directory: str) -> list[str]:
    """``--each`` over a directory: its video and image files (natural order), each one input;
    other entries are skipped with a warning. Raises :class:`MediaError` when there are none."""
    listing = scan_directory(directory)
    warn_skipped(directory, listing.others, "non-media")
    names = natural(listing.images + listing.videos)
    if not names:
        raise MediaError(f"no media files in directory (supported: {supported_list()})", directory)
    return [os.path.join(directory, name) for name in names]


def _image_set(path: Path, shown: str) -> list[Path]:
    """A directory as one image set: its image files, natural order."""
    listing = scan_directory(path)
    if not listing.images:
        hint = ""
        if listing.videos:
            n = len(listing.videos)
            hint = f"; it holds {n} video file{'s' if n > 1 else ''}: pass a video file directly"
        elif listing.empty:
            hint = "; the directory is empty"
        raise MediaError(f"no image files in directory (supported: {supported_list(IMAGE_EXTENSIONS)}{hint})",
                         source=shown)
    warn_skipped(shown, listing.videos + listing.others, "non-image")
    return [path / name for name in listing.images]


class ExpandedInputs(NamedTuple):
    kind: str  # "video" or "images"
    sources: tuple[Path, ...]
    origin: str  # label: the video / directory as typed, or "a.jpg + 2 more"


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
        shown = os.fspath(raw)
        if shown == "":
            raise UsageError("empty media path")
        path = Path(raw)
        st = lstat_checked(path, shown)
        if stat.S_ISDIR(st.st_mode):
            images.extend(_image_set(path, shown))
            continue
        ext = path.suffix.lower()
        if ext in VIDEO_EXTENSIONS:
            videos.append(shown)
        elif ext in IMAGE_EXTENSIONS:
            images.append(path)
        elif ext:
            raise MediaError(f"unsupported file type '{ext}' (supported: {supported_list()})", source=shown)
        else:
            raise MediaError(f"unsupported file type (no extension; supported: {supported_list()})", source=shown)
    if videos and (len(videos) > 1 or images or len(paths) > 1):
        other = videos[1] if len(videos) > 1 else os.fspath(next(p for p in paths if os.fspath(p) != videos[0]))
        raise UsageError(f"one video per prompt: got '{videos[0]}' together with '{other}' "
                         "(a video cannot be combined with other media)")
    if videos:
        return ExpandedInputs("video", (Path(videos[0]),), videos[0])
    if len(paths) == 1 and os.path.isdir(paths[0]):
        origin = os.fspath(paths[0])
    else:
        origin = set_label(images)
    return ExpandedInputs("images", tuple(images), origin)
