"""Load the chunks each dynamic head wants into its device slots, keeping hits.

Layout
------
host_k, host_v    [H_dyn, C, c, d]  CPU (pinned when CUDA is available), one chunk contiguous
store_k, store_v  [T, d]            the layer's flat device store
slot_base         [H_dyn] int64     head i's slot s is rows slot_base[i] + s*c ... + c
resident          [H_dyn, n] int64  chunk id held by each slot, -1 = empty (updated in place)
want              [H_dyn, n] int64  the chunk set each head must hold after the call
                                    (distinct ids in [0, C) per row, any order)

Semantics (every backend)
-------------------------
A slot whose chunk is in ``want`` is a hit and is not touched. The other ("free") slots, in
slot order, receive the wanted-but-not-resident ids, in ``want`` order. Bytes moved =
misses x c x d x 2 (K and V) x host element size.

The plan (which slot gets which chunk) is computed on the device without a host sync: in torch
with boolean [H, C] masks and two stable sorts (:func:`gather_plan`), in the zero-copy path by
one kernel (``gather_plan_kernel``) before the copy kernel.
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

import torch

from .dispatch import load_triton_module, next_power_of_2, resolve_backend

__all__ = [
    "chunk_gather",
    "chunk_gather_torch",
    "GatherTarget",
    "copy_assigned",
    "chunk_gather_triton",
    "gather_plan",
]

_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _check(host_k, host_v, store_k, store_v, slot_base, resident, want):
    if host_k.dim() != 4 or host_v.shape != host_k.shape:
        raise ValueError(f"host_k/host_v must be [H, C, c, d], got {tuple(host_k.shape)}, "
                         f"{tuple(host_v.shape)}")
    H, C, c, d = host_k.shape
    if store_k.dim() != 2 or store_k.shape[1] != d or store_v.shape != store_k.shape:
        raise ValueError(f"store_k/store_v must be [T, {d}], got {tuple(store_k.shape)}")
    if resident.dim() != 2 or resident.shape[0] != H:
        raise ValueError(f"resident must be [{H}, n], got {tuple(resident.shape)}")
    if want.shape != resident.shape:
        raise ValueError(f"want must have resident's shape {tuple(resident.shape)}, got "
                         f"{tuple(want.shape)}")
    if not (host_k.is_contiguous() and host_v.is_contiguous()):
        raise ValueError("host_k/host_v must be contiguous (a reshape would copy the host store)")
    if slot_base.shape != (H,):
        raise ValueError(f"slot_base must be [{H}], got {tuple(slot_base.shape)}")
    if resident.dtype != torch.int64:
        raise ValueError("resident must be int64 (updated in place)")


def gather_plan(resident: torch.Tensor, want: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """Which chunk each slot must load.

    Parameters
    ----------
    resident, want : Tensor [H, n] int64
        Current slot contents (-1 = empty) and the wanted chunk set (distinct ids).
    n_chunks : int
        C, the number of chunks per head.

    Returns
    -------
    Tensor [H, n] int64
        ``assign[i, s]`` = chunk id to copy into slot s of head i, or -1 to leave it as is.
        Free slots (not holding a wanted chunk), in slot order, are paired with the missing
        ids, in ``want`` order; the pairing is a scatter, so no host sync is needed.
    """
    C = int(n_chunks)
    want = want.to(device=resident.device, dtype=torch.int64)
    held = resident.remainder(C + 1)  # an empty slot (-1) -> column C, which nothing wants
    is_held = torch.zeros(resident.shape[0], C + 1, dtype=torch.bool, device=resident.device).scatter_(1, held, True)
    is_wanted = torch.zeros_like(is_held).scatter_(1, want, True)
    hit = is_wanted.gather(1, held)  # [H, n] the slot keeps its chunk
    had = is_held.gather(1, want)  # [H, n] the wanted id is resident already
    # stable sorts put the free slots (slot order) and the missing ids (want order) first; both
    # counts are n - hits, so position j pairs them, and a resident id (-1 here) pairs no slot
    free_order = torch.sort(hit, dim=1, stable=True).indices
    missing = want.masked_fill(had, -1).gather(1, torch.sort(had, dim=1, stable=True).indices)
    return torch.empty_like(resident).scatter_(1, free_order, missing)


def _side_stream(device: torch.device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def chunk_gather_torch(host_k, host_v, store_k, store_v, slot_base, resident, want, moved=None, read=0):
    """Torch path of :func:`chunk_gather` (the reference semantics; the CPU path): the plan
    (:func:`gather_plan`), then :func:`copy_assigned`."""
    _check(host_k, host_v, store_k, store_v, slot_base, resident, want)
    if moved is None:
        moved = torch.zeros((), dtype=torch.int64, device=store_k.device)
    target = GatherTarget(host_k, host_v, store_k, store_v, slot_base, resident, moved)
    copy_assigned([target], gather_plan(resident, want, host_k.shape[1]))
    if read:
        moved.add_(read * host_k.shape[0])
    return moved


class GatherTarget(NamedTuple):
    """One sequence's dynamic heads as :func:`chunk_gather` takes them (``moved``: its byte counter)."""

    host_k: torch.Tensor
    host_v: torch.Tensor
    store_k: torch.Tensor
    store_v: torch.Tensor
    slot_base: torch.Tensor
    resident: torch.Tensor
    moved: torch.Tensor


def copy_assigned(targets: list[GatherTarget], assign: torch.Tensor) -> None:
    """Copy the chunks of a plan (``assign``: :func:`gather_plan`'s for the targets' heads, target
    after target; one geometry but the head count) into their slots.

    What to copy is found for all targets at once, and their resident ids and byte counters are
    updated by one op each (on the CPU a step's cost is mostly per op); then the missing chunks
    move: one host ``index_select`` per tensor for each target, or for all of them when they share
    one host KV (copies of one kept prefix), then on CUDA into a pinned staging buffer and
    ``copy_(non_blocking=True)`` on a side stream, K's DMA running while the CPU gathers V; the
    compute stream waits on an event before each target's ``index_copy_`` into its store, and
    the host does not wait for the copy.
    """
    first = targets[0]
    _, C, c, d = first.host_k.shape
    dev = first.store_k.device
    heads = [t.resident.shape[0] for t in targets]
    resident = first.resident if len(targets) == 1 else torch.cat([t.resident for t in targets])
    sel = assign >= 0
    rows, slots = sel.nonzero(as_tuple=True)  # the one host sync (on CUDA): the CPU must know what to copy
    base = (first.slot_base if len(targets) == 1 else torch.cat([t.slot_base for t in targets]))
    dst = base.to(device=dev, dtype=torch.int64)[rows] + slots * c
    if len(targets) == 1:
        src, counts = rows * C + assign[rows, slots], [rows.numel()]
    else:  # each target's misses (rows ascend: nonzero is row-major), by its own heads' rows
        starts = torch.tensor([0, *accumulate(heads)], device=rows.device)
        owner = torch.searchsorted(starts, rows, right=True) - 1
        src = (rows - starts[owner]) * C + assign[rows, slots]
        counts = torch.bincount(owner, minlength=len(targets)).tolist()
    if c > 1:  # chunks -> their token rows [misses * c], a chunk's c rows in a run
        run = torch.arange(c, device=dev)
        src, dst = (src[:, None] * c + run).reshape(-1), (dst[:, None] + run).reshape(-1)
    sizes, src = [n * c for n in counts], src.cpu()
    if not src.numel():
        return
    if all(t.host_k is first.host_k and t.host_v is first.host_v for t in targets):
        _copy_rows(first.host_k, first.host_v, src, [(t.store_k, t.store_v) for t in targets], dst.split(sizes))
    else:
        for t, src_rows, dst_rows, n in zip(targets, src.split(sizes), dst.split(sizes), counts):
            if n:
                _copy_rows(t.host_k, t.host_v, src_rows, [(t.store_k, t.store_v)], [dst_rows])
    moving = [i for i, n in enumerate(counts) if n]
    if moving:
        held = torch.where(sel, assign, resident).split(heads)
        torch._foreach_copy_([targets[i].resident for i in moving], [held[i] for i in moving])
        torch._foreach_add_([targets[i].moved for i in moving],
                            [counts[i] * c * d * 2 * targets[i].host_k.element_size() for i in moving])


def _copy_rows(host_k: torch.Tensor, host_v: torch.Tensor, src: torch.Tensor, stores: list[tuple], dsts: list) -> None:
    """Host token rows ``src`` (of ``host_k``/``host_v`` [H, C, c, d], chunk rows head after head)
    into ``stores`` (``(store_k, store_v)`` each): store ``i`` gets the next ``len(dsts[i])`` of
    them, at its rows ``dsts[i]``."""
    d = host_k.shape[-1]
    dev = stores[0][0].device
    flat = [host_k.reshape(-1, d), host_v.reshape(-1, d)]
    if dev.type != "cuda":
        rows = [host.index_select(0, src) for host in flat]
    else:
        main = torch.cuda.current_stream(dev)
        side = _side_stream(dev)
        rows = []
        for host in flat:
            stage = torch.empty((src.numel(), d), dtype=host.dtype, pin_memory=True)
            torch.index_select(host, 0, src, out=stage)
            with torch.cuda.stream(side):  # allocated in the side stream's pool
                buf = torch.empty((src.numel(), d), dtype=host.dtype, device=dev)
                buf.copy_(stage, non_blocking=True)
            buf.record_stream(main)  # consumed on main: not reused before that finishes
            rows.append(buf)
        main.wait_stream(side)
    sizes = [dst.numel() for dst in dsts]
    parts = [r.split(sizes) for r in rows] if len(dsts) > 1 else [[r] for r in rows]
    for (store_k, store_v), dst, part_k, part_v in zip(stores, dsts, *parts):
        if dst.numel():
            for store, part in ((store_k, part_k), (store_v, part_v)):
                store.index_copy_(0, dst, part if part.dtype == store.dtype else part.to(store.dtype))


def chunk_gather_triton(host_k, host_v, store_k, store_v, slot_base, resident, want, moved=None, read=0):
    """Zero-copy Triton path of :func:`chunk_gather` (see ``_chunk_gather_triton.py``).

    On CUDA the host tensors must be pinned (read through UVA); under the interpreter every
    tensor is on the CPU. No host sync: the plan and the byte count stay on the device. Raises
    ``RuntimeError`` where Triton cannot run these tensors.
    """
    resolve_backend("triton", store_k)
    return _launch(host_k, host_v, store_k, store_v, slot_base, resident, want, moved, read)


def _launch(host_k, host_v, store_k, store_v, slot_base, resident, want, moved=None, read=0):
    """:func:`chunk_gather_triton` once the backend is resolved."""
    _check(host_k, host_v, store_k, store_v, slot_base, resident, want)
    if store_k.is_cuda and not (host_k.is_pinned() and host_v.is_pinned()):
        raise ValueError("zero-copy chunk_gather needs pinned host_k/host_v")
    H, C, c, d = host_k.shape
    n = resident.shape[1]
    if host_k.dtype != store_k.dtype or host_v.dtype != store_v.dtype:
        raise ValueError("zero-copy chunk_gather needs host and store of the same dtype")
    if host_k.stride(-1) != 1 or host_v.stride(-1) != 1 or store_k.stride(-1) != 1 \
            or store_v.stride(-1) != 1:
        raise ValueError("zero-copy chunk_gather needs unit stride along d")
    mod = load_triton_module("_chunk_gather_triton")
    dev = store_k.device
    base = slot_base.to(device=dev, dtype=torch.int64).contiguous()
    moved = torch.zeros((), dtype=torch.int64, device=dev) if moved is None else moved
    if H and n:  # two launches: the plan (which slot loads which chunk), then the copies
        resident_in = resident if resident.is_contiguous() else resident.contiguous()
        want = want.to(device=dev, dtype=torch.int64).contiguous()
        assign = torch.empty_like(resident_in)
        mod.gather_plan_kernel[(H,)](
            resident_in, want, assign, moved, base, n, c * d * 2 * host_k.element_size(), read,
            resident_in.stride(0), want.stride(0), assign.stride(0),
            BLOCK_N=min(64, next_power_of_2(n)), BLOCK_J=min(64, next_power_of_2(n)),  # tiles: any n
        )
        if resident_in is not resident:
            resident.copy_(resident_in)
        mod.chunk_gather_kernel[(H, n)](
            host_k, host_v, store_k, store_v, base, assign, base, c, d,
            host_k.stride(0), host_k.stride(1), host_k.stride(2),
            host_v.stride(0), host_v.stride(1), host_v.stride(2),
            store_k.stride(0), store_v.stride(0), assign.stride(0),
            BLOCK_T=next_power_of_2(c), BLOCK_D=max(16, next_power_of_2(d)), num_warps=4,
        )
    return moved  # stays on the device: no sync


def chunk_gather(host_k, host_v, store_k, store_v, slot_base, resident, want, backend="auto", moved=None, read=0):
    """Make each dynamic head's device slots hold exactly its wanted chunks.

    Parameters
    ----------
    host_k, host_v : Tensor [H_dyn, C, c, d]
        Offloaded prompt K/V of the dynamic heads (CPU; pinned when CUDA is available).
    store_k, store_v : Tensor [T, d]
        The layer's flat device store; slots are written in place.
    slot_base : Tensor [H_dyn] int64
        First store row of each head's slots (slot s = rows ``slot_base + s*c`` ... ``+ c``).
    resident : Tensor [H_dyn, n] int64
        Chunk id held by each slot, -1 = empty; updated in place.
    want : Tensor [H_dyn, n] int64
        The chunk set to hold (distinct ids in [0, C) per row, any order), e.g. from
        :func:`chunk_topk` (then n = min(k, C)).
    backend : {"auto", "torch", "triton"}
        "triton" is the zero-copy kernel, what "auto" takes on CUDA (no host sync); the torch
        path needs the plan on the host (see :mod:`hybridkv_kernels.dispatch`).
    moved : Tensor (0-d, int64, on the store's device), optional
        A byte counter to add the bytes moved to (in place, on the device), and return.
    read : int
        Bytes each head's ranking read from host memory this step (host keys), added to ``moved``
        in the plan's launch: a step's host traffic is one counter.

    Returns
    -------
    Tensor (0-d, int64, on the store's device)
        Bytes moved host -> device: misses x c x d x 2 x element size. 0 when every wanted
        chunk is already resident. A device tensor, so a caller can add it up over a whole
        generation and read it once at the end.
    """
    if resolve_backend(backend, store_k) == "triton":
        return _launch(host_k, host_v, store_k, store_v, slot_base, resident, want, moved, read)
    return chunk_gather_torch(host_k, host_v, store_k, store_v, slot_base, resident, want, moved, read)
