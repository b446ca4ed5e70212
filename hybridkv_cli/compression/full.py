"""``full``: no compression, through the same store and decode kernel as every other method."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression import register
from hybridkv_cli.compression.base import Policy, PrefillLayer
from hybridkv_cli.compression.store import RaggedStore


@register("full")
@dataclass
class Full(Policy):
    """Every head keeps every prompt entry; ``budget`` is ignored (always 1.0)."""

    def __post_init__(self):
        self.budget = 1.0

    def compress(self, layer: PrefillLayer) -> RaggedStore:
        keep = torch.ones(layer.num_heads, layer.length, dtype=torch.bool, device=layer.keys.device)
        return RaggedStore.build(layer.keys, layer.values, keep)
