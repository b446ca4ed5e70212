"""How much a better selection could win on pass keys: one-shot and per-step oracles.

All are diagnostics, not methods. At budget b, on every pass-key and multi-key row of a task
file, each variant keeps ``round(b·N)`` entries per KV head (as SnapKV does) and answers.
Selected once, at prefill:

- ``snapkv``: the registered method.
- ``oracle``: the window first, then the key's digit tokens and the 4 tokens before them in every
  head of every layer, then SnapKV's best-scored rest. Whatever it misses, no selection that
  keeps the evidence can win back.
- ``merged``: SnapKV for three quarters of the entries; the evicted tokens of each head fold,
  in position order, into as many groups as the last quarter holds, each one entry with the
  group's mean key and value and a logit bias of log(group size), so the evicted tail keeps
  its attention mass (decode attention in torch, for this script only).

    python -m benchmarks.passkey_bounds --tasks benchmarks/tasks/text_dev.jsonl --budgets 0.1,0.2 \\
        --out docs/results/passkey_bounds_dev.json
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import hybridkv_kernels as hk
import torch

from benchmarks.diagnose_passkey import key_positions
from benchmarks.quality import task_rows
from hybridkv_cli.api import ask
from hybridkv_cli.compression.base import Compressed, LayerKV, Policy
from hybridkv_cli.compression.detector import LowRankKeys
from hybridkv_cli.compression.scoring import head_entries, window_attention
from hybridkv_cli.compression.selection import keep_top_tiered
from hybridkv_cli.compression.snapkv import SnapKV
from hybridkv_cli.compression.store import RaggedStore
from hybridkv_cli.models.registry import load_model
from hybridkv_cli.models.prompt import build_text_prompt
from hybridkv_cli.runs.answers import is_correct
from hybridkv_cli.runs.fidelity import rouge_l


@dataclass
class OracleKey(SnapKV):
    """SnapKV with the key's tokens forced into every head (``evidence``: prompt positions)."""

    evidence: list = field(default_factory=list)

    def compress(self, layer):
        _, pooled, w = window_attention(layer, self.window)
        tier = torch.zeros(layer.length)
        tier[self.evidence] = 1.0
        tier[layer.length - w:] = 2.0
        counts = torch.full((layer.num_heads,), head_entries(self.budget, layer.length), dtype=torch.long)
        return Compressed(RaggedStore.build(layer.keys, layer.values, keep_top_tiered(pooled, tier, counts)))


class BiasedKV(LayerKV):
    """Per-head entries with a logit bias each, plus generated tokens (bias 0)."""

    def __init__(self, keys: list, values: list, bias: list):
        self.keys, self.values, self.bias = keys, values, bias

    def append(self, key, value):
        for h in range(len(self.keys)):
            self.keys[h] = torch.cat([self.keys[h], key[h]])
            self.values[h] = torch.cat([self.values[h], value[h]])
            self.bias[h] = torch.cat([self.bias[h], self.bias[h].new_zeros(1)])

    def attend(self, query, scale, q_len=1):
        if q_len != 1:
            raise NotImplementedError("the bounds read a question in the prompt, one token a step after it")
        # in fp32 whatever the model's dtype (a bf16 run's logits plus the fp32 bias)
        return torch.stack([torch.softmax(q.float() @ k.float().T * scale + b, -1) @ v.float()
                            for q, k, v, b in zip(query, self.keys, self.values, self.bias)]).to(query.dtype)

    def device_bytes(self):
        return 0


@dataclass
class MergedTail(SnapKV):
    """SnapKV on 3/4 of the entries; the evicted tail folded into the last 1/4 (see module doc)."""

    def compress(self, layer):
        _, pooled, w = window_attention(layer, self.window)
        total = head_entries(self.budget, layer.length)
        groups = total // 4
        tier = torch.zeros(layer.length)
        tier[layer.length - w:] = 1.0
        counts = torch.full((layer.num_heads,), total - groups, dtype=torch.long)
        keep = keep_top_tiered(pooled, tier, counts)
        keys, values, bias = [], [], []
        for h in range(layer.num_heads):
            evicted = torch.tensor_split((~keep[h]).nonzero().squeeze(1), max(1, groups))
            evicted = [g for g in evicted if g.numel()]
            keys.append(torch.cat([layer.keys[h][keep[h]], *(layer.keys[h][g].mean(0, keepdim=True) for g in evicted)]))
            values.append(torch.cat([layer.values[h][keep[h]], *(layer.values[h][g].mean(0, keepdim=True) for g in evicted)]))
            bias.append(torch.tensor([0.0] * int(keep[h].sum()) + [math.log(g.numel()) for g in evicted]))
        return Compressed(BiasedKV(keys, values, bias))


def ranked_keys(keys: torch.Tensor, ranking: str):
    """``logits(q [H, G, d]) -> [H, G, N]`` of one ranking of the prompt ``keys`` [H, N, d]."""
    if ranking == "exact":
        return lambda q: torch.einsum("hgd,hnd->hgn", q, keys)
    if ranking == "keys":
        codes, bounds = hk.pack_keys(keys)
        low, scale = bounds.unbind(1)
        approx = (low[:, :, None] + scale[:, :, None] * hk.unpack_codes(codes)).transpose(1, 2)
        return lambda q: torch.einsum("hgd,hnd->hgn", q, approx)
    if ranking == "lowrank":
        return LowRankKeys.build(keys, 8).logits
    raise ValueError(f"unknown ranking {ranking!r}")


class StepTopKV(BiasedKV):
    """The whole prompt KV; each step attends to the window and the prompt tokens (in chunks of
    ``chunk``) that ``rank`` puts first, plus the generated tokens."""

    def __init__(self, keys, values, rank, keep: int, window: int, chunk: int):
        super().__init__(list(keys), list(values), [keys.new_zeros(keys.shape[1])] * keys.shape[0])
        self.rank, self.keep, self.window, self.chunk, self.prompt = rank, keep, window, chunk, keys.shape[1]

    def attend(self, query, scale, q_len=1):
        n, w = self.prompt, min(self.window, self.prompt)
        best = self.rank(query).amax(dim=1)[:, : n - w]  # [H, prompt before the window]
        chunks = best.shape[1] // self.chunk
        scores = best[:, : chunks * self.chunk].unflatten(1, (chunks, self.chunk)).amax(2)
        top = scores.topk(min(chunks, max(0, self.keep - w) // self.chunk), dim=1).indices
        masked = torch.full((len(self.keys), n), float("-inf"))
        masked[:, n - w:] = 0.0
        rows = (top[:, :, None] * self.chunk + torch.arange(self.chunk)).flatten(1)
        masked.scatter_(1, rows, 0.0)
        self.bias = [torch.cat([m, b[n:]]) for m, b in zip(masked, self.bias)]
        return super().attend(query, scale, q_len)


@dataclass
class StepOracle(Policy):
    """Per-step selection over the whole prompt KV by ``ranking`` (see the module docstring)."""

    ranking: str = "exact"
    chunk: int = 1
    window: int = 32

    def compress(self, layer):
        return Compressed(StepTopKV(layer.keys, layer.values, ranked_keys(layer.keys, self.ranking),
                                    round(self.budget * layer.length), self.window, self.chunk))


def step_oracle(spec: str, budget: float) -> StepOracle:
    """``step-RANKING[:cN][@B]`` (see the module docstring)."""
    spec, _, at = spec.partition("@")
    ranking, _, chunk = spec.removeprefix("step-").partition(":c")
    return StepOracle(budget=float(at) if at else budget, ranking=ranking, chunk=int(chunk or 1))


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--budgets", default="0.1")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=2500, help="skip rows of more prompt tokens")
    parser.add_argument("--variants", default="snapkv,oracle,merged", help="snapkv, oracle, merged, step-... "
                        "(see the module docstring), comma-separated")
    parser.add_argument("--summaries", action="store_true", help="also the summary rows (their own max_new_tokens; "
                        "fidelity to the full-cache output, no accuracy); the step- variants only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loaded = load_model("smollm2", device="cpu")
    rows = [(t, r) for t, r in task_rows(args.tasks) if t.answers or args.summaries]
    items = []
    for task, row in rows:
        ids = build_text_prompt(loaded.tokenizer, task.context, task.question).inputs["input_ids"][0].tolist()
        if len(ids) > args.max_prompt:
            continue
        new_tokens = int(row.get("max_new_tokens", args.max_new_tokens))
        evidence = []
        if task.answers:
            digits = key_positions(loaded.tokenizer, ids, task.answers[0][0])
            evidence = list(range(max(0, digits[0] - 4), digits[-1] + 1))
        reference = None
        for budget in [1.0] + [float(b) for b in args.budgets.split(",")]:
            one_shot = {"snapkv": lambda: SnapKV(budget=budget), "merged": lambda: MergedTail(budget=budget),
                        "oracle": lambda: OracleKey(budget=budget, evidence=evidence)}
            variants = {"full": "full"} if budget == 1.0 else {
                name: one_shot[name]() if name in one_shot else step_oracle(name, budget)
                for name in args.variants.split(",")}
            for name, method in variants.items():
                if not task.answers and not name.startswith(("full", "step-")):
                    continue
                r = ask(loaded, None, task.question, context=task.context, method=method, max_new_tokens=new_tokens)
                reference = reference if reference is not None else r["answer"]
                items.append({"id": task.id, "variant": name, "budget": budget, "answer": r["answer"],
                              "correct": is_correct(r["answer"], task.answers) if task.answers else None,
                              "fidelity": rouge_l(r["answer"], reference), "tokens": len(ids)})
                print(f"{task.id:24s} {name:14s} {budget:<4g} {items[-1]['correct']!s:5} "
                      f"fid={items[-1]['fidelity']:.2f} {r['answer']!r}", flush=True)
    table = {}
    for i in items:
        table.setdefault(f"{i['variant']}@{i['budget']:g}", []).append(i)
    summary = {k: {"correct": f"{sum(bool(i['correct']) for i in v if i['correct'] is not None)}/"
                              f"{sum(i['correct'] is not None for i in v)}",
                   "summary_fidelity": _mean([i["fidelity"] for i in v if i["correct"] is None])}
               for k, v in table.items()}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"tasks": args.tasks, "summary": summary, "items": items}, indent=1) + "\n")


if __name__ == "__main__":
    main()
