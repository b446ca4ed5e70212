"""Stage 1: text-centric head classification (static = sparse, stable focus; dynamic = diffuse)."""

from __future__ import annotations

import math

import torch


# Attention sinks: the first tokens, which many heads attend to whatever the query.
SINK_TOKENS = 4


def sparsity_scores(attn: torch.Tensor, topk_share: float, skip: int = 0) -> torch.Tensor:
    """Attention mass on the top ``ceil(p·N)`` positions of each head.

    Parameters
    ----------
    attn : Tensor [H_kv, N]
        Text-centric attention: mean over the window queries and the GQA group (rows sum to 1).
    topk_share : float
        p, the share of positions whose mass counts.
    skip : int
        Leading positions left out of the top (sink-aware score: a head parked on the sinks
        is not "sparse", it has no focus to keep). The mass is not renormalised.
    """
    k = max(1, math.ceil(topk_share * attn.shape[1]))
    rest = attn[:, min(skip, attn.shape[1] - 1):].float()
    return rest.topk(min(k, rest.shape[1]), dim=1).values.sum(dim=1)


def classify_static(
    attn: torch.Tensor, theta: float, topk_share: float, sink_aware: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(static, scores)``: static heads are those whose sparsity score is >= theta."""
    scores = sparsity_scores(attn, topk_share, SINK_TOKENS if sink_aware else 0)
    return scores >= theta, scores
