"""The vision encoder's windowed attention with the windows of one length in one call.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL encode a video's patches in attention windows (a frame pair,
or a window of it), given as ``cu_seqlens``. With flash attention transformers attends them all in
one variable-length call; with SDPA, the default, it calls attention once per window: 96 calls
for the demo's 64-frame clip, and for Qwen2.5-VL-7B on 64 frames of 448x448 about 14,500 (512
windows in each of its 28 windowed blocks, a frame pair's in each of the 4 others), each a kernel
launch on a GPU. :class:`WindowAttention` stacks the windows of each length into one batch and
makes one SDPA call of it, which computes every window exactly as its own call does (the same
output bit for bit, tested on the CPU for every family). Every model :func:`load_model
<hybridkv_cli.models.registry.load_model>` loads whose vision encoder runs SDPA gets it in place of
that attention: the same parameters under the same names.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["WindowAttention", "batch_windows"]


class WindowAttention(nn.Module):
    """A Qwen vision attention (``attn``: its ``qkv`` and ``proj``, its family's rotary embedding)
    attending the windows of each length in one call."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.qkv, self.proj, self.num_heads, self.scaling = attn.qkv, attn.proj, attn.num_heads, attn.scaling
        self._rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb_vision

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = self._rotate(q, k, *position_embeddings)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
        bounds = cu_seqlens.tolist()  # (as transformers reads them: one host read a block)
        out = torch.empty_like(q)
        for length, starts in windows_by_length(bounds).items():
            end = starts[0] + len(starts) * length
            rows = slice(starts[0], end) if starts == list(range(starts[0], end, length)) else (  # side by side: a view
                torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
            # [windows, heads, length, d]: one batch, each window attending only itself
            batch = [t[:, rows].unflatten(1, (len(starts), length)).transpose(0, 1) for t in (q, k, v)]
            out[:, rows] = F.scaled_dot_product_attention(*batch, scale=self.scaling).transpose(0, 1).flatten(1, 2)
        return self.proj(out.transpose(0, 1).reshape(n, -1))


def windows_by_length(bounds: list[int]) -> dict[int, list[int]]:
    """The windows' first rows by their length (``bounds``: ``cu_seqlens``; empty windows left out)."""
    groups: dict[int, list[int]] = {}
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            groups.setdefault(end - start, []).append(start)
    return groups


def replaceable(attn: nn.Module | None) -> bool:
    """Whether ``attn`` is a Qwen vision attention running SDPA (flash attention already makes one call)."""
    return (attn is not None and type(attn).__name__.endswith("VisionAttention")
            and all(hasattr(attn, a) for a in ("qkv", "proj", "num_heads", "scaling", "config"))
            and hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb_vision")
            and attn.config._attn_implementation == "sdpa")


def batch_windows(model: nn.Module) -> int:
    """Every vision block's SDPA attention in ``model`` (a module's ``attn``) replaced by its
    :class:`WindowAttention`; how many were."""
    owners = [m for m in model.modules() if replaceable(getattr(m, "attn", None))]
    for owner in owners:
        owner.attn = WindowAttention(owner.attn)
    return len(owners)
