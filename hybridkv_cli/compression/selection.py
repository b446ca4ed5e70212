"""Per-head top-k selection with a different k for every head, as one tensor op."""

from __future__ import annotations

import torch


def keep_top(priority: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mask of the ``counts[h]`` highest-priority entries of each row.

    Parameters
    ----------
    priority : Tensor [H, N]
    counts : LongTensor [H]
        Entries to keep per row (clipped to [0, N]).

    Returns
    -------
    BoolTensor [H, N]
    """
    return keep_top_tiered(priority, priority.new_zeros(()), counts)


def keep_top_tiered(priority: torch.Tensor, tier: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mask of the ``counts[h]`` first entries of each row in (tier, priority) order, both descending.

    Lexicographic, so scores of any magnitude (cumulative attention sums, positions) never cross
    a tier; ties within a tier keep position order.

    Parameters
    ----------
    priority : Tensor [H, N]
    tier : Tensor [N] or [H, N]
        Higher tiers are taken first, whatever their priority.
    counts : LongTensor [H]
        Entries to keep per row (clipped to [0, N]).

    Returns
    -------
    BoolTensor [H, N]
    """
    order = priority.argsort(dim=1, descending=True, stable=True)
    by_tier = tier.expand_as(priority).gather(1, order).argsort(dim=1, descending=True, stable=True)
    order = order.gather(1, by_tier)
    positions = torch.arange(priority.shape[1], device=priority.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    return rank < counts.clamp(0, priority.shape[1]).unsqueeze(1)
