"""Triton kernels of ``chunk_topk``: chunk scores, then an exact top-k by bisection.

Loaded by :func:`hybridkv_kernels.dispatch.load_triton_module`; launcher and torch reference
are in ``chunk_topk.py``.

Selection without sorting: map each fp32 score to an int32 key with the same order, find by
bisection (32 passes over the head's scores, which stay in L2) the largest threshold T with
``count(key >= T) >= k``; take every chunk with key > T and the lowest-id chunks with key == T
until k are taken; write the ids compacted in id order (a cumsum), i.e. already sorted.
This handles thousands of chunks per head in one program with O(BLOCK) registers, and makes
ties deterministic (lowest id wins), the same rule as the torch reference.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_scores_kernel(
    Q, LM, LM_SCALE, SCORES, G, C, D,
    stride_qh, stride_qg, stride_lh, stride_lc, stride_sch, stride_sh,
    HAS_SCALE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """SCORES[h, c] = max_g q[h, g] . landmark[h, c] (x scale[h, c]), in fp32.

    ``tl.dot`` with the group padded to 16 rows (fp32 operands, exact "ieee" products) rather
    than a broadcast [G, BLOCK_C, D] product, which would not fit in registers.
    """
    h = tl.program_id(0)
    cb = tl.program_id(1)
    off_g = tl.arange(0, BLOCK_G)
    off_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    off_d = tl.arange(0, BLOCK_D)
    mask_g = off_g < G
    mask_c = off_c < C
    mask_d = off_d < D
    q = tl.load(Q + h * stride_qh + off_g[:, None] * stride_qg + off_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    lm = tl.load(LM + h * stride_lh + off_c[:, None] * stride_lc + off_d[None, :],
                 mask=mask_c[:, None] & mask_d[None, :], other=0).to(tl.float32)
    s = tl.dot(q, tl.trans(lm), input_precision="ieee")  # [BLOCK_G, BLOCK_C]
    if HAS_SCALE:
        sc = tl.load(LM_SCALE + h * stride_sch + off_c, mask=mask_c, other=0.0).to(tl.float32)
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
def topk_select_kernel(
    SCORES, OUT, C, K,
    stride_sh, stride_oh,
    BLOCK: tl.constexpr,
):
    """One program per head: OUT[h, :K] = ids of the K largest SCORES[h, :C], ascending."""
    h = tl.program_id(0)
    base = SCORES + h * stride_sh
    offs = tl.arange(0, BLOCK)

    # largest T with count(key >= T) >= K; invariant: the answer lies in [lo, hi]
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        cnt = tl.full([], 0, tl.int32)
        for c0 in range(0, C, BLOCK):
            mask = (c0 + offs) < C
            key = _order_key(tl.load(base + c0 + offs, mask=mask, other=0.0))
            cnt += tl.sum(((key >= mid) & mask).to(tl.int32), 0)
        ok = cnt >= K
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)

    # count strictly above the threshold, then how many ties (key == lo) to take
    n_gt = tl.full([], 0, tl.int32)
    for c0 in range(0, C, BLOCK):
        mask = (c0 + offs) < C
        key = _order_key(tl.load(base + c0 + offs, mask=mask, other=0.0))
        n_gt += tl.sum(((key > lo) & mask).to(tl.int32), 0)
    need = K - n_gt

    # compaction in id order: the output is sorted ascending for free
    n_out = tl.full([], 0, tl.int32)
    n_eq = tl.full([], 0, tl.int32)
    for c0 in range(0, C, BLOCK):
        ids = c0 + offs
        mask = ids < C
        key = _order_key(tl.load(base + ids, mask=mask, other=0.0))
        eq = ((key == lo) & mask).to(tl.int32)
        eq_rank = tl.cumsum(eq, 0) + n_eq  # 1-based rank among the ties seen so far
        sel = (((key > lo) & mask) | ((eq > 0) & (eq_rank <= need))).to(tl.int32)
        dest = n_out + tl.cumsum(sel, 0) - 1
        tl.store(OUT + h * stride_oh + dest, ids.to(tl.int64), mask=sel > 0)
        n_out += tl.sum(sel, 0)
        n_eq += tl.sum(eq, 0)
