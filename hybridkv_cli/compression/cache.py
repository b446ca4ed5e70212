"""Glue to transformers: a ``Cache`` whose layers a policy compresses, and the attention function.

The text attention of the model calls ``cache.update`` and then the attention function. Inside
:func:`policy_attention` that function is :func:`attend`: at prefill it runs stock SDPA over the
full prompt, then hands the layer (queries included) to the policy, which replaces the full KV
by its compressed form, so the peak prefill cache is one layer of full KV plus the compressed
layers before it. At decode it asks the compressed layer for attention directly.

The attention function finds the cache in its own call's keyword arguments: transformers hands
``cache.update`` the attention call's ``kwargs``, and :meth:`PolicyCache.update` adds itself
there. Nothing is registered at import time, and the model is restored on leaving the block.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hybridkv_cli.compression.base import LayerKV, Policy, PrefillLayer
from hybridkv_cli.compression.retrieval import DynamicHeads
from hybridkv_cli.compression.store import tensor_bytes
from hybridkv_kernels import batched_decode_attention, resolve_backend, retrieval_table, segment_table

ATTENTION_NAME = "hybridkv"
CACHE_KWARG = "hybridkv_cache"  # the keyword under which the attention call receives its cache


class DeviceClock:
    """Time spent in spans of work: the host clock on the CPU; on CUDA a pair of events per
    span (the host clock would time the kernel launches, not the kernels), read once at the end
    so that timing adds no sync to a decode step."""

    def __init__(self):
        self._host = 0.0
        self._events: list = []

    @contextlib.contextmanager
    def span(self, device: torch.device):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            start = time.perf_counter()
            yield
            self._host += time.perf_counter() - start

    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
        return self._host + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


class PolicyLayer(CacheLayerMixin):
    """One layer: the full prompt KV until the policy compresses it, then the policy's ``LayerKV``."""

    is_compileable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.kv: LayerKV | None = None
        self.seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        if self.kv is not None:
            if key_states.shape[-2] != 1:
                raise RuntimeError("a compressed cache takes one new token per step")
            self.kv.append(key_states[0], value_states[0])
        return key_states, value_states

    def get_seq_length(self) -> int:
        # The logical length (tokens seen), not tokens kept: positions and masks depend on it.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kv, self.seen = None, 0


class AttendingCache(Cache):
    """A cache whose attention calls find it: :meth:`update` hands it to the attention call that
    follows (see the module docstring)."""

    #: Times decode attention (a :class:`DeviceClock`), or None.
    attention_clock: DeviceClock | None = None

    def update(self, key_states, value_states, layer_idx: int, *args, kwargs: dict | None = None, **rest):
        """Cache the new keys and values; hand this cache to the attention call that follows
        (``kwargs`` are that call's keyword arguments)."""
        if kwargs is not None:
            kwargs[CACHE_KWARG] = self
        return super().update(key_states, value_states, layer_idx, *args, kwargs=kwargs, **rest)


class PolicyCache(AttendingCache):
    """The KV cache of one generation, owned by a compression policy.

    Parameters
    ----------
    policy : Policy
    num_layers : int
    visual : BoolTensor [N]
        Roles of the prompt tokens (see ``PrefillLayer.visual``).
    """

    def __init__(self, policy: Policy, num_layers: int, visual: torch.Tensor):
        super().__init__([PolicyLayer() for _ in range(num_layers)])
        self.attention_clock = DeviceClock()  # decode attention incl. retrieval and refresh
        self.policy = policy
        self.visual = visual
        self.run: dict = {}  # what the policy shares between the layers of this generation
        self.reports: dict[int, object] = {}  # the policy's report of each compressed layer
        self.prefill_peak_bytes = 0
        self.compress_seconds = 0.0  # classification, allocation, pruning, offload: all of compress()

    def compress_layer(self, index: int, query, key, value, scale: float) -> None:
        """Replace layer ``index``'s full prompt KV by the policy's compressed form."""
        start = time.perf_counter()
        full_bytes = tensor_bytes(key, value)
        heads = key.shape[1]
        prefill = PrefillLayer(
            index=index,
            num_layers=len(self.layers),
            query=query[0].unflatten(0, (heads, -1)),
            keys=key[0],
            values=value[0],
            visual=self.visual.to(key.device),
            scale=scale,
            run=self.run,
        )
        self.layers[index].kv, self.reports[index] = self.policy.compress(prefill)
        # Peak while prefilling: this layer's full KV beside the layers compressed before it.
        self.prefill_peak_bytes = max(self.prefill_peak_bytes, full_bytes + self.device_bytes())
        self.compress_seconds += time.perf_counter() - start

    @property
    def attention_seconds(self) -> float:
        """Decode attention time over the generation (on CUDA read from events, at the end)."""
        return self.attention_clock.seconds()

    def summary(self) -> dict | None:
        """The policy's head report of this generation (read once, at the end)."""
        return self.policy.summary([self.reports[i] for i in sorted(self.reports)])

    def _compressed(self) -> list[LayerKV]:
        return [layer.kv for layer in self.layers if layer.kv is not None]

    def device_bytes(self) -> int:
        return sum(kv.device_bytes() for kv in self._compressed())

    def host_bytes(self) -> int:
        return sum(kv.host_bytes() for kv in self._compressed())

    def transferred_bytes(self) -> int:
        return sum(kv.transferred_bytes() for kv in self._compressed())

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more generated tokens in every layer (:meth:`RaggedStore.reserve`)."""
        for kv in self._compressed():
            kv.reserve(rows)

    def advance(self) -> None:
        """The host's count of one token fed by a batch step (its rows are written on the device)."""
        for layer in self.layers:
            layer.seen += 1
            layer.kv.advance()

    @property
    def replayable(self) -> bool:
        """Every layer's decode step repeats the same device work (``LayerKV.replayable``)."""
        return all(kv.replayable for kv in self._compressed())

    @property
    def generated(self) -> int:
        """Generated rows written to every layer's store so far."""
        return self.layers[0].kv.store.n_gen

    @property
    def room(self) -> int:
        """Generated rows allocated and not yet written (the same in every layer)."""
        store = self.layers[0].kv.store
        return store.gen_k.shape[1] - store.n_gen


class BatchLayer(CacheLayerMixin):
    """Layer ``index`` of a batch: the members' own layers, appended to and attended together."""

    is_compileable = False
    is_sliding = False

    def __init__(self, index: int, batch: "BatchCache"):
        super().__init__()
        self.index, self.batch = index, batch
        self.kv = BatchedKV(index, batch)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device

    def update(self, key_states, value_states, *args, **kwargs):
        """Every member's new token (``[B, H_kv, 1, d]``) into its own store, at the row the
        batch's device counts give (so a replayed step writes where it should)."""
        rows = self.batch.rows
        for b, cache in enumerate(self.batch.members):
            store = cache.layers[self.index].kv.store
            store.gen_k.index_copy_(1, rows[b:b + 1], key_states[b])
            store.gen_v.index_copy_(1, rows[b:b + 1], value_states[b])
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max((cache.layers[self.index].seen for cache in self.batch.members), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class BatchedKV:
    """One layer of every member: the chunk retrieval of all members' dynamic heads in one pass
    (:meth:`DynamicHeads.refresh_all`), each member's own step work (:meth:`LayerKV.segments`),
    then one :func:`batched_decode_attention` over all their segments.

    When the batch is :attr:`BatchCache.planned`, the launch tables of both are built at the
    first step of its members and serve every later step: the generated-row counts are read on
    the device, so the step's launches are the same every step (a CUDA graph can replay them).
    """

    def __init__(self, index: int, batch: "BatchCache"):
        self.index, self.batch = index, batch
        self.plan = None  # (retrieval table or None, segment table) of the current members

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        batch = self.batch
        layers = [cache.layers[self.index].kv for cache in batch.members]
        queries = query.split(query.shape[0] // len(layers))
        dynamic = [(kv.dynamic, q, kv.store) for kv, q in zip(layers, queries) if kv.dynamic is not None]
        if not batch.planned:
            DynamicHeads.refresh_all(dynamic, batch.backend)
            return batched_decode_attention(query, [kv.segments(q, scale) for kv, q in zip(layers, queries)],
                                            scale=scale, backend=batch.backend)
        if self.plan is None:  # the members' first step: their tables, for every later one
            one_pass = DynamicHeads.one_pass(dynamic)
            self.plan = (retrieval_table(DynamicHeads.parts(one_pass)) if one_pass else None,
                         segment_table([kv.store.segments() for kv in layers], batch.counts))
        retrieval, table = self.plan
        DynamicHeads.refresh_all(dynamic, "triton", retrieval)
        counts = batch.counts
        parts = [kv.segments(q, scale, counts[b:b + 1]) for b, (kv, q) in enumerate(zip(layers, queries))]
        return batched_decode_attention(query, parts, scale=scale, backend="triton", table=table)


class BatchCache(AttendingCache):
    """The cache of a batch being decoded: :attr:`members` are the member generations' own
    caches, in batch order (:meth:`join` and :meth:`keep` change them).

    Parameters
    ----------
    backend : {"auto", "torch", "triton"}
        Kernels of the step (see ``hybridkv_kernels.dispatch``); a batch is :attr:`planned` (its
        step replayable) when it resolves to Triton, as "auto" does on CUDA.
    """

    def __init__(self, num_layers: int, device: torch.device, backend: str = "auto"):
        self.members: list[PolicyCache] = []
        self.backend = backend
        # Generated rows of each member (the same in all its layers) on the device, and the row
        # this step writes: a step's appends and attention read them, never a host count.
        self.counts = torch.zeros(0, dtype=torch.long, device=device)
        self.rows = torch.zeros(0, dtype=torch.long, device=device)
        self.planned = False
        super().__init__([BatchLayer(i, self) for i in range(num_layers)])

    def join(self, cache: PolicyCache) -> None:
        """Add a member whose generated rows are allocated for the rest of its decoding."""
        self.members.append(cache)
        count = torch.tensor([cache.generated], dtype=torch.long, device=self.counts.device)
        self.counts, self.rows = torch.cat([self.counts, count]), torch.cat([self.rows, count])
        self._replan()

    def keep(self, index: list[int]) -> None:
        """Keep the members at ``index`` (in that order); the others leave."""
        self.members[:] = [self.members[b] for b in index]
        at = torch.tensor(index, dtype=torch.long, device=self.counts.device)
        self.counts, self.rows = self.counts.index_select(0, at), self.rows.index_select(0, at)
        self._replan()

    def grow(self, rows: int) -> bool:
        """``rows`` more generated rows for every member whose allocated rows are all written
        (they move: the launch tables are built again); whether any grew."""
        full = [cache for cache in self.members if cache.room == 0]
        for cache in full:
            cache.reserve(rows)
        if full:
            self._replan()
        return bool(full)

    def _replan(self) -> None:
        for layer in self.layers:
            layer.kv.plan = None
        self.planned = bool(self.members) and all(c.replayable for c in self.members) and (
            resolve_backend(self.backend, self.counts) == "triton")

    def begin_step(self) -> None:
        """On the device: one more generated row per member, written at ``rows``."""
        self.counts.add_(1)
        torch.sub(self.counts, 1, out=self.rows)

    def device_bytes(self) -> int:
        return sum(cache.device_bytes() for cache in self.members)


def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function inside :func:`policy_attention` (see the module docstring)."""
    cache = kwargs.pop(CACHE_KWARG, None)
    if cache is None:  # not generating through a PolicyCache (e.g. a plain forward): behave as SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    layer = cache.layers[module.layer_idx]
    if layer.kv is None:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        cache.compress_layer(module.layer_idx, query, key, value, scaling)
        return out
    batch, q_heads, q_len, dim = query.shape  # q_len 1: a decode step (of each member of a batch)
    grouped = query[:, :, 0].reshape(batch * key.shape[1], -1, dim)
    clock = cache.attention_clock
    with clock.span(query.device) if clock is not None else contextlib.nullcontext():
        out = layer.kv.attend(grouped, scaling)
    return out.reshape(batch, q_len, q_heads, dim), None


@contextlib.contextmanager
def policy_attention(model):
    """Route the language model's attention through :func:`attend` inside the block.

    A multimodal model (one with sub-configs: text, vision, ...) keeps its own attention
    everywhere but in its text model. On exit the model's attention implementations are what
    they were and the name :data:`ATTENTION_NAME` is registered only if it was before.

    No attention-mask function is registered under the name, so transformers builds no mask:
    prefill runs SDPA with ``is_causal`` (what stock SDPA does for an unpadded prompt) and
    decoding reads the compressed layers, which need none.
    """
    subs = model.config.sub_configs
    previous = ({key: getattr(model.config, key)._attn_implementation for key in subs} if subs
                else model.config._attn_implementation)
    registered = ATTENTION_NAME in ALL_ATTENTION_FUNCTIONS
    ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = attend
    try:
        model.set_attn_implementation({key: ATTENTION_NAME if key == "text_config" else previous[key] for key in subs}
                                      if subs else ATTENTION_NAME)
        yield model
    finally:
        model.set_attn_implementation(previous)
        if not registered:
            del ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]
