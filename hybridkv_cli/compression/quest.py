"""``quest``: query-aware page selection at every decode step (Tang et al., 2024).

The full prompt KV stays on the device (Quest saves reads, not memory), in the shared ragged
store, beside per-page min/max key metadata. At each decode step and for each KV head, every page
gets an upper bound of its best attention logit, ``sum_d max(q_d·min_d, q_d·max_d)`` (max over the
GQA group); the head reads the top pages that fit its budget ``round(b·N)``, always with the last
(possibly partial) page, plus the generated tokens. ``device_bytes`` counts the full KV and the
metadata (none at b = 1, where every entry is read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hybridkv_kernels import RaggedKV

from hybridkv_cli.compression.base import Compressed, LayerKV, Policy, PrefillLayer
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.landmarks import page_bounds
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.store import RaggedStore, tensor_bytes


@dataclass
class QuestLayerKV(LayerKV):
    """A layer's full prompt KV (ragged store, every entry) plus page metadata.

    Attributes
    ----------
    store : RaggedStore
        Every prompt entry of every head, and the generated tokens.
    kmin, kmax : Tensor [H, P, d]
        Metadata of the selectable pages (every page but the last, which is always read).
    pages : int
        Selectable pages read per step and head.
    page_size, length : int
    max_read : int
        Most prompt entries one head has read in one step so far.
    """

    store: RaggedStore
    kmin: torch.Tensor
    kmax: torch.Tensor
    pages: int
    page_size: int
    length: int
    max_read: int = 0
    steps: int = 0

    @property
    def read_entries(self) -> int:
        """Prompt entries each head reads per step: the selected pages and the last page."""
        return self.pages * self.page_size + self.length - self.kmin.shape[1] * self.page_size

    def segments(self, query: torch.Tensor, scale: float) -> RaggedKV:
        self.steps += 1
        if self.pages == self.kmin.shape[1]:  # every page: read the store as it is
            self.max_read = max(self.max_read, self.length)
            return self.store.segments()
        heads = query.shape[0]
        device = query.device
        top = page_bounds(query, self.kmin, self.kmax).topk(self.pages, dim=1).indices.sort(dim=1).values
        within = torch.arange(self.page_size, device=device)
        tail = torch.arange(self.kmin.shape[1] * self.page_size, self.length, device=device)
        page_rows = (top.unsqueeze(-1) * self.page_size + within).flatten(1)
        positions = torch.cat([page_rows, tail.expand(heads, -1)], dim=1)  # [H, read], position order
        rows = (self.store.offsets.unsqueeze(1) + positions).flatten()
        read = positions.shape[1]
        self.max_read = max(self.max_read, read)
        lengths = torch.full((heads,), read, dtype=torch.long, device=device)
        return RaggedKV(self.store.keys[rows], self.store.values[rows], lengths.cumsum(0) - lengths, lengths,
                        self.store.gen_k, self.store.gen_v, self.store.n_gen, read)

    def device_bytes(self) -> int:
        return self.store.device_bytes() + tensor_bytes(self.kmin, self.kmax)


@register("quest")
@dataclass
class Quest(Policy):
    """Quest: full KV on the device, each decode step reads the top pages (upper-bound score) within b·N.

    Parameters
    ----------
    page_size : int
        Tokens per page (8 here, as HybridKV's chunks).

    Each head reads ``round(b·N)`` prompt entries per step at most, or the last page if that is
    longer; memory is not reduced.
    """

    page_size: int = 8

    def compress(self, layer: PrefillLayer) -> Compressed:
        n, page = layer.length, self.page_size
        budget = Budget.of(self.budget, layer)
        # Every page but the last (possibly partial) one; at b = 1 every entry is read, so none
        # is selected and no metadata is kept.
        selectable = 0 if budget.full else (n - 1) // page
        keys = layer.keys[:, : selectable * page].unflatten(1, (selectable, page))
        last = n - selectable * page
        pages = min(selectable, max(0, budget.head_entries - last) // page)
        keep = torch.ones(layer.num_heads, n, dtype=torch.bool, device=layer.keys.device)
        kv = QuestLayerKV(
            RaggedStore.build(layer.keys, layer.values, keep),
            keys.amin(dim=2), keys.amax(dim=2), pages, page, n,
        )
        return Compressed(kv, (n, pages, kv.read_entries))

    def summary(self, reports: list[tuple[int, int, int]]) -> dict:
        return {
            "page_size": self.page_size,
            "prompt_entries": reports[0][0] if reports else 0,
            "pages_per_step": [pages for _, pages, _ in reports],
            "read_entries_per_head": [read for _, _, read in reports],
            "device_keeps_full_kv": True,
        }
