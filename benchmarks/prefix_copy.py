"""What a question about a kept prefix copies: every storage, or all but the fixed ones.

    python benchmarks/prefix_copy.py --out benchmarks/results/prefix_copy.json

Every question (``-Q``, a ``.hkv`` file, a server's cached prefix) decodes a copy of the compressed
state (``engine.graph.Cloner``). The offloaded KV and its landmarks are never written after
compression, so the copy shares them and copies only what decoding writes. One layer at the
Qwen2.5-VL-7B attention geometry (4 KV heads of 128, 7 query heads each, bf16), random KV of N
prompt tokens, compressed by ``hybridkv`` at b = 0.1; the copy is timed with every storage copied
(as before) and with the fixed ones shared, in one process, the mean of 5, and scaled to 28 layers.
Host memory, unpinned (on CUDA the host KV is pinned, whose allocation costs more).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybridkv_cli.compression import make_policy
from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.engine import graph

HEADS, GROUP, DIM, LAYERS = 4, 7, 128, 28


def copy_ms(flat, repeats: int = 5) -> float:
    copy = graph.Cloner(*flat)
    copy()
    start = time.perf_counter()
    for _ in range(repeats):
        copy()
    return (time.perf_counter() - start) / repeats * 1e3


def measure(tokens: int, landmark: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    layer = PrefillLayer(index=0, num_layers=1, query=rand(HEADS, GROUP, 64, DIM), keys=rand(HEADS, tokens, DIM),
                         values=rand(HEADS, tokens, DIM), visual=torch.ones(tokens, dtype=torch.bool), scale=DIM**-0.5)
    state = [make_policy("hybridkv", budget=0.1, landmark=landmark).compress(layer).kv]
    storages, info, tree = graph.flatten(state)
    fixed = sum(data.numel() for key, data in storages.items() if info[key]["fixed"])
    shared = copy_ms((storages, info, tree))
    everything = copy_ms((storages, {key: {**i, "fixed": False} for key, i in info.items()}, tree))
    total = sum(data.numel() for data in storages.values())
    return {"tokens": tokens, "landmark": landmark, "state_mib_per_layer": total / 2**20,
            "fixed_mib_per_layer": fixed / 2**20, "copy_all_ms": everything * LAYERS, "copy_shared_ms": shared * LAYERS,
            "speedup": everything / shared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--landmarks", nargs="+", default=["auto", "keys"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(n, landmark) for n in args.tokens for landmark in args.landmarks]
    for r in rows:
        print(f"{r['tokens']:>6} tokens, --landmark {r['landmark']:<5}: {r['state_mib_per_layer'] * LAYERS:7.0f} MiB "
              f"kept ({r['fixed_mib_per_layer'] * LAYERS:.0f} fixed); a question's copy {r['copy_all_ms']:6.1f} ms -> "
              f"{r['copy_shared_ms']:5.1f} ms ({r['speedup']:.1f}x)")
    if args.out:
        args.out.write_text(json.dumps({"config": {**vars(args), "out": str(args.out), "layers": LAYERS,
                                                   "torch": torch.__version__}, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
