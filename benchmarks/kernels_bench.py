"""Time the decode-path kernels (Triton vs torch reference) at Qwen2.5-VL-7B geometry.

Geometry: 4 KV heads x 7 query heads each, d = 128, bf16, chunks of c = 8, window w = 32, one
layer. For each prompt length N and budget b (1.0 = the full cache, run through the same op):

- ragged_decode_attention over a store of b*N rows per head on average (head lengths vary
  +-50% around it, as HybridKV's static heads do) plus n_gen generated rows;
- chunk_topk over C = N / c int8 landmarks per head, k = the dynamic heads' slot count;
- quant_key_topk over every prompt token's key at 2 bits (d/4 bytes a token), single-token
  chunks, k = the token slots of a dynamic head;
- chunk_gather with a steady-state miss rate (``--miss``): each call swaps that share of every
  head's chunks, alternating between two wanted sets so every call moves the same bytes;
  torch (pinned staging + side stream) vs the zero-copy Triton kernel;
- window_scores (prefill, torch only) once per N.

Reports median ms over ``--iters`` runs and achieved GB/s = bytes the op must read (or move
host->device, for the gather) / time.

    python benchmarks/kernels_bench.py                  # CUDA: Triton vs torch
    python benchmarks/kernels_bench.py --cpu --prompts 8192   # torch references on the CPU
    python benchmarks/kernels_bench.py --json out.json

Without CUDA and without ``--cpu`` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

import hybridkv_kernels as hk
from hybridkv_kernels.testing import rel_err

H_KV, G, D, C_TOK, W = 4, 7, 128, 8, 32
DTYPE = torch.bfloat16


def _timer(device: torch.device):
    """Median wall time (ms) of fn() with device synchronisation."""

    def run(fn, iters: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def _head_lengths(n_prompt: int, budget: float) -> list[int]:
    if budget >= 1.0:
        return [n_prompt] * H_KV
    avg = budget * n_prompt
    return [min(n_prompt, max(W, int(avg * f))) for f in (1.5, 0.5, 1.25, 0.75)]


def bench_attention(n_prompt, budget, n_gen, device, backends, timeit, iters, warmup):
    lengths = _head_lengths(n_prompt, budget)
    T = sum(lengths)
    g = torch.Generator(device="cpu").manual_seed(0)
    keys = torch.randn(T, D, generator=g).to(device, DTYPE)
    values = torch.randn(T, D, generator=g).to(device, DTYPE)
    offsets = torch.tensor([0] + lengths[:-1], device=device).cumsum(0)
    lens = torch.tensor(lengths, device=device)
    q = torch.randn(H_KV, G, D, generator=g).to(device, DTYPE)
    gen_k = torch.randn(H_KV, n_gen + 64, D, generator=g).to(device, DTYPE)
    gen_v = torch.randn(H_KV, n_gen + 64, D, generator=g).to(device, DTYPE)
    rows = T + H_KV * n_gen
    nbytes = rows * D * 2 * 2 + 2 * q.numel() * 2
    out, res = {}, []
    for b in backends:
        fn = lambda b=b: hk.ragged_decode_attention(q, keys, values, offsets, lens, gen_k, gen_v,
                                                   n_gen, backend=b, max_length=max(lengths))
        out[b] = fn()
        ms = timeit(fn, iters, warmup)
        res.append(dict(op="ragged_decode_attention", N=n_prompt, budget=budget, backend=b,
                        ms=ms, GBps=nbytes / ms / 1e6, rows=rows))
    if len(out) == 2:
        res[-1]["rel_err_vs_torch"] = rel_err(out["torch"].float(), out["triton"].float())
        s, _ = hk.decode_split_heuristic(max(lengths) + n_gen, H_KV, 64, device)
        res[-1]["num_splits"] = s
    return res


def _slots(n_prompt, budget, n_chunks):
    if budget >= 1.0:
        return n_chunks
    want = max(1, round((0.75 * budget * n_prompt - W) / C_TOK))
    return min(n_chunks, 1 << round(math.log2(want)))  # nearest power of two, as HybridKV allocates


def bench_topk(n_prompt, budget, device, backends, timeit, iters, warmup):
    n_chunks = (n_prompt - W) // C_TOK
    k = _slots(n_prompt, budget, n_chunks)
    g = torch.Generator(device="cpu").manual_seed(1)
    lm = torch.randint(-127, 128, (H_KV, n_chunks, D), dtype=torch.int8, generator=g).to(device)
    scale = (torch.rand(H_KV, n_chunks, generator=g) * 0.01).to(device)
    q = torch.randn(H_KV, G, D, generator=g).to(device, DTYPE)
    nbytes = lm.numel() + scale.numel() * 4
    out, res = {}, []
    for b in backends:
        fn = lambda b=b: hk.chunk_topk(q, lm, k, landmark_scale=scale, backend=b)
        out[b] = fn()
        ms = timeit(fn, iters, warmup)
        res.append(dict(op="chunk_topk", N=n_prompt, budget=budget, backend=b, ms=ms,
                        GBps=nbytes / ms / 1e6, C=n_chunks, k=k))
    if len(out) == 2:
        ref = hk.chunk_scores_torch(q, lm, scale)
        res[-1]["rel_err_selected_scores"] = rel_err(
            ref.gather(1, out["torch"]).sort(1).values, ref.gather(1, out["triton"]).sort(1).values)
    return res


def bench_quant_keys(n_prompt, budget, device, backends, timeit, iters, warmup):
    tokens = n_prompt - W
    k = min(tokens, max(1, round(0.75 * budget * n_prompt - W)))
    g = torch.Generator(device="cpu").manual_seed(2)
    codes, bounds = (t.to(device) for t in hk.pack_keys(torch.randn(H_KV, tokens, D, generator=g)))
    q = torch.randn(H_KV, G, D, generator=g).to(device, DTYPE)
    nbytes = codes.numel() + bounds.numel() * 4
    out, res = {}, []
    for b in backends:
        fn = lambda b=b: hk.quant_key_topk(q, codes, bounds, 1, k, backend=b)
        out[b] = fn()
        ms = timeit(fn, iters, warmup)
        res.append(dict(op="quant_key_topk", N=n_prompt, budget=budget, backend=b, ms=ms,
                        GBps=nbytes / ms / 1e6, tokens=tokens, k=k))
    if len(out) == 2:
        ref = hk.quant_key_scores_torch(q, codes, bounds, 1)
        res[-1]["rel_err_selected_scores"] = rel_err(
            ref.gather(1, out["torch"]).sort(1).values, ref.gather(1, out["triton"]).sort(1).values)
    return res


def bench_gather(n_prompt, budget, miss, device, backends, timeit, iters, warmup):
    n_chunks = (n_prompt - W) // C_TOK
    n = _slots(n_prompt, budget, n_chunks)
    if budget >= 1.0 or n >= n_chunks:
        return []  # full cache: nothing is offloaded
    pin = device.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(2)
    host_k = torch.randn(H_KV, n_chunks, C_TOK, D, generator=g).to(DTYPE)
    host_v = torch.randn(H_KV, n_chunks, C_TOK, D, generator=g).to(DTYPE)
    if pin:
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    slot_base = torch.arange(H_KV, device=device) * (n * C_TOK)
    m = max(1, int(miss * n))
    perm = torch.stack([torch.randperm(n_chunks, generator=g)[: n + m] for _ in range(H_KV)])
    want_a = perm[:, :n].to(device)
    want_b = torch.cat([perm[:, :n - m], perm[:, n:n + m]], 1).to(device)  # m chunks swapped
    res = []
    for b in backends:
        store_k = torch.zeros(H_KV * n * C_TOK, D, dtype=DTYPE, device=device)
        store_v = torch.zeros_like(store_k)
        resident = torch.full((H_KV, n), -1, dtype=torch.int64, device=device)
        hk.chunk_gather(host_k, host_v, store_k, store_v, slot_base, resident, want_a, backend=b)
        state = {"flip": False, "bytes": 0}

        def fn(b=b):
            state["flip"] = not state["flip"]
            want = want_b if state["flip"] else want_a
            state["bytes"] = hk.chunk_gather(host_k, host_v, store_k, store_v, slot_base,
                                             resident, want, backend=b)

        ms = timeit(fn, iters, warmup)
        res.append(dict(op="chunk_gather", N=n_prompt, budget=budget, backend=b, ms=ms,
                        GBps=state["bytes"] / ms / 1e6, slots=n, misses_per_head=m,
                        bytes=state["bytes"]))
    return res


def bench_window(n_prompt, device, timeit, iters, warmup):
    g = torch.Generator(device="cpu").manual_seed(3)
    q = torch.randn(H_KV, G, W, D, generator=g).to(device, DTYPE)
    k = torch.randn(H_KV, n_prompt, D, generator=g).to(device, DTYPE)
    ms = timeit(lambda: hk.window_scores(q, k, backend="torch"), iters, warmup)
    return [dict(op="window_scores", N=n_prompt, budget=None, backend="torch", ms=ms,
                 GBps=k.numel() * 2 / ms / 1e6)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run the torch references on the CPU")
    p.add_argument("--prompts", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 1.0])
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--miss", type=float, default=0.1, help="share of slots missing per step")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)

    if args.cpu:
        device, backends = torch.device("cpu"), ["torch"]
        args.iters, args.warmup = min(args.iters, 10), min(args.warmup, 2)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        backends = ["torch", "triton"] if hk.HAS_TRITON else ["torch"]
    else:
        print("kernels_bench: needs CUDA (or --cpu to time the torch references on the CPU)")
        return 0
    timeit = _timer(device)
    rows = []
    for n_prompt in args.prompts:
        rows += bench_window(n_prompt, device, timeit, max(3, args.iters // 5), 1)
        for budget in args.budgets:
            rows += bench_attention(n_prompt, budget, args.n_gen, device, backends, timeit,
                                    args.iters, args.warmup)
            rows += bench_topk(n_prompt, budget, device, backends, timeit, args.iters,
                               args.warmup)
            if budget < 1.0:
                rows += bench_quant_keys(n_prompt, budget, device, backends, timeit, args.iters, args.warmup)
            rows += bench_gather(n_prompt, budget, args.miss, device, backends, timeit,
                                 args.iters, args.warmup)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, H_kv={H_KV} G={G} d={D} {DTYPE}, "
          f"n_gen={args.n_gen}, miss={args.miss}")
    print(f"{'op':<24}{'N':>7}{'budget':>8}{'backend':>9}{'ms':>10}{'GB/s':>9}  extra")
    skip = {"op", "N", "budget", "backend", "ms", "GBps"}
    for r in rows:
        extra = " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in r.items() if k not in skip)
        budget = "full" if r["budget"] == 1.0 else ("-" if r["budget"] is None else r["budget"])
        print(f"{r['op']:<24}{r['N']:>7}{budget!s:>8}{r['backend']:>9}{r['ms']:>10.3f}"
              f"{r['GBps']:>9.1f}  {extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
