"""A video's header facts, read with PyAV before decoding: size, frame count, rate, rotation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from hybridkv_cli.io.errors import HybridKVError, MediaError
from hybridkv_cli.media.images import refuse_oversized
from hybridkv_cli.media.sniff import one_line, sniff


class Probe(NamedTuple):
    """What PyAV says about a video before it is decoded."""

    width: int
    height: int
    frames: int  # from the container header; 0 if unknown
    fps: float | None  # average frame rate
    duration: float | None  # seconds
    rotation: int  # degrees counter-clockwise to apply for display (multiple of 90)
    codec: str


def av_error_reason(e: BaseException) -> str:
    """PyAV's error, as the one-line reason a user sees."""
    msg = getattr(e, "strerror", None) or str(e)
    msg = " ".join(str(msg).split())
    low = msg.lower()
    if "invalid data" in low:
        return "cannot open video: invalid data (corrupt, truncated, or not a video file)"
    if "permission" in low:
        return "permission denied"
    return f"cannot open video: {one_line(msg)}"


def probe_video(path: Path, shown: str, head: bytes) -> Probe:
    """Read the header facts of ``path`` (``head``: its first bytes); a MediaError when it is no video."""
    import av

    guess = sniff(head)
    if guess is not None and guess[0] in ("image", "text", "other"):
        hint = " (wrong extension?)" if guess[0] == "image" else ""
        raise MediaError(f"file content is {guess[1]}, not a video{hint}", source=shown)
    try:
        container = av.open(str(path), metadata_errors="ignore")
    except Exception as e:
        raise MediaError(av_error_reason(e), source=shown) from None
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
        refuse_oversized("video", width, height, shown)  # from the header, before a frame is decoded
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
        refuse_oversized("video", width, height, shown)  # a header without the size: its first frame's
        return Probe(width, height, int(stream.frames or 0), fps, duration, rotation, cc.name or "?")
    except HybridKVError:
        raise
    except Exception as e:
        raise MediaError(av_error_reason(e), source=shown) from None
    finally:
        try:
            container.close()
        except Exception:
            pass
