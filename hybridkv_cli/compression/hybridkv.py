"""``hybridkv``: static heads pruned once (text first), dynamic heads served by chunk retrieval."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv_cli.compression import register
from hybridkv_cli.compression.allocate import LayerPlan, plan_layer
from hybridkv_cli.compression.base import Policy, PrefillLayer
from hybridkv_cli.compression.classify import classify_static
from hybridkv_cli.compression.retrieval import DynamicHeads
from hybridkv_cli.compression.static_prune import text_prior_keep
from hybridkv_cli.compression.store import RaggedStore
from hybridkv_kernels import window_scores


@dataclass
class HybridLayerKV:
    """A layer's ragged store plus, when the layer has dynamic heads, their retrieval state."""

    store: RaggedStore
    dynamic: DynamicHeads | None

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        if self.dynamic is not None:
            self.dynamic.refresh(query, self.store)
        return self.store.attend(query, scale)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.store.append(key, value)

    def device_bytes(self) -> int:
        return self.store.device_bytes() + (self.dynamic.device_bytes() if self.dynamic else 0)

    def host_bytes(self) -> int:
        return self.dynamic.host_bytes() if self.dynamic else 0

    def transferred_bytes(self) -> int:
        return self.dynamic.transferred if self.dynamic else 0


@dataclass
class LayerRecord:
    """What the report shows of one layer."""

    sparsity: list[float]
    plan: LayerPlan
    length: int


@register("hybridkv")
@dataclass
class HybridKV(Policy):
    """HybridKV: text-centric head classification, top-down budgets, text-prior pruning + chunk retrieval.

    Parameters
    ----------
    theta : float
        Heads whose sparsity score is >= theta are static.
    sparsity_topk : float
        p: the sparsity score is the attention mass on the top ``ceil(p·N)`` positions.
    share : float
        r: a dynamic head's budget as a share of the average head budget.
    chunk_size : int
        Tokens per retrieval chunk.
    alpha : float
        Floor of a static head's budget, as a share of the static average (Ada-KV safeguard).
    """

    budget: float = 0.1
    theta: float = 0.9
    sparsity_topk: float = 0.05
    share: float = 0.75
    chunk_size: int = 8
    alpha: float = 0.2
    records: dict[int, LayerRecord] = field(default_factory=dict, repr=False)

    def compress(self, layer: PrefillLayer) -> HybridLayerKV:
        n = layer.length
        window = min(self.window, n)
        attn, pooled = window_scores(layer.window_query(window), layer.keys, scale=layer.scale)
        static, sparsity = classify_static(attn, self.theta, self.sparsity_topk)
        plan = plan_layer(pooled, static, budget=self.budget, window=window, share=self.share,
                          chunk=self.chunk_size, alpha=self.alpha)
        self.records[layer.index] = LayerRecord(sparsity.tolist(), plan, n)

        dynamic = ~static
        num_chunks = max(0, n - window) // self.chunk_size
        slot_rows = plan.chunks * self.chunk_size
        keep = torch.zeros_like(pooled, dtype=torch.bool)
        keep[static] = text_prior_keep(pooled[static], layer.visual, window, plan.entries[static])
        keep[dynamic, num_chunks * self.chunk_size:] = True  # the resident tail of dynamic heads
        reserve = torch.where(dynamic, slot_rows, 0)
        store = RaggedStore.build(layer.keys, layer.values, keep, reserve)
        retrieval = None
        if dynamic.any():
            retrieval = DynamicHeads.offload(
                layer.keys, layer.values, dynamic.nonzero().flatten(), store,
                chunks=plan.chunks, chunk=self.chunk_size, num_chunks=num_chunks,
            )
        return HybridLayerKV(store, retrieval)

    def summary(self) -> dict:
        layers = [self.records[i] for i in sorted(self.records)]
        static = [int(r.plan.static.sum()) for r in layers]
        dynamic = [len(r.sparsity) - s for r, s in zip(layers, static)]
        total = sum(static) + sum(dynamic)
        target = sum(r.plan.target for r in layers)
        rounding = sum(r.plan.rounding for r in layers)

        def mean_entries(kind_static: bool) -> float | None:
            vals = [e for r in layers for e, s in zip(r.plan.entries.tolist(), r.plan.static.tolist()) if s == kind_static]
            return sum(vals) / len(vals) if vals else None

        return {
            "static": sum(static),
            "dynamic": sum(dynamic),
            "static_share": sum(static) / total if total else 0.0,
            "per_layer": {
                "static": static,
                "dynamic": dynamic,
                "chunks_per_dynamic_head": [r.plan.chunks for r in layers],
                "entries": [r.plan.entries.tolist() for r in layers],
                "sparsity": [[round(s, 4) for s in r.sparsity] for r in layers],
            },
            "budget_per_type": {
                "static_mean_entries": mean_entries(True),
                "dynamic_entries": mean_entries(False),
            },
            "budget_entries": target,
            "padding_entries": rounding,
            "padding_share": rounding / target if target else 0.0,
            "theta": self.theta,
            "p": self.sparsity_topk,
            "r": self.share,
            "chunk_size": self.chunk_size,
        }
