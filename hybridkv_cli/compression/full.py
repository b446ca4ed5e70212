"""``full``: no compression, through the same store and decode kernel as every other method."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.base import Compressed, Policy, PrefillLayer
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.store import RaggedStore
from hybridkv_cli.io.errors import UsageError


@register("full")
@dataclass
class Full(Policy):
    """Every head keeps every prompt entry (budget 1)."""

    budget: float = 1.0

    def __post_init__(self):
        if self.budget != 1:
            raise UsageError(f"full keeps the whole cache: its budget is 1, got {self.budget:g}", "--budget")

    def compress(self, layer: PrefillLayer) -> Compressed:
        keep = torch.ones(layer.num_heads, layer.length, dtype=torch.bool, device=layer.keys.device)
        return Compressed(RaggedStore.build(layer.keys, layer.values, keep))
