"""``lookm``: text-prior heavy hitters + recent tokens, evicted entries merged (Wan et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv_cli.compression.base import Compressed, Policy, PrefillLayer
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.selection import keep_top_tiered
from hybridkv_cli.compression.store import RaggedStore

# Transient fp32 elements per block of the cumulative-attention and merge loops (64 MiB).
BLOCK_ELEMENTS = 1 << 24


def cumulative_attention(
    query: torch.Tensor, keys: torch.Tensor, scale: float, block_elements: int = BLOCK_ELEMENTS
) -> torch.Tensor:
    """H2O score: attention each key receives from the prompt's queries, summed over the queries.

    ``out[h, j]`` = sum over query positions i >= j of the causal softmax probability of key j,
    averaged over the G query heads of KV head h. The queries are the prompt's last T positions
    (T = N in a one-pass prefill; a streamed prefill keeps only its last chunk's). Queries are
    processed in blocks so the transient scores stay within ``block_elements`` fp32 values (N
    can be 5k+).

    Parameters
    ----------
    query : Tensor [H, G, T, d]
    keys : Tensor [H, N, d], N >= T

    Returns
    -------
    Tensor [H, N] fp32
    """
    heads, group, t, dim = query.shape
    n = keys.shape[1]
    offset = n - t  # the position of the first query
    block = max(1, block_elements // (heads * group * n))
    k = keys.float()
    out = torch.zeros(heads, n, dtype=torch.float32, device=keys.device)
    for start in range(0, t, block):
        end = min(t, start + block)
        size, seen = end - start, offset + end
        # Queries start..end-1 see keys 0..seen-1; only the last `size` columns can be masked.
        s = torch.bmm(query[:, :, start:end].float().reshape(heads, group * size, dim), k[:, :seen].transpose(1, 2))
        s = s.view(heads, group, size, seen)
        causal = torch.ones(size, size, dtype=torch.bool, device=keys.device).triu_(1)
        s[..., offset + start:].masked_fill_(causal, float("-inf"))
        out[:, :seen] += torch.softmax(s.mul_(scale), dim=-1).sum(dim=2).mean(dim=1)
    return out


def pivot_merge(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, block_elements: int = BLOCK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every evicted entry into the kept entry whose key is most cosine-similar.

    A kept entry becomes the mean of itself and the entries merged into it; values follow the
    keys' assignment. Every head must keep the same number of entries.

    Parameters
    ----------
    keys, values : Tensor [H, N, d]
    keep : BoolTensor [H, N]

    Returns
    -------
    keys, values : Tensor [H, K, d]
        The kept entries in position order, merged.
    """
    heads, n, dim = keys.shape
    kept = int(keep[0].sum())
    if not bool((keep.sum(dim=1) == kept).all()):
        raise ValueError("pivot_merge needs the same number of kept entries in every head")
    kept_idx = keep.nonzero()[:, 1].view(heads, kept)
    evicted_idx = (~keep).nonzero()[:, 1].view(heads, n - kept)

    def rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return t.gather(1, idx.unsqueeze(-1).expand(-1, -1, dim)).float()

    kk, kv = rows(keys, kept_idx), rows(values, kept_idx)
    if n == kept or kept == 0:
        return kk.to(keys.dtype), kv.to(values.dtype)
    ek, ev = rows(keys, evicted_idx), rows(values, evicted_idx)
    pivots = F.normalize(kk, dim=-1).transpose(1, 2)
    target = torch.empty(heads, n - kept, dtype=torch.long, device=keys.device)
    block = max(1, block_elements // (heads * kept))
    for start in range(0, n - kept, block):
        end = min(n - kept, start + block)
        target[:, start:end] = torch.bmm(F.normalize(ek[:, start:end], dim=-1), pivots).argmax(dim=-1)
    spread = target.unsqueeze(-1).expand(-1, -1, dim)
    counts = torch.ones(heads, kept, device=keys.device)
    counts.scatter_add_(1, target, torch.ones_like(target, dtype=torch.float32))
    merged_k = kk.scatter_add_(1, spread, ek).div_(counts.unsqueeze(-1))
    merged_v = kv.scatter_add_(1, spread, ev).div_(counts.unsqueeze(-1))
    return merged_k.to(keys.dtype), merged_v.to(values.dtype)


@register("lookm")
@dataclass
class LookM(Policy):
    """LOOK-M: text-prior H2O heavy hitters + recent tokens; evicted entries merged into kept ones.

    Score = H2O cumulative attention of all prompt queries (sum over query positions, mean over
    the GQA group). Each head keeps ``round(b·N)`` entries: the most recent ``round(b·N) // 2``
    positions, then heavy hitters for the other half, every text token before any visual token
    (by score within each modality). Every evicted entry is then merged (averaged) into its most
    cosine-similar kept key ("pivot merge"), values alongside.
    """

    def keep(self, layer: PrefillLayer) -> torch.Tensor:
        """Entries each head keeps before merging, BoolTensor [H_kv, N]."""
        budget = Budget.of(self.budget, layer)
        recent = budget.head_entries // 2
        score = cumulative_attention(layer.query, layer.keys, layer.scale)
        tier = (~layer.visual).float()  # text before visual
        tier[layer.length - recent:] = 2.0  # the recent half first
        return keep_top_tiered(score, tier, budget.counts())

    def compress(self, layer: PrefillLayer) -> Compressed:
        keys, values = pivot_merge(layer.keys, layer.values, self.keep(layer))
        return Compressed(RaggedStore.build(keys, values, torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device)))
