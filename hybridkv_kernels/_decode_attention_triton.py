"""Triton kernels of ``ragged_decode_attention`` (split-KV / flash-decoding).

Loaded by :func:`hybridkv_kernels.dispatch.load_triton_module`, once per mode (compiled or
interpreter); do not import it directly. The launcher and the torch reference are in
``decode_attention.py``.

Why ``tl.dot`` with the query group padded to 16 rows rather than multiply + sum:
decode attention is bandwidth-bound (each K/V row is read once and used by G <= 8 queries),
so the padded rows cost tensor-core cycles that are free, while a broadcast product
``[G, BLOCK_N, D]`` in fp32 (8 x 64 x 128 = 64k values per program) would not fit in registers
and would spill. Padding rows are masked on load (zeros) and on store.
"""

import triton
import triton.language as tl


@triton.jit
def _attend_block(q, k, v, mask_n, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """Online-softmax update with one block of keys/values (log2 domain)."""
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [BG, BN] fp32
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    # every block handed in has >= 1 valid key, so m_new is finite: no inf - inf
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


# n_gen grows every step: without this, n_gen == 1 and n_gen % 16 == 0 would each compile
# their own variant, i.e. compile stalls in the first decode steps
@triton.jit(do_not_specialize=["n_gen"])
def ragged_decode_stage1_kernel(
    Q, K, V, GK, GV, OFF, LEN, SEG, O_PART, LSE_PART,
    n_gen, split_len, qk_scale, G, D,
    stride_qh, stride_qg,
    stride_kt, stride_vt,
    stride_gkh, stride_gkt, stride_gvh, stride_gvt,
    stride_oh, stride_os, stride_og,
    stride_lh, stride_ls,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, TABLE: tl.constexpr, COUNTS: tl.constexpr = False,
):
    """One program = one KV head x one split of its (ragged rows ++ generated rows).

    ``TABLE``: the heads are segments of several stores (a batch of sequences, each its own
    tensors): ``SEG[h]`` holds five int64s, the addresses of segment h's store keys and values,
    of its first generated key and value row, and its generated-row count; ``K``, ``V``, ``GK``,
    ``GV`` and ``n_gen`` are then unused (dummies of the element type) and ``OFF`` is relative
    to the segment's own store. Every row stride is ``D`` in that mode (checked by the launcher).
    With ``COUNTS`` the fifth int64 is instead the address of the segment's generated-row count
    (an int64 on the device), read at launch: the table then stays valid while tokens are
    appended, so a decode step can be replayed (a CUDA graph) with the same table.

    Writes the split's normalised partial output ``O_PART[h, s, :G, :D]`` (fp32) and its
    log-sum-exp in log2 units ``LSE_PART[h, s, :G]`` (-inf for an empty split).
    The last dimension of every tensor is contiguous (checked by the launcher).
    """
    h = tl.program_id(0)
    s = tl.program_id(1)
    off_g = tl.arange(0, BLOCK_G)
    off_n = tl.arange(0, BLOCK_N)
    off_d = tl.arange(0, BLOCK_D)
    mask_g = off_g < G
    mask_d = off_d < D

    q = tl.load(Q + h * stride_qh + off_g[:, None] * stride_qg + off_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:  # interpreter: bf16 arithmetic is done on raw bits there
        q = q.to(tl.float32)

    if TABLE:
        ptr = K.dtype.element_ty
        # 16-byte aligned (the launcher checks): without the hint the loads are not vectorised
        K = tl.multiple_of(tl.load(SEG + h * 5).to(tl.pointer_type(ptr)), 16)
        V = tl.multiple_of(tl.load(SEG + h * 5 + 1).to(tl.pointer_type(ptr)), 16)
        GK = tl.multiple_of(tl.load(SEG + h * 5 + 2).to(tl.pointer_type(ptr)), 16)
        GV = tl.multiple_of(tl.load(SEG + h * 5 + 3).to(tl.pointer_type(ptr)), 16)
        if COUNTS:
            n_gen = tl.load(tl.load(SEG + h * 5 + 4).to(tl.pointer_type(tl.int64)))
        else:
            n_gen = tl.load(SEG + h * 5 + 4)
        head = 0  # the table's generated-row addresses are already the segment's own
    else:
        head = h
    row0 = tl.load(OFF + h).to(tl.int64)
    length = tl.load(LEN + h).to(tl.int64)
    total = length + n_gen
    start = s.to(tl.int64) * split_len
    end = tl.minimum(start + split_len, total)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    # part 1: the head's ragged rows of the flat store
    hi = tl.minimum(end, length)
    for n0 in range(start, hi, BLOCK_N):
        offs = n0 + off_n
        mask_n = offs < hi
        rows = row0 + offs
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + rows[:, None] * stride_kt + off_d[None, :], mask=mask_kv, other=0.0)
        v = tl.load(V + rows[:, None] * stride_vt + off_d[None, :], mask=mask_kv, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _attend_block(q, k, v, mask_n, m_i, l_i, acc, qk_scale, PREC)

    # part 2: generated rows (virtual positions length .. length + n_gen)
    lo = tl.maximum(start, length) - length
    hi = end - length
    for n0 in range(lo, hi, BLOCK_N):
        offs = n0 + off_n
        mask_n = offs < hi
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(GK + head * stride_gkh + offs[:, None] * stride_gkt + off_d[None, :],
                    mask=mask_kv, other=0.0)
        v = tl.load(GV + head * stride_gvh + offs[:, None] * stride_gvt + off_d[None, :],
                    mask=mask_kv, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _attend_block(q, k, v, mask_n, m_i, l_i, acc, qk_scale, PREC)

    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(O_PART + h * stride_oh + s * stride_os + off_g[:, None] * stride_og + off_d[None, :],
             o, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(LSE_PART + h * stride_lh + s * stride_ls + off_g, lse, mask=mask_g)


@triton.jit(do_not_specialize=["S"])
def merge_splits_kernel(
    O_PART, LSE_PART, OUT, S, D,
    stride_oh, stride_os, stride_og,
    stride_lh, stride_ls,
    stride_outh, stride_outg,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program = one query head: combine the splits' partial outputs by their LSE.

    A head whose splits are all empty (-inf) gets zeros, never NaN.
    """
    h = tl.program_id(0)
    g = tl.program_id(1)
    off_s = tl.arange(0, BLOCK_S)
    off_d = tl.arange(0, BLOCK_D)
    mask_s = off_s < S
    lse = tl.load(LSE_PART + h * stride_lh + off_s * stride_ls + g, mask=mask_s,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # exp2(-inf) = 0 for empty splits
    den = tl.sum(w, 0)
    o_ptr = O_PART + h * stride_oh + g * stride_og
    o = tl.load(o_ptr + off_s[:, None] * stride_os + off_d[None, :],
                mask=mask_s[:, None] & (off_d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    tl.store(OUT + h * stride_outh + g * stride_outg + off_d, out.to(OUT.dtype.element_ty),
             mask=off_d < D)
