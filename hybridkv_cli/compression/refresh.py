"""Refresh of heads pruned at prefill: re-select their kept tokens while decoding (RCR).

A head pruned once keeps what the prompt's last queries looked at; as generation moves, the
evidence it needs moves too (a copied key's next digit, the next object of a description).
Rate-controlled refresh keeps the head's whole prompt KV on the host and, per layer and
decode step:

1. **Drift**: the attention mass the current query puts on evicted tokens, with exact logits
   for what the device holds (kept slots, window, generated tokens) and low-rank logits
   (:class:`~hybridkv_cli.compression.detector.LowRankKeys`) for the evicted rest; the layer's
   drift is its mean over heads and query heads.
2. **Trigger**: ``drift > τ`` (``rcr``), with one per-generation threshold updated after every
   layer-step as ``τ ← τ·exp(η(f − ρ))`` (f = 1 if the step triggered): τ tracks a running
   quantile of drift, so a share ρ of layer-steps refresh, and drift decides which; or every
   ``T``-th step (``periodic``, the control).
3. **Re-selection**: the detector's top ``4n`` tokens (exact logits for kept ones) are
   candidates; their exact keys are read from the host, the top ``n`` by exact logit (max over
   the query group) become the new selection, and only the values (and keys) of tokens not
   already resident are copied into the slots.

The decision stays on the device: the new selection is computed at every step and merged with
the old one under the trigger mask (``torch.where``); an untriggered layer "wants" what it
holds, so the gather copies nothing. ``branching=True`` is the host-branch version, kept to
test that both give the same tokens. Host→device bytes are counted as a masked read moves them:
candidate keys and missing entries of triggered steps only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.detector import LowRankKeys
from hybridkv_cli.compression.store import RaggedStore, tensor_bytes, to_host
from hybridkv_kernels import chunk_gather

REFRESH_KINDS = ("none", "rcr", "periodic")


@dataclass(frozen=True)
class RefreshOptions:
    """How refreshed heads are refreshed (the policy's configuration).

    Parameters
    ----------
    kind : {"none", "rcr", "periodic"}
    rate : float
        ρ, the target share of layer-steps that refresh (``rcr``).
    period : int
        T: refresh at the first decode step and every T-th after it (``periodic``).
    rank : int
        R, channels of the low-rank detector.
    candidates : int
        Candidates per kept slot (4 in the paper: ``4n`` exact keys read per refresh).
    eta : float
        Controller gain η.
    tau : float | None
        Initial threshold τ; None starts at the first drift seen (drift has no common scale,
        so any fixed start is far off for some input and short outputs never recover from it).
    """

    kind: str = "rcr"
    rate: float = 0.4
    period: int = 3
    rank: int = 8
    candidates: int = 4
    eta: float = 0.05
    tau: float | None = None


class RateController:
    """One generation's drift threshold, shared by all its layers: ``τ ← τ·exp(η(f − ρ))``.

    Lives on the device (a 0-d tensor), so no decode step reads it on the host.
    """

    def __init__(self, options: RefreshOptions, device: torch.device):
        self.options = options
        self.tau = torch.tensor(-1.0 if options.tau is None else options.tau, device=device)

    @classmethod
    def shared(cls, run: dict, options: RefreshOptions, device: torch.device) -> "RateController":
        """The generation's one controller, made by the first layer that refreshes (``run`` is
        the generation's scratch space, :attr:`PrefillLayer.run`)."""
        if "refresh" not in run:
            run["refresh"] = cls(options, device)
        return run["refresh"]

    def trigger(self, drift: torch.Tensor) -> torch.Tensor:
        """Whether ``drift`` (0-d) exceeds τ; updates τ with the outcome."""
        self.tau.copy_(torch.where(self.tau < 0, drift, self.tau))  # unset: start at this drift
        fired = drift > self.tau
        self.tau.mul_(torch.exp(self.options.eta * (fired.float() - self.options.rate)))
        return fired


@dataclass
class Refresher:
    """Refresh state of one layer's refreshed heads.

    Attributes
    ----------
    heads : LongTensor [H_r]
        Which KV heads of the layer are refreshed.
    host_k, host_v : Tensor [H_r, P, 1, d]
        Their prompt KV before the resident tail (host; pinned on CUDA), one token a "chunk".
    detector : LowRankKeys
        Low-rank keys of those P tokens (device).
    slot_base : LongTensor [H_r]
        Store row of each head's first slot; the head's resident tail follows its slots.
    resident : LongTensor [H_r, n]
        Position held by each slot.
    tail : int
        Rows after the slots in each head's segment (the window).
    """

    heads: torch.Tensor
    host_k: torch.Tensor
    host_v: torch.Tensor
    detector: LowRankKeys
    slot_base: torch.Tensor
    resident: torch.Tensor
    tail: int
    options: RefreshOptions
    controller: RateController
    branching: bool = False
    steps: int = 0
    transferred: int = 0

    def __post_init__(self):
        device = self.resident.device
        self.refreshes = torch.zeros((), dtype=torch.long, device=device)  # triggered layer-steps
        self.key_reads = torch.zeros((), dtype=torch.long, device=device)  # candidate key bytes

    @classmethod
    def offload(cls, keys, values, heads: torch.Tensor, store: RaggedStore, selection: torch.Tensor,
                options: RefreshOptions, controller: RateController, **kw) -> "Refresher":
        """Move the first ``P`` prompt positions of ``heads`` to the host, fill their slots.

        Parameters
        ----------
        keys, values : Tensor [H, N, d]
            The layer's full prompt KV.
        store : RaggedStore
            Already holds each refreshed head's tail and reserves ``n`` slot rows before it.
        selection : LongTensor [H_r, n]
            Positions (< P) the slots start with (the prefill selection).
        """
        slots = selection.shape[1]
        tail = int(store.lengths[heads[0]]) - slots if len(heads) else 0
        span = keys.shape[1] - tail
        host_k, host_v = to_host(keys[heads, :span].unsqueeze(2)), to_host(values[heads, :span].unsqueeze(2))
        detector = LowRankKeys.build(keys[heads, :span], options.rank)
        slot_base = store.offsets[heads].clone()
        resident = torch.full_like(selection, -1)
        chunk_gather(host_k, host_v, store.keys, store.values, slot_base, resident, selection)
        return cls(heads, host_k, host_v, detector, slot_base, resident, tail, options, controller, **kw)

    @staticmethod
    def device_bytes_for(heads: int, slots: int, tokens: int, dim: int, rank: int) -> int:
        """Device bytes of the state besides the store rows, before building it."""
        return LowRankKeys.bytes_for(heads, tokens, dim, rank) + 8 * heads * (slots + 2)

    def refresh(self, query: torch.Tensor, store: RaggedStore, scale: float) -> None:
        """Re-select the slots for this step's ``query`` [H_kv, G, d] where the trigger fires."""
        self.steps += 1
        q = query[self.heads].float()
        kept, approx, drift = self._drift(q, store, scale)
        fired = self._fire(drift)
        new = self._reselect(q, kept, approx)
        if self.branching:
            if not bool(fired):
                return
            want = new
        else:
            want = torch.where(fired, new, self.resident)
        self.transferred += chunk_gather(self.host_k, self.host_v, store.keys, store.values,
                                         self.slot_base, self.resident, want)
        self.refreshes += fired.long()
        self.key_reads += fired.long() * (self.heads.numel() * self._candidates() * self.host_k[0, 0].nbytes)

    def _drift(self, q: torch.Tensor, store: RaggedStore, scale: float):
        """Unscaled exact logits of the kept slots [H_r, G, n], low-rank logits of every
        token [H_r, G, P], and the layer's drift (0-d)."""
        n = self.resident.shape[1]
        rows = self.slot_base[:, None] + torch.arange(n + self.tail, device=q.device)
        exact = torch.bmm(q, store.keys[rows].float().transpose(1, 2))  # slots + tail
        gen = torch.bmm(q, store.gen_k[self.heads, :store.n_gen].float().transpose(1, 2))
        approx = self.detector.logits(q)
        held = torch.zeros(approx.shape[::2], dtype=torch.bool, device=q.device).scatter_(1, self.resident, True)
        evicted = approx.masked_fill(held[:, None], float("-inf")) * scale
        total = torch.cat([exact * scale, gen * scale, evicted], dim=-1).logsumexp(dim=-1)
        drift = (evicted.logsumexp(dim=-1) - total).exp().mean()
        return exact[..., :n], approx, drift

    def _fire(self, drift: torch.Tensor) -> torch.Tensor:
        if self.options.kind == "periodic":
            fired = (self.steps - 1) % self.options.period == 0
            return torch.tensor(fired, device=drift.device)
        return self.controller.trigger(drift)

    def _candidates(self) -> int:
        return min(self.options.candidates * self.resident.shape[1], self.host_k.shape[1])

    def _reselect(self, q: torch.Tensor, kept: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
        """The top ``n`` positions among the detector's top candidates, by exact logit."""
        score = approx.amax(dim=1).scatter_(1, self.resident, kept.amax(dim=1))  # kept: exact
        cand = score.topk(self._candidates(), dim=1).indices  # [H_r, 4n]
        host_rows = (torch.arange(len(self.heads), device=q.device)[:, None] * self.host_k.shape[1] + cand)
        keys = self.host_k.view(-1, self.host_k.shape[-1])[host_rows.to(self.host_k.device)]
        exact = torch.bmm(q, keys.to(q.device).float().transpose(1, 2)).amax(dim=1)  # [H_r, 4n]
        return cand.gather(1, exact.topk(self.resident.shape[1], dim=1).indices)

    def device_bytes(self) -> int:
        return self.detector.device_bytes() + tensor_bytes(self.heads, self.slot_base, self.resident)

    def host_bytes(self) -> int:
        return tensor_bytes(self.host_k, self.host_v)

    def transferred_bytes(self) -> int:
        return self.transferred + int(self.key_reads)


def refresh_summary(kind: str, rate: float, refreshers: list[Refresher | None]) -> dict | None:
    """What the report says of refresh over a generation's layers (read once, at the end)."""
    if kind == "none":
        return None
    live = [r for r in refreshers if r is not None]
    steps = sum(r.steps for r in live)
    refreshes = sum(int(r.refreshes) for r in live)
    return {
        "kind": kind,
        "target_rate": rate if kind == "rcr" else None,
        "refreshed_heads": sum(len(r.heads) for r in live),
        "layer_steps": steps,
        "refreshes": refreshes,
        "refresh_rate": refreshes / steps if steps else None,
        "h2d_bytes": sum(r.transferred_bytes() for r in live),
    }
