"""Triton kernel of ``quant_key_topk``'s scores (launcher and torch reference: ``quant_keys.py``)."""

import triton
import triton.language as tl


@triton.jit
def code_logits(Q_ROW, stride_qg, off_g, mask_g, BOUNDS_ROW, CODES_ROW, tok, stride_ct, mask_t, stride_cj, D,
                BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr):
    """[BLOCK_G, BLOCK_T] fp32 logits ``q_g · (low + scale * code)`` of tokens ``tok``, whose byte
    ``j`` (channels 4j..4j+3) sits at ``CODES_ROW + tok * stride_ct + j * stride_cj``; masked
    groups are -inf. Unpacked in registers BLOCK_DK channels at a time, one ``tl.dot`` a tile of
    the scaled queries (group padded to 16 rows) with the codes, plus ``q · low``: a whole
    [BLOCK_D, BLOCK_T] tile of unpacked codes (128 x 128 at d = 128) spilled 8 KB a thread."""
    s = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32)
    bias = tl.zeros([BLOCK_G], dtype=tl.float32)  # q · low
    for d0 in tl.static_range(0, BLOCK_D, BLOCK_DK):
        off_d = d0 + tl.arange(0, BLOCK_DK)
        mask_d = off_d < D
        q = tl.load(Q_ROW + off_g[:, None] * stride_qg + off_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        low = tl.load(BOUNDS_ROW + off_d, mask=mask_d, other=0.0)
        scale = tl.load(BOUNDS_ROW + D + off_d, mask=mask_d, other=0.0)
        bias += tl.sum(q * low[None, :], 1)
        byte = tl.load(CODES_ROW + tok[None, :] * stride_ct + (off_d // 4)[:, None] * stride_cj,
                       mask=mask_d[:, None] & mask_t[None, :], other=0).to(tl.int32)
        code = ((byte >> ((off_d % 4) * 2)[:, None]) & 3).to(tl.float32)  # [BLOCK_DK, BLOCK_T]
        s += tl.dot(q * scale[None, :], code, input_precision="ieee")
    return tl.where(mask_g[:, None], s + bias[:, None], float("-inf"))


@triton.jit
def quant_key_scores_kernel(
    Q, CODES, BOUNDS, SCORES, TAB, G, P, D,
    stride_qh, stride_qg, stride_ch, stride_cj, stride_sh,
    CHUNK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    TABLE: tl.constexpr = False, BLOCK_DK: tl.constexpr = 32,
):
    """SCORES[h, c] = max over the group and the chunk's tokens of q · (low + scale * code).

    One program per (head, block of BLOCK_P tokens): the packed bytes [d/4, BLOCK_P] are read
    once per channel (four channels a byte, from cache after the first) and unpacked in
    registers (:func:`code_logits`). ``TABLE`` (``chunk_retrieve``): row h's codes, bounds, chunk
    count and code row stride are its own (TAB columns 0, 1, 2 and 13 of batched_retrieval.COLUMNS).
    """
    h = tl.program_id(0)
    pb = tl.program_id(1)
    codes_row = CODES + h * stride_ch
    bounds_row = BOUNDS + h * 2 * D
    if TABLE:
        codes_row = tl.load(TAB + h * 14).to(tl.pointer_type(tl.uint8))
        bounds_row = tl.load(TAB + h * 14 + 1).to(tl.pointer_type(tl.float32))
        P = tl.load(TAB + h * 14 + 2).to(tl.int32) * CHUNK
        stride_cj = tl.load(TAB + h * 14 + 13)
    off_g = tl.arange(0, BLOCK_G)
    off_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_g = off_g < G
    mask_p = off_p < P
    s = code_logits(Q + h * stride_qh, stride_qg, off_g, mask_g, bounds_row, codes_row, off_p, 1, mask_p, stride_cj,
                    D, BLOCK_G, BLOCK_P, BLOCK_D, BLOCK_DK)
    best = tl.max(s, 0)  # [BLOCK_P]
    best = tl.max(tl.reshape(best, [BLOCK_P // CHUNK, CHUNK]), 1)
    off_c = pb * (BLOCK_P // CHUNK) + tl.arange(0, BLOCK_P // CHUNK)
    tl.store(SCORES + h * stride_sh + off_c, best, mask=off_c < P // CHUNK)
