"""``retentivekv``: evicted tokens folded into state entries, and brought back when a state draws attention.

A reconstruction from an abstract (RetentiveKV; see docs/methods.md for what is the idea and
what is this project's design). Visual tokens can matter late ("deferred importance"), so
instead of dropping what a one-shot selection evicts, each head folds it into a few **state
entries** and keeps a host copy:

1. **Keep**: the window and the best-scored tokens (SnapKV's pooled window attention), ``K``
   per head.
2. **Fold**: the evicted tokens, in position order, are cut into ``S`` groups of ``g``; each
   group becomes one state entry, the mean of its keys and of its values weighted by each
   token's information under the window's attention ``p``: ``-p·log p`` (its share of the
   attention entropy), so a token the window half-attends weighs more than one it ignores. A
   state entry takes part in decode attention like a kept token.
3. **Reactivate**: at every decode step each head ranks its states by the query (max over the
   group of ``q·state``) and holds the ``g`` tokens of the best-ranked group in ``g`` slots,
   copied from the host when they change (the state of a reactivated group stays too).

Per head ``window + K + S + g <= b·N`` (indices paid from the budget): ``g ≈ sqrt(N - b·N)``
minimises ``S + g``, leaving the most room for kept tokens. When the budget cannot pay for a
group, the head keeps the window and states only; at ``b = 1`` nothing is folded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hybridkv_kernels import chunk_gather

from hybridkv_cli.compression.base import Compressed, LayerKV, Policy, PrefillLayer
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.scoring import snap_keep, window_attention
from hybridkv_cli.compression.store import RaggedStore, tensor_bytes, to_host


def plan_groups(n: int, entries: int, window: int) -> tuple[int, int, int]:
    """(kept K, states S, group size g) of a head with ``entries`` of ``n`` at ``window``.

    Every evicted token belongs to a group: ``S = ceil(evicted / g)`` with ``evicted = n - window
    - K`` and ``K = entries - window - S - g`` (one group of slots). ``g = 0``: no reactivation
    (the budget cannot pay for a group); then all but the window goes to states.
    """
    room = entries - window
    best = None
    for g in range(2, max(3, math.isqrt(max(0, n - entries)) * 2)):
        states = math.ceil((n - entries + g) / (g - 1))
        kept = room - states - g
        if kept >= 0 and (best is None or kept > best[0]):
            best = (kept, states, g)
    if best is None:  # states only
        states = max(1, room)
        return 0, states, 0
    return best


@dataclass
class RetentiveLayerKV(LayerKV):
    """A layer's store (slots, states, kept tokens and window per head) and the host groups.

    Attributes
    ----------
    host_k, host_v : Tensor [H, S, g, d]
        The evicted tokens, grouped (host; pinned on CUDA).
    state_rows : LongTensor [H, S]
        Store row of each state entry.
    slot_base : LongTensor [H]
        Store row of each head's reactivation slots.
    resident : LongTensor [H, 1]
        The group held in the slots (-1: none yet).
    """

    store: RaggedStore
    host_k: torch.Tensor | None = None
    host_v: torch.Tensor | None = None
    state_rows: torch.Tensor | None = None
    slot_base: torch.Tensor | None = None
    resident: torch.Tensor | None = None

    def __post_init__(self):
        self.transferred = torch.zeros((), dtype=torch.long, device=self.store.keys.device)

    def segments(self, query: torch.Tensor, scale: float):
        if self.resident is not None:  # bring back the group whose state the query ranks first
            heads, states = self.state_rows.shape
            keys = self.store.keys.index_select(0, self.state_rows.flatten()).view(heads, states, -1)
            want = torch.bmm(query.to(keys.dtype), keys.transpose(1, 2)).amax(dim=1).argmax(dim=1, keepdim=True)
            chunk_gather(self.host_k, self.host_v, self.store.keys, self.store.values, self.slot_base, self.resident,
                         want, moved=self.transferred)
        return self.store.segments()

    def device_bytes(self) -> int:
        return self.store.device_bytes() + tensor_bytes(self.state_rows, self.slot_base, self.resident)

    def host_bytes(self) -> int:
        return tensor_bytes(self.host_k, self.host_v)

    def transferred_bytes(self) -> int:
        return int(self.transferred)


@register("retentivekv")
@dataclass
class RetentiveKV(Policy):
    """RetentiveKV (reconstructed from the abstract): evicted tokens folded into states, restored on demand.

    Evicted tokens become entropy-weighted state entries; a group comes back from the host when
    its state draws attention.

    Parameters
    ----------
    window : int
        Observation window (kept, and the queries that score the tokens).
    """

    window: int = 32

    def compress(self, layer: PrefillLayer) -> Compressed:
        n, heads = layer.length, layer.num_heads
        budget = Budget.of(self.budget, layer)
        attn, pooled, _ = window_attention(layer, self.window)
        # Indices paid from the budget: state rows (at most a head's entries), slot base, resident.
        per_head = budget.entries(8 * heads * (math.ceil(budget.per_head) + 2)) // heads
        window = budget.window(self.window, per_head)
        if per_head >= n or per_head <= window:  # nothing to fold (b = 1), or no room for a state
            counts = budget.counts(per_head)
            store = RaggedStore.build(layer.keys, layer.values, snap_keep(pooled, window, counts))
            return Compressed(RetentiveLayerKV(store), {"kept": int(counts[0]), "states": 0, "group": 0})
        kept, states, group = plan_groups(n, per_head, window)
        counts = budget.counts(window + kept)
        keep = snap_keep(pooled, window, counts)
        evicted = (~keep).nonzero()[:, 1].view(heads, -1)  # the same count per head, position order
        size = group or math.ceil(evicted.shape[1] / states)
        pad = states * size - evicted.shape[1]  # the last group repeats its last token to fill up
        groups = torch.cat([evicted, evicted[:, -1:].expand(-1, pad)], dim=1).view(heads, states, size)
        info = -attn * torch.log(attn.clamp_min(1e-12)) + 1e-9  # a token's share of the attention entropy
        weight = info.gather(1, groups.flatten(1)).view(heads, states, size)
        weight[:, -1, size - pad:] = 0  # the padding carries no weight
        weight = weight / weight.sum(dim=2, keepdim=True)
        k = _gather(layer.keys, groups)
        v = _gather(layer.values, groups)
        state_k = (weight.unsqueeze(-1) * k.float()).sum(dim=2).to(layer.keys.dtype)
        state_v = (weight.unsqueeze(-1) * v.float()).sum(dim=2).to(layer.values.dtype)
        store = RaggedStore.build(layer.keys, layer.values, keep, torch.full_like(counts, group + states))
        state_rows = store.offsets[:, None] + group + torch.arange(states, device=layer.keys.device)
        store.keys[state_rows.flatten()] = state_k.flatten(0, 1)
        store.values[state_rows.flatten()] = state_v.flatten(0, 1)
        report = {"kept": kept, "states": states, "group": size}
        if not group:
            return Compressed(RetentiveLayerKV(store, state_rows=state_rows), report)
        resident = torch.full((heads, 1), -1, dtype=torch.long, device=layer.keys.device)
        kv = RetentiveLayerKV(store, to_host(k), to_host(v), state_rows, store.offsets.clone(), resident)
        return Compressed(kv, report)

    def summary(self, reports: list[dict]) -> dict:
        return {
            "reconstruction": "RetentiveKV rebuilt from its abstract (no public code)",
            "per_layer": {key: [r[key] for r in reports] for key in ("kept", "states", "group")},
        }


def _gather(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``tensor`` [H, N, d] at ``positions`` [H, S, g] -> [H, S, g, d]."""
    heads, states, size = positions.shape
    flat = positions.flatten(1).unsqueeze(-1).expand(-1, -1, tensor.shape[-1])
    return tensor.gather(1, flat).view(heads, states, size, -1)
