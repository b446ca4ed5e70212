"""Tiny media made at test time (PyAV + Pillow): small, fast, deterministic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def frame_value(i: int) -> int:
    """Grey level encoded in frame i (recoverable after lossy coding to +-~6)."""
    return (i * 37) % 200 + 28


def make_video(path: Path, n: int = 30, w: int = 64, h: int = 48, fps: int = 10, codec: str = "libx264",
               rotation: int | None = None, marker: bool = False, faststart: bool = False) -> Path:
    """A video whose frame i is a flat grey of ``frame_value(i)``; with ``marker`` the top 8 rows
    are red (to check orientation)."""
    import av

    path = Path(path)
    opts = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=opts) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        if codec == "libx264":
            s.options = {"crf": "10", "preset": "ultrafast"}
        if rotation is not None:
            s.set_display_rotation(rotation)
        for i in range(n):
            arr = np.full((h, w, 3), frame_value(i), np.uint8)
            if marker:
                arr[:8, :, :] = (255, 0, 0)
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def make_noise_video(path: Path, n: int = 40, w: int = 64, h: int = 48, fps: int = 10) -> Path:
    """Random frames (large packets, so truncation in the middle hits frame data)."""
    import av

    rng = np.random.default_rng(0)
    with av.open(str(path), "w", options={"movflags": "faststart"}) as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"preset": "ultrafast", "crf": "0"}
        for _ in range(n):
            arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return Path(path)


def make_audio_only(path: Path, seconds: float = 0.5) -> Path:
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, int(8000 * seconds)), np.float32), format="fltp",
                                           layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return Path(path)


def make_image(path: Path, w: int = 40, h: int = 30, color=(200, 30, 30), mode: str = "RGB", **save_kw) -> Path:
    img = Image.new("RGB", (w, h), color)
    if mode != "RGB":
        img = img.convert(mode)
    img.save(path, **save_kw)
    return Path(path)


def set_mkv_duration(path: Path, seconds: float, out: Path) -> Path:
    """A copy of the Matroska file ``path`` whose Segment Duration element (ms, float) says
    ``seconds``: a container that lies about its length while its stream stays the same."""
    import struct

    data = bytearray(Path(path).read_bytes())
    i = data.find(b"\x44\x89")  # the Duration element's ID, followed by its size and a float
    size = {0x88: 8, 0x84: 4}[data[i + 2]]
    data[i + 3:i + 3 + size] = struct.pack(">d" if size == 8 else ">f", seconds * 1000.0)
    Path(out).write_bytes(bytes(data))
    return Path(out)
