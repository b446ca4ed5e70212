"""A selection that changes less from step to step: the scores a dynamic head's top-k ranks.

A dynamic head's slots follow its ranking step by step, and every chunk that enters is copied
from host memory. On the text dev rows about a third of a head's retrieved tokens change every
step, most of them at the edge of the selection, where near-equal scores trade places and
attention gives them little weight. Two ways to copy less:

* **stickiness** (``bonus``): a held chunk ranks ``bonus`` above its score, so a newcomer enters
  only when it beats the weakest held chunk by that margin. At 1 logit it copies a third less
  on the dev rows with the same answers (opt-in: the test rows answered fewer; see
  docs/step_model.md).
* **a cap** (``limit``): a step's selection is the top ``n`` of the held chunks and the ``limit``
  best others, so at most ``limit`` chunks enter, a bound on the copy whatever the prompt's
  length. A head with an empty slot is not capped (it fills).

:func:`cap_scores` is the torch path (and the reference): the scores it raises or sets to
``-inf`` make the unchanged top-k (tie rule included) choose. On Triton both are inside the
selection's one launch (``capped_topk_kernel``, :func:`~hybridkv_kernels.chunk_topk.launch_topk`
with ``limit`` and ``bonus``): no launch of their own.
"""

from __future__ import annotations

import torch

from .chunk_topk import order_keys

__all__ = ["cap_scores"]


def cap_scores(scores: torch.Tensor, resident: torch.Tensor, limit: int = 0, bonus: float = 0.0) -> torch.Tensor:
    """``scores`` [rows, C] as the selection ranks them (a new tensor): the held chunks raised by
    ``bonus``; with ``limit`` > 0, every chunk not held that is below the ``limit``-th best of
    them set to ``-inf``.

    Parameters
    ----------
    scores : Tensor [rows, C] fp32
    resident : LongTensor [rows, n]
        Chunk held by each slot, -1 = empty (a row with an empty slot is not capped).
    limit : int
        Most chunks a row may take in that it does not hold (0: no cap).
    bonus : float
        What a held chunk's score gains, in the scores' units.
    """
    chunks = scores.shape[1]
    held = resident >= 0
    is_resident = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, resident.clamp_min(0), held)
    out = scores + bonus * is_resident if bonus else scores
    if limit <= 0 or chunks == 0 or limit >= chunks:
        return out
    order = order_keys(out)  # distinct: exactly ``limit`` others reach the floor, ties as the top-k breaks them
    lowest = torch.iinfo(torch.int64).min
    floor = order.masked_fill(is_resident, lowest).topk(limit, dim=1).values[:, -1:]
    floor = floor.masked_fill(~held.all(dim=1, keepdim=True), lowest)  # a slot to fill: no cap
    return out.masked_fill(~is_resident & (order < floor), float("-inf"))
