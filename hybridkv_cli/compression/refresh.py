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
3. **Re-selection** of a head's ``c`` moving slots: the detector's top ``4c`` tokens (exact
   logits for resident ones) are candidates; their exact keys are read from the host, the top
   ``c`` by exact logit (max over the query group) become the new selection, and only the
   values (and keys) of tokens not already resident are copied into the slots.

A head's slots are split (:func:`split_slots`): at most ``c`` (``RefreshOptions.slots``, 256; the
paper's c is 32-224) move, the rest hold the best of the prefill selection for good. So a refresh
reads ``5c`` vectors whatever the budget: at a 16k-token prompt and b = 0.1 a head has ~1600
slots, and re-selecting all of them would read 8000 keys per refresh.

The decision stays on the device on the CUDA path (``hybridkv_kernels.refresh_want``): five
launches a layer-step, the same whether the trigger fires or not (a CUDA graph replays them),
the candidates' keys read by a kernel in place in pinned host memory where it fired, and an
untriggered layer "wants" what it holds, so the gather copies nothing. The torch path
(``refresh_torch.py``: a batch's members of one geometry side by side) is the reference and the
CPU path: reading the trigger on the host costs nothing there, so the refresh is skipped when it
does not fire (``branching``); its branch-free form (the new selection merged under the trigger
mask) is what a test compares the branching one with.
Host→device bytes are counted on the device as the kernels move them: candidate keys of
triggered steps (``key_reads``) and every entry the gather copies (``transferred``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.base import Policy, check_choice
from hybridkv_cli.compression.detector import LowRankKeys
from hybridkv_cli.compression.refresh_torch import evidence, geometry, reselect_fired
from hybridkv_cli.compression.store import RaggedStore, tensor_bytes, to_host
from hybridkv_kernels import chunk_gather, cuda_path, refresh_want, resolve_backend
from hybridkv_kernels.refresh_step import RefreshState

REFRESH_KINDS = ("none", "rcr", "periodic")


@dataclass
class RefreshPolicy(Policy):
    """Base of the methods that refresh pruned heads: their refresh fields (documented by each
    method), checked once here."""

    refresh: str = "rcr"
    refresh_rate: float = 0.4
    refresh_period: int = 3
    refresh_slots: int = 256

    def __post_init__(self):
        super().__post_init__()
        check_choice("refresh", self.refresh, REFRESH_KINDS)


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
    slots : int
        c: most slots of a head that a refresh re-selects; the rest keep the best of the prefill
        selection.
    candidates : int
        Candidates per moving slot (4 in the paper: ``4c`` exact keys read per refresh).
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
    slots: int = 256
    candidates: int = 4
    eta: float = 0.05
    tau: float | None = None

    @classmethod
    def of(cls, policy: RefreshPolicy) -> "RefreshOptions":
        """The options a policy's refresh fields set."""
        return cls(kind=policy.refresh, rate=policy.refresh_rate, period=policy.refresh_period,
                   slots=policy.refresh_slots)


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

    @staticmethod
    def trigger_all(controllers: list["RateController"], drift: torch.Tensor) -> torch.Tensor:
        """Whether each drift [B] exceeds its controller's τ (the controllers of B generations);
        updates every τ with its outcome."""
        tau = torch.stack([c.tau for c in controllers])
        tau = torch.where(tau < 0, drift, tau)  # unset: start at this drift
        fired = drift > tau
        options = controllers[0].options
        tau.mul_(torch.exp(options.eta * (fired.float() - options.rate)))
        for c, t in zip(controllers, tau):
            c.tau.copy_(t)
        return fired


def split_slots(selection: torch.Tensor, options: RefreshOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(fixed, moving) positions of a ranked prefill ``selection`` [H_r, n] (best first): the
    best ``n - c`` stay for good, the last ``c`` start the slots that refreshes re-select."""
    fixed = max(0, selection.shape[1] - options.slots)
    return selection[:, :fixed], selection[:, fixed:]


@dataclass
class Refresher:
    """Refresh state of one layer's refreshed heads.

    Attributes
    ----------
    heads : LongTensor [H_r]
        Which KV heads of the layer are refreshed.
    host_k, host_v : Tensor [H_r, P, 1, d]
        Their prompt KV before the window (host; pinned on CUDA), one token a "chunk".
    detector : LowRankKeys
        Low-rank keys of those P tokens (device).
    slot_base : LongTensor [H_r]
        Store row of each head's first moving slot; its fixed entries and window follow.
    resident : LongTensor [H_r, c]
        Position held by each moving slot.
    fixed : LongTensor [H_r, n - c]
        Positions held for good (store rows after the slots, in position order).
    tail : int
        Rows after the slots in each head's segment (fixed entries + window).
    branching : bool | None
        Torch path: skip the re-selection on the host when the trigger does not fire; None: off
        the CUDA path only (``hybridkv_kernels.cuda_path``).
    """

    heads: torch.Tensor
    host_k: torch.Tensor
    host_v: torch.Tensor
    detector: LowRankKeys
    slot_base: torch.Tensor
    resident: torch.Tensor
    fixed: torch.Tensor
    tail: int
    options: RefreshOptions
    controller: RateController
    branching: bool | None = None
    steps: int = 0

    def __post_init__(self):
        device = self.resident.device
        if self.branching is None:
            self.branching = not cuda_path(device)
        # Device counters, read once at the end of the generation.
        self.refreshes = torch.zeros((), dtype=torch.long, device=device)  # triggered layer-steps
        self.clock = torch.zeros((), dtype=torch.long, device=device)  # decode steps (periodic trigger)
        self.transferred = torch.zeros((), dtype=torch.long, device=device)  # slot entries moved
        self.key_reads = torch.zeros((), dtype=torch.long, device=device)  # candidate key bytes

    @classmethod
    def offload(cls, keys, values, heads: torch.Tensor, store: RaggedStore, fixed: torch.Tensor,
                moving: torch.Tensor, options: RefreshOptions, controller: RateController, **kw) -> "Refresher":
        """Move the first ``P`` prompt positions of ``heads`` to the host, fill their slots.

        Parameters
        ----------
        keys, values : Tensor [H, N, d]
            The layer's full prompt KV.
        store : RaggedStore
            Already holds each refreshed head's ``fixed`` entries and window, and reserves its
            moving slots in front of them.
        fixed, moving : LongTensor [H_r, n - c], [H_r, c]
            :func:`split_slots` of the prefill selection (positions < P).
        """
        slots = moving.shape[1]
        tail = int(store.lengths[heads[0]]) - slots if len(heads) else 0
        span = keys.shape[1] - (tail - fixed.shape[1])
        host_k, host_v = to_host(keys[heads, :span].unsqueeze(2)), to_host(values[heads, :span].unsqueeze(2))
        detector = LowRankKeys.build(keys[heads, :span], options.rank)
        slot_base = store.offsets[heads].clone()
        resident = torch.full_like(moving, -1)
        chunk_gather(host_k, host_v, store.keys, store.values, slot_base, resident, moving)
        return cls(heads, host_k, host_v, detector, slot_base, resident, fixed.contiguous(), tail, options, controller,
                   **kw)

    @staticmethod
    def device_bytes_for(heads: int, slots: int, tokens: int, dim: int, rank: int) -> int:
        """Device bytes of the state besides the store rows, before building it."""
        return LowRankKeys.bytes_for(heads, tokens, dim, rank) + 8 * heads * (slots + 2)

    @property
    def replayable(self) -> bool:
        """The step takes the kernels (the same launches every step, no host branch)."""
        return resolve_backend("auto", self.resident) == "triton"

    def refresh(self, query: torch.Tensor, store: RaggedStore, scale: float, count: torch.Tensor | None = None) -> None:
        """Re-select the moving slots for this step's ``query`` [H_kv, G, d] where the trigger fires
        (``count``: the generated rows on the device, in a batch; else the store's ``n_gen``)."""
        Refresher.refresh_all([(self, query, store, count)], scale)

    @staticmethod
    def refresh_all(items: list[tuple], scale: float) -> None:
        """:meth:`refresh` of one layer's refreshers of several generations (``(refresher, query,
        store, count)`` each): on the kernels each alone, on the torch path those of one
        ``refresh_torch.geometry`` together (one op a step for all their heads)."""
        groups: dict[tuple, list] = {}
        for r, query, store, count in items:
            r.steps += 1
            if resolve_backend("auto", query, store.keys) == "triton":
                r._on_device(query, store, scale, count)
            else:
                groups.setdefault(geometry(r, query, store), []).append((r, query, store))
        for group in groups.values():
            seen = evidence(group, scale)
            reselect_fired(group, Refresher._fire([r for r, _, _ in group], seen.drift), seen)

    def _on_device(self, query: torch.Tensor, store: RaggedStore, scale: float, count: torch.Tensor | None) -> None:
        """The kernels' refresh: decided on the device, the same launches whether it fires or not."""
        query = query if query.stride(-1) == 1 else query.contiguous()
        o = self.options
        want = refresh_want(query, self._state(), store.keys, store.gen_k, store.n_gen if count is None else count,
                            scale, kind=o.kind, rate=o.rate, eta=o.eta, period=o.period, candidates=self.candidates)
        chunk_gather(self.host_k, self.host_v, store.keys, store.values, self.slot_base, self.resident, want,
                     "triton", self.transferred)

    def _state(self) -> RefreshState:
        d = self.detector
        return RefreshState(self.heads, self.host_k, d.basis, d.codes, d.scale, self.slot_base, self.resident,
                            self.fixed, self.resident.shape[1] + self.tail, self.controller.tau, self.clock,
                            self.refreshes, self.key_reads)

    @staticmethod
    def _fire(refreshers: list["Refresher"], drift: torch.Tensor) -> torch.Tensor:
        """Whether each refresher's trigger fires at this layer-step [B] (one per generation)."""
        options = refreshers[0].options
        if options.kind == "periodic":  # steps 1, 1 + T, ...: the count kept on the device
            for r in refreshers:
                r.clock += 1
            return torch.stack([(r.clock - 1) % options.period == 0 for r in refreshers])
        return RateController.trigger_all([r.controller for r in refreshers], drift)

    @property
    def candidates(self) -> int:
        """Candidates a refresh reads the exact keys of, per head."""
        return min(self.options.candidates * self.resident.shape[1], self.host_k.shape[1] - self.fixed.shape[1])

    def device_bytes(self) -> int:
        return self.detector.device_bytes() + tensor_bytes(self.heads, self.slot_base, self.resident, self.fixed)

    def host_bytes(self) -> int:
        return tensor_bytes(self.host_k, self.host_v)

    def transferred_bytes(self) -> int:
        return int(self.transferred + self.key_reads)


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
