"""What several baselines share: per-head budgets and SnapKV-style window selection.

SnapKV, MadaKV and SparseMM all score a head's prompt positions with the window attention
(mean over the last ``w`` prompt queries and the GQA group), max-pooled over positions, and keep
the window itself plus the best-scored rest. They differ only in how many entries each head
(or each modality of a head) gets; that split is :func:`proportional_split`.
"""

from __future__ import annotations

import torch

from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.compression.selection import keep_top_tiered
from hybridkv_kernels import window_scores


def head_entries(budget: float, length: int) -> int:
    """Prompt entries one head keeps under a uniform budget: ``round(b·N)`` within ``[0, N]``.

    The layer then holds ``H·round(b·N)`` entries, within ``H/2`` of ``b·N·H``. Methods ask it
    through :attr:`~hybridkv_cli.compression.budget.Budget.head_entries`; a bare fraction and
    length are what the benchmarks' own policies have.
    """
    return max(0, min(length, round(budget * length)))


def proportional_split(total: int, weights: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Split ``total`` entries over heads in proportion to ``weights``, at most ``caps[h]`` each.

    Water-filling: what a capped head cannot take goes to the others, again in proportion, and
    whole entries are handed out by largest remainder. The result sums to
    ``min(total, caps.sum())`` exactly. Heads whose weights are all zero share equally.

    Parameters
    ----------
    total : int
    weights : Tensor [H]
        Non-negative.
    caps : LongTensor [H]

    Returns
    -------
    LongTensor [H]
    """
    caps = caps.to(torch.long)
    weights = weights.to(torch.float64).clamp_min(0)
    counts = torch.zeros_like(caps)
    remaining = min(int(total), int(caps.sum()))
    while remaining > 0:
        room = caps - counts
        open_ = room > 0
        w = torch.where(open_, weights, 0.0)
        if float(w.sum()) <= 0:
            w = open_.to(torch.float64)
        ideal = w / w.sum() * remaining
        grant = torch.minimum(ideal.floor().long(), room)
        capped = bool((ideal > room).any())
        if not capped:
            # Sum of floors is short of `remaining` by less than the number of open heads: one more
            # entry each to the largest fractional parts (they have room, as ideal <= room).
            short = remaining - int(grant.sum())
            if short > 0:
                frac = torch.where(open_, ideal - ideal.floor(), -1.0)
                grant[frac.topk(short).indices] += 1
        counts += grant
        remaining -= int(grant.sum())
    return counts


def window_attention(layer: PrefillLayer, window: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Window attention of ``layer`` and its max-pooled form (kernel 7).

    Returns
    -------
    attn, pooled : Tensor [H_kv, N] fp32
        See :func:`hybridkv_kernels.window_scores`; each row of ``attn`` sums to 1.
    window : int
        The window actually used, ``min(window, N)``.
    """
    w = min(window, layer.length)
    attn, pooled = window_scores(layer.window_query(w), layer.keys, scale=layer.scale)
    return attn, pooled, w


def snap_keep(
    pooled: torch.Tensor, window: int, counts: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """SnapKV selection: each head keeps the window first, then its best pooled scores.

    Parameters
    ----------
    pooled : Tensor [H, N]
        Max-pooled window attention.
    window : int
        The last ``window`` positions come first (by score among themselves if the count is
        smaller than the window).
    counts : LongTensor [H]
        Entries per head.
    allowed : BoolTensor [N] or [H, N], optional
        Only these positions may be kept (e.g. one modality); counts are clipped to them.

    Returns
    -------
    BoolTensor [H, N]
        At ``counts == N`` every entry, so ``b = 1`` keeps the whole prompt.
    """
    n = pooled.shape[1]
    tier = torch.zeros(n, device=pooled.device)
    tier[max(0, n - window):] = 1.0
    if allowed is not None:
        allowed = allowed.expand_as(pooled)
        tier = torch.where(allowed, tier, -1.0)
        counts = torch.minimum(counts, allowed.sum(dim=1))
    return keep_top_tiered(pooled, tier, counts)
