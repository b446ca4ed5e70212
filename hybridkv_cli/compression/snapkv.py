"""``snapkv``: window attention, max-pooled, picks what every head keeps (Li et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv_cli.compression.base import Compressed, Policy, PrefillLayer
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.scoring import snap_keep, window_attention
from hybridkv_cli.compression.store import RaggedStore


@register("snapkv")
@dataclass
class SnapKV(Policy):
    """SnapKV: each head keeps the observation window plus its top window-attention positions.

    Score = attention of the last ``window`` prompt queries (mean over them and the GQA group),
    max-pooled over positions (kernel 7). Every head keeps ``round(b·N)`` entries: the window,
    then the ``round(b·N) - w`` best-scored other positions. Uniform budget per head.
    """

    window: int = 32

    def compress(self, layer: PrefillLayer) -> Compressed:
        _, pooled, window = window_attention(layer, self.window)
        keep = snap_keep(pooled, window, Budget.of(self.budget, layer).counts())
        return Compressed(RaggedStore.build(layer.keys, layer.values, keep))
