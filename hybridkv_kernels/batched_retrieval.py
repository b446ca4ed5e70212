"""Chunk retrieval for the dynamic heads of several sequences in one pass.

Each part is one sequence's layer: its dynamic heads' landmarks, offloaded chunks, store, slots
and byte counter, each its own tensors. :func:`chunk_retrieve` does for every part what
``chunk_topk`` + ``chunk_gather`` do for one (the top ``n`` chunks of each head for its query,
loaded into the head's ``n`` slots, hits kept), the parts' chunk counts, slot counts and chunk
lengths all differing. The Triton path is four launches for all parts (scores, top-k, plan,
copy), each kernel the single-sequence one reading its rows through a table of addresses
(``TABLE`` mode; the scores from int8 mean keys or from 2-bit keys, on the device or in pinned
host memory read in place, one kind per pass). The
torch path ranks and plans the parts of one geometry together (their heads side by side: one
op for all of them, as a batch's cost on the CPU is mostly per op), then copies each part's
missing chunks into its own store.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .chunk_gather import GatherTarget, chunk_gather, copy_assigned, gather_plan
from .chunk_topk import chunk_topk, launch_topk
from .dispatch import cdiv, load_triton_module, next_power_of_2, resolve_backend
from .quant_keys import launch_scores, quant_key_topk
from .tensors import joined

__all__ = ["RetrievalPart", "RetrievalTable", "chunk_retrieve", "retrieval_table"]

#: The int64 columns of a row of the table, in kernel order.
COLUMNS = ("landmarks", "landmark_scale", "chunks", "slots", "resident", "moved", "host_k", "host_v", "store_k",
           "store_v", "slot_base", "chunk", "read", "code_row")


class RetrievalPart(NamedTuple):
    """One sequence's dynamic heads in a layer (the arguments of ``chunk_topk`` or
    ``quant_key_topk``, and ``chunk_gather``).

    landmarks [H, C, d] int8 with landmark_scale [H, C] (mean keys), or the 2-bit keys of
    ``pack_keys``: uint8 codes [H, d/4, C·c] (on the device, or pinned host memory: host keys)
    with their bounds [H, 2, d]; host_k, host_v [H, C, c, d]; store_k, store_v [T, d]; slot_base
    [H]; resident [H, n] (updated in place); moved: 0-d int64, the part's byte counter (added to
    in place); read: the bytes a head's ranking reads from host memory a step (added to moved).
    """

    landmarks: torch.Tensor
    landmark_scale: torch.Tensor
    host_k: torch.Tensor
    host_v: torch.Tensor
    store_k: torch.Tensor
    store_v: torch.Tensor
    slot_base: torch.Tensor
    resident: torch.Tensor
    moved: torch.Tensor
    read: int = 0

    @property
    def target(self) -> GatherTarget:
        return GatherTarget(self.host_k, self.host_v, self.store_k, self.store_v, self.slot_base, self.resident,
                            self.moved)


class RetrievalTable(NamedTuple):
    """The parts' rows for the ``TABLE``-mode kernels (:data:`COLUMNS`, one row per head, on the
    device) and the largest chunk count, slot count and chunk length among them."""

    rows: torch.Tensor
    chunks: int
    slots: int
    chunk: int


def retrieval_table(parts: list[RetrievalPart]) -> RetrievalTable:
    """The table :func:`chunk_retrieve` launches with. It holds addresses only (every state it
    points at is updated in place), so one table serves every step of the same parts."""
    first = parts[0]
    if any(p.host_k.dtype != first.host_k.dtype or p.store_k.dtype != first.host_k.dtype
           or p.landmarks.dtype != first.landmarks.dtype or p.landmarks.dtype not in (torch.int8, torch.uint8)
           or p.landmark_scale.dtype != torch.float32 for p in parts):
        raise ValueError("chunk_retrieve needs one kind of landmarks (int8 mean keys or 2-bit keys) with fp32 scales "
                         "and one dtype for every host chunk and store")
    if _two_bit(first) and any(p.host_k.shape[2] != first.host_k.shape[2] for p in parts):
        raise ValueError("chunk_retrieve needs one chunk length for every part ranked by 2-bit keys")
    rows = []
    for p in parts:  # 2-bit code rows may be padded (pack_keys aligns them): the table holds their stride
        if not all(t.is_contiguous() for t in (p.landmark_scale, p.host_k, p.host_v, p.resident, p.slot_base)) \
                or p.landmarks.stride(-1) != 1 or p.landmarks.stride(0) != p.landmarks.shape[1] * p.landmarks.stride(1):
            raise ValueError("chunk_retrieve needs contiguous tensors (2-bit codes: rows of any stride)")
        if p.store_k.is_cuda and not (p.host_k.is_pinned() and p.host_v.is_pinned()
                                      and (p.landmarks.is_cuda or p.landmarks.is_pinned())):
            raise ValueError("chunk_retrieve reads host chunks and codes in place: they must be pinned")
        heads, chunks, chunk, _ = p.host_k.shape
        for h in range(heads):
            rows.append((p.landmarks[h].data_ptr(), p.landmark_scale[h].data_ptr(), chunks, p.resident.shape[1],
                         p.resident[h].data_ptr(), p.moved.data_ptr(), p.host_k[h].data_ptr(), p.host_v[h].data_ptr(),
                         p.store_k.data_ptr(), p.store_v.data_ptr(), p.slot_base[h:].data_ptr(), chunk, p.read,
                         p.landmarks.stride(1)))
    table = torch.tensor(rows, dtype=torch.int64)
    device = first.store_k.device
    table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
    return RetrievalTable(table, max(p.host_k.shape[1] for p in parts), max(p.resident.shape[1] for p in parts),
                          max(p.host_k.shape[2] for p in parts))


def chunk_retrieve(queries: list[torch.Tensor], parts: list[RetrievalPart], backend: str = "auto",
                   table: RetrievalTable | None = None, swaps: int = 0, stickiness: float = 0.0) -> None:
    """Load every part's wanted chunks for its query (``queries[i]``: [H_i, G, d], part i's heads).

    ``backend`` resolves as every op's does (:mod:`.dispatch`); the result is the parts' slots,
    resident ids and byte counters.
    With Triton the parts go through the ``TABLE``-mode kernels (four launches for all of them),
    ``table`` (:func:`retrieval_table`) built earlier or now; a single part without a table takes
    the single-sequence kernels. The torch path takes the parts of one :func:`_geometry` together.
    With 2-bit keys, ``stickiness`` (logits a held chunk gains) and ``swaps`` (most new chunks a
    head a step, 0: no cap) make a step's selection change less (:mod:`.swap_cap`).
    """
    if not parts:
        return
    resolved = resolve_backend(backend, queries[0], parts[0].store_k)
    if resolved != "triton":
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(parts):
            groups.setdefault(_geometry(p), []).append(i)
        for index in groups.values():
            _together([queries[i] for i in index], [parts[i] for i in index], "torch", swaps, stickiness)
        return
    if len(parts) == 1 and table is None:
        _together(queries, parts, resolved, swaps, stickiness)
        return
    _launch(torch.cat(queries), parts[0], table or retrieval_table(parts), swaps, stickiness)


def _two_bit(part: RetrievalPart) -> bool:
    return part.landmarks.dtype == torch.uint8


def _geometry(p: RetrievalPart) -> tuple:
    """What parts must share to be ranked and planned as one: every size but their head counts,
    and the element types."""
    return (p.landmarks.shape[1:], p.landmark_scale.shape[1:], p.host_k.shape[1:], p.resident.shape[1],
            p.landmarks.dtype, p.landmark_scale.dtype, p.host_k.dtype, p.store_k.dtype)


def _together(queries: list[torch.Tensor], parts: list[RetrievalPart], backend: str = "torch", swaps: int = 0,
              stickiness: float = 0.0) -> None:
    """``parts`` of one geometry: the top chunks and the plan of all their heads at once (one op
    each), then each part's copies; a single part takes ``backend``'s own gather."""
    first = parts[0]
    q, chunks, chunk, n = joined(queries), first.host_k.shape[1], first.host_k.shape[2], first.resident.shape[1]
    if _two_bit(first) and backend == "torch" and all(p.landmarks is first.landmarks
                                                      and p.landmark_scale is first.landmark_scale for p in parts):
        landmarks, scale = first.landmarks, first.landmark_scale  # copies of one prefix: its codes unpacked once
    else:
        landmarks, scale = joined([p.landmarks for p in parts]), joined([p.landmark_scale for p in parts])
    if _two_bit(first):
        resident = joined([p.resident for p in parts]) if swaps or stickiness else None
        want = quant_key_topk(q, landmarks, scale, chunk, n, backend, resident=resident, swaps=swaps,
                              stickiness=stickiness)
    else:
        want = chunk_topk(q, landmarks, n, landmark_scale=scale, backend=backend)
    if len(parts) == 1:
        chunk_gather(*first.target[:6], want, backend, first.moved, first.read)
        return
    copy_assigned([p.target for p in parts], gather_plan(joined([p.resident for p in parts]), want, chunks))
    for p in parts:
        if p.read:
            p.moved.add_(p.read * p.resident.shape[0])


def _launch(q: torch.Tensor, first: RetrievalPart, tab: RetrievalTable, swaps: int = 0, stickiness: float = 0.0
            ) -> None:
    """The four ``TABLE``-mode launches (``first``: any part, for the kernels' element types)."""
    dev = q.device
    mod_top, mod_gat = load_triton_module("_chunk_topk_triton"), load_triton_module("_chunk_gather_triton")
    rows, group, d = q.shape
    table, c_max, n_max, chunk_max = tab
    q = q if q.is_contiguous() else q.contiguous()
    want = torch.full((rows, n_max), -1, dtype=torch.int64, device=dev)
    assign = torch.full((rows, n_max), -1, dtype=torch.int64, device=dev)
    block_d = max(16, next_power_of_2(d))
    if _two_bit(first):
        scores = launch_scores(q, first.landmarks, first.landmark_scale, chunk_max, table=table,
                               tokens=c_max * chunk_max)
    else:
        scores, block_c = torch.empty(rows, c_max, dtype=torch.float32, device=dev), 64
        mod_top.chunk_scores_kernel[(rows, cdiv(c_max, block_c))](
            q, first.landmarks, first.landmark_scale, scores, table, group, c_max, d,
            q.stride(0), q.stride(1), 0, d, 0, scores.stride(0),
            HAS_SCALE=True, BLOCK_G=max(16, next_power_of_2(group)), BLOCK_C=block_c, BLOCK_D=block_d, TABLE=True,
            num_warps=4,
        )
    if _two_bit(first):  # the held chunks' bonus (logits -> raw q·k) and the cap, in the selection's launch
        launch_topk(scores, n_max, out=want, table=table, limit=swaps, bonus=stickiness * d ** 0.5)
    else:
        launch_topk(scores, n_max, out=want, table=table)
    mod_gat.gather_plan_kernel[(rows,)](
        first.resident, want, assign, first.moved, table, n_max, d * 2 * first.host_k.element_size(), 0,
        0, want.stride(0), assign.stride(0),
        BLOCK_N=min(64, next_power_of_2(n_max)), BLOCK_J=min(64, next_power_of_2(n_max)), TABLE=True,
    )
    mod_gat.chunk_gather_kernel[(rows, n_max)](
        first.host_k, first.host_v, first.store_k, first.store_v, first.slot_base, assign, table, chunk_max, d,
        d, d, d, d, d, d, d, d, assign.stride(0),  # (per row from c and D in TABLE mode)
        BLOCK_T=next_power_of_2(chunk_max), BLOCK_D=block_d, TABLE=True, num_warps=4,
    )
