"""Time one HybridKV decode layer-step (dynamic heads, default options) at 7B attention geometry.

The smallest unit that compares two checkouts of the code: 4 KV heads x 7 queries, head dim
128, a random 16k-token prompt compressed at b = 0.1 with every head dynamic, then 40 decode
steps (attend + append) on one thread; prints the median and minimum of the last 35. Run it
alternately from each checkout on an otherwise idle machine:

    python benchmarks/step_ab.py                 # 16384 tokens
    python benchmarks/step_ab.py 32768 --profile # and the aten ops of 5 steps

It builds its layer itself rather than through ``step_ops.random_layer`` so that it can be copied
into an older checkout and run there unchanged.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository root
from hybridkv_cli.compression import make_policy  # noqa: E402
from hybridkv_cli.compression.base import PrefillLayer  # noqa: E402

HEADS, GROUP, DIM, WINDOW, STEPS, WARMUP = 4, 7, 128, 64, 40, 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", nargs="?", type=int, default=16384)
    parser.add_argument("--profile", action="store_true", help="also print the aten ops of 5 steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    n = args.tokens
    layer = PrefillLayer(index=0, num_layers=1, query=rand(HEADS, GROUP, WINDOW, DIM), keys=rand(HEADS, n, DIM),
                         values=rand(HEADS, n, DIM), visual=torch.ones(n, dtype=torch.bool), scale=DIM ** -0.5)
    kv = make_policy("hybridkv", budget=0.1, theta=1.0).compress(layer).kv
    steps = [(rand(HEADS, GROUP, DIM), rand(HEADS, 1, DIM), rand(HEADS, 1, DIM)) for _ in range(STEPS)]
    times = []
    for q, k, v in steps:
        start = time.perf_counter()
        kv.attend(q, layer.scale)
        kv.append(k, v)
        times.append(time.perf_counter() - start)
    timed = times[WARMUP:]
    print(f"{n} tokens: median {statistics.median(timed) * 1e3:.2f} ms, min {min(timed) * 1e3:.2f} ms a layer-step")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for q, k, v in steps[:5]:
                kv.attend(q, layer.scale)
                kv.append(k, v)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
