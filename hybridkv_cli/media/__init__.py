"""Media loading: one video, or one image set, made ready for Qwen2.5-VL.

``load_media(paths)`` turns what the user typed into a :class:`MediaInput`:

* one video file -> ``kind == "video"``: ``frames`` indices spread uniformly over the whole
  video (or ``duration * fps`` of them), decoded with decord, or with PyAV when decord cannot
  open or decode the file (or is not installed); frames upright (the display matrix's rotation
  applied, ``MediaInput.rotation``); the count is made even (Qwen2.5-VL's temporal patch is 2 frames) and every
  frame is resized with Qwen's ``smart_resize`` (multiples of 28) using qwen-vl-utils' per-frame
  pixel limits;
* one animated GIF / WebP / APNG -> ``kind == "video"``, its frames sampled like a video's
  (:mod:`.animation`);
* one or more image files, or one directory of images -> ``kind == "images"``: EXIF orientation
  applied, converted to RGB (alpha composited on white, 16-bit scaled down, CMYK/palette/grey
  converted), first frame of an animation inside a set (with a warning), resized with
  ``smart_resize`` (a set of more than 256 images gets a warning from the session, which also
  warns about any prompt of more than 16k visual tokens, counted in the built prompt).

One job per module: :mod:`.paths` (path checks, the directory scan, labels), :mod:`.sniff`
(file checks, content sniffing), :mod:`.geometry` (Qwen's sizes), :mod:`.images` (image
decoding), :mod:`.probe`, :mod:`.decoders` and :mod:`.video` (video decoding), :mod:`.frame_stream`
(a long video read chunk by chunk: :func:`open_video_stream`).

Every failure is a :class:`~hybridkv_cli.io.errors.MediaError` (exit 1) or, for bad arguments, a
:class:`~hybridkv_cli.io.errors.UsageError` (exit 2), one line naming the path as the user typed it.
No exception from decord, PyAV or Pillow escapes. Non-fatal notices (skipped files in a
directory, capped frame counts) are emitted with ``warnings.warn(..., MediaWarning)``.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.media.animation import is_animation, load_animation
from hybridkv_cli.media.frame_stream import VideoStream, open_video_stream
from hybridkv_cli.media.geometry import check_pixel_arg, pixel_bounds, target_size
from hybridkv_cli.media.images import load_image
from hybridkv_cli.media.input import MediaInput
from hybridkv_cli.media.paths import (IMAGE_EXTENSIONS, MEDIA_EXTENSIONS, VIDEO_EXTENSIONS, ExpandedInputs,
                                      expand_inputs, media_in_directory, set_label)
from hybridkv_cli.media.video import load_video
from hybridkv_cli.io.errors import MediaWarning

__all__ = [
    "IMAGE_EXTENSIONS",
    "MEDIA_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "ExpandedInputs",
    "MediaInput",
    "MediaWarning",
    "VideoStream",
    "expand_inputs",
    "load_media",
    "load_media_stream",
    "media_in_directory",
    "open_video_stream",
    "pixel_bounds",
    "set_label",
    "target_size",
]


def load_media(paths: Sequence[str | os.PathLike] | str | os.PathLike, *, frames: int = 64,
               fps: float | None = None, max_pixels: int | None = None, min_pixels: int | None = None
               ) -> MediaInput:
    """Load one video or one image set (see the module docstring).

    Parameters
    ----------
    paths
        A video, image files, or one directory of images.
    frames, fps
        Video sampling: ``frames`` uniformly, or ``fps`` frames per second of video.
    max_pixels, min_pixels
        Pixels per frame / image (None: Qwen's defaults).
    """
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
    max_pixels = check_pixel_arg("max_pixels", max_pixels)
    min_pixels = check_pixel_arg("min_pixels", min_pixels)
    # validate the pixel arguments once, up front, for either kind
    pixel_bounds("images", min_pixels=min_pixels, max_pixels=max_pixels)

    expanded = expand_inputs(paths)
    if expanded.kind == "video":
        return load_video(expanded.sources[0], int(frames), fps, min_pixels, max_pixels)
    if len(expanded.sources) == 1 and is_animation(expanded.sources[0]):
        return load_animation(expanded.sources[0], int(frames), fps, min_pixels, max_pixels, expanded.origin)
    several = len(expanded.sources) > 1
    images = tuple(load_image(p, min_pixels, max_pixels, in_set=several) for p in expanded.sources)
    return MediaInput(kind="images", sources=expanded.sources, video=None, images=images, frames_total=None,
                      frames_used=len(images), sample_fps=None, origin=expanded.origin, decoder="pillow")


def load_media_stream(paths: Sequence[str | os.PathLike] | str | os.PathLike, *, frames: int | None = 64,
                      fps: float | None = None, max_frames=None, max_pixels: int | None = None,
                      min_pixels: int | None = None) -> MediaInput:
    """One video opened for reading while its prompt is read (``MediaInput.stream``; no frame
    decoded yet): ``frames`` spread over it, or ``fps`` a second, at most ``max_frames`` (None /
    ``"all"``: no cap). Each frame keeps a 64-frame clip's resolution (:mod:`.frame_stream`)."""
    expanded = expand_inputs(paths)
    if expanded.kind != "video" or is_animation(expanded.sources[0]):
        raise UsageError("reads one video file (not images or an animation)", "--max-frames")
    stream = open_video_stream(expanded.sources[0], frames=frames, fps=fps, max_frames=max_frames,
                               min_pixels=min_pixels, max_pixels=max_pixels)
    return MediaInput(kind="video", sources=expanded.sources, video=None, images=(), frames_total=stream.frames_total,
                      frames_used=stream.count,
                      sample_fps=stream.count / stream.duration if stream.duration > 0 else None,
                      origin=str(expanded.sources[0]), decoder=stream.decoder, frame_indices=stream.indices,
                      rotation=stream.rotation, stream=stream)
