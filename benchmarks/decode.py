"""Decode benchmark at Qwen2.5-VL-7B attention geometry: full vs hybridkv, same attention kernel.

A randomly initialised Qwen2.5-VL text stack with the 7B attention geometry (hidden 3584, 28
query / 4 KV heads, head dim 128) but few layers and a narrow MLP, fed a random prompt whose
middle is marked as visual tokens (the layout of a video prompt). Everything runs through the
library's own generation path, so prefill, compression and decode are what `hybridkv ask` does.

    python benchmarks/decode.py --lengths 8192 16384 --budgets 0.1 0.2 --out docs/cpu_decode.json
    python benchmarks/decode.py --lengths 16384 --budgets 0.1 --methods rcr rcr:refresh=none   # refresh cost
    python benchmarks/gpu_decode.py      # CUDA: 28 layers, bf16, 8k/32k/64k, plus stock SDPA generate

Reports per method: per-token decode latency (whole step), decode attention time per step
(the ragged kernel + retrieval, summed over layers), device KV bytes and ratio vs full, host
bytes, and compression overhead (classification + allocation + pruning + offload) as a share of
the prefill time.

Timing: every configuration (prompt length x method x budget, and stock) first runs one untimed
warm-up generation of the same prompt and length, so Triton compiles and first-call allocations
stay out of the timed run. The warm-up's wall time is reported apart: ``warmup_s``, and
``warmup_overhead_s``, what it took beyond the timed run (an estimate of those one-time costs,
within run-to-run noise: about 0, or below, on the CPU where nothing compiles). Steps are timed
on the host after a device sync; decode attention with CUDA events on CUDA (the host clock on
the CPU) per layer call, summed per step: ``attention_ms_per_step`` is the mean over the decode
steps, ``attention_ms_p50`` the median. ``--no-warmup`` times the first generation (cold).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from unittest import mock

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from hybridkv_cli.compression import cache as cache_module
from hybridkv_cli.compression import make_policy
from hybridkv_cli.engine import Meter, generate
from hybridkv_cli.library import StepClock
from hybridkv_cli.models.prompt import Prompt


def build_model(layers: int, intermediate: int, vocab: int = 2048, device="cpu", dtype=torch.float32):
    head_dim = 128
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab, hidden_size=28 * head_dim, num_attention_heads=28, num_key_value_heads=4,
            num_hidden_layers=layers, intermediate_size=intermediate, max_position_embeddings=65536,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        ),
        vision_config=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=64, out_hidden_size=28 * head_dim),
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialise where it runs: a 28-layer model is slow to init on a CPU
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model.to(dtype=dtype).eval()


def video_like_prompt(length: int, vocab: int) -> Prompt:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(10, vocab, (1, length), generator=g)
    visual = torch.zeros(length, dtype=torch.bool)
    visual[16 : length - 64] = True
    return Prompt(inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)}, visual=visual)


def parse_method(spec: str) -> tuple[str, dict]:
    """``name`` or ``name:key=value,key=value`` (values parsed as numbers where they are)."""
    name, _, rest = spec.partition(":")
    options = {}
    for pair in filter(None, rest.split(",")):
        key, _, value = pair.partition("=")
        try:
            options[key] = float(value) if "." in value else int(value)
        except ValueError:
            options[key] = value
    return name, options


class Spans:
    """Seconds of each decode attention call (one layer of one step): CUDA events on CUDA (no
    sync, read at the end), the host clock on the CPU."""

    def __init__(self):
        self.spans: list = []  # seconds (CPU) or (start, end) CUDA events

    @contextlib.contextmanager
    def span(self, device: torch.device):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            start = time.perf_counter()
            yield
            self.spans.append(time.perf_counter() - start)

    def span_seconds(self) -> list[float]:
        if self.spans and isinstance(self.spans[0], tuple):
            self.spans[-1][1].synchronize()
            return [s.elapsed_time(e) / 1e3 for s, e in self.spans]
        return list(self.spans)


@contextlib.contextmanager
def attention_spans():
    """Time every decode attention call inside the block (a compressed layer's: retrieval,
    refresh and attention), whichever cache makes it -- a generation's own or the engine's batch
    of one; yields the :class:`Spans`."""
    spans = Spans()
    attend = cache_module.attend

    def timed(module, query, *args, **kwargs):
        cache = kwargs.get(cache_module.CACHE_KWARG)
        if cache is None or cache.layers[module.layer_idx].kv is None:  # prefill
            return attend(module, query, *args, **kwargs)
        with spans.span(query.device):
            return attend(module, query, *args, **kwargs)

    with mock.patch.object(cache_module, "attend", timed):
        yield spans


def attention_per_step(spans: list[float], steps: int, layers: int) -> list[float] | None:
    """Decode attention seconds of each step: the spans (one per layer per decode step, in order)
    summed in groups of ``layers``. None where the spans do not divide into ``steps`` steps."""
    if steps == 0 or len(spans) != steps * layers:
        print(f"  attention spans: {len(spans)}, expected {steps} steps x {layers} layers: no per-step p50",
              file=sys.stderr, flush=True)
        return None
    return [sum(spans[i * layers:(i + 1) * layers]) for i in range(steps)]


def run(model, prompt: Prompt, spec: str, budget: float, new_tokens: int, warmup: bool = True) -> dict:
    method, options = parse_method(spec)
    policy = make_policy(method, budget=budget, **options)
    warmup_s = None
    if warmup:  # untimed: Triton compiles and first-call allocations happen here, not below
        started = time.perf_counter()
        generate(model, prompt, policy, max_new_tokens=new_tokens)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        warmup_s = time.perf_counter() - started
    with attention_spans() as timed:
        out = generate(model, prompt, policy, max_new_tokens=new_tokens)
    spans = timed.span_seconds()
    cfg = model.config.get_text_config()
    full_prompt_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 128 * prompt.length * model.dtype.itemsize
    steps = len(out.step_s)
    heads = out.cache.summary()
    attention_steps = attention_per_step(spans, steps, cfg.num_hidden_layers)
    timed_s = out.prefill_s + sum(out.step_s)
    return {
        "method": spec,
        "budget": policy.budget,
        "prefill_s": out.prefill_s,
        "compress_s": out.cache.compress_seconds,
        "compress_share_of_prefill": out.cache.compress_seconds / out.prefill_s,
        # One-time costs (Triton compiles, first-call allocations) fall in the warm-up run;
        # the first timed step still pays for cold retrieval: reported apart.
        "warmup_s": warmup_s,
        "warmup_overhead_s": None if warmup_s is None else warmup_s - timed_s,
        "first_step_ms": 1e3 * out.step_s[0],
        "step_ms_mean": 1e3 * statistics.fmean(out.step_s[1:] or out.step_s),
        "step_ms_p50": 1e3 * statistics.median(out.step_s[1:] or out.step_s),
        # Attention of the first decode step includes cold retrieval; the generation's total is averaged.
        "attention_ms_per_step": 1e3 * sum(spans) / steps,
        "attention_ms_p50": None if attention_steps is None else 1e3 * statistics.median(attention_steps),
        "device_bytes_after_prefill": out.device_bytes_after_prefill,
        "device_ratio_vs_full_prompt": out.device_bytes_after_prefill / full_prompt_bytes,
        "host_bytes": out.cache.host_bytes(),
        "h2d_bytes_per_step": out.cache.transferred_bytes() / steps,
        "cuda_peak_bytes": out.cuda_peak_bytes,
        "heads": None if heads is None else {k: heads[k] for k in ("static", "dynamic", "refresh") if k in heads},
    }


def stock_run(model, prompt: Prompt, new_tokens: int, warmup: bool = True) -> dict:
    """Stock ``generate`` with transformers' own cache and SDPA: the baseline users have today."""
    inputs = {k: v.to(model.device) for k, v in prompt.inputs.items()}
    warmup_s = None
    if warmup:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        warmup_s = time.perf_counter() - started
    meter = Meter(model.device)
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                       streamer=StepClock(meter, on_first_token=lambda: None))
    run = meter.finish([], None, 0, prompt.length)
    steps = run.step_s
    return {
        "method": "stock-sdpa", "budget": 1.0, "prefill_s": run.prefill_s,
        "warmup_s": warmup_s,
        "warmup_overhead_s": None if warmup_s is None else warmup_s - (run.prefill_s + sum(steps)),
        "step_ms_mean": 1e3 * statistics.fmean(steps), "step_ms_p50": 1e3 * statistics.median(steps),
        "cuda_peak_bytes": run.cuda_peak_bytes,
    }


def parser(**defaults) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=defaults.get("lengths", [8192, 16384]))
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2])
    ap.add_argument("--methods", nargs="+", default=["hybridkv"],
                    help="methods to time beside full: NAME or NAME:option=value,...")
    ap.add_argument("--layers", type=int, default=defaults.get("layers", 2))
    ap.add_argument("--intermediate", type=int, default=defaults.get("intermediate", 1024))
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--device", default=defaults.get("device", "cpu"))
    ap.add_argument("--dtype", default=defaults.get("dtype", "float32"))
    ap.add_argument("--stock", action=argparse.BooleanOptionalAction, default=defaults.get("stock", False),
                    help="also time stock generate (transformers cache + SDPA)")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one untimed generation per configuration before the timed one (default: on)")
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None, **defaults) -> None:
    args = parser(**defaults).parse_args(argv)
    model = build_model(args.layers, args.intermediate, device=args.device, dtype=getattr(torch, args.dtype))
    rows = []
    for length in args.lengths:
        prompt = video_like_prompt(length, model.config.get_text_config().vocab_size)
        runs = [("full", 1.0)] + [(m, b) for m in args.methods for b in args.budgets]
        if args.stock:
            rows.append({"prompt_tokens": length, **stock_run(model, prompt, args.new_tokens, args.warmup)})
            print(json.dumps(rows[-1]), flush=True)
        for method, budget in runs:
            started = time.perf_counter()
            row = {"prompt_tokens": length, **run(model, prompt, method, budget, args.new_tokens, args.warmup)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
        full = next(r for r in rows if r["prompt_tokens"] == length and r["method"] == "full")
        for r in rows:
            if r["prompt_tokens"] == length and r["method"] != "stock-sdpa":
                r["attention_speedup_vs_full"] = full["attention_ms_per_step"] / r["attention_ms_per_step"]
                r["step_speedup_vs_full"] = full["step_ms_mean"] / r["step_ms_mean"]
                r["device_kv_smaller_x"] = full["device_bytes_after_prefill"] / r["device_bytes_after_prefill"]
    gpu = torch.cuda.get_device_name() if model.device.type == "cuda" else None
    meta = {"machine": gpu or platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "dtype": args.dtype,
            "torch": torch.__version__, "layers": args.layers, "intermediate": args.intermediate,
            "new_tokens": args.new_tokens, "warmup": args.warmup}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
