"""Milliseconds to load a video's 64 frames and build its prompt, one thread, by source size.

What every question about a new video pays on the host before the model sees it, as ``hybridkv
ask`` and a server's prefix-cache miss pay it: the frames decoded, sampled and resized
(:func:`hybridkv_cli.media.load_media`), then the prompt built (:func:`build_prompt`: the
processor's pixels and tokens; the demo's processor, Qwen2.5-VL's). With ``--stream N`` also a
long video read while it is prefilled (``ask --max-frames N``): N frames of a clip twice as long,
its prompt built, then every pixel row produced as the prefill's 2,048-token chunks ask for them
(decode, resize, processor). The videos are made here: 96 frames of a moving box (H.264, ``--sizes`` WxH), loaded
at ``--max-pixels`` a frame (default: 448x448, Qwen2.5-VL's frame budget at 64 frames). Each
time is the median of ``--rounds`` loads after one warm-up. Run it from each checkout to compare
them (``PYTHONPATH=<checkout>``):

    OMP_NUM_THREADS=1 python benchmarks/media_load.py
    OMP_NUM_THREADS=1 PYTHONPATH=../old python benchmarks/media_load.py --sizes 640x480
    OMP_NUM_THREADS=1 python benchmarks/media_load.py --sizes 640x480 --stream 256

Prints one JSON object: per source size, the frames' shape, the decoder and the median ms of each
step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import torch

from hybridkv_cli.media import load_media, load_media_stream
from hybridkv_cli.models.chunks import chunk_bounds, chunk_inputs, visual_units
from hybridkv_cli.models.prompt import build_prompt
from hybridkv_cli.models.registry import load_model


def make_clip(path: Path, width: int, height: int, frames: int = 96) -> Path:
    """A moving white box over a changing background, ``frames`` frames at 24 fps."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        box = max(8, width // 16)
        for i in range(frames):
            image = np.zeros((height, width, 3), np.uint8)
            image[:, :, 1] = (2 * i) % 255
            x = (i * width // frames) % (width - box)
            image[height // 3:height // 3 + box, x:x + box] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return path


def streamed(loaded, clip: Path, frames: int, max_pixels: int) -> float:
    """Seconds to build ``frames`` streamed frames' prompt and produce every pixel row in the
    prefill's chunks (as ``ask --max-frames`` reads them)."""
    start = time.perf_counter()
    media = load_media_stream([clip], frames=frames, max_frames=frames, max_pixels=max_pixels)
    prompt = build_prompt(loaded.processor, media, "What happens in the video?")
    units = visual_units(loaded.model.config, prompt.inputs)
    for begin, end in chunk_bounds(units, prompt.length, 2048):
        chunk_inputs(prompt.inputs, units, begin, end)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["640x480", "1280x720", "1920x1080"])
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--max-pixels", type=int, default=448 * 448)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stream", type=int, default=0, metavar="N", help="also a long video's N frames, streamed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("demo", device="cpu")
    processor = loaded.processor
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes:
            width, height = map(int, size.split("x"))
            clip = make_clip(Path(folder) / f"{size}.mp4", width, height)
            load, prompt = [], []
            for _ in range(args.rounds + 1):
                start = time.perf_counter()
                media = load_media([clip], frames=args.frames, max_pixels=args.max_pixels)
                load.append(time.perf_counter() - start)
                start = time.perf_counter()
                build_prompt(processor, media, "What happens in the video?")
                prompt.append(time.perf_counter() - start)
            out[size] = {"frames": list(media.video.shape), "decoder": media.decoder,
                         "load_ms": round(1e3 * statistics.median(load[1:]), 1),
                         "prompt_ms": round(1e3 * statistics.median(prompt[1:]), 1)}
            if args.stream:
                long = make_clip(Path(folder) / f"{size}-long.mp4", width, height, frames=2 * args.stream)
                times = [streamed(loaded, long, args.stream, args.max_pixels) for _ in range(args.rounds + 1)]
                out[size][f"stream_{args.stream}_ms"] = round(1e3 * statistics.median(times[1:]), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
