"""Stage 3a: text-prior pruning of static heads, once at prefill."""

from __future__ import annotations

import torch

from hybridkv_cli.compression.selection import keep_top_tiered


def text_prior_keep(pooled: torch.Tensor, visual: torch.Tensor, window: int, budgets: torch.Tensor) -> torch.Tensor:
    """Entries each head keeps: the window first, then text tokens by score, then visual tokens.

    Parameters
    ----------
    pooled : Tensor [H, N]
        Max-pooled text-centric attention of each head.
    visual : BoolTensor [N]
        Visual-token positions.
    window : int
        The last ``window`` positions form the observation window.
    budgets : LongTensor [H]
        Entries per head.
    """
    n = pooled.shape[1]
    tier = (~visual).long()  # text 1, visual 0
    tier[max(0, n - window):] = 2
    return keep_top_tiered(pooled, tier, budgets)
