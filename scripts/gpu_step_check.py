"""The decode layer-step on a GPU: host syncs (``torch.cuda.set_sync_debug_mode("error")``) and
kernel launches (``torch.profiler``), single run and batch, with both head kinds and refresh.

A Llama with Qwen2.5-VL-7B's attention geometry (4 KV heads x 7 queries, head dim 128; two
layers, a narrow MLP, random weights) speaking the demo tokenizer; HybridKV at b = 0.1 twice:
with 2-bit keys on the device and its KV heads forced half static, half dynamic (rate-controlled
refresh), as the default takes it in bf16 (the keys on the device, every head dynamic, a sticky
selection), and at b = 0.05 (the keys in host memory, read through UVA). Each
layer-step (the new token's append and the layer's attention with retrieval and refresh) runs
under the sync debug mode, which raises on any sync; a sample of layer-steps is profiled and
its CUDA kernels counted (memcpy/memset included). Writes ``<what>.json`` into ``--out``.

    python scripts/gpu_step_check.py --what sync --out gpu_check
    python scripts/gpu_step_check.py --what launches --out gpu_check
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hybridkv_cli.compression.batch_cache as batch_mod  # noqa: E402
import hybridkv_cli.compression.cache as cache_mod  # noqa: E402
import hybridkv_cli.compression.hybridkv as hybrid_mod  # noqa: E402
from hybridkv_cli.compression import make_policy  # noqa: E402
from hybridkv_cli.engine import generate, prompt_job  # noqa: E402
from hybridkv_cli.engine.decoder import Decoder  # noqa: E402
from hybridkv_cli.models.demo import build_demo_tokenizer  # noqa: E402
from hybridkv_cli.models.prompt import build_text_prompt  # noqa: E402

NEW = 8
CONTEXT = " ".join(f"Line {i}: the {c} box is on shelf {i % 7}." for i, c in
                   zip(range(400), ["red", "blue", "green", "yellow", "black"] * 80))


def model_and_tokenizer(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_demo_tokenizer()
    config = LlamaConfig(hidden_size=3584, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=28,
                         num_key_value_heads=4, head_dim=128, vocab_size=len(tokenizer), max_position_embeddings=32768,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LlamaForCausalLM(config).to(device, dtype).eval(), tokenizer


def force_mix():
    original = hybrid_mod.classify_static

    def forced(attn, theta, topk_share, sink_aware=False):  # even KV heads static, odd dynamic
        static, scores = original(attn, theta, topk_share, sink_aware)
        return torch.arange(static.shape[0], device=static.device) % 2 == 0, scores

    hybrid_mod.classify_static = forced


def wrap_layer_steps(around):
    """Run every decode layer-step (append + attention) inside ``around(layer_step_fn)``."""
    update_single, update_batch, attend = cache_mod.PolicyLayer.update, batch_mod.BatchLayer.update, cache_mod.attend

    def single(self, *args, **kwargs):
        if self.kv is None:
            return update_single(self, *args, **kwargs)
        return around(lambda: update_single(self, *args, **kwargs), "append")

    def batch(self, *args, **kwargs):
        return around(lambda: update_batch(self, *args, **kwargs), "append")

    def attention(module, *args, **kwargs):
        cache = kwargs.get(cache_mod.CACHE_KWARG)
        if cache is None or cache.layers[module.layer_idx].kv is None:
            return attend(module, *args, **kwargs)
        return around(lambda: attend(module, *args, **kwargs), "attend")

    cache_mod.PolicyLayer.update, batch_mod.BatchLayer.update, cache_mod.attend = single, batch, attention


PROMPTS = ((CONTEXT, "Which box is on shelf 3?"), (CONTEXT[: len(CONTEXT) * 2 // 3], "Which box is on shelf 5?"))


def run(model, tokenizer, policy, which: str) -> None:
    """``single``: one generation; ``batch``: two decoded together."""
    prompts = [build_text_prompt(tokenizer, context, question) for context, question in PROMPTS]
    if which == "single":
        generate(model, prompts[0], policy, max_new_tokens=NEW)
        return
    decoder = Decoder(model, NEW)
    decoder.eos = set()
    for member in decoder.start([prompt_job(model, p, policy, tag=i) for i, p in enumerate(prompts)]):
        decoder.join(member)
    for _ in range(NEW - 1):
        decoder.step()


def check_syncs(model, tokenizer, policy) -> dict:
    """Every layer-step under the sync debug mode "error": the first sync of a run raises and
    ends that run (its layer-steps so far and the sync's place are recorded)."""
    counted, out = Counter(), {}
    state = {"run": "single"}

    def around(fn, part):
        counted[state["run"]] += part == "attend"
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)

    wrap_layer_steps(around)
    for name in ("single", "batch"):
        state["run"] = name
        try:
            run(model, tokenizer, policy, name)
            out[name] = {"layer_steps": counted[name], "sync": None}
        except RuntimeError as e:
            out[name] = {"layer_steps": counted[name], "sync": str(e).splitlines()[0],
                         "where": traceback.format_exc().splitlines()[-12:]}
    return {**out, "ok": all(v["sync"] is None for v in out.values())}


def count_launches(model, tokenizer, policy) -> dict:
    from torch.profiler import ProfilerActivity, profile

    samples, state = {"single": [], "batch": []}, {"run": "single", "calls": 0}

    def around(fn, part):
        state["calls"] += 1
        if state["calls"] % 5 or len(samples[state["run"]]) >= 6:  # profile every fifth layer call
            return fn()
        with profile(activities=[ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]) as prof:
            out = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        kernels = Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")
        samples[state["run"]].append({"part": part, "kernels": sum(kernels.values()), "by_name": dict(kernels)})
        return out

    wrap_layer_steps(around)
    for name in ("single", "batch"):
        state["run"] = name
        run(model, tokenizer, policy, name)
    return {name: {"attend_max": max((s["kernels"] for s in rows if s["part"] == "attend"), default=None),
                   "append_max": max((s["kernels"] for s in rows if s["part"] == "append"), default=None),
                   "samples": rows} for name, rows in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("sync", "launches"), required=True)
    parser.add_argument("--out", type=Path, default=Path("gpu_check"))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = model_and_tokenizer(args.device)
    force_mix()
    check = check_syncs if args.what == "sync" else count_launches
    # Both head kinds with the keys on the device; the default at b = 0.1 in bf16 (the keys on the
    # device, every head dynamic, sticky); and at b = 0.05, the keys in host memory (UVA).
    policies = {"keys, static and dynamic heads": make_policy("hybridkv", budget=0.1, landmark="keys"),
                "auto": make_policy("hybridkv", budget=0.1),
                "auto at b = 0.05 (host keys)": make_policy("hybridkv", budget=0.05)}
    result = {name: check(model, tokenizer, policy) for name, policy in policies.items()}
    (args.out / f"{args.what}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result)[:2000])


if __name__ == "__main__":
    main()
