"""The memory budget of one layer: what a method may keep on the device, side structures included.

A budget ``b`` allows ``b·N·H`` prompt entries per layer (an entry is one key and one value of
one KV head), i.e. ``b`` times the bytes of the full prompt KV. Landmarks, detectors and
indices live on the device too, so they are paid for in entries: a method first prices its side
structures, then keeps what the rest of the budget buys. At ``b = 1`` nothing is priced: every
method keeps the whole cache (:attr:`Budget.full`), so it reproduces the full cache exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.compression.scoring import head_entries

# RaggedStore's per-head offsets and lengths (int64 each): paid below b = 1; at b = 1 they are
# the only bytes beyond the full prompt KV, as they are for the ``full`` method itself.
STORE_INDEX_BYTES_PER_HEAD = 16


@dataclass(frozen=True)
class Budget:
    """Budget ``fraction`` of one layer of ``heads`` KV heads and ``length`` prompt positions,
    whose entries are ``entry_bytes`` each; built by :meth:`of` and asked by every method, so
    the arithmetic (and the ``b = 1`` case) lives here once."""

    fraction: float
    length: int
    heads: int
    entry_bytes: int
    device: torch.device = torch.device("cpu")

    @classmethod
    def of(cls, fraction: float, layer: PrefillLayer) -> "Budget":
        if layer.budget_cap is not None:  # a device cap in tokens (a long streamed prompt)
            fraction = min(fraction, layer.budget_cap / layer.length)
        return cls(fraction, layer.length, layer.num_heads, 2 * layer.keys.shape[-1] * layer.keys.element_size(),
                   layer.keys.device)

    @property
    def full(self) -> bool:
        """The whole cache stays: every entry, the whole window, no side structure."""
        return self.fraction >= 1

    @property
    def per_head(self) -> float:
        """``b·N``: a head's share before side structures (what sizes them)."""
        return self.fraction * self.length

    @property
    def head_entries(self) -> int:
        """Entries of every head of a uniform method, ``round(b·N)`` (no side structure)."""
        return head_entries(self.fraction, self.length)

    @property
    def pool(self) -> int:
        """``round(b·N·H)``: the layer's entries for a method that splits them over its heads."""
        return round(self.fraction * self.length * self.heads)

    def entries(self, overhead_bytes: int = 0) -> int:
        """Prompt entries the layer keeps after paying ``overhead_bytes`` of side structures and
        the store's index; 0 when the side structures alone exceed the budget (the caller then
        keeps nothing it could retrieve, and reports it). At ``b = 1`` all ``N·H``, whatever the
        side structures would cost: a full cache needs none."""
        everything = self.length * self.heads
        if self.full:
            return everything
        overhead = overhead_bytes + STORE_INDEX_BYTES_PER_HEAD * self.heads
        allowed = self.fraction * self.length * self.heads * self.entry_bytes
        return max(0, math.floor((allowed - overhead) / self.entry_bytes))

    def counts(self, entries: int | None = None) -> torch.Tensor:
        """``entries`` (default :attr:`head_entries`) for every head, LongTensor [H] on the layer's device."""
        entries = self.head_entries if entries is None else entries
        return torch.full((self.heads,), entries, dtype=torch.long, device=self.device)

    def window(self, window: int, entries: float | None = None) -> int:
        """The observation window a head of ``entries`` (default ``b·N``) can afford: at most
        half of them, so selection keeps room; at ``b = 1`` all of it (within the prompt)."""
        if self.full:
            return min(window, self.length)
        return max(0, min(window, math.floor((self.per_head if entries is None else entries) / 2)))
