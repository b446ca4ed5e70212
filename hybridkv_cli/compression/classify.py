"""Stage 1: text-centric head classification (static = sparse, stable focus; dynamic = diffuse)."""

from __future__ import annotations

import math

import torch


def sparsity_scores(attn: torch.Tensor, topk_share: float) -> torch.Tensor:
    """Attention mass on the top ``ceil(p·N)`` positions of each head.

    Parameters
    ----------
    attn : Tensor [H_kv, N]
        Text-centric attention: mean over the window queries and the GQA group (rows sum to 1).
    topk_share : float
        p, the share of positions whose mass counts.
    """
    k = max(1, math.ceil(topk_share * attn.shape[1]))
    return attn.float().topk(k, dim=1).values.sum(dim=1)


def classify_static(attn: torch.Tensor, theta: float, topk_share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(static, scores)``: static heads are those whose sparsity score is >= theta."""
    scores = sparsity_scores(attn, topk_share)
    return scores >= theta, scores
