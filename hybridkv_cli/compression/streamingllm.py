"""``streamingllm``: attention sinks + the most recent tokens (Xiao et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.base import Compressed, Policy, PrefillLayer
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.store import RaggedStore


@register("streamingllm")
@dataclass
class StreamingLLM(Policy):
    """StreamingLLM: every head keeps the first ``sinks`` prompt tokens and the most recent ones.

    Parameters
    ----------
    sinks : int
        Attention-sink tokens kept at the start of the prompt (4 in the paper).

    Each head keeps ``round(b·N)`` entries: ``min(sinks, round(b·N))`` sinks, the rest the most
    recent prompt positions.
    """

    sinks: int = 4

    def compress(self, layer: PrefillLayer) -> Compressed:
        n = layer.length
        entries = Budget.of(self.budget, layer).head_entries
        sinks = min(self.sinks, entries)
        recent = entries - sinks
        keep = torch.zeros(layer.num_heads, n, dtype=torch.bool, device=layer.keys.device)
        keep[:, :sinks] = True
        if recent:
            keep[:, n - recent:] = True
        return Compressed(RaggedStore.build(layer.keys, layer.values, keep), (sinks, recent))

    def summary(self, reports: list[tuple[int, int]]) -> dict:
        sinks, recent = reports[-1] if reports else (0, 0)
        return {"sinks": self.sinks, "entries_per_head": {"sinks": sinks, "recent": recent}}
