"""``hybridkv``: static heads pruned once (text first), dynamic heads served by chunk retrieval."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hybridkv_kernels import window_scores

from hybridkv_cli.compression.allocate import LayerPlan, plan_layer
from hybridkv_cli.compression.base import Compressed, LayerKV, PrefillLayer, check_choice
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.classify import classify_static
from hybridkv_cli.compression.index_choice import choose_index, every_head_dynamic
from hybridkv_cli.compression.labels import channel_weights, choose_labels, layer_labels, load_label_file
from hybridkv_cli.compression.landmarks import LANDMARKS, label_count
from hybridkv_cli.compression.refresh import (RateController, Refresher, RefreshOptions, RefreshPolicy, refresh_summary,
                                              split_slots)
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.retrieval import DynamicHeads
from hybridkv_cli.compression.static_prune import text_prior_keep
from hybridkv_cli.compression.store import RaggedStore
from hybridkv_cli.costs.profiles import device_profile


@dataclass
class HybridLayerKV(LayerKV):
    """A layer's ragged store plus the retrieval state of its dynamic heads and the refresh
    state of its static heads (each None when the layer has none)."""

    store: RaggedStore
    dynamic: DynamicHeads | None
    refresher: Refresher | None = None

    def _parts(self):
        return [p for p in (self.dynamic, self.refresher) if p is not None]

    @property
    def replayable(self) -> bool:
        return self.refresher is None or self.refresher.replayable

    def segments(self, query: torch.Tensor, scale: float):
        """The store's rows: retrieval and refresh have run (:meth:`LayerKV.attend`, a batch's step)."""
        return self.store.segments()

    def device_bytes(self) -> int:
        return self.store.device_bytes() + sum(p.device_bytes() for p in self._parts())

    def host_bytes(self) -> int:
        return sum(p.host_bytes() for p in self._parts())

    def transferred_bytes(self) -> int:
        return sum(p.transferred_bytes() for p in self._parts())


@dataclass
class LayerRecord:
    """What the report shows of one layer."""

    sparsity: list[float]
    plan: LayerPlan
    length: int
    window: int
    refresher: Refresher | None
    fallback: bool  # dynamic heads made static: the budget could not pay for a retrieval chunk
    chunk: int
    landmark: str
    landmark_reason: str


@register("hybridkv")
@dataclass
class HybridKV(RefreshPolicy):
    """HybridKV: text-centric head classification, top-down budgets, text-prior pruning + chunk retrieval.

    Defaults: the paper's θ, p and r; sink-aware scores, rate-controlled refresh of static heads,
    2-bit key landmarks with single-token retrieval (in host memory, every head dynamic, where on
    the device they would cost over half the budget), the 16-token window and the chunk-size rule
    were chosen on the dev splits (docs/quality.md). The paper's own setting is
    ``window=32, sink_aware=False, chunk_size=8, landmark="mean", refresh="none"``.

    Parameters
    ----------
    window : int
        w: the last prompt positions whose queries score the heads and the tokens, always kept
        (16: on the text dev splits 29 of 42 rows against 26 at the paper's 32, with 2-bit keys).
    theta : float
        Heads whose sparsity score is >= theta are static (none where 2-bit keys would cost over
        half the budget, whatever the landmark: :func:`~hybridkv_cli.compression.index_choice.every_head_dynamic`).
    sparsity_topk : float
        p: the sparsity score is the attention mass on the top ``ceil(p·N)`` positions.
    sink_aware : bool
        Score without the first tokens (attention sinks), so sink-parked heads are not static.
    share : float
        r: a dynamic head's budget as a share of the average head budget.
    chunk_size : int | None
        Tokens per retrieval chunk; None: :meth:`chunk_for` (1 with 2-bit keys).
    alpha : float
        Floor of a static head's budget, as a share of the static average (Ada-KV safeguard).
    landmark : {"auto", "keys", "host-keys", "labels", "minmax", "mean", "detector"}
        How dynamic heads rank their chunks (:mod:`~hybridkv_cli.compression.landmarks`).
        ``host-keys``: the 2-bit keys in host memory, read whole every step (the device pays
        only each channel's range). ``labels`` ranks in two stages for a sixty-fourth of a bf16
        head's KV on the device (label channels, then 2-bit keys read from the host for the
        candidates). ``auto`` (:meth:`landmark_for`): ``keys`` while they cost at most half of
        the budget (the fastest index that keeps the answers), then ``host-keys``.
        ``keys`` (every token's key at 2 bits per channel): on the text dev splits at b = 0.1 it
        answers 20 of 26 retrieval rows where min/max bounds answer 7 and the full cache 18 (a
        bound or a mean over a chunk blurs the one token a copy needs); every video dev needle,
        as min/max bounds do. It costs 1/32 of a dynamic head's fp32 KV (1/16 in bf16), paid
        from the budget.
    refresh : {"none", "rcr", "periodic"}
        Refresh of static heads while decoding (:mod:`~hybridkv_cli.compression.refresh`);
        refreshed static heads share their budget evenly.
    refresh_rate : float
        ρ, the share of layer-steps that refresh (``rcr``).
    refresh_period : int
        T (``periodic``).
    refresh_slots : int
        c: most slots of a refreshed head that move; the rest keep the best of the prefill
        selection (bounds the cost of a refresh at long prompts).
    swaps : int
        With 2-bit keys (``keys``, ``host-keys``): most tokens a dynamic head takes in per step
        that it does not hold, so a step copies at most ``swaps`` rows a head from host memory
        whatever the prompt's length (0: no cap; on the text dev rows a cap of 16 loses 2 of 7
        answers). The slots are filled at prefill from the device KV
        (:func:`~hybridkv_cli.compression.retrieval.fill_slots`).
    stickiness : float
        With 2-bit keys: logits a held token gains in the ranking, so a newcomer must beat it by
        that much to be copied in (1: a third fewer copies on the text dev rows with the same
        answers, but fewer on the test rows; 3 loses 3 of 7 dev answers). 0 (the default): the
        selection is each step's top-n, whatever is held, so the prefill's slot fill changes
        what is copied, never what is chosen.
    index_file : str, optional
        A label file (``hybridkv calibrate``) giving the label channels of ``landmark="labels"``;
        without one they are chosen from the prompt (:mod:`~hybridkv_cli.compression.labels`).
    """

    window: int = 16
    theta: float = 0.9
    sparsity_topk: float = 0.05
    sink_aware: bool = True
    share: float = 0.75
    chunk_size: int | None = None
    alpha: float = 0.2
    landmark: str = "auto"
    index_file: str | None = None
    swaps: int = 0
    stickiness: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_choice("landmark", self.landmark, ("auto", *LANDMARKS))
        self._label_weights = load_label_file(self.index_file) if self.index_file else None

    def landmark_for(self, budget: Budget, element_size: int, length: int, heads: int, dim: int,
                     device: torch.device) -> tuple[str, str]:
        """``(landmark, reason)`` of a layer: with ``auto``, the index that keeps the answers at
        this budget at the lowest modelled step time on the device
        (:func:`~hybridkv_cli.compression.index_choice.choose_index`): 2-bit keys on the device
        while they cost at most half of the budget, else in host memory."""
        if budget.full:
            return "keys", "b = 1 keeps the whole cache: nothing is ranked"
        if self.landmark != "auto":
            return self.landmark, "chosen with --landmark"
        return choose_index(budget.fraction, length, heads, dim, element_size, device_profile(device))

    def _labels(self, layer: PrefillLayer, landmark: str) -> torch.Tensor | None:
        """Every head's label channels [H, K] (``landmark="labels"``), else None."""
        if landmark != "labels":
            return None
        count = label_count(layer.keys.shape[-1])
        if self._label_weights is None:
            return choose_labels(channel_weights(layer), count)
        return layer_labels(self._label_weights, layer, count, self.index_file)

    def chunk_for(self, budget: Budget, landmark: str) -> int:
        """The chunk size for a layer's ``budget``. With 2-bit keys every token is ranked on
        its own, so single tokens are retrieved (the text dev splits: 20 of 26 rows at 1 token,
        19 at 2). Chunk landmarks (mean, min/max) take fine chunks when a dynamic head can hold
        few: with one 16-token chunk a head retrieves one place of the prompt (the video dev
        split: 53 % of needles at 8 tokens, 33 % at 16), with several the coarser chunks keep
        more context around each hit at half the landmark bytes (the text dev split)."""
        if self.chunk_size:
            return self.chunk_size
        if landmark in ("keys", "host-keys", "labels"):
            return 1
        room = self.share * budget.per_head - budget.window(self.window)
        return 16 if room >= 2 * 16 else 8

    def _overhead(self, layer: PrefillLayer, budget: Budget, static: torch.Tensor, refreshed: bool, chunk: int,
                  landmark: str) -> int:
        """Device bytes of landmarks, detectors and indices (upper bounds), paid from the budget."""
        n, dim, avg = layer.length, layer.keys.shape[-1], budget.per_head
        n_stat = int(static.sum())
        n_dyn = layer.num_heads - n_stat
        num_chunks = max(0, n - budget.window(self.window)) // chunk
        out = DynamicHeads.device_bytes_for(n_dyn, math.ceil(avg / chunk), chunk, num_chunks,
                                            dim, landmark) if n_dyn else 0
        if refreshed and n_stat:
            out += Refresher.device_bytes_for(n_stat, math.ceil(avg), n, dim, RefreshOptions().rank)
        return out

    def _plan(self, layer: PrefillLayer, budget: Budget, pooled: torch.Tensor, static: torch.Tensor, refreshed: bool,
              chunk: int, landmark: str):
        """The layer's allocation and window after paying for side structures. With an index in
        host memory (the tight budgets) the window takes at most a quarter of a head's entries,
        else half: at b = 0.05 a 16-token window left a dynamic head 17 retrieval slots of 33,
        and with 8 the text dev split's first 8 rows went from 2 to 6 answers."""
        target = budget.entries(self._overhead(layer, budget, static, refreshed, chunk, landmark))
        tight = landmark in ("host-keys", "labels")
        window = budget.window(self.window, target / layer.num_heads / (2 if tight else 1))
        plan = plan_layer(pooled, static, target=target, window=window, share=self.share,
                          chunk=chunk, alpha=self.alpha, adaptive=not refreshed)
        return plan, window

    def compress(self, layer: PrefillLayer) -> Compressed:
        n = layer.length
        budget = Budget.of(self.budget, layer)
        attn, pooled = window_scores(layer.window_query(min(self.window, n)), layer.keys, scale=layer.scale)
        static, sparsity = classify_static(attn, self.theta, self.sparsity_topk, self.sink_aware)
        landmark, reason = self.landmark_for(budget, layer.keys.element_size(), n, layer.num_heads,
                                             layer.keys.shape[-1], layer.decode_device)
        if budget.full:  # every head keeps the whole prompt on the device: nothing to retrieve or refresh
            static = torch.ones_like(static)
        elif every_head_dynamic(budget.fraction, layer.keys.element_size()):
            static = torch.zeros_like(static)
        refresh_on = self.refresh != "none" and not budget.full
        chunk = self.chunk_for(budget, landmark)
        plan, window = self._plan(layer, budget, pooled, static, refresh_on, chunk, landmark)
        fallback = bool((~static).any()) and plan.chunks == 0
        if fallback:  # the budget cannot pay for one retrieval chunk: prune every head once
            static = torch.ones_like(static)
            plan, window = self._plan(layer, budget, pooled, static, refresh_on, chunk, landmark)

        dynamic = ~static
        num_chunks = max(0, n - window) // chunk
        slots = torch.where(static, plan.entries - window, 0).clamp_min(0)
        refreshed = static & refresh_on & (slots > 0) & (slots < n - window)
        keep = torch.zeros_like(pooled, dtype=torch.bool)
        once = static & ~refreshed
        keep[once] = text_prior_keep(pooled[once], layer.visual, window, plan.entries[once])
        keep[dynamic, num_chunks * chunk:] = True  # the resident tail of dynamic heads
        reserve = torch.where(dynamic, plan.chunks * chunk, 0)
        if refreshed.any():  # text first, then the best-scored rest; the best stay, the others move
            heads, span = refreshed.nonzero().flatten(), n - window
            options = RefreshOptions.of(self)
            first = text_prior_keep(pooled[heads, :span], layer.visual[:span], 0, slots[heads])
            best_first = pooled[heads, :span].masked_fill(~first, float("-inf"))
            fixed, moving = split_slots(best_first.topk(int(slots[heads[0]]), dim=1).indices, options)
            keep[heads, span:] = True  # the window, after the slots and the fixed entries
            keep[heads] = keep[heads].scatter(1, fixed, True)
            reserve = reserve + torch.where(refreshed, moving.shape[1], 0)
        store = RaggedStore.build(layer.keys, layer.values, keep, reserve)
        retrieval = None
        if dynamic.any():
            retrieval = DynamicHeads.offload(
                layer.keys, layer.values, dynamic.nonzero().flatten(), store,
                chunks=plan.chunks, chunk=chunk, num_chunks=num_chunks, landmark=landmark,
                channels=self._labels(layer, landmark), query=layer.query[:, :, -1], swaps=self.swaps,
                stickiness=self.stickiness,
            )
        refresher = None
        if refreshed.any():
            controller = RateController.shared(layer.run, options, layer.keys.device)
            refresher = Refresher.offload(layer.keys, layer.values, heads, store, fixed, moving, options, controller)
        record = LayerRecord(sparsity.tolist(), plan, n, window, refresher, fallback, chunk, landmark, reason)
        return Compressed(HybridLayerKV(store, retrieval, refresher), record)

    def summary(self, layers: list[LayerRecord]) -> dict:
        static = [int(r.plan.static.sum()) for r in layers]
        dynamic = [len(r.sparsity) - s for r, s in zip(layers, static)]
        total = sum(static) + sum(dynamic)
        target = sum(r.plan.target for r in layers)
        rounding = sum(r.plan.rounding for r in layers)

        def mean_entries(kind_static: bool) -> float | None:
            vals = [e for r in layers for e, s in zip(r.plan.entries.tolist(), r.plan.static.tolist()) if s == kind_static]
            return sum(vals) / len(vals) if vals else None

        return {
            "static": sum(static),
            "dynamic": sum(dynamic),
            "static_share": sum(static) / total if total else 0.0,
            "per_layer": {
                "static": static,
                "dynamic": dynamic,
                "chunks_per_dynamic_head": [r.plan.chunks for r in layers],
                "entries": [r.plan.entries.tolist() for r in layers],
                "sparsity": [[round(s, 4) for s in r.sparsity] for r in layers],
            },
            "budget_per_type": {
                "static_mean_entries": mean_entries(True),
                "dynamic_entries": mean_entries(False),
            },
            "budget_entries": target,
            "padding_entries": rounding,
            "padding_share": rounding / target if target else 0.0,
            "theta": self.theta,
            "p": self.sparsity_topk,
            "r": self.share,
            "chunk_size": layers[0].chunk if layers else self.chunk_size,
            "window": [r.window for r in layers],
            "retrieval_fallback_layers": sum(r.fallback for r in layers),
            "landmark": layers[0].landmark if layers else self.landmark,
            "landmark_reason": layers[0].landmark_reason if layers else None,
            **({"label_channels": f"file {self.index_file}" if self.index_file else
                "from the prompt (no --index-file)"} if any(r.landmark == "labels" for r in layers) else {}),
            "sink_aware": self.sink_aware,
            "refresh": refresh_summary(self.refresh, self.refresh_rate, [r.refresher for r in layers]),
        }
