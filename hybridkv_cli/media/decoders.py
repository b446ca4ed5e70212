"""The video decoders behind one interface: ``decode(path, probe, plan, shown) -> Decoded``.

``plan(total, duration, (height, width))`` is the caller's sampling rule: it returns the source
frame indices to keep and the size to resize them to. decord is tried first; a decoder that
cannot handle a file raises :class:`DecodeFailed` and the next one (PyAV) takes over. Both
return the frames upright: the rotation of the stream's display matrix is applied.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from hybridkv_cli.io.errors import HybridKVError, MediaError
from hybridkv_cli.media.probe import Probe
from hybridkv_cli.media.sniff import one_line

#: Video frames are decoded and resized this many at a time (bounds peak memory on 4K input).
DECODE_CHUNK = 16

Plan = Callable[[int, float, tuple[int, int]], tuple[list[int], tuple[int, int]]]


class Decoded(NamedTuple):
    video: torch.Tensor  # uint8 (T, 3, H, W), resized
    total: int  # frames in the source
    indices: list[int]  # source index of each frame
    duration: float  # seconds


class DecodeFailed(Exception):
    """This decoder cannot handle the file: try the next one."""


def to_display(chunk: torch.Tensor, rotation: int) -> torch.Tensor:
    """Frames ``(..., H, W)`` turned by ``rotation`` degrees counter-clockwise (a multiple of 90)."""
    k = (rotation // 90) % 4
    return torch.rot90(chunk, k, dims=(-2, -1)) if k else chunk


def upright_size(probe: Probe) -> tuple[int, int]:
    """(height, width) of the frames as displayed (a quarter turn swaps them)."""
    return (probe.width, probe.height) if probe.rotation in (90, 270) else (probe.height, probe.width)


def resize_chunk(chunk: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Frames ``(..., H, W)`` resized to ``size`` (bicubic, antialiased), or as they are."""
    if tuple(chunk.shape[-2:]) == size:
        return chunk.contiguous()
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    return TF.resize(chunk, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)


def decode_decord(path: Path, probe: Probe, plan: Plan, shown: str) -> Decoded:
    """Decode with decord (fast random access); :class:`DecodeFailed` hands over to PyAV."""
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
    try:
        if probe.rotation:
            # decord applies the display matrix itself but only gets the buffer size right when asked
            # for the stored size: the upright picture then comes squeezed into it, and the resize to
            # the upright target below undoes the squeeze (checked against PyAV in the tests).
            vr = decord.VideoReader(str(path), ctx=decord.cpu(0), width=probe.width, height=probe.height)
        else:
            vr = decord.VideoReader(str(path), ctx=decord.cpu(0))
        total = len(vr)
        if total <= 0:
            raise DecodeFailed("decord found no frames")
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
        indices, size = plan(total, duration, upright_size(probe))
        out = []
        for start in range(0, len(indices), DECODE_CHUNK):
            idx = indices[start:start + DECODE_CHUNK]
            arr = vr.get_batch(idx).asnumpy()
            if arr.ndim != 4 or arr.shape != (len(idx), probe.height, probe.width, 3) or arr.dtype != np.uint8:
                raise DecodeFailed(f"decord returned frames of shape {tuple(arr.shape)}, expected "
                                    f"({len(idx)}, {probe.height}, {probe.width}, 3)")
            chunk = torch.from_numpy(np.ascontiguousarray(arr)).permute(0, 3, 1, 2)
            out.append(resize_chunk(chunk, size))
            del arr, chunk
        return Decoded(torch.cat(out), total, indices, duration)
    except (DecodeFailed, HybridKVError):
        raise
    except Exception as e:
        raise DecodeFailed(f"decord: {one_line(e)}") from None


def _count_packets(path: Path) -> int:
    import av

    with av.open(str(path), metadata_errors="ignore") as c:
        s = c.streams.video[0]
        return sum(1 for p in c.demux(s) if p.size)


def decode_pyav(path: Path, probe: Probe, plan: Plan, shown: str) -> Decoded:
    """Decode with PyAV, sequentially to the last wanted frame (rotation applied)."""
    import av

    total = probe.frames
    if total <= 0:
        try:
            total = _count_packets(path)
        except Exception as e:
            raise MediaError(f"cannot read video packets: {one_line(e)}", source=shown) from None
    if total <= 0:
        raise MediaError("no decodable video frames (the video stream is empty)", source=shown)
    duration = probe.duration or (total / probe.fps if probe.fps else total / 2.0)
    first_time = last_time = None
    indices, size = plan(total, duration, upright_size(probe))

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
        chunk = resize_chunk(to_display(chunk, probe.rotation), size)
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
                        t = resize_chunk(t.unsqueeze(0), (probe.height, probe.width))[0]
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
        error = one_line(e)
    flush()

    if decoded == 0:
        reason = "no decodable video frames"
        raise MediaError(reason + (f": {error[:1].lower() + error[1:]}" if error else ""), source=shown)
    missing = [pos for pos, t in enumerate(results) if t is None]
    if missing:
        # Headers often over-count by a frame or two; a bigger shortfall is a damaged file.
        if total - decoded <= max(2, math.ceil(0.01 * total)) and last_frame is not None:
            filler = resize_chunk(to_display(last_frame.unsqueeze(0), probe.rotation), size)[0]
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
    return Decoded(torch.stack(results), total, indices, duration)


#: (name, decode), in the order they are tried.
DECODERS: tuple[tuple[str, Callable[[Path, Probe, Plan, str], Decoded]], ...] = (
    ("decord", decode_decord),
    ("pyav", decode_pyav),
)
