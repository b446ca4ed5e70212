"""The memory budget in bytes: what a layer may keep on the device, side structures included.

A budget ``b`` allows ``b·N·H`` prompt entries per layer (an entry is one key and one value of
one KV head), i.e. ``b`` times the bytes of the full prompt KV. Landmarks, detectors and
indices live on the device too, so they are paid for in entries: a method first prices its side
structures, then keeps what the rest of the budget buys.
"""

from __future__ import annotations

import math

from hybridkv_cli.compression.base import PrefillLayer

# RaggedStore's per-head offsets and lengths (int64 each).
STORE_INDEX_BYTES_PER_HEAD = 16


def entry_bytes(layer: PrefillLayer) -> int:
    """Bytes of one entry: a key and a value of one head."""
    return 2 * layer.keys.shape[-1] * layer.keys.element_size()


def budget_entries(budget: float, layer: PrefillLayer, overhead_bytes: int = 0) -> int:
    """Prompt entries a layer may keep after paying ``overhead_bytes`` of side structures.

    Never more than the whole prompt (``N·H``); 0 when the side structures alone exceed the
    budget (the caller then keeps nothing it could retrieve, and reports it).
    """
    each = entry_bytes(layer)
    allowed = budget * layer.length * layer.num_heads * each
    overhead = overhead_bytes + STORE_INDEX_BYTES_PER_HEAD * layer.num_heads
    return max(0, min(layer.length * layer.num_heads, math.floor((allowed - overhead) / each)))


def fit_window(window: int, per_head: float) -> int:
    """The observation window a head can afford: at most half of its ``per_head`` entries."""
    return max(0, min(window, math.floor(per_head / 2)))
