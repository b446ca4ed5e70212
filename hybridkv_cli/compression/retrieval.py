"""Stage 3b: dynamic heads, served by chunk-wise retrieval from their offloaded prompt KV.

The prompt positions before the resident tail are cut into chunks of ``chunk`` tokens. Each
dynamic head's chunks move to host memory (pinned on CUDA), one chunk contiguous; on the device
stay what ranks them (:mod:`~hybridkv_cli.compression.landmarks`: every token's key at 2 bits
by default, with 1-token chunks), ``chunks`` retrieval slots and the resident tail. Every decode step ranks the chunks
for the query, keeps the slots whose chunk is still wanted and loads only the missing chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.landmarks import LANDMARKS, LabelKeys, MeanLandmarks, top_ids
from hybridkv_cli.compression.store import RaggedStore, tensor_bytes, to_host
from hybridkv_kernels import RetrievalPart, RetrievalTable, chunk_gather, chunk_retrieve


@dataclass
class DynamicHeads:
    """Retrieval state of one layer's dynamic heads.

    Attributes
    ----------
    heads : LongTensor [H_dyn]
        Which KV heads of the layer are dynamic.
    host_k, host_v : Tensor [H_dyn, C, chunk, d]
        The offloaded prompt KV (host memory, pinned on CUDA).
    landmarks : QuantKeys | HostKeys | LabelKeys | MinMaxLandmarks | MeanLandmarks | TokenDetector
        What ranks the chunks (on the device, but for the host-resident codes of HostKeys and
        LabelKeys).
    slot_base : LongTensor [H_dyn]
        Store row of each dynamic head's first slot.
    resident : LongTensor [H_dyn, n]
        Chunk held by each slot (-1: empty).
    swaps, stickiness : int, float
        With 2-bit keys, a selection that changes less (:mod:`hybridkv_kernels.swap_cap`): at most
        ``swaps`` chunks a head a step that it does not hold (0: no cap), and a held chunk ranking
        ``stickiness`` logits above its score.
    """

    heads: torch.Tensor
    host_k: torch.Tensor
    host_v: torch.Tensor
    landmarks: object
    slot_base: torch.Tensor
    resident: torch.Tensor
    swaps: int = 0  # most new chunks a head takes a step (2-bit keys; 0: no cap)
    stickiness: float = 0.0  # logits a held chunk gains in the ranking (2-bit keys)

    def __post_init__(self):
        self.transferred = torch.zeros((), dtype=torch.long, device=self.resident.device)  # read at the end

    @classmethod
    def offload(
        cls, keys, values, heads: torch.Tensor, store: RaggedStore, *, chunks: int, chunk: int, num_chunks: int,
        landmark: str = "mean", channels: torch.Tensor | None = None, query: torch.Tensor | None = None,
        swaps: int = 0, stickiness: float = 0.0,
    ) -> "DynamicHeads":
        """Move the first ``num_chunks * chunk`` prompt positions of ``heads`` to the host and
        build their landmarks.

        ``keys``/``values`` are the layer's full prompt KV [H, N, d]; ``store`` already reserves
        ``chunks * chunk`` slot rows at the start of each dynamic head's segment; ``channels``
        [H, K] are the label channels of every head (``landmark="labels"``). With ``query`` (the
        last prompt position's, [H, G, d]) the slots are filled here, from the KV the prefill
        holds on the device, with the chunks its exact logits rank first: the first decode step
        then copies what changed, not every slot.
        """
        dim = keys.shape[-1]
        span = num_chunks * chunk
        k = keys[heads, :span].reshape(len(heads), num_chunks, chunk, dim)
        v = values[heads, :span].reshape(len(heads), num_chunks, chunk, dim)
        landmarks = LabelKeys.build(k, channels[heads]) if landmark == "labels" else LANDMARKS[landmark].build(k)
        base = store.offsets[heads].clone()
        resident = torch.full((len(heads), chunks), -1, dtype=torch.long, device=keys.device)
        if query is not None and chunks and num_chunks:
            resident = fill_slots(query[heads], k, v, store, base, chunks)
        return cls(heads, to_host(k), to_host(v), landmarks, base, resident, swaps, stickiness)

    @staticmethod
    def device_bytes_for(heads: int, chunks: int, chunk: int, num_chunks: int, dim: int, landmark: str) -> int:
        """Device bytes besides the store rows, before building (budget accounting)."""
        return LANDMARKS[landmark].bytes_for(heads, num_chunks, chunk, dim) + 8 * heads * (chunks + 2)

    def refresh(self, query: torch.Tensor, store: RaggedStore, backend: str = "auto") -> None:
        """Load into the slots the top chunks for this step's ``query`` [H_kv, G, d] (``backend``:
        the gather's)."""
        if self.resident.shape[1] == 0:
            return
        want = self.landmarks.top(query[self.heads], self.resident.shape[1], self.resident, swaps=self.swaps,
                                  stickiness=self.stickiness)
        chunk_gather(self.host_k, self.host_v, store.keys, store.values, self.slot_base, self.resident, want, backend,
                     self.transferred, self.read_per_head())

    def read_per_head(self) -> int:
        """Host bytes one head's ranking reads a step (host keys, labels' second stage; else 0)."""
        return self.landmarks.read_bytes(self.resident.shape[1]) // max(1, len(self.heads))

    @staticmethod
    def one_pass(items: list[tuple["DynamicHeads", torch.Tensor, RaggedStore]]) -> list:
        """The ``(heads, query, store)`` items that :func:`~hybridkv_kernels.chunk_retrieve` serves
        in one pass: those with slots, ranked by the kind of the first one's landmarks when it has
        a retrieval kernel (mean keys, 2-bit keys on the device or in host memory, with the first
        one's chunk length)."""
        ready = [(d, q, s) for d, q, s in items
                 if d.resident.shape[1] and getattr(d.landmarks, "pass_tensors", None) is not None]
        if not ready:
            return []
        kind, chunk = type(ready[0][0].landmarks), ready[0][0].host_k.shape[2]
        return [(d, q, s) for d, q, s in ready
                if type(d.landmarks) is kind and (kind is MeanLandmarks or d.host_k.shape[2] == chunk)]

    @staticmethod
    def parts(items: list) -> list[RetrievalPart]:
        """The retrieval parts of :meth:`one_pass` items (for a reusable ``retrieval_table``)."""
        return [RetrievalPart(*d.landmarks.pass_tensors, d.host_k, d.host_v, s.keys, s.values,
                              d.slot_base, d.resident, d.transferred, d.read_per_head()) for d, _, s in items]

    @staticmethod
    def refresh_all(items: list[tuple["DynamicHeads", torch.Tensor, RaggedStore]], backend: str = "auto",
                    table: RetrievalTable | None = None) -> None:
        """:meth:`refresh` of several sequences' dynamic heads (``(heads, query, store)`` of one
        layer each): the :meth:`one_pass` ones in one pass (with ``table``, the
        ``retrieval_table`` of their :meth:`parts` built earlier), the others one by one; all
        with ``backend``."""
        one_pass = DynamicHeads.one_pass(items)
        if one_pass:  # one policy's layers: one cap
            first = one_pass[0][0]
            chunk_retrieve([q[d.heads] for d, q, _ in one_pass], DynamicHeads.parts(one_pass), backend, table,
                           first.swaps, first.stickiness)
        for d, q, s in items:
            if all(d is not other for other, _, _ in one_pass):
                d.refresh(q, s, backend)

    def device_bytes(self) -> int:
        return self.landmarks.device_bytes() + tensor_bytes(self.heads, self.slot_base, self.resident)

    def host_bytes(self) -> int:
        return tensor_bytes(self.host_k, self.host_v) + self.landmarks.host_bytes()

    def transferred_bytes(self) -> int:
        return int(self.transferred)


def fill_slots(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: RaggedStore, base: torch.Tensor,
               slots: int) -> torch.Tensor:
    """Fill each head's ``slots`` with the chunks whose best exact logit for ``query`` [H, G, d]
    is highest (``k``/``v`` [H, C, c, d] on the device; slot ``s`` of head ``h`` is store rows
    ``base[h] + s·c …``). Returns the resident chunk ids [H, slots], ascending."""
    heads, num_chunks, chunk, dim = k.shape
    logits = torch.einsum("hgd,htd->hgt", query.float(), k.flatten(1, 2).float()).amax(dim=1)
    want = top_ids(logits.unflatten(1, (num_chunks, chunk)).amax(dim=2), slots)
    taken = want.shape[1]
    rows = (base[:, None, None] + torch.arange(taken, device=k.device)[None, :, None] * chunk
            + torch.arange(chunk, device=k.device)[None, None, :]).flatten()
    at = torch.arange(heads, device=k.device)[:, None]
    store.keys[rows] = k[at, want].reshape(-1, dim)
    store.values[rows] = v[at, want].reshape(-1, dim)
    return torch.cat([want, want.new_full((heads, slots - taken), -1)], dim=1)
