#!/usr/bin/env python
"""Write the small media the README and tests use (deterministic; PyAV + Pillow only).

    python scripts/make_sample_media.py [outdir]      # default: sample_media/

Writes:
  shapes.mp4                8 s, 320x240, 16 fps, H.264 (libx264; mpeg4 if unavailable):
                            a red circle, a blue square and a green triangle appear, move and leave
                            at different times; a caption on every frame says what is happening.
  images/red_circle.png     a red circle on a light background
  images/blue_square.jpg    a blue square on grass-green ground under a sky
  images/green_triangle.webp  a green triangle over a dark line
  events.txt                the timeline of shapes.mp4 (seconds and captions)
  needle.mp4                64 frames, 112x112, 4 fps: a synthetic clip (training/synthetic.py) whose
                            star shows in two frames only; the README's first command asks about it
  questions.jsonl           every question about needle.mp4 with its answer (what the trained demo
                            is tested on: tests/test_trained_demo.py)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

W, H, FPS, SECONDS = 320, 240, 16, 8
CAPTION_H = 30
STAGE_H = H - CAPTION_H
BACKGROUND = (236, 236, 230)

# (start, end) seconds each shape is visible, and its path (x0, y0) -> (x1, y1) in stage pixels
RED_CIRCLE = (1.0, 4.0, (-30, 70), (350, 70))
BLUE_SQUARE = (2.5, 6.5, (230, 10), (230, 150))
GREEN_TRIANGLE = (4.5, 7.5, (160, 240), (160, 50))

# what the caption says from each time on
EVENTS = [
    (0.0, "an empty stage"),
    (1.0, "a red circle enters from the left"),
    (2.5, "a blue square appears at the top"),
    (3.2, "the red circle leaves to the right"),
    (4.0, "the blue square moves down"),
    (4.5, "a green triangle rises from the bottom"),
    (6.5, "the blue square disappears"),
    (7.5, "the green triangle is gone"),
]


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 (FreeType build)
    except TypeError:  # pragma: no cover
        return ImageFont.load_default()


def _pos(spec, t):
    start, end, (x0, y0), (x1, y1) = spec
    if not (start <= t < end):
        return None
    a = (t - start) / (end - start)
    return x0 + a * (x1 - x0), y0 + a * (y1 - y0)


def _caption(t: float) -> str:
    text = EVENTS[0][1]
    for start, what in EVENTS:
        if t >= start:
            text = what
    return text


def draw_frame(i: int) -> Image.Image:
    t = i / FPS
    img = Image.new("RGB", (W, H), BACKGROUND)
    d = ImageDraw.Draw(img)
    if (p := _pos(RED_CIRCLE, t)) is not None:
        x, y = p
        d.ellipse([x - 28, y - 28, x + 28, y + 28], fill=(220, 30, 30), outline=(90, 0, 0), width=2)
    if (p := _pos(BLUE_SQUARE, t)) is not None:
        x, y = p
        d.rectangle([x - 25, y, x + 25, y + 50], fill=(30, 60, 220), outline=(0, 0, 90), width=2)
    if (p := _pos(GREEN_TRIANGLE, t)) is not None:
        x, y = p
        ang = (t - GREEN_TRIANGLE[0]) * 1.5  # it turns slowly while rising
        pts = [(x + 34 * math.sin(ang + k * 2 * math.pi / 3), y - 34 * math.cos(ang + k * 2 * math.pi / 3))
               for k in range(3)]
        d.polygon(pts, fill=(30, 170, 60), outline=(0, 80, 0))
    # caption bar
    d.rectangle([0, STAGE_H, W, H], fill=(20, 20, 20))
    d.text((8, STAGE_H + 6), f"{t:4.1f}s  {_caption(t)}", fill=(255, 255, 255), font=_font(15))
    return img


def rgb_to_yuv420p(rgb: np.ndarray) -> np.ndarray:
    """BT.601 limited-range RGB -> planar YUV 4:2:0 in numpy (no swscale: fixed arithmetic)."""
    x = rgb.astype(np.float64)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    y = 16 + (65.481 * r + 128.553 * g + 24.966 * b) / 255
    cb = 128 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255
    cr = 128 + (112.0 * r - 93.786 * g - 18.214 * b) / 255
    h, w = y.shape

    def sub(c):
        return c.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3))

    planes = [y.reshape(-1), sub(cb).reshape(-1), sub(cr).reshape(-1)]
    out = np.concatenate(planes).round().clip(0, 255).astype(np.uint8)
    return out.reshape(h * 3 // 2, w)


def write_video(path: Path) -> str:
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.codec_context.thread_count = 1  # deterministic output
        if codec == "libx264":
            # x264's sync-lookahead thread made the bytes vary from run to run even with threads=1
            stream.options = {"crf": "30", "preset": "medium", "g": str(FPS * 2),
                              "x264-params": "threads=1:lookahead-threads=1:sync-lookahead=0"}
        else:
            stream.bit_rate = 300_000
        for i in range(FPS * SECONDS):
            frame = av.VideoFrame.from_ndarray(rgb_to_yuv420p(np.asarray(draw_frame(i))), format="yuv420p")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return codec


def write_images(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []

    img = Image.new("RGB", (256, 192), (245, 240, 225))
    d = ImageDraw.Draw(img)
    d.ellipse([78, 46, 178, 146], fill=(220, 30, 30), outline=(90, 0, 0), width=3)
    p = folder / "red_circle.png"
    img.save(p, optimize=True)
    out.append(p)

    img = Image.new("RGB", (256, 192), (150, 200, 245))  # sky
    d = ImageDraw.Draw(img)
    d.rectangle([0, 140, 256, 192], fill=(70, 150, 60))  # grass
    d.rectangle([98, 70, 168, 140], fill=(30, 60, 220), outline=(0, 0, 90), width=3)
    p = folder / "blue_square.jpg"
    img.save(p, quality=85)
    out.append(p)

    img = Image.new("RGB", (256, 192), (250, 250, 250))
    d = ImageDraw.Draw(img)
    d.line([0, 160, 256, 160], fill=(40, 40, 40), width=4)
    d.polygon([(128, 30), (70, 150), (186, 150)], fill=(30, 170, 60), outline=(0, 80, 0))
    p = folder / "green_triangle.webp"
    img.save(p, quality=85, method=4)
    out.append(p)
    return out


NEEDLE_SEED = 12  # a scene with a two-frame star, a circle, a triangle and squares; the squares come first


def write_needle_clip(out: Path) -> list[Path]:
    """needle.mp4 and questions.jsonl (one row per question the scene answers)."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from training import synthetic as S  # the repository's training package

    scene = S.make_scene(np.random.default_rng(NEEDLE_SEED), needle=True, kinds=("count", "first"))
    S.write_mp4(out / "needle.mp4", scene.video)
    rows = [{"media": "needle.mp4", "question": qa.question, "answer": qa.answer, "kind": qa.kind,
             "frames": [min(qa.evidence), max(qa.evidence)] if qa.evidence else None} for qa in scene.qas]
    (out / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return [out / "needle.mp4", out / "questions.jsonl"]


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "sample_media"
    out.mkdir(parents=True, exist_ok=True)
    codec = write_video(out / "shapes.mp4")
    images = write_images(out / "images")
    lines = [f"shapes.mp4: {SECONDS} s, {W}x{H}, {FPS} fps, {codec}; caption timeline:"]
    lines += [f"  {start:4.1f}s  {what}" for start, what in EVENTS]
    (out / "events.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    total = 0
    for p in [out / "shapes.mp4", out / "events.txt", *images, *write_needle_clip(out)]:
        size = p.stat().st_size
        total += size
        print(f"{p}  {size / 1024:.1f} KiB")
    print(f"total {total / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
