"""Triton kernel of ``candidate_key_topk``'s scores (launcher and torch reference: ``candidate_keys.py``).

On CUDA the token-major codes are a pinned host tensor: through unified virtual addressing its
CPU address is also a device address (the Triton launcher accepts such pointers, as for
``chunk_gather``'s host store), so each program reads its candidates' bytes straight over PCIe,
d/4 contiguous bytes a candidate, with no CPU gather and no host sync.
"""

import triton
import triton.language as tl

from ._quant_keys_triton import code_logits


@triton.jit
def candidate_scores_kernel(
    Q, CODES, BOUNDS, CAND, SCORES, G, M, D,
    stride_qh, stride_qg, stride_ch, stride_cp, stride_mh, stride_sh,
    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr,
):
    """SCORES[h, m] = max over the group of q · (low + scale * code) of token CAND[h, m].

    One program per (head, block of BLOCK_M candidates): the candidate ids are loaded once, then
    their packed bytes (each requested four times, from cache after the first) are unpacked in
    registers by ``quant_key_scores_kernel``'s :func:`code_logits`, with a gathered token axis.
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
    s = code_logits(Q + h * stride_qh, stride_qg, off_g, mask_g, bounds_row, codes_row, cand, stride_cp, mask_m, 1,
                    D, BLOCK_G, BLOCK_M, BLOCK_D, BLOCK_DK)
    tl.store(SCORES + h * stride_sh + off_m, tl.max(s, 0), mask=mask_m)
