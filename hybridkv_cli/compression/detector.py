"""A low-rank view of a head's prompt keys on the device: approximate logits for every token.

The prompt keys of a KV head ``K [P, d]`` are projected on their top ``R`` right singular
vectors ``V_R [d, R]``; ``K·V_R`` approximates every key's logit with any query as
``(q·V_R)·(k·V_R)``, at ``R`` numbers a token instead of ``2d`` (key and value). The projected
keys are stored as int8 with one scale per channel (the channels' spreads differ by their
singular values, tokens do not need their own scale), so at ``R = 8`` a token costs 8 bytes on
the device: 1/64 of its fp32 KV at ``d = 64``, 1/64 of its bf16 KV at ``d = 128``.

Used by refresh (which tokens has attention drifted to?) and by dynamic-head retrieval
(rank chunks by their best token rather than by their mean key).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.store import tensor_bytes


@dataclass
class LowRankKeys:
    """Projected prompt keys of ``H`` heads.

    Attributes
    ----------
    basis : Tensor [H, d, R] fp32
        Top right singular vectors of each head's keys.
    codes : int8 Tensor [H, R, P]
        Projected keys, transposed (``codesᵀ * scale ≈ K·basis``): a query's product with them
        is then a plain batched matmul.
    scale : Tensor [H, R] fp32
    """

    basis: torch.Tensor
    codes: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def build(cls, keys: torch.Tensor, rank: int) -> "LowRankKeys":
        """Project ``keys`` [H, P, d] on their top ``rank`` right singular vectors."""
        k = keys.float()
        rank = min(rank, k.shape[-1])
        basis = torch.linalg.svd(k, full_matrices=False).Vh[:, :rank].transpose(1, 2).contiguous()
        projected = torch.bmm(k, basis)  # [H, P, R]
        scale = projected.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        codes = torch.round(projected / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(basis, codes.transpose(1, 2).contiguous(), scale)

    @staticmethod
    def bytes_for(heads: int, tokens: int, dim: int, rank: int) -> int:
        """Device bytes of :meth:`build`'s result, known before building it (budget accounting)."""
        rank = min(rank, dim)
        return heads * (dim * rank * 4 + tokens * rank + rank * 4)

    def logits(self, query: torch.Tensor) -> torch.Tensor:
        """Approximate ``q·k`` for every query of the group and every token, [H, G, P] fp32.

        Parameters
        ----------
        query : Tensor [H, G, d]
        """
        q = torch.bmm(query.float(), self.basis) * self.scale[:, None]  # fold the scale into q
        return torch.bmm(q, self.codes.float())

    def device_bytes(self) -> int:
        return tensor_bytes(self.basis, self.codes, self.scale)
