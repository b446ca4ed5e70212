"""The video decoders behind one interface, and the one decoding loop both video paths share.

A decoder is an *opener*: ``open(path, probe, total, shown) -> FrameSource``; a source's
``read(indices)`` returns those frames (ascending source indices, repeats allowed) upright as uint8
``(k, 3, h, w)``. decord is tried first (fast random access); a decoder that cannot handle a file
raises :class:`DecodeFailed` (at open or at any read) and the next one (PyAV, sequential) takes
over from the frames being read. :func:`decode_chunks` is the loop: it asks the source for at most
:data:`DECODE_CHUNK` frames at a time, resizes them and yields them ``k`` at a time, so the eager
:func:`~hybridkv_cli.media.video.load_video` (one chunk of every frame) and the lazy
:mod:`~hybridkv_cli.media.frame_stream` (chunk by chunk) decode alike.

:func:`frame_table` counts a video's frames before any is decoded: it demuxes the stream's packets
(no decoding; ~10 ms for 4096 frames) for the real count and each frame's presentation time,
which headers get wrong (a truncated download, a container with a wrong duration).
"""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence

import numpy as np
import torch

from hybridkv_cli.io.errors import HybridKVError, MediaError, MediaWarning
from hybridkv_cli.media.probe import Probe
from hybridkv_cli.media.sniff import one_line

#: Video frames are decoded and resized this many at a time (bounds peak memory on 4K input).
DECODE_CHUNK = 16


class DecodeFailed(Exception):
    """This decoder cannot handle the file: try the next one."""


class FrameSource(Protocol):
    def read(self, indices: Sequence[int]) -> torch.Tensor:
        """uint8 ``(len(indices), 3, h, w)``, upright; ``indices`` ascending, after those read before."""

    def close(self) -> None: ...


Opener = Callable[[Path, Probe, int, str], FrameSource]


class FrameTable(NamedTuple):
    """What the stream's packets say, before decoding."""

    count: int  # packets that hold a frame: the frames really in the file
    times: np.ndarray | None  # seconds of each frame from the first, in presentation order (None: no timestamps)
    duration: float | None  # from the first frame's start to the last one's end


def shortfall_tolerated(expected: int, got: int) -> bool:
    """Headers and decoders often disagree by a frame or two; a bigger shortfall is a damaged file."""
    return expected - got <= max(2, math.ceil(0.01 * expected))


def frame_table(path: Path, probe: Probe, shown: str) -> FrameTable:
    """Demux (without decoding) the video stream of ``path``: its real frame count and timestamps.

    A header promising more frames than the packets hold (beyond :func:`shortfall_tolerated`) is a
    truncated or damaged file: a MediaError. A header that is merely wrong about the duration (or
    has no count) yields to the packets, with a MediaWarning when they disagree by much.
    """
    import av

    pts: list[int] = []
    ends: list[int] = []
    time_base = None
    try:
        with av.open(str(path), metadata_errors="ignore") as c:
            stream = c.streams.video[0]
            time_base = stream.time_base
            try:
                for p in c.demux(stream):
                    if p.size:
                        pts.append(p.pts if p.pts is not None else -1)
                        ends.append(int(p.duration or 0))
            except Exception:
                pass  # a damaged tail: the packets read so far are the file's frames
    except Exception as e:
        raise MediaError(f"cannot read video packets: {one_line(e)}", source=shown) from None
    count = len(pts)
    if count == 0:
        raise MediaError("no decodable video frames (the video stream is empty)", source=shown)
    if probe.frames and probe.frames > count and not shortfall_tolerated(probe.frames, count):
        raise MediaError(f"truncated or corrupt video: only {count} of {probe.frames} frames are in the file",
                         source=shown)
    times = duration = None
    if time_base and min(pts) >= 0:
        order = np.argsort(np.asarray(pts, dtype=np.int64), kind="stable")
        start = np.asarray(pts, dtype=np.float64)[order]
        last = float(ends[order[-1]]) or (1.0 / probe.fps / float(time_base) if probe.fps else 0.0)
        times = (start - start[0]) * float(time_base)
        duration = float(times[-1] + last * float(time_base))
        if not (math.isfinite(duration) and duration > 0):
            times = duration = None
    said = probe.duration
    if duration and said and abs(said - duration) > max(0.1 * duration, 2.0 / (probe.fps or 1.0)):
        warnings.warn(f"{shown}: the container says {said:.1f} s but its video stream holds {count} frames over "
                      f"{duration:.1f} s; the stream's numbers are used", MediaWarning, stacklevel=3)
    return FrameTable(count, times, duration)


def to_display(chunk: torch.Tensor, rotation: int) -> torch.Tensor:
    """Frames ``(..., H, W)`` turned by ``rotation`` degrees counter-clockwise (a multiple of 90)."""
    k = (rotation // 90) % 4
    return torch.rot90(chunk, k, dims=(-2, -1)) if k else chunk


def upright_size(probe: Probe) -> tuple[int, int]:
    """(height, width) of the frames as displayed (a quarter turn swaps them)."""
    return (probe.width, probe.height) if probe.rotation in (90, 270) else (probe.height, probe.width)


#: Frames are resized at most this many bytes of float pixels at a time. The resize works on float
#: copies of its frames: those of a whole chunk (16 frames of 640x480: 59 MB) are mapped fresh from
#: the system and faulted in at every call, where one frame's reuses freed memory, so a frame at a
#: time is about twice as fast from 480p up (1080p: 464 -> 270 ms a chunk) and the same below.
RESIZE_BYTES = 4 << 20


def resize_chunk(chunk: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Frames ``(n, ..., H, W)`` resized to ``size`` (bicubic, antialiased), or as they are; a
    few frames at a time (:data:`RESIZE_BYTES`), each frame's pixels as if resized alone."""
    if tuple(chunk.shape[-2:]) == size:
        return chunk.contiguous()
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    def resized(frames: torch.Tensor) -> torch.Tensor:
        return TF.resize(frames, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)

    step = max(1, RESIZE_BYTES // (4 * chunk[:1].numel()))
    if len(chunk) <= step:
        return resized(chunk)
    out = torch.empty((len(chunk), *chunk.shape[1:-2], *size), dtype=chunk.dtype)
    for start in range(0, len(chunk), step):
        out[start:start + step] = resized(chunk[start:start + step])
    return out


class DecordSource:
    """decord's random access; every failure is a :class:`DecodeFailed` (PyAV takes over)."""

    def __init__(self, path: Path, probe: Probe, total: int, shown: str):
        try:
            import decord
        except Exception as e:
            raise DecodeFailed(f"decord unavailable ({one_line(e)})") from None
        # decord logs through its own FFmpeg, outside Python's logging (every seek, a truncated file's
        # complaints): silenced where Python's logging drops library lines (console.quiet_libraries, a
        # command without --debug), left alone otherwise.
        if not logging.getLogger("decord").isEnabledFor(logging.ERROR):
            try:
                decord.logging.set_level(decord.logging.QUIET)
            except Exception:
                pass
        self.probe = probe
        try:
            if probe.rotation:
                # decord applies the display matrix itself but only gets the buffer size right when asked
                # for the stored size: the upright picture then comes squeezed into it, and the resize to
                # the upright target undoes the squeeze (checked against PyAV in the tests).
                self.vr = decord.VideoReader(str(path), ctx=decord.cpu(0), width=probe.width, height=probe.height)
            else:
                self.vr = decord.VideoReader(str(path), ctx=decord.cpu(0))
            n = len(self.vr)
        except Exception as e:
            raise DecodeFailed(f"decord: {one_line(e)}") from None
        if n < total:
            raise DecodeFailed(f"decord sees {n} frames of {total}")

    def read(self, indices: Sequence[int]) -> torch.Tensor:
        probe = self.probe
        try:
            arr = self.vr.get_batch(list(indices)).asnumpy()
        except Exception as e:
            raise DecodeFailed(f"decord: {one_line(e)}") from None
        if arr.ndim != 4 or arr.shape != (len(indices), probe.height, probe.width, 3) or arr.dtype != np.uint8:
            raise DecodeFailed(f"decord returned frames of shape {tuple(arr.shape)}, expected "
                               f"({len(indices)}, {probe.height}, {probe.width}, 3)")
        return torch.from_numpy(np.ascontiguousarray(arr)).permute(0, 3, 1, 2)

    def close(self) -> None:
        self.vr = None


class PyAVSource:
    """PyAV, decoding sequentially up to each wanted frame (rotation applied). A stream that ends
    before a wanted frame is a MediaError, but for the last frame or two (:func:`shortfall_tolerated`),
    which the last decoded frame stands in for, with a MediaWarning."""

    def __init__(self, path: Path, probe: Probe, total: int, shown: str):
        self.path, self.probe, self.total, self.shown = path, probe, total, shown
        self.container = self.frames = None
        self.decoded = 0  # frames decoded so far; the next one has this index
        self.last: tuple[int, torch.Tensor] | None = None  # (index, frame) of the last frame kept
        self.error: str | None = None
        self.ended = False

    def _next(self):
        """The next decoded frame, or None at the end of the stream (or at a decoding error)."""
        if self.ended:
            return None
        try:
            if self.container is None:
                import av

                self.container = av.open(str(self.path), metadata_errors="ignore")
                stream = self.container.streams.video[0]
                stream.thread_type = "AUTO"
                self.frames = self.container.decode(stream)
            return next(self.frames)
        except StopIteration:
            pass
        except HybridKVError:
            raise
        except Exception as e:
            self.error = one_line(e)
        self.ended = True
        return None

    def _frame(self, i: int) -> torch.Tensor | None:
        probe = self.probe
        if self.last is not None and self.last[0] == i:
            return self.last[1]
        while self.decoded <= i:
            frame = self._next()
            if frame is None:
                return None
            self.decoded += 1
            if self.decoded - 1 == i:
                t = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
                if tuple(t.shape[-2:]) != (probe.height, probe.width):  # mid-stream size change
                    t = resize_chunk(t.unsqueeze(0), (probe.height, probe.width))[0]
                self.last = (i, t)
                return t
        raise ValueError(f"frame {i} asked for after frame {self.decoded - 1}: indices must ascend")

    def read(self, indices: Sequence[int]) -> torch.Tensor:
        out = []
        for i in indices:
            t = self._frame(i)
            if t is None:
                t = self._missing(i)
            out.append(t)
        return to_display(torch.stack(out), self.probe.rotation)

    def _missing(self, i: int) -> torch.Tensor:
        shown, error = self.shown, self.error
        if self.decoded == 0:
            reason = "no decodable video frames"
            raise MediaError(reason + (f": {error[:1].lower() + error[1:]}" if error else ""), source=shown)
        if self.last is None or not shortfall_tolerated(self.total, self.decoded):
            detail = f": {error}" if error else ""
            raise MediaError(f"truncated or corrupt video: only {self.decoded} of {self.total} frames could be "
                             f"decoded{detail}", source=shown)
        warnings.warn(f"{shown}: the video stream ends after {self.decoded} of {self.total} frames; frame {i} "
                      f"repeats frame {self.last[0]}", MediaWarning, stacklevel=2)
        return self.last[1]

    def close(self) -> None:
        if self.container is not None:
            try:
                self.container.close()
            except Exception:
                pass
        self.container = self.frames = None


#: (name, open), in the order they are tried.
DECODERS: tuple[tuple[str, Opener], ...] = (
    ("decord", DecordSource),
    ("pyav", PyAVSource),
)


class Decoding:
    """The source in use for one pass over a video and the decoders left to fall back on."""

    def __init__(self, path: Path, probe: Probe, total: int, shown: str, decoders: Sequence[tuple[str, Opener]]):
        self.path, self.probe, self.total, self.shown = path, probe, total, shown
        self.decoders = tuple(decoders)
        self.failures: list[str] = []
        self.position = -1
        self.name = ""
        self.source: FrameSource | None = None
        self.fall_back(None)

    def fall_back(self, failure: DecodeFailed | None) -> None:
        """Close the source (``failure``: why) and open the next decoder that can read the file."""
        if failure is not None:
            self.failures.append(str(failure))
        self.close()
        for self.position in range(self.position + 1, len(self.decoders)):
            self.name, opener = self.decoders[self.position]
            try:
                self.source = opener(self.path, self.probe, self.total, self.shown)
                return
            except DecodeFailed as e:
                self.failures.append(str(e))
            except MediaError as e:
                raise self.annotated(e) from None
        raise MediaError(f"no decoder can read the video ({'; '.join(self.failures) or 'none installed'})",
                         source=self.shown)

    def annotated(self, e: MediaError) -> MediaError:
        if self.failures and "decord unavailable" not in self.failures[0]:
            e.reason = f"{e.reason} (decord failed too)"
        return e

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None


def decode_chunks(decoding: Decoding, indices: Sequence[int], size: tuple[int, int], k: int
                  ) -> Iterator[torch.Tensor]:
    """The frames ``indices`` (ascending) resized to ``size``, ``k`` at a time: uint8 ``(<=k, 3, H, W)``.

    At most :data:`DECODE_CHUNK` frames are held at the source's size; a decoder failing at a chunk
    hands that chunk (and the rest) to the next one. The source is closed when the iterator ends
    or is closed.
    """
    try:
        for start in range(0, len(indices), k):
            want = indices[start:start + k]
            chunk = torch.empty((len(want), 3, *size), dtype=torch.uint8)
            while True:
                try:
                    for j in range(0, len(want), DECODE_CHUNK):
                        chunk[j:j + DECODE_CHUNK] = resize_chunk(decoding.source.read(want[j:j + DECODE_CHUNK]), size)
                    break
                except DecodeFailed as e:
                    decoding.fall_back(e)
                except MediaError as e:
                    raise decoding.annotated(e) from None
            yield chunk
            del chunk
    finally:
        decoding.close()
