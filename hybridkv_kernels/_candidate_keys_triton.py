"""Triton kernel of ``candidate_key_topk``'s scores (launcher and torch reference: ``candidate_keys.py``).

On CUDA the token-major codes are a pinned host tensor: through unified virtual addressing its
CPU address is also a device address (the Triton launcher accepts such pointers, as for
``chunk_gather``'s host store), so each program reads its candidates' bytes straight over PCIe,
d/4 contiguous bytes a candidate, with no CPU gather and no host sync.
"""

import triton
import triton.language as tl


@triton.jit
def candidate_scores_kernel(
    Q, CODES, BOUNDS, CAND, SCORES, G, M, D,
    stride_qh, stride_qg, stride_ch, stride_cp, stride_mh, stride_sh,
    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr,
):
    """SCORES[h, m] = max over the group of q · (low + scale * code) of token CAND[h, m].

    One program per (head, block of BLOCK_M candidates): the candidate ids are loaded once, then
    BLOCK_DK channels at a time the packed bytes [BLOCK_DK, BLOCK_M] (four channels a byte: each
    byte is requested four times, from cache after the first) are unpacked in registers and the
    logits add up one ``tl.dot`` a channel tile, of the scaled queries (group padded to 16 rows)
    with the codes, plus ``q · low`` (as ``quant_key_scores_kernel``, with a gathered token axis).
    """
    h = tl.program_id(0)
    mb = tl.program_id(1)
    codes_row = CODES + h.to(tl.int64) * stride_ch  # a long prompt's codes: beyond 2^31 bytes
    bounds_row = BOUNDS + h * 2 * D
    off_g = tl.arange(0, BLOCK_G)
    off_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_g = off_g < G
    mask_m = off_m < M
    cand = tl.load(CAND + h * stride_mh + off_m, mask=mask_m, other=0).to(tl.int64)
    s = tl.zeros([BLOCK_G, BLOCK_M], dtype=tl.float32)
    bias = tl.zeros([BLOCK_G], dtype=tl.float32)  # q · low
    for d0 in tl.static_range(0, BLOCK_D, BLOCK_DK):
        off_d = d0 + tl.arange(0, BLOCK_DK)
        mask_d = off_d < D
        q = tl.load(Q + h * stride_qh + off_g[:, None] * stride_qg + off_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        low = tl.load(bounds_row + off_d, mask=mask_d, other=0.0)
        scale = tl.load(bounds_row + D + off_d, mask=mask_d, other=0.0)
        bias += tl.sum(q * low[None, :], 1)
        byte = tl.load(codes_row + cand[None, :] * stride_cp + (off_d // 4)[:, None],
                       mask=mask_d[:, None] & mask_m[None, :], other=0).to(tl.int32)
        code = ((byte >> ((off_d % 4) * 2)[:, None]) & 3).to(tl.float32)  # [BLOCK_DK, BLOCK_M]
        s += tl.dot(q * scale[None, :], code, input_precision="ieee")
    s = tl.where(mask_g[:, None], s + bias[:, None], float("-inf"))
    tl.store(SCORES + h * stride_sh + off_m, tl.max(s, 0), mask=mask_m)
