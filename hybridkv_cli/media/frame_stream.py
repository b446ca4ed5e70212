"""A video read chunk by chunk, in memory bounded by the chunk: an hour of video for a streaming prefill.

:func:`open_video_stream` probes the file and counts its frames (demuxing, no decoding: see
:func:`~hybridkv_cli.media.decoders.frame_table`), so a :class:`VideoStream` knows before decoding
any frame how many frames it yields (``count``), which (``indices``, ``timestamps``) and at what
size; :meth:`VideoStream.chunks` then decodes ``k`` frames at a time (decord, PyAV fallback).

Sampling: ``frames`` spread uniformly over the video, or ``fps`` frames per second of it, all of
them (no cap at Qwen's ``FPS_MAX_FRAMES``: that cap is the eager loader's) unless ``max_frames``
caps them (still spread over the whole video); the count is made even (Qwen's 2-frame temporal
patch), at least 2 (a 1-frame video yields its frame twice).

Size: Qwen's ``smart_resize`` for video frames with the per-frame pixel bound of a clip of
``min(count, STREAM_REFERENCE_FRAMES)`` frames. Qwen's own bound shrinks as a clip grows (its
total-pixel budget is spread over every frame); a stream is prefilled a chunk at a time, so every
frame of a long video keeps the resolution of a 64-frame clip's instead of shrinking toward
Qwen's minimum. ``max_pixels`` / ``min_pixels`` override it as for the eager loader.

The ``check_*`` functions are the argument checks (:class:`~hybridkv_cli.io.errors.UsageError`
naming the flag, exit 2) for a caller to run before it loads a model; :func:`frame_memory` prices
the frames in host memory (a pure function: the caller refuses what does not fit).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from hybridkv_cli.io.errors import HybridKVError, MediaError, UsageError
from hybridkv_cli.media.decoders import DECODE_CHUNK, Decoding, Opener, decode_chunks, frame_table, upright_size
from hybridkv_cli.media.geometry import FRAME_FACTOR, check_pixel_arg, pixel_bounds, target_size
from hybridkv_cli.media.probe import Probe, probe_video
from hybridkv_cli.media.sniff import check_file, one_line

#: A stream's frames get the per-frame pixel bound of a clip of this many frames (see the module doc).
STREAM_REFERENCE_FRAMES = 64

#: ``(total frames, duration s, upright (H, W)) -> (source indices, (H, W) to resize to)``
Plan = Callable[[int, float, tuple[int, int]], tuple[list[int], tuple[int, int]]]


# --- argument checks (UsageError naming the flag) ---------------------------------------------------
def _whole(value, flag: str, least: int, what: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UsageError(f"must be a whole number, got {value!r}", flag)
    if value < least:
        raise UsageError(f"must be {what}, got {value}", flag)
    return int(value)


def check_frames(value, flag: str = "--frames") -> int:
    """``frames`` to spread over a video: a whole number >= 1."""
    return _whole(value, flag, 1, "positive")


def check_fps(value, flag: str = "--fps") -> float:
    """A sampling rate: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise UsageError(f"must be a number, got {value!r}", flag)
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"must be a positive number of frames per second, got {value!r}", flag)
    return float(value)


def check_max_frames(value, flag: str = "--max-frames") -> int | None:
    """A cap on a stream's frames: a whole number >= 2, or None / ``"all"`` (no cap)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return _whole(value, flag, FRAME_FACTOR, f"at least {FRAME_FACTOR} (or 'all')")


def check_chunk_frames(value, flag: str = "--chunk-frames") -> int:
    """Frames per chunk: a whole, even number >= 2 (every chunk then holds whole temporal patches)."""
    k = _whole(value, flag, FRAME_FACTOR, f"at least {FRAME_FACTOR}")
    if k % FRAME_FACTOR:
        raise UsageError(f"must be a multiple of {FRAME_FACTOR} (Qwen's temporal patch), got {k}", flag)
    return k


class StreamArgs(NamedTuple):
    frames: int | None
    fps: float | None
    max_frames: int | None
    min_pixels: int | None
    max_pixels: int | None


def check_stream_args(frames=None, fps=None, max_frames=None, min_pixels=None, max_pixels=None) -> StreamArgs:
    """Every argument of :func:`open_video_stream`, checked and normalised; ``fps`` given wins over
    ``frames`` (as for the eager loader); neither given is a UsageError."""
    if frames is None and fps is None:
        raise UsageError("give --frames N (spread over the video) or --fps RATE", "--frames/--fps")
    fps = None if fps is None else check_fps(fps)
    frames = None if frames is None or fps is not None else check_frames(frames)
    max_frames = check_max_frames(max_frames)
    pixels = {}
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        try:
            pixels[name] = check_pixel_arg(name, value)
        except UsageError as e:
            raise UsageError(e.reason, "--" + name.replace("_", "-")) from None
    try:
        pixel_bounds("video", STREAM_REFERENCE_FRAMES, **pixels)
    except UsageError as e:
        raise UsageError(e.reason, "--max-pixels" if "min_pixels" not in e.reason else "--min-pixels") from None
    return StreamArgs(frames, fps, max_frames, pixels["min_pixels"], pixels["max_pixels"])


# --- host memory ------------------------------------------------------------------------------------
class FrameMemory(NamedTuple):
    """Bytes of uint8 RGB frames in host memory."""

    frame: int  # one frame at the model's size
    chunk: int  # peak while reading one chunk: its frames + the decoder's batch at the source's size
    video: int  # every frame at the model's size (what the whole video would hold at once)


def frame_memory(size: tuple[int, int], count: int, chunk: int,
                 source_size: tuple[int, int] | None = None) -> FrameMemory:
    """Host bytes of ``count`` frames of ``size`` (H, W) read ``chunk`` at a time. With the source's
    size the chunk's peak adds the decoder's batch of up to :data:`DECODE_CHUNK` source frames,
    twice (the decoder's array and its tensor). The caller adds its own (the KV cache, the model)."""
    frame = 3 * int(size[0]) * int(size[1])
    k = min(int(chunk), int(count))
    decode = 2 * min(k, DECODE_CHUNK) * 3 * int(source_size[0]) * int(source_size[1]) if source_size else 0
    return FrameMemory(frame, k * frame + decode, int(count) * frame)


# --- sampling ---------------------------------------------------------------------------------------
def spread(total: int, n: int) -> list[int]:
    """``n`` source indices (at most ``total``) spread uniformly from the first frame to the last,
    made even and at least 2 for Qwen's 2-frame temporal patch (a 1-frame video: its frame twice)."""
    if total < FRAME_FACTOR:
        return [0] * FRAME_FACTOR
    n = min(n, total)
    n = max(FRAME_FACTOR, n - n % FRAME_FACTOR)
    return torch.linspace(0, total - 1, n).round().long().tolist()


def stream_plan(frames: int | None, fps: float | None, max_frames: int | None, min_pixels: int | None,
                max_pixels: int | None, shown: str) -> Plan:
    """The sampling and size rule of a stream (see the module doc)."""

    def plan(total: int, duration: float, source_size: tuple[int, int]):
        n = frames if fps is None else max(1, int(round(duration * fps)))
        indices = spread(total, n if max_frames is None else min(n, max_frames))
        lo, hi = pixel_bounds("video", min(len(indices), STREAM_REFERENCE_FRAMES), min_pixels=min_pixels,
                              max_pixels=max_pixels)
        return indices, target_size(*source_size, lo, hi, source=shown)

    return plan


# --- the stream -------------------------------------------------------------------------------------
class VideoStream:
    """One video's sampled frames, known up front, decoded on demand (:meth:`chunks`).

    ``count`` frames (``indices`` into the source's ``frames_total``, at ``timestamps`` seconds from
    its first frame), each resized to ``size`` (H, W) and upright (``rotation`` applied).
    ``decoder`` is the decoder reading it ("decord" / "pyav"; it becomes "pyav" should decord fail
    at a chunk).
    """

    def __init__(self, path: Path, shown: str, probe: Probe, total: int, duration: float,
                 times: np.ndarray | None, indices: list[int], size: tuple[int, int], decoding: Decoding):
        self.path, self.shown = path, shown
        self.frames_total = total
        self.indices = tuple(int(i) for i in indices)
        self.count = len(self.indices)
        self.size = (int(size[0]), int(size[1]))
        self.source_size = upright_size(probe)
        self.duration = float(duration)
        self.source_fps = probe.fps or (total / duration if duration > 0 else None)
        if times is not None:
            self.timestamps = tuple(float(times[i]) for i in self.indices)
        else:
            rate = self.source_fps or 1.0
            self.timestamps = tuple(i / rate for i in self.indices)
        self.rotation = probe.rotation
        self.decoder = decoding.name
        self._probe, self._decoders = probe, decoding.decoders
        self._ready: Decoding | None = decoding  # opened to learn the decoder; the first read takes it

    def __repr__(self) -> str:
        return (f"VideoStream({self.shown!r}, count={self.count}, size={self.size}, frames_total={self.frames_total}, "
                f"duration={self.duration:.2f}, decoder={self.decoder!r})")

    def memory(self, chunk: int) -> FrameMemory:
        """Host bytes of this stream's frames read ``chunk`` at a time (:func:`frame_memory`)."""
        return frame_memory(self.size, self.count, chunk, self.source_size)

    def chunks(self, k: int) -> Iterator[torch.Tensor]:
        """The frames, ``k`` (even) at a time: uint8 ``(k, 3, H, W)``, the last chunk possibly shorter
        (still even). Only the current chunk's frames are decoded and held; each call reads anew.
        A stream ending before its ``count`` frames is a MediaError (one line, naming the file)."""
        return self._chunks(check_chunk_frames(k))

    def read_all(self) -> torch.Tensor:
        """Every frame as one uint8 ``(count, 3, H, W)`` tensor (the eager loader's way)."""
        return next(self._chunks(self.count))

    def _chunks(self, k: int) -> Iterator[torch.Tensor]:
        decoding, self._ready = self._ready, None
        if decoding is None:
            decoding = _guarded(self.shown, lambda: Decoding(self.path, self._probe, self.frames_total, self.shown,
                                                             self._decoders))
        inner = decode_chunks(decoding, self.indices, self.size, k)
        try:
            while True:
                chunk = _guarded(self.shown, lambda: next(inner, None))
                if chunk is None:
                    return
                self.decoder = decoding.name
                yield chunk
                del chunk
        finally:
            inner.close()


def _guarded(shown: str, step):
    """``step()``; every failure a one-line MediaError naming the file."""
    try:
        return step()
    except HybridKVError:
        raise
    except MemoryError:
        raise MediaError("out of memory while decoding the video", source=shown) from None
    except Exception as e:  # a last guard: nothing from decord / PyAV / torchvision escapes raw
        raise MediaError(f"cannot load video ({one_line(e)})", source=shown) from None


def open_planned(path: Path, plan: Plan, decoders: Sequence[tuple[str, Opener]]) -> VideoStream:
    """Probe ``path``, count its frames, apply ``plan`` and open the first decoder that can read it."""
    shown = str(path)

    def open_it() -> VideoStream:
        probe = probe_video(path, shown, check_file(path, shown))
        table = frame_table(path, probe, shown)
        total = table.count
        duration = table.duration or probe.duration or (total / probe.fps if probe.fps else total / 2.0)
        indices, size = plan(total, duration, upright_size(probe))
        decoding = Decoding(path, probe, total, shown, decoders)
        return VideoStream(path, shown, probe, total, duration, table.times, indices, size, decoding)

    return _guarded(shown, open_it)


def open_video_stream(path, *, frames: int | None = None, fps: float | None = None, max_frames=None,
                      min_pixels: int | None = None, max_pixels: int | None = None) -> VideoStream:
    """Open one video file for reading chunk by chunk (see the module doc). Bad arguments are a
    UsageError naming the flag (:func:`check_stream_args`); a file that cannot be read is a MediaError
    naming it. Nothing is decoded yet but the probe's first frame."""
    from hybridkv_cli.media import decoders

    args = check_stream_args(frames, fps, max_frames, min_pixels, max_pixels)
    path = Path(path)
    return open_planned(path, stream_plan(*args, str(path)), decoders.DECODERS)
