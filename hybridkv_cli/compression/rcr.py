"""``rcr``: SnapKV's one-shot selection at prefill, refreshed while decoding (rate-controlled refresh).

Every head keeps its window plus ``n`` slots that start with SnapKV's choice (pooled window
attention) and are re-selected when the layer's drift fires the rate controller
(:mod:`~hybridkv_cli.compression.refresh`). The detector and the slot indices are paid from
the budget, so the slots are fewer than SnapKV's entries at the same ``b``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridkv_cli.compression.base import Compressed, PrefillLayer
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.hybridkv import HybridLayerKV
from hybridkv_cli.compression.refresh import (RateController, Refresher, RefreshOptions, RefreshPolicy, refresh_summary,
                                              split_slots)
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.scoring import snap_keep, window_attention
from hybridkv_cli.compression.store import RaggedStore


@register("rcr")
@dataclass
class RCR(RefreshPolicy):
    """Rate-controlled refresh over a SnapKV selection.

    Parameters
    ----------
    refresh : {"rcr", "periodic", "none"}
        ``none`` is the one-shot selection with the same layout and budget accounting.
    refresh_rate : float
        ρ, the share of layer-steps that refresh.
    refresh_period : int
        T for ``periodic``.
    refresh_slots : int
        c: most slots of a refreshed head that move; the rest keep the best of the prefill
        selection (bounds the cost of a refresh at long prompts).
    """

    window: int = 32

    def compress(self, layer: PrefillLayer) -> Compressed:
        n, heads = layer.length, layer.num_heads
        budget = Budget.of(self.budget, layer)
        _, pooled, _ = window_attention(layer, self.window)
        options = RefreshOptions.of(self)
        refresh_on = self.refresh != "none" and not budget.full
        overhead = Refresher.device_bytes_for(heads, math.ceil(budget.per_head), n, layer.keys.shape[-1],
                                              options.rank) if refresh_on else 0
        per_head = budget.entries(overhead) // heads
        window = budget.window(self.window, per_head)
        slots, span = per_head - window, n - window
        counts = budget.counts(per_head)
        if not refresh_on or not 0 < slots < span:  # nothing to refresh: one-shot selection
            store = RaggedStore.build(layer.keys, layer.values, snap_keep(pooled, window, counts))
            return Compressed(HybridLayerKV(store, None), (window, per_head, None))
        fixed, moving = split_slots(pooled[:, :span].topk(slots, dim=1).indices, options)
        keep = torch.zeros_like(pooled, dtype=torch.bool)
        keep[:, span:] = True
        keep.scatter_(1, fixed, True)
        store = RaggedStore.build(layer.keys, layer.values, keep, torch.full_like(counts, moving.shape[1]))
        controller = RateController.shared(layer.run, options, layer.keys.device)
        every = torch.arange(heads, device=layer.keys.device)
        refresher = Refresher.offload(layer.keys, layer.values, every, store, fixed, moving, options, controller)
        return Compressed(HybridLayerKV(store, None, refresher), (window, slots, refresher))

    def summary(self, records: list[tuple[int, int, Refresher | None]]) -> dict:
        return {
            "window": [w for w, _, _ in records],
            "slots_per_head": [s for _, s, _ in records],
            "refresh": refresh_summary(self.refresh, self.refresh_rate, [r for _, _, r in records]),
        }
