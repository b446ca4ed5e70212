"""Cheaper ranking indexes for dynamic heads, measured before they are built: per-step oracles.

Every variant keeps the whole prompt KV and lets each decode step attend to the window and the
prompt tokens one ranking puts first, ``round(b·N)`` entries per KV head (the step oracles of
``benchmarks/passkey_bounds.py``); the ranking reads only an *index* of the prompt keys, so the
score says how much that index alone would keep. An index's cost is its bits per token and head
as a share of the head's bf16 KV (``2·d·16`` bits):

- ``keys``: every channel at 2 bits (today's ``--landmark keys``): ``2d`` bits, 1/16.
- ``sign``: every channel's sign around its prompt mean, one scale per channel: ``d`` bits, 1/32.
- ``labels:K:B``: ``K`` label channels per head, chosen offline on calibration prose (largest
  mean ``|q_c|·|k_c|``, as Double Sparsity's offline channels), at ``B`` bits: ``K·B`` bits.
- ``lowrank:R:B``: the keys projected on their top ``R`` right singular vectors (per prompt and
  head, as Loki's PCA), at ``B`` bits a coordinate: ``R·B`` bits.
- ``A>B``: a pair: index ``A`` on the device picks ``4·b·N`` candidates, index ``B`` (kept in
  host memory, its candidates' rows read each step) ranks them; the device pays for ``A`` only.
- ``exact``: the exact logits (the ceiling of any index).

    python -m benchmarks.index_bounds --tasks benchmarks/tasks/text_dev.jsonl \\
        --calibration benchmarks/tasks/text_dev2.jsonl --budgets 0.05,0.1 --dtype bfloat16 \\
        --out docs/results/index_bounds_dev.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.passkey_bounds import StepOracle, StepTopKV
from benchmarks.quality import task_rows
from hybridkv_cli.api import ask
from hybridkv_cli.compression.base import Compressed, Policy
from hybridkv_cli.compression.store import RaggedStore
from hybridkv_cli.models.registry import load_model
from hybridkv_cli.runs.answers import is_correct


def quantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` [H, N, C] rounded to ``bits`` per value, one range per head and channel."""
    low, high = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    scale = (high - low).clamp_min(1e-12) / (2**bits - 1)
    return low + scale * torch.round((x - low) / scale)


def index_bits(spec: str, dim: int) -> int:
    """Device bits per token and head of the index ``spec``."""
    name, *args = spec.split(">")[0].split(":")
    return {"keys": 2 * dim, "sign": dim, "exact": 16 * dim}.get(name) or int(args[0]) * int(args[1])


def index_logits(spec: str, keys: torch.Tensor, labels: torch.Tensor | None):
    """``logits(q [H, G, d]) -> [H, G, N]`` of the index ``spec`` over the prompt ``keys`` [H, N, d]."""
    k = keys.float()
    name, *args = spec.split(":")
    if name == "exact":
        approx = k
    elif name == "keys":
        approx = quantized(k, 2)
    elif name == "sign":
        mean = k.mean(dim=1, keepdim=True)
        spread = (k - mean).abs().mean(dim=1, keepdim=True)
        approx = mean + spread * torch.sign(k - mean)
    elif name == "labels":
        count, bits = int(args[0]), int(args[1])
        chosen = labels[:, :count]  # [H, K]
        picked = quantized(k.gather(2, chosen[:, None].expand(-1, k.shape[1], -1)), bits)
        return lambda q: torch.einsum("hgk,hnk->hgn", q.float().gather(2, chosen[:, None].expand(-1, q.shape[1], -1)),
                                      picked)
    elif name == "lowrank":
        rank, bits = int(args[0]), int(args[1])
        basis = torch.linalg.svd(k, full_matrices=False).Vh[:, :rank].transpose(1, 2)  # [H, d, R]
        projected = quantized(torch.bmm(k, basis), bits)
        return lambda q: torch.einsum("hgr,hnr->hgn", torch.bmm(q.float(), basis), projected)
    else:
        raise ValueError(f"unknown index {spec!r}")
    return lambda q: torch.einsum("hgd,hnd->hgn", q.float(), approx)


def two_stage(first, second, keep: int, factor: int = 4):
    """Rank by ``second`` among the ``factor·keep`` tokens ``first`` puts first."""
    def rank(q):
        coarse = first(q).amax(dim=1)  # [H, N]
        candidates = coarse.topk(min(coarse.shape[1], factor * keep), dim=1).indices[:, None].expand(-1, q.shape[1], -1)
        fine = second(q)
        return torch.full_like(fine, float("-inf")).scatter_(2, candidates, fine.gather(2, candidates))
    return rank


@dataclass
class Calibration(Policy):
    """Keeps everything and adds up, per layer, head and channel, mean ``|q_c|`` times mean
    ``|k_c|`` over the prompt: the channels whose products move the logits most."""

    budget: float = 1.0
    sums: dict = field(default_factory=dict)

    def compress(self, layer):
        weight = layer.query.float().abs().mean(dim=(1, 2)) * layer.keys.float().abs().mean(dim=1)  # [H, d]
        self.sums[layer.index] = self.sums.get(layer.index, 0) + weight
        keep = torch.ones(layer.keys.shape[:2], dtype=torch.bool)
        return Compressed(RaggedStore.build(layer.keys, layer.values, keep))

    def labels(self) -> dict[int, torch.Tensor]:
        """Each layer's channels per head, best first [H, d]."""
        return {i: s.argsort(dim=1, descending=True) for i, s in self.sums.items()}


@dataclass
class IndexOracle(StepOracle):
    """A step oracle ranking by ``index`` (see the module docstring)."""

    index: str = "keys"
    labels: dict = field(default_factory=dict)

    def compress(self, layer):
        keep = round(self.budget * layer.length)
        ranks = [index_logits(spec, layer.keys, self.labels.get(layer.index)) for spec in self.index.split(">")]
        rank = ranks[0] if len(ranks) == 1 else two_stage(*ranks, keep)
        return Compressed(StepTopKV(layer.keys, layer.values, rank, keep, self.window, self.chunk))


def calibrate(loaded, path: str, rows: int) -> dict[int, torch.Tensor]:
    policy = Calibration()
    for task, _ in list(task_rows(path))[:rows]:
        ask(loaded, None, task.question, context=task.context, method=policy, max_new_tokens=1)
    return policy.labels()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--calibration", required=True, help="task file whose contexts choose the label channels")
    parser.add_argument("--calibration-rows", type=int, default=6)
    parser.add_argument("--budgets", default="0.05,0.1")
    parser.add_argument("--indexes", default="exact,keys,sign,labels:16:2,labels:8:4,labels:32:2,lowrank:8:4,"
                        "lowrank:16:2,labels:16:2>keys,lowrank:8:4>keys")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=2500)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loaded = load_model("smollm2", device="cpu", dtype=getattr(torch, args.dtype))
    dim = loaded.model.config.hidden_size // loaded.model.config.num_attention_heads
    labels = calibrate(loaded, args.calibration, args.calibration_rows)
    items = []
    for task, row in task_rows(args.tasks):
        if not task.answers:
            continue
        tokens = len(loaded.tokenizer(task.context)["input_ids"])
        if tokens > args.max_prompt:
            continue
        new = int(row.get("max_new_tokens", args.max_new_tokens))
        runs = [("full", 1.0, "full")] + [
            (spec, float(b), IndexOracle(budget=float(b), index=spec, labels=labels))
            for b in args.budgets.split(",") for spec in args.indexes.split(",")]
        for name, budget, method in runs:
            answer = ask(loaded, None, task.question, context=task.context, method=method, max_new_tokens=new)["answer"]
            items.append({"id": task.id, "kind": row.get("kind"), "index": name, "budget": budget, "answer": answer,
                          "correct": is_correct(answer, task.answers)})
            print(f"{task.id:26s} {name:14s} {budget:<5g} {items[-1]['correct']!s:5} {answer!r}", flush=True)
    summary = {}
    for i in items:
        entry = summary.setdefault(f"{i['index']}@{i['budget']:g}", {
            "correct": 0, "rows": 0,
            "index_share_of_bf16_kv": None if i["index"] == "full" else round(index_bits(i["index"], dim) / (32 * dim), 4)})
        entry["correct"] += bool(i["correct"])
        entry["rows"] += 1
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"tasks": args.tasks, "calibration": args.calibration, "dtype": args.dtype,
                                        "summary": summary, "items": items}, indent=1) + "\n")


if __name__ == "__main__":
    main()
