"""Batched decode throughput under a KV-memory cap: how many sequences fit, and tokens/s.

The random Qwen2.5-VL text stack of ``benchmarks/decode.py`` (7B attention geometry: hidden
3584, 28 query / 4 KV heads, head dim 128; few layers, a narrow MLP), one video-like prompt per
length. Its prefill runs once; every method compresses that same prefill (the layers' queries,
keys and values, recorded), and every sequence of a run starts from its own copy of the
compressed state, so the many sequences cost one prefill but decode exactly as fresh ones do.
The runs go through the engine's decode (``hybridkv_cli.engine``): admission by the
measured device KV of each member under ``--cap`` bytes, continuous batching as members finish.

    python -m benchmarks.throughput --lengths 4096 16384 --out docs/throughput.json --plot docs/throughput.png
    python -m benchmarks.throughput --device cuda --dtype bfloat16 --layers 28 --intermediate 18944 ...  # a GPU

Per (length, method, budget, cap): the most concurrent sequences, aggregate decode tokens/s
(decode tokens over the summed batch-step times), the device KV per sequence (measured), and
the same for a fixed batch of 1 and of 8 hybridkv sequences (no cap; four waves of each).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from benchmarks.decode import build_model, video_like_prompt
from hybridkv_cli.engine import Job, Limits, Prefix, decode
from hybridkv_cli.compression import make_policy
from hybridkv_cli.compression.cache import PolicyCache, policy_attention


class RecordingCache(PolicyCache):
    """A full-cache prefill that keeps what each layer handed to compression."""

    def __init__(self, *args):
        super().__init__(*args)
        self.recorded = []

    def compress_layer(self, index, query, key, value, scale):
        self.recorded.append((index, query, key, value, scale))
        super().compress_layer(index, query, key, value, scale)


def record_prefill(model, prompt):
    """(next-token logits, recorded layers) of one full-cache prefill of ``prompt``."""
    layers = model.config.get_text_config().num_hidden_layers
    cache = RecordingCache(make_policy("full", budget=1.0), layers, prompt.visual)
    inputs = {k: v.to(model.device) for k, v in prompt.inputs.items()}
    with torch.inference_mode(), policy_attention(model):
        out = model(**inputs, cache=cache, use_cache=True)
    return out.logits[:, -1].float(), cache.recorded


def compressed(model, prompt, policy, recorded, logits) -> Prefix:
    """``policy`` applied to the recorded prefill, as a prefix every sequence copies."""
    layers = model.config.get_text_config().num_hidden_layers
    cache = PolicyCache(policy, layers, prompt.visual)
    with torch.inference_mode():
        for args in recorded:
            cache.compress_layer(*args)
    return Prefix(policy=policy, cache=cache, seen=prompt.length, visual=prompt.visual,
                  tokens={"input_ids": prompt.inputs["input_ids"]}, rope_deltas=None, logits=logits, shared=True)


def run(model, prefix: Prefix, limits: Limits, sequences: int, new_tokens: int) -> dict:
    """Decode ``sequences`` copies of ``prefix`` under ``limits``."""
    jobs = [(i, lambda i=i: Job(i, [], prefix=prefix)) for i in range(sequences)]
    started = time.perf_counter()
    steps: dict[int, float] = {}
    tokens = 0
    peak = size = per_sequence = 0
    for outcome in decode(lambda: model, jobs, max_new_tokens=new_tokens, limits=limits):
        if outcome.error is not None:
            raise outcome.error
        b, g = outcome.batch, outcome.generation
        for i, s in enumerate(g.step_s):
            steps[b["joined_step"] + i] = s
        tokens += len(g.step_s)
        size = max(size, b["size_max"])
        peak = max(peak, b["kv_device_bytes_peak"])
        per_sequence = max(per_sequence, g.cache.device_bytes())
    decode_s = sum(steps.values())
    return {"concurrent_max": size, "decode_tokens": tokens, "decode_s": decode_s,
            "tokens_per_s": tokens / decode_s if decode_s else None, "kv_peak_bytes": peak,
            "kv_bytes_per_sequence": per_sequence, "wall_s": time.perf_counter() - started}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--methods", nargs="+", default=["hybridkv", "snapkv", "sparsemm", "madakv", "lookm",
                                                      "streamingllm", "rcr", "retentivekv", "quest"])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2])
    ap.add_argument("--caps", type=float, nargs="+", default=[2.0, 4.0],
                    help="KV caps, in full-cache sequences of the longest length (the plot's x axis)")
    ap.add_argument("--sequences", type=int, default=48, help="sequences per run (enough to fill the cap)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--cuda-graphs", action="store_true", help="replay the decode steps as CUDA graphs")
    args = ap.parse_args(argv)
    limits = lambda **kw: Limits(cuda_graphs=args.cuda_graphs, **kw)  # noqa: E731

    model = build_model(args.layers, args.intermediate, device=args.device, dtype=getattr(torch, args.dtype))
    vocab = model.config.get_text_config().vocab_size
    rows = []
    full_bytes = None
    for length in sorted(args.lengths, reverse=True):  # the longest first: it sets the caps
        prompt = video_like_prompt(length, vocab)
        logits, recorded = record_prefill(model, prompt)
        runs = [("full", 1.0)] + [(m, b) for m in args.methods for b in args.budgets]
        for method, budget in runs:
            prefix = compressed(model, prompt, make_policy(method, budget=budget), recorded, logits)
            if full_bytes is None:  # full at the longest length, with its generated rows
                full_bytes = run(model, prefix, limits(batch_size=1), 1,
                                 args.new_tokens)["kv_bytes_per_sequence"]
            for cap in args.caps:
                row = {"prompt_tokens": length, "method": method, "budget": budget, "cap_sequences_of_full": cap,
                       "cap_bytes": int(cap * full_bytes),
                       **run(model, prefix, limits(kv_memory=int(cap * full_bytes)),
                             args.sequences, args.new_tokens)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if method == "hybridkv" and budget == min(args.budgets):
                for size in (1, 8):
                    row = {"prompt_tokens": length, "method": method, "budget": budget, "batch_size": size,
                           **run(model, prefix, limits(batch_size=size), 4 * size,
                                 args.new_tokens)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del prefix
        del recorded
    gpu = torch.cuda.get_device_name() if model.device.type == "cuda" else None
    meta = {"machine": gpu or platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "dtype": args.dtype,
            "torch": torch.__version__, "layers": args.layers, "intermediate": args.intermediate,
            "new_tokens": args.new_tokens, "sequences": args.sequences, "full_bytes_longest": full_bytes,
            "cuda_graphs": args.cuda_graphs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


def replot(argv=None) -> None:
    """``python -c "from benchmarks.throughput import replot; replot()" docs/throughput.json docs/throughput.png``"""
    import sys

    src, dst = (argv or sys.argv[1:])[:2]
    with open(src) as f:
        plot(json.load(f)["rows"], dst)


def plot(rows: list[dict], path: str) -> None:
    """Aggregate tokens/s against the cap, one line per (method, budget), at each length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capped = [r for r in rows if "cap_bytes" in r]
    lengths = sorted({r["prompt_tokens"] for r in capped})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        runs = sorted({(r["method"], r["budget"]) for r in capped if r["prompt_tokens"] == length})
        methods = sorted({m for m, _ in runs})
        colours = plt.get_cmap("tab10")
        for method, budget in runs:
            pts = sorted((r["cap_bytes"] / 2**20, r["tokens_per_s"]) for r in capped
                         if r["prompt_tokens"] == length and (r["method"], r["budget"]) == (method, budget))
            ax.plot(*zip(*pts), marker="o", label=f"{method} {budget:g}", color=colours(methods.index(method) % 10),
                    linestyle="-" if budget <= min(b for m, b in runs if m == method) else "--",
                    linewidth=2.5 if method in ("full", "hybridkv") else 1)
        ax.set_title(f"{length} prompt tokens")
        ax.set_xlabel("device KV cap (MiB)")
        ax.set_ylabel("decode tokens/s (all sequences)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
