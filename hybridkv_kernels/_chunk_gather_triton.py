"""Triton kernel of ``chunk_gather``: zero-copy load of missing chunks from pinned host memory.

Loaded by :func:`hybridkv_kernels.dispatch.load_triton_module`; plan, launcher and torch
reference are in ``chunk_gather.py``.

On CUDA the host tensors are pinned, so through unified virtual addressing their CPU address
is also a device address (the Triton launcher accepts such pointers): each program reads its
chunk straight over PCIe and writes it into its slot. No CPU gather, no staging buffer, and
the grid is the full (head, slot) grid so it can be launched without knowing how many chunks
miss (no host sync before the copy); programs of slots that keep their chunk exit at once.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_gather_kernel(
    HK, HV, SK, SV, SLOT_BASE, ASSIGN, TAB, c, D,
    stride_hkh, stride_hkc, stride_hkt, stride_hvh, stride_hvc, stride_hvt,
    stride_skt, stride_svt, stride_ah,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, TABLE: tl.constexpr = False,
):
    """Program (h, s): if ASSIGN[h, s] >= 0 copy host chunk ASSIGN[h, s] of head h (K and V,
    [c, D]) to store rows SLOT_BASE[h] + s * c ... + c.

    ``TABLE`` (``chunk_retrieve``): row h's host chunks, store and slot base are its own
    (addresses in TAB, columns of batched_retrieval.COLUMNS), with its own chunk length c; every
    tensor is contiguous, so the strides follow from c and D."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    cid = tl.load(ASSIGN + h * stride_ah + s)
    head = h
    if TABLE:
        ptr = HK.dtype.element_ty
        HK = tl.load(TAB + h * 14 + 6).to(tl.pointer_type(ptr))
        HV = tl.load(TAB + h * 14 + 7).to(tl.pointer_type(ptr))
        SK = tl.load(TAB + h * 14 + 8).to(tl.pointer_type(ptr))
        SV = tl.load(TAB + h * 14 + 9).to(tl.pointer_type(ptr))
        SLOT_BASE = tl.load(TAB + h * 14 + 10).to(tl.pointer_type(tl.int64))
        c = tl.load(TAB + h * 14 + 11).to(tl.int32)
        stride_hkc = c * D
        stride_hvc = c * D
        head = 0
    if cid >= 0:
        off_t = tl.arange(0, BLOCK_T)
        off_d = tl.arange(0, BLOCK_D)
        mask = (off_t[:, None] < c) & (off_d[None, :] < D)
        rows = tl.load(SLOT_BASE + head).to(tl.int64) + s.to(tl.int64) * c + off_t
        k = tl.load(HK + head.to(tl.int64) * stride_hkh + cid * stride_hkc
                    + off_t[:, None] * stride_hkt + off_d[None, :], mask=mask)
        tl.store(SK + rows[:, None] * stride_skt + off_d[None, :], k, mask=mask)
        v = tl.load(HV + head.to(tl.int64) * stride_hvh + cid * stride_hvc
                    + off_t[:, None] * stride_hvt + off_d[None, :], mask=mask)
        tl.store(SV + rows[:, None] * stride_svt + off_d[None, :], v, mask=mask)


@triton.jit
def _any_equal(VALUES, n, ROW, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """For each of ``ROW`` [BLOCK_R]: 1 where it equals one of VALUES[:n] (walked BLOCK_V at a time)."""
    found = tl.zeros([BLOCK_R], dtype=tl.int32)
    for v0 in range(0, n, BLOCK_V):
        vs = v0 + tl.arange(0, BLOCK_V)
        other = tl.load(VALUES + vs, mask=vs < n, other=-3)  # -3 matches nothing (-1: empty, -2: padding)
        found = tl.maximum(found, tl.max((ROW[:, None] == other[None, :]).to(tl.int32), axis=1))
    return found


@triton.jit
def _sort_key(ids):
    """Order of a wanted row: ids ascending, then the -1 padding (TABLE rows with fewer chunks than slots)."""
    return tl.where(ids < 0, 0x7FFFFFFFFFFFFFFF, ids)


@triton.jit
def _ascending(want_row, n, BLOCK_J: tl.constexpr):
    """Whether want_row[:n] is in :func:`_sort_key` order (as chunk_topk writes it)."""
    bad = tl.full([], 0, tl.int32)
    for j0 in range(0, n, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        a = _sort_key(tl.load(want_row + js, mask=js < n, other=0))
        b = _sort_key(tl.load(want_row + js + 1, mask=js + 1 < n, other=-1))
        bad += tl.sum((a > b).to(tl.int32), axis=0)
    return bad == 0


@triton.jit
def _search(want_row, n, top, x):
    """For each key x [BLOCK]: the number of wanted ids with a smaller key (binary search of the
    sorted row; ``top``: the largest power of two <= n)."""
    pos = tl.zeros(x.shape, dtype=tl.int32)
    step = top
    while step > 0:
        cand = pos + step
        v = _sort_key(tl.load(want_row + cand - 1, mask=cand <= n, other=-1))
        pos = tl.where((cand <= n) & (v < x), cand, pos)
        step = step // 2
    return pos


@triton.jit
def _hits_sorted(res_row, want_row, n, top, s0, BLOCK_N: tl.constexpr):
    """Slots s0 .. s0 + BLOCK_N: (in range, resident id, hit, index of the hit's wanted id)."""
    slots = s0 + tl.arange(0, BLOCK_N)
    in_n = slots < n
    res = tl.load(res_row + slots, mask=in_n, other=-2)
    key = _sort_key(res)
    pos = _search(want_row, n, top, key)
    found = _sort_key(tl.load(want_row + pos, mask=in_n & (pos < n), other=-2))
    return in_n, res, in_n & (pos < n) & (found == key), pos


@triton.jit
def _pair_sorted(res_row, want_row, assign_row, n, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    """The plan for a wanted row in :func:`_sort_key` order: O(n log n), binary searches.

    ASSIGN holds, in turn: a flag per wanted id (resident or not); then the missing ids, compacted
    in want order (the i-th missing id at i); partners are parked in RESIDENT as ``-3 - id``.
    """
    top = 1
    while top * 2 <= n:
        top *= 2
    for j0 in range(0, n, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        tl.store(assign_row + js, tl.zeros([BLOCK_J], dtype=tl.int64), mask=js < n)
    tl.debug_barrier()
    for s0 in range(0, n, BLOCK_N):  # flag the wanted ids some slot holds
        in_n, res, hit, pos = _hits_sorted(res_row, want_row, n, top, s0, BLOCK_N)
        tl.store(assign_row + pos, tl.full([BLOCK_N], 1, dtype=tl.int64), mask=hit)
    tl.debug_barrier()
    missing = tl.full([], 0, tl.int32)
    for j0 in range(0, n, BLOCK_J):  # compact the missing ids (the i-th stored at i <= its index)
        js = j0 + tl.arange(0, BLOCK_J)
        flag = tl.load(assign_row + js, mask=js < n, other=1)
        want = tl.load(want_row + js, mask=js < n, other=-1)
        miss = (flag == 0).to(tl.int32)
        rank = missing + tl.cumsum(miss, axis=0) - 1
        tl.debug_barrier()  # every flag of the tile read before any is overwritten
        tl.store(assign_row + rank, want, mask=miss > 0)
        missing += tl.sum(miss, axis=0)
    tl.debug_barrier()
    free_seen = tl.full([], 0, tl.int32)
    for s0 in range(0, n, BLOCK_N):  # the i-th free slot takes the i-th missing id
        in_n, res, hit, pos = _hits_sorted(res_row, want_row, n, top, s0, BLOCK_N)
        free = in_n & (hit == 0)
        rank = free_seen + tl.cumsum(free.to(tl.int32), axis=0) - 1
        partner = tl.load(assign_row + rank, mask=free & (rank < missing), other=-1)
        tl.store(res_row + s0 + tl.arange(0, BLOCK_N), tl.where(partner >= 0, -3 - partner, res), mask=in_n)
        free_seen += tl.sum(free.to(tl.int32), axis=0)


@triton.jit
def _pair_any_order(res_row, want_row, assign_row, n, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    """The plan for wanted ids in any order: O(n^2) comparisons, [BLOCK_N, BLOCK_J] at a time.

    ASSIGN holds each wanted id's rank among the missing ones (-1: resident); partners are parked
    in RESIDENT as ``-3 - id``.
    """
    missing = tl.full([], 0, tl.int32)
    for j0 in range(0, n, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        want = tl.load(want_row + js, mask=js < n, other=-3)
        miss = ((js < n) & (_any_equal(res_row, n, want, BLOCK_J, BLOCK_N) == 0)).to(tl.int32)
        rank = missing + tl.cumsum(miss, axis=0) - 1
        tl.store(assign_row + js, tl.where(miss > 0, rank, -1).to(tl.int64), mask=js < n)
        missing += tl.sum(miss, axis=0)
    tl.debug_barrier()
    free_seen = tl.full([], 0, tl.int32)
    for s0 in range(0, n, BLOCK_N):
        slots = s0 + tl.arange(0, BLOCK_N)
        in_n = slots < n
        res = tl.load(res_row + slots, mask=in_n, other=-2)  # -1: empty, -2: padding
        free = in_n & (_any_equal(want_row, n, res, BLOCK_N, BLOCK_J) == 0)
        rank = free_seen + tl.cumsum(free.to(tl.int32), axis=0) - 1
        partner = tl.full([BLOCK_N], -1, dtype=tl.int64)
        for j0 in range(0, n, BLOCK_J):
            js = j0 + tl.arange(0, BLOCK_J)
            want = tl.load(want_row + js, mask=js < n, other=-3)
            miss_rank = tl.load(assign_row + js, mask=js < n, other=-1)
            pair = free[:, None] & (miss_rank[None, :] >= 0) & (rank[:, None] == miss_rank[None, :])
            partner = tl.maximum(partner, tl.max(tl.where(pair, want[None, :], -1), axis=1))
        tl.store(res_row + slots, tl.where(partner >= 0, -3 - partner, res), mask=in_n)
        free_seen += tl.sum(free.to(tl.int32), axis=0)


@triton.jit
def gather_plan_kernel(
    RESIDENT, WANT, ASSIGN, MOVED, TAB, n, chunk_bytes, read, stride_rh, stride_wh, stride_ah,
    BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, TABLE: tl.constexpr = False,
):
    """Program h: the plan of ``gather_plan`` for head h, written to ASSIGN[h]; RESIDENT[h]
    updated to what the slots will hold; MOVED += the bytes the gather will copy and ``read``,
    the bytes the head's ranking read from host memory (one counter of a step's host traffic).

    Slot s is a hit when its chunk is wanted; the free slots, in slot order, take the wanted
    chunks that are not resident, in want order (rank of a free slot == rank of a missing id).
    Tiles of BLOCK_N slots and BLOCK_J wanted ids, any n: the tile sizes bound registers and
    compile time, not n. A wanted row in ascending order (chunk_topk's, with any -1 padding
    last) is planned by binary searches, O(n log n): thousands of slots a head stay cheap; any
    other order by comparing every slot with every wanted id, O(n^2). Either way the partners
    are parked in RESIDENT as ``-3 - id``, then a last pass writes ASSIGN[h, s] (the id slot s
    loads, -1: none) and RESIDENT[h, s]. Barriers separate the passes, which read what the
    previous one stored.
    """
    h = tl.program_id(0)
    head = h
    if TABLE:  # row h's own slots, resident ids, byte counter and ranking reads (``chunk_bytes``: per element of D)
        RESIDENT = tl.load(TAB + h * 14 + 4).to(tl.pointer_type(tl.int64))
        MOVED = tl.load(TAB + h * 14 + 5).to(tl.pointer_type(tl.int64))
        n = tl.load(TAB + h * 14 + 3).to(tl.int32)
        chunk_bytes = chunk_bytes * tl.load(TAB + h * 14 + 11)
        read = tl.load(TAB + h * 14 + 12)
        head = 0
    res_row = RESIDENT + head * stride_rh
    want_row = WANT + h * stride_wh
    assign_row = ASSIGN + h * stride_ah
    if _ascending(want_row, n, BLOCK_J):
        _pair_sorted(res_row, want_row, assign_row, n, BLOCK_N, BLOCK_J)
    else:
        _pair_any_order(res_row, want_row, assign_row, n, BLOCK_N, BLOCK_J)
    tl.debug_barrier()
    loads = tl.full([], 0, tl.int32)
    for s0 in range(0, n, BLOCK_N):
        slots = s0 + tl.arange(0, BLOCK_N)
        in_n = slots < n
        parked = tl.load(res_row + slots, mask=in_n, other=-2)
        loaded = parked <= -3
        tl.store(assign_row + slots, tl.where(loaded, -3 - parked, -1), mask=in_n)
        tl.store(res_row + slots, tl.where(loaded, -3 - parked, parked), mask=in_n)
        loads += tl.sum(loaded.to(tl.int32), axis=0)
    tl.atomic_add(MOVED, loads.to(tl.int64) * chunk_bytes + read)
