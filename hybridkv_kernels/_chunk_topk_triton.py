"""Triton kernels of ``chunk_topk``: chunk scores, then an exact top-k by radix select.

Loaded by :func:`hybridkv_kernels.dispatch.load_triton_module`; launcher and torch reference
are in ``chunk_topk.py``.

Selection without sorting: map each fp32 score to an int32 key with the same order, find the
k-th largest key T by a radix select (8 bits a pass: 4 passes over the head's scores, which stay
in L2, each a 256-bucket histogram in shared memory; fewer when the bucket of the k-th holds only
keys of the top k, typically after 2 or 3); take every chunk with key > T and the lowest-id chunks
with key == T until k are taken; write the ids compacted in id order (a cumsum), i.e. already
sorted. One launch, one program per head, at most 5 passes over its C scores whatever k: tens of
thousands of candidates with O(BLOCK) registers; ties deterministic (lowest id wins), the same
rule as the torch reference.

Why one program per head: the threshold needs the whole row's histogram before each next digit,
and the id-ordered output needs every earlier block's count, i.e. a grid-wide step between
passes. Several blocks per head would take a launch per step (tile histograms, the threshold, a
compaction: three launches and scratch at least), worth it only if a GPU profile shows these
passes matter next to the step (64k candidates: 16 blocks of 4096 a pass).
"""

import triton
import triton.language as tl


# TABLE mode (chunk_retrieve): the heads are rows of several sequences' layers, each with its
# own tensors; TAB[h] holds the row's int64s (see batched_retrieval.py, ``COLUMNS``): the address
# of its landmarks and scales (the row's own start), its chunk count C and slot count K, ... .
@triton.jit
def chunk_scores_kernel(
    Q, LM, LM_SCALE, SCORES, TAB, G, C, D,
    stride_qh, stride_qg, stride_lh, stride_lc, stride_sch, stride_sh,
    HAS_SCALE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr, TABLE: tl.constexpr = False,
):
    """SCORES[h, c] = max_g q[h, g] . landmark[h, c] (x scale[h, c]), in fp32.

    ``tl.dot`` with the group padded to 16 rows (fp32 operands, exact "ieee" products) rather
    than a broadcast [G, BLOCK_C, D] product, which would not fit in registers.
    """
    h = tl.program_id(0)
    cb = tl.program_id(1)
    row = h
    if TABLE:
        LM = tl.load(TAB + h * 14).to(tl.pointer_type(LM.dtype.element_ty))
        LM_SCALE = tl.load(TAB + h * 14 + 1).to(tl.pointer_type(tl.float32))
        C = tl.load(TAB + h * 14 + 2).to(tl.int32)
        row = 0  # the table's addresses are the row's own
    off_g = tl.arange(0, BLOCK_G)
    off_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    off_d = tl.arange(0, BLOCK_D)
    mask_g = off_g < G
    mask_c = off_c < C
    mask_d = off_d < D
    q = tl.load(Q + h * stride_qh + off_g[:, None] * stride_qg + off_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    lm = tl.load(LM + row * stride_lh + off_c[:, None] * stride_lc + off_d[None, :],
                 mask=mask_c[:, None] & mask_d[None, :], other=0).to(tl.float32)
    s = tl.dot(q, tl.trans(lm), input_precision="ieee")  # [BLOCK_G, BLOCK_C]
    if HAS_SCALE:
        sc = tl.load(LM_SCALE + row * stride_sch + off_c, mask=mask_c, other=0.0).to(tl.float32)
        s = s * sc[None, :]  # before the max: a negative scale would flip it
    s = tl.where(mask_g[:, None], s, float("-inf"))
    best = tl.max(s, 0)
    tl.store(SCORES + h * stride_sh + off_c, best, mask=mask_c)


@triton.jit
def _order_key(s):
    """int32 key with the order of the fp32 value s (-0.0 and +0.0 equal, like torch)."""
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(s == 0.0, 0, key)


@triton.jit
def _radix_threshold(base, C, K, BLOCK: tl.constexpr):
    """(T, need): T = the K-th largest order key of base[:C]; need = how many keys equal to T
    belong to the top K (the others above T are all in).

    8 bits a pass from the top (at most 4 passes): each pass histograms, among the keys whose
    higher bits equal T's so far, their next byte (256 buckets), and descends into the bucket
    holding the K-th largest. When every key of that bucket belongs to the top K (typical once
    the bucket is narrow: distinct scores), the search stops there: T is the bucket's lowest
    possible key and every key >= T is in.
    """
    offs = tl.arange(0, BLOCK)
    buckets = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.int64)  # T's bits found so far, in unsigned order
    need = K
    done = tl.full([], 0, tl.int32)
    for p in tl.static_range(4):
        if done == 0:
            shift = 24 - 8 * p
            high = (tl.full([], 0xFFFFFFFF, tl.int64) << (shift + 8)) & 0xFFFFFFFF  # the bits found
            hist = tl.zeros([256], dtype=tl.int32)
            for c0 in range(0, C, BLOCK):
                mask = (c0 + offs) < C
                u = _order_key(tl.load(base + c0 + offs, mask=mask, other=0.0)).to(tl.int64) + 2147483648
                digit = ((u >> shift) & 255).to(tl.int32)
                hist += tl.histogram(digit, 256, mask=mask & ((u & high) == prefix))
            above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # keys in higher buckets than each bucket
            bucket = 256 - tl.sum((above < need).to(tl.int32), 0)  # highest b with count(>= b) >= need
            need -= tl.sum(tl.where(buckets > bucket, hist, 0), 0)
            prefix = prefix | (bucket.to(tl.int64) << shift)
            if tl.sum(tl.where(buckets == bucket, hist, 0), 0) == need:
                done = 1
    return (prefix - 2147483648).to(tl.int32), need


@triton.jit
def topk_select_kernel(
    SCORES, OUT, TAB, C, K,
    stride_sh, stride_oh,
    BLOCK: tl.constexpr, TABLE: tl.constexpr = False,
):
    """One program per head: OUT[h, :K] = ids of the K largest SCORES[h, :C], ascending
    (``TABLE``: the row's own C and K, from TAB)."""
    h = tl.program_id(0)
    if TABLE:
        C = tl.load(TAB + h * 14 + 2).to(tl.int32)
        K = tl.load(TAB + h * 14 + 3).to(tl.int32)
    _select(SCORES + h * stride_sh, OUT + h * stride_oh, C, K, BLOCK)


@triton.jit
def _select(base, out, C, K, BLOCK: tl.constexpr):
    """out[:K] = ids of the K largest base[:C], ascending (ties: lowest id)."""
    offs = tl.arange(0, BLOCK)
    # radix select of the threshold T = the K-th largest key: 4 passes over the scores
    lo, need = _radix_threshold(base, C, K, BLOCK)
    # compaction in id order: the output is sorted ascending for free
    n_out = tl.full([], 0, tl.int32)
    n_eq = tl.full([], 0, tl.int32)
    for c0 in range(0, C, BLOCK):
        ids = c0 + offs
        mask = ids < C
        sel, n_eq = _in_top(tl.load(base + ids, mask=mask, other=0.0), mask, lo, need, n_eq)
        sel = sel.to(tl.int32)
        dest = n_out + tl.cumsum(sel, 0) - 1
        tl.store(out + dest, ids.to(tl.int64), mask=sel > 0)
        n_out += tl.sum(sel, 0)


@triton.jit
def _in_top(scores, mask, lo, need, n_eq):
    """Which of a block's ``scores`` are in the top K of the row (threshold key ``lo``, ``need``
    ties at it, ``n_eq`` ties seen in earlier blocks: the lowest ids win), and the ties seen now."""
    key = _order_key(scores)
    eq = ((key == lo) & mask).to(tl.int32)
    eq_rank = tl.cumsum(eq, 0) + n_eq  # 1-based rank among the ties seen so far
    return ((key > lo) & mask) | ((eq > 0) & (eq_rank <= need)), n_eq + tl.sum(eq, 0)


@triton.jit
def capped_topk_kernel(
    SCORES, RES, SAVE, OUT, TAB, C, K, LIMIT, BONUS,
    stride_sh, stride_rh, stride_vh, stride_oh,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, TABLE: tl.constexpr = False,
):
    """``topk_select_kernel`` over scores where the row's held ids RES[h, :K] gain BONUS, with at
    most LIMIT ids outside them (``swap_cap.py``; a row with an empty slot, -1, is not capped),
    in one program per row. SCORES is scratch: for the cap the held scores are parked in SAVE
    while they stand at +inf (the K + LIMIT best are then every held id and the LIMIT best
    others), the others below that are set to -inf, the parked scores come back raised by
    BONUS, and the plain selection of K runs over what is left."""
    h = tl.program_id(0)
    res = RES + h * stride_rh
    if TABLE:
        C = tl.load(TAB + h * 14 + 2).to(tl.int32)
        K = tl.load(TAB + h * 14 + 3).to(tl.int32)
        res = tl.load(TAB + h * 14 + 4).to(tl.pointer_type(tl.int64))
    base = SCORES + h * stride_sh
    save = SAVE + h * stride_vh
    offs = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK_N)
    empty = tl.full([], 0, tl.int32)
    for j0 in range(0, K, BLOCK_N):
        m = (j0 + offs_n) < K
        ids = tl.load(res + j0 + offs_n, mask=m, other=0)
        empty += tl.sum((m & (ids < 0)).to(tl.int32), 0)
    if (LIMIT > 0) & (empty == 0) & (K + LIMIT < C):
        for j0 in range(0, K, BLOCK_N):
            m = (j0 + offs_n) < K
            ids = tl.load(res + j0 + offs_n, mask=m, other=0)
            tl.store(save + j0 + offs_n, tl.load(base + ids, mask=m, other=0.0), mask=m)
            tl.store(base + ids, tl.full([BLOCK_N], float("inf"), tl.float32), mask=m)
        tl.debug_barrier()
        lo, need = _radix_threshold(base, C, K + LIMIT, BLOCK)
        n_eq = tl.full([], 0, tl.int32)
        for c0 in range(0, C, BLOCK):
            ids = c0 + offs
            mask = ids < C
            keep, n_eq = _in_top(tl.load(base + ids, mask=mask, other=0.0), mask, lo, need, n_eq)
            tl.store(base + ids, tl.full([BLOCK], float("-inf"), tl.float32), mask=mask & ~keep)
        tl.debug_barrier()
        for j0 in range(0, K, BLOCK_N):
            m = (j0 + offs_n) < K
            ids = tl.load(res + j0 + offs_n, mask=m, other=0)
            tl.store(base + ids, tl.load(save + j0 + offs_n, mask=m, other=0.0) + BONUS, mask=m)
    else:
        for j0 in range(0, K, BLOCK_N):
            m = (j0 + offs_n) < K
            ids = tl.load(res + j0 + offs_n, mask=m, other=-1)
            held = m & (ids >= 0)
            tl.store(base + ids, tl.load(base + ids, mask=held, other=0.0) + BONUS, mask=held)
    tl.debug_barrier()
    _select(base, OUT + h * stride_oh, C, K, BLOCK)
