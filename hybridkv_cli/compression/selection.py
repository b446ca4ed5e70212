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
    order = priority.argsort(dim=1, descending=True, stable=True)
    ranks = torch.arange(priority.shape[1], device=priority.device).expand_as(order)
    keep_sorted = ranks < counts.clamp(0, priority.shape[1]).unsqueeze(1)
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
