"""A batch of generations decoded together: one ``Cache`` over the members' own caches.

Its layers hold no KV of their own: a step's new keys and values go to each member's store at
the member's generated-row count, kept on the device (:attr:`BatchCache.counts`), and a layer's
attention (:meth:`BatchedKV.attend`) runs the chunk retrieval of all members' dynamic heads in
one pass, the refresh of their pruned heads, each member's own step work and one decode-attention
launch over all their segments.
"""

from __future__ import annotations

import torch

from hybridkv_cli.compression.cache import AttendingCache, MembersLayer, PolicyCache
from hybridkv_cli.compression.refresh import Refresher
from hybridkv_cli.compression.retrieval import DynamicHeads
from hybridkv_kernels import (RaggedKV, RetrievalTable, batched_decode_attention, resolve_backend, retrieval_table,
                              segment_table)


class BatchLayer(MembersLayer):
    """Layer ``index`` of a batch: the members' own layers, appended to and attended together."""

    def __init__(self, index: int, batch: "BatchCache"):
        super().__init__(index, batch)
        self.kv = BatchedKV(index, batch)

    def update(self, key_states, value_states, *args, **kwargs):
        """Every member's new token (``[B, H_kv, 1, d]``) into its own store, at the row the
        batch's device counts give (so a replayed step writes where it should)."""
        owner = self.owner
        for cache, row, k, v in zip(owner.members, owner.member_rows, key_states.unbind(0), value_states.unbind(0)):
            store = cache.layers[self.index].kv.store
            store.gen_k.index_copy_(1, row, k)
            store.gen_v.index_copy_(1, row, v)
        return key_states, value_states


class BatchedKV:
    """One layer of every member: the chunk retrieval of all members' dynamic heads in one pass
    (:meth:`DynamicHeads.refresh_all`), the refresh of their pruned heads
    (:meth:`Refresher.refresh_all`: on the CPU those of one geometry together), each member's own
    step work (:meth:`LayerKV.segments`), then one :func:`batched_decode_attention` over all
    their segments.

    When the batch is :attr:`BatchCache.planned`, the launch tables of both are built at the
    first step of its members and serve every later step: the generated-row counts are read on
    the device, so the step's launches are the same every step (a CUDA graph can replay them).
    """

    def __init__(self, index: int, batch: "BatchCache"):
        self.index, self.batch = index, batch
        self.plan = None  # (retrieval table or None, segment table) of the current members

    def attend(self, query: torch.Tensor, scale: float, q_len: int = 1) -> torch.Tensor:
        if q_len != 1:
            raise RuntimeError("a batch step feeds each member one token (a suffix is read before it joins)")
        batch = self.batch
        layers = [cache.layers[self.index].kv for cache in batch.members]
        queries = query.split(query.shape[0] // len(layers))
        if not batch.planned:
            parts = step_parts(layers, queries, scale, batch.backend)
            return batched_decode_attention(query, parts, scale=scale, backend=batch.backend)
        if self.plan is None:  # the members' first step: their tables, for every later one
            one_pass = DynamicHeads.one_pass(dynamic_items(layers, queries))
            self.plan = (retrieval_table(DynamicHeads.parts(one_pass)) if one_pass else None,
                         segment_table([kv.store.segments() for kv in layers], batch.counts))
        retrieval, table = self.plan
        # the kernels read each member's count on the device
        counts = [batch.counts[b:b + 1] for b in range(len(layers))]
        parts = step_parts(layers, queries, scale, "triton", retrieval, counts)
        return batched_decode_attention(query, parts, scale=scale, backend="triton", table=table)


def step_parts(layers: list, queries: list[torch.Tensor], scale: float, backend: str = "auto",
               retrieval: RetrievalTable | None = None, counts: list | None = None) -> list[RaggedKV]:
    """The step work of several sequences' layers (``queries[i]``: layer i's [H_kv, G_i, d], a
    chunk's queries as one group), and what each then attends: the chunk retrieval of all their
    dynamic heads in one pass (:meth:`DynamicHeads.refresh_all`; ``retrieval``: its table built
    earlier), the refresh of their pruned heads (:meth:`Refresher.refresh_all`; ``counts``: each
    one's generated rows on the device, None: its store's count), then each one's
    :meth:`LayerKV.segments`."""
    DynamicHeads.refresh_all(dynamic_items(layers, queries), backend, retrieval)
    counts = counts or [None] * len(layers)
    Refresher.refresh_all([(kv.refresher, q, kv.store, count) for kv, q, count in zip(layers, queries, counts)
                           if kv.refresher is not None], scale)
    return [kv.segments(q, scale) for kv, q in zip(layers, queries)]


def dynamic_items(layers: list, queries: list[torch.Tensor]) -> list[tuple]:
    """``(heads, query, store)`` of the layers with dynamic heads, for one retrieval pass: their
    queries in one group size, a smaller group (a shorter chunk) padded with copies of its last
    row -- a ranking scores a chunk by its best row, which a copy does not change."""
    rows = max(q.shape[1] for q in queries)
    return [(kv.dynamic, q if q.shape[1] == rows else torch.cat([q, q[:, -1:].expand(-1, rows - q.shape[1], -1)], 1),
             kv.store) for kv, q in zip(layers, queries) if kv.dynamic is not None]


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
        self.member_rows: tuple[torch.Tensor, ...] = ()  # each member's [1] view of rows (made as members change)
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
        self.member_rows = self.rows.split(1)
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
