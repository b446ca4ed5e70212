"""``madakv``: modality-preference budgets per head, unused budget carried to the next layer.

MadaKV (Li et al., 2025, arXiv:2506.15724) has no public code. This is a reconstruction from
its abstract ("modality preference adaptation" + "hierarchical compression compensation"), not
the authors' algorithm:

1. Modality preference of each KV head = the share of its window attention (mean over the last
   ``w`` prompt queries and the GQA group) that falls on text vs visual positions.
2. The layer's pool is its budget ``round(b·N·H)`` plus what the previous layer carried; every
   head gets an equal share of the pool, split between text and visual entries in proportion
   to its preference.
3. Within each modality, SnapKV selection: the window first, then the best max-pooled window
   scores of that modality.
4. A modality that has fewer tokens than its share leaves the rest unused. Unused entries are
   carried to the next layer, up to what the next layer can still place (``N·H`` minus its own
   budget; nothing after the last layer); beyond that they go to the other modality of the same
   head, so at ``b = 1`` every head keeps everything and no budget is left unused.

The total over layers never exceeds ``L·round(b·N·H)``; single layers may hold more than their
own share (that is the compensation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.base import Compressed, Policy, PrefillLayer
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.scoring import proportional_split, snap_keep, window_attention
from hybridkv_cli.compression.store import RaggedStore


@dataclass
class ModalityPlan:
    """Entries per head and modality of one layer, and the carry in and out."""

    text_share: torch.Tensor  # [H] fp32, share of window attention on text
    text: torch.Tensor  # [H] long
    visual: torch.Tensor  # [H] long
    carry_in: int
    carry_out: int


def plan_modalities(text_share: torch.Tensor, visual: torch.Tensor, budget: int, carry_in: int,
                    last: bool = False) -> ModalityPlan:
    """Steps 2 and 4 of the module docstring for one layer.

    Parameters
    ----------
    text_share : Tensor [H]
        Share of each head's window attention on text positions.
    visual : BoolTensor [N]
    budget : int
        The layer's own budget ``round(b·N·H)``.
    carry_in : int
        Entries carried from the previous layer (at most ``N·H - budget``).
    last : bool
        The model's last layer: nothing can be carried out.
    """
    heads, n = text_share.numel(), visual.numel()
    n_visual = int(visual.sum())
    n_text = n - n_visual
    device = text_share.device
    full = torch.full((heads,), n, dtype=torch.long, device=device)
    per_head = proportional_split(budget + carry_in, torch.ones(heads, device=device), full)
    text_want = torch.minimum(torch.round(per_head * text_share.double()).long().clamp(min=0), per_head)
    text = text_want.clamp(max=n_text)
    vis = (per_head - text_want).clamp(max=n_visual)
    spare = per_head - text - vis
    total_spare = int(spare.sum())
    carry_out = 0 if last else min(total_spare, heads * n - budget)
    # What the next layer could not place goes back to the heads that spared it, into their
    # other modality (a head's spare never exceeds the room left there, as per_head <= N).
    back = proportional_split(total_spare - carry_out, spare.double(), spare)
    to_text = torch.minimum(back, n_text - text)
    return ModalityPlan(text_share, text + to_text, vis + back - to_text, carry_in, carry_out)


@register("madakv")
@dataclass
class MadaKV(Policy):
    """MadaKV (reconstructed from the abstract): modality-preference budgets, carried across layers.

    Per head, entries are split between text and visual tokens in proportion to the head's
    window-attention mass on each; SnapKV selection within each modality; budget a layer cannot
    use is carried to the next layer. See the module docstring for the exact rules.
    """

    window: int = 32

    def compress(self, layer: PrefillLayer) -> Compressed:
        carry = layer.run.get("madakv_carry", 0)  # what the previous layer of this generation left
        attn, pooled, window = window_attention(layer, self.window)
        visual = layer.visual
        text_share = attn[:, ~visual].sum(dim=1)
        last = layer.index == layer.num_layers - 1
        plan = plan_modalities(text_share, visual, Budget.of(self.budget, layer).pool, carry, last=last)
        layer.run["madakv_carry"] = plan.carry_out
        keep = snap_keep(pooled, window, plan.text, allowed=~visual)
        keep |= snap_keep(pooled, window, plan.visual, allowed=visual)
        return Compressed(RaggedStore.build(layer.keys, layer.values, keep), plan)

    def summary(self, plans: list[ModalityPlan]) -> dict:
        return {
            "reconstruction": "MadaKV rebuilt from its abstract (no public code)",
            "per_layer": {
                "text_preference": [[round(s, 4) for s in p.text_share.tolist()] for p in plans],
                "text_entries": [p.text.tolist() for p in plans],
                "visual_entries": [p.visual.tolist() for p in plans],
                "carry_in": [p.carry_in for p in plans],
            },
        }
