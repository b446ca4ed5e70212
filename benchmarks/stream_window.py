"""Choose the streamed prefill's working window on a dev split: needle-colour questions made like
the demo's training data (a dev seed, not the reported test set's), the trained demo, HybridKV
at b = 0.1 streamed with windows of 64 to all tokens (the question read after compression),
beside the full cache and a one-pass prefill with the question read with the media or after
compression. Prints one JSON line per length: answers right out of the items.

    python benchmarks/stream_window.py --frames 64 256 1024 --items 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv_cli.compression import make_policy  # noqa: E402
from hybridkv_cli.engine import generate  # noqa: E402
from hybridkv_cli.engine.stream import Streaming  # noqa: E402
from hybridkv_cli.media import load_media  # noqa: E402
from hybridkv_cli.models import registry  # noqa: E402
from hybridkv_cli.models.prompt import build_prompt  # noqa: E402
from training.synthetic import held_out, write_item  # noqa: E402

DEV_SEED = 1  # the reported long-video set uses the held-out seed
WINDOWS = (64, 256, 1024, 1 << 20)


def runs() -> dict:
    """name -> (policy, streaming or None for one pass, question read after compression). A
    streamed prompt's question is always read after compression."""
    out = {"full": (make_policy("full"), None, False)}
    for defer in (False, True):
        out["one pass" + (", deferred" if defer else "")] = (make_policy("hybridkv", budget=0.1), None, defer)
    for window in WINDOWS:
        out[f"window {window}"] = (make_policy("hybridkv", budget=0.1), Streaming("on", 256, window), True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--items", type=int, default=8)
    args = parser.parse_args()
    demo = registry.load_model("demo", device="cpu", dtype="float32")
    max_pixels = registry.max_pixels_for("demo", None)
    with tempfile.TemporaryDirectory() as folder:
        for frames in args.frames:
            right: dict[str, int] = {}
            for item in held_out(seed=DEV_SEED, quota={"needle_colour": args.items}, frames=frames):
                path = Path(folder) / write_item(item, folder, f"{item.id}-{frames}")
                prompt = build_prompt(demo.processor, load_media([path], frames=frames, max_pixels=max_pixels),
                                      item.qa.question)
                for name, (policy, streaming, defer) in runs().items():
                    tokens = generate(demo.model, prompt, policy, 6, defer_question=defer, streaming=streaming).tokens
                    answer = demo.processor.tokenizer.decode(tokens).lower()
                    right[name] = right.get(name, 0) + (item.qa.answer.lower() in answer)
            print(json.dumps({"frames": frames, "items": args.items, "right": right}), flush=True)


if __name__ == "__main__":
    main()
