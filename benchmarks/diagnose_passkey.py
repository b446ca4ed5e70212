"""Why a method loses pass keys: kept-entry dumps of HybridKV on pass-key prompts.

For every pass-key row of a task file, HybridKV runs at budget b and the script records, per
layer and KV head: the head's class; for a head pruned once at prefill, whether it kept the
key's digits and how much of its budget the text prior spent on text tokens (the question,
the chat template and the system prompt, which come before any context token); for a dynamic
head, whether the chunk holding the key was ever retrieved while decoding.

    python benchmarks/diagnose_passkey.py --tasks benchmarks/tasks/text_dev.jsonl --budget 0.1 \\
        --out docs/results/passkey_diagnosis.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from unittest import mock

import torch

from benchmarks.quality import task_rows
from hybridkv_cli.compression import hybridkv as hybridkv_module
from hybridkv_cli.compression import make_policy
from hybridkv_cli.compression.retrieval import DynamicHeads
from hybridkv_cli.engine import generate
from hybridkv_cli.models.registry import load_model
from hybridkv_cli.models.prompt import build_text_prompt
from hybridkv_cli.runs.answers import is_correct


def key_positions(tokenizer, ids: list[int], key: str) -> list[int]:
    """Token positions of the key's digits (SmolLM2 writes each digit as its own token)."""
    digits = [tokenizer.convert_tokens_to_ids(d) for d in key]
    for start in range(len(ids) - len(digits) + 1):
        if ids[start:start + len(digits)] == digits:
            return list(range(start, start + len(digits)))
    raise ValueError(f"key {key} not found as digit tokens")


def diagnose(loaded, task, budget: float, options: dict, new_tokens: int) -> dict:
    prompt = build_text_prompt(loaded.tokenizer, task.context, task.question)
    ids = prompt.inputs["input_ids"][0].tolist()
    key = key_positions(loaded.tokenizer, ids, task.answers[0])
    text = ~prompt.visual
    static_kept: dict[int, torch.Tensor] = {}  # layer -> [H_static, N] kept mask
    wanted: dict[int, list[torch.Tensor]] = {}  # id(DynamicHeads) -> chunk sets per step
    layer_of: dict[int, int] = {}
    real_keep = hybridkv_module.text_prior_keep
    real_refresh = DynamicHeads.refresh
    current = {"layer": -1}

    def keep_spy(pooled, visual, window, budgets):
        mask = real_keep(pooled, visual, window, budgets)
        if window > 0:  # the prefill pruning of fixed static heads (refresh selections pass 0)
            current["layer"] += 1
            static_kept[current["layer"]] = mask.clone()
        return mask

    def refresh_spy(self, query, store):
        real_refresh(self, query, store)
        wanted.setdefault(id(self), []).append(self.resident.clone())

    policy = make_policy("hybridkv", budget=budget, **options)
    with mock.patch.object(hybridkv_module, "text_prior_keep", keep_spy), \
            mock.patch.object(DynamicHeads, "refresh", refresh_spy):
        run = generate(loaded.model, prompt, policy, max_new_tokens=new_tokens)
    answer = loaded.tokenizer.decode(run.tokens, skip_special_tokens=True).strip()
    layers = []
    key_t = torch.tensor(key)
    for index, layer in enumerate(run.cache.layers):
        kv = layer.kv
        record = run.cache.reports[index]
        row = {"static": int(record.plan.static.sum()), "window": record.window}
        mask = static_kept.get(index) if int(record.plan.static.sum()) and kv.refresher is None else None
        if mask is not None and len(mask):
            row["static_keeps_whole_key"] = int(mask[:, key_t].all(dim=1).sum())
            row["static_keeps_no_key_digit"] = int((~mask[:, key_t]).all(dim=1).sum())
            row["static_text_share"] = float((mask & text).sum() / mask.sum())
        if kv.dynamic is not None:
            chunk = kv.dynamic.host_k.shape[2]
            key_chunks = torch.unique(key_t // chunk)
            steps = wanted.get(id(kv.dynamic), [])
            hit = [bool(torch.isin(key_chunks, s).all(dim=0).any()) if s.numel() else False for s in steps]
            per_head = [sum(bool(torch.isin(key_chunks, s[h]).any()) for s in steps) for h in range(len(kv.dynamic.heads))]
            row["dynamic"] = len(kv.dynamic.heads)
            row["dynamic_heads_ever_retrieving_key"] = sum(c > 0 for c in per_head)
            row["dynamic_steps_with_key_retrieved"] = sum(hit)
        layers.append(row)
    return {"id": task.id, "tokens": prompt.length, "key_positions": key, "answer": answer,
            "correct": bool(is_correct(answer, task.answers)), "layers": layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--options", default="{}", help="HybridKV options as JSON")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loaded = load_model(args.model, device="cpu")
    tasks = [t for t, r in task_rows(args.tasks) if r.get("kind") == "passkey"]
    out = []
    for task in tasks:
        d = diagnose(loaded, task, args.budget, json.loads(args.options), args.new_tokens)
        out.append(d)
        static = [r for r in d["layers"] if "static_keeps_whole_key" in r]
        dyn = [r for r in d["layers"] if "dynamic" in r]
        print(f"{task.id:24s} N={d['tokens']:5d} correct={d['correct']!s:5s} "
              f"static heads {sum(r['static'] for r in static)}: whole key kept "
              f"{sum(r['static_keeps_whole_key'] for r in static)}, no digit {sum(r['static_keeps_no_key_digit'] for r in static)}, "
              f"text share {sum(r['static_text_share'] for r in static) / max(1, len(static)):.2f} | "
              f"dynamic heads {sum(r['dynamic'] for r in dyn)}: ever retrieved key "
              f"{sum(r['dynamic_heads_ever_retrieving_key'] for r in dyn)} | {d['answer']!r}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"budget": args.budget, "options": json.loads(args.options), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
