"""Stage 2: top-down budget allocation of one layer (head type first, then individual heads)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class LayerPlan:
    """Device-resident prompt entries of every KV head of a layer.

    Attributes
    ----------
    static : BoolTensor [H]
    entries : LongTensor [H]
        Entries per head: static heads' kept tokens; dynamic heads' retrieval slots
        (``chunks * chunk``) plus their resident tail (the window and the < chunk positions
        before it that do not fill a chunk).
    chunks : int
        Retrieval chunks per dynamic head.
    target : int
        The layer budget ``round(b·N·H)``.
    """

    static: torch.Tensor
    entries: torch.Tensor
    chunks: int
    target: int

    @property
    def rounding(self) -> int:
        """Entries beyond (positive) or short of (negative) the budget, from power-of-two rounding."""
        return int(self.entries.sum()) - self.target


def nearest_power_of_two(x: float) -> int:
    """Nearest power of two to ``x`` (0 below 0.5; ties go down)."""
    if x < 0.5:
        return 0
    low = 2 ** math.floor(math.log2(x)) if x >= 1 else 1
    return low if x - low <= 2 * low - x else 2 * low


def adaptive_split(pooled: torch.Tensor, total: int, alpha: float) -> torch.Tensor:
    """Ada-KV split of ``total`` entries over heads: a floor of ``alpha·total/S`` each, the rest
    to the heads that win the global top scores. Never more than N per head.

    Parameters
    ----------
    pooled : Tensor [S, N]
        Pooled window scores of the S heads sharing the budget.
    """
    heads, n = pooled.shape
    total = max(0, min(total, heads * n))
    floor = min(n, int(alpha * total / heads))
    rest = total - heads * floor
    counts = torch.full((heads,), floor, dtype=torch.long, device=pooled.device)
    if rest > 0:
        # Each head's top `floor` entries are already held; compete for the rest globally.
        remaining = pooled.float().sort(dim=1, descending=True).values[:, floor:]
        winners = remaining.flatten().topk(rest).indices // remaining.shape[1]
        counts += torch.bincount(winners, minlength=heads)
    return counts


def plan_layer(
    pooled: torch.Tensor,
    static: torch.Tensor,
    *,
    target: int,
    window: int,
    share: float,
    chunk: int,
    alpha: float,
    adaptive: bool = True,
) -> LayerPlan:
    """Split the layer's ``target`` entries (``b·N·H`` less side structures) between head types,
    then between heads.

    Dynamic heads each get ``r·B̄`` (B̄ = target / H; type total clipped to ``target``; all of
    ``B̄`` when the layer has no static head) as whole retrieval chunks, the chunk count rounded
    to the nearest power of two (down, where rounding up would overrun the layer budget); static
    heads share the remainder adaptively (``adaptive``) or evenly (refreshed heads re-select
    while decoding, so a prefill-time ranking of heads means little). What one type cannot use
    (more than N per head) goes to the other type, so at b = 1 every head holds the whole prompt.
    """
    heads, n = pooled.shape
    avg = target / heads
    n_dyn = int((~static).sum())
    n_stat = heads - n_dyn
    num_chunks = max(0, n - window) // chunk
    tail = n - num_chunks * chunk
    entries = torch.zeros(heads, dtype=torch.long, device=pooled.device)

    chunks = 0
    if n_dyn:
        per_dyn = avg if n_stat == 0 else min(share * avg * n_dyn, heads * avg) / n_dyn
        wanted = (per_dyn - tail) / chunk
        chunks = min(num_chunks, nearest_power_of_two(wanted))
        if n_dyn * (chunks * chunk + tail) > target:
            # Rounding up would overrun the whole layer budget: round down instead, to none if
            # even one chunk does not fit (the caller then has no use for retrieval).
            chunks = min(chunks, 2 ** math.floor(math.log2(wanted)) if wanted >= 1 else 0)
            if n_dyn * (chunks * chunk + tail) > target:
                chunks = 0
    static_total = target - n_dyn * (chunks * chunk + tail)
    if n_stat:
        even = torch.full((n_stat,), min(n, max(0, static_total) // n_stat), dtype=torch.long, device=pooled.device)
        entries[static] = adaptive_split(pooled[static], static_total, alpha) if adaptive else even
    if n_dyn:
        unused = target - n_dyn * (chunks * chunk + tail) - int(entries[static].sum())
        if unused >= n_dyn * chunk:  # static heads are full (or absent): the rest becomes chunks
            chunks = min(num_chunks, chunks + unused // (n_dyn * chunk))
        entries[~static] = chunks * chunk + tail
    return LayerPlan(static=static, entries=entries, chunks=chunks, target=target)
