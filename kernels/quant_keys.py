"""Chunk scores from 2-bit keys: every prompt token's key at 2 bits per channel ranks the chunks.

A head's keys are kept as ``k ≈ low + scale * code`` with ``code`` in 0..3, one range per
channel, four channels to a byte (:func:`pack_keys`). A chunk's score is the best approximate
logit of its tokens over the query group, ``max_g max_t (q_g · k̂_t)``, so one strongly matching
token shows as sharply as in exact attention; the top chunks are then chosen as
:func:`~hybridkv_kernels.chunk_topk` chooses them (same tie rule, ids ascending).

The Triton kernel reads the packed bytes (1/16 of a bf16 key and value) and unpacks them in
registers; the torch reference unpacks them into an fp32 matrix.
"""

from __future__ import annotations

import torch

from .chunk_topk import _topk_ids_from_scores
from .dispatch import cdiv, load_triton_module, next_power_of_2, resolve_backend

__all__ = ["pack_keys", "quant_key_scores_torch", "quant_key_topk", "unpack_codes"]

SHIFTS = (0, 2, 4, 6)  # channel 4j + s sits at bits 2s of byte j


def pack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``keys`` [H, P, d] (d divisible by 4) at 2 bits per channel.

    Returns ``(codes, low, scale)``: uint8 [H, d/4, P] (byte ``j`` of token ``p`` holds channels
    ``4j .. 4j+3``, low bits first; channel-major, so a query's product is one matmul), and fp32
    [H, d] with ``k ≈ low + scale * code``.
    """
    heads, tokens, dim = keys.shape
    if dim % 4:
        raise ValueError(f"2-bit keys need a head dimension divisible by 4, got {dim}")
    k = keys.float()
    low = k.amin(dim=1)
    scale = (k.amax(dim=1) - low).clamp_min(1e-12) / 3.0
    codes = torch.round((k - low[:, None]) / scale[:, None]).clamp_(0, 3).to(torch.uint8)
    fours = codes.transpose(1, 2).unflatten(1, (dim // 4, 4))  # [H, d/4, 4, P]
    packed = fours[:, :, 0] | fours[:, :, 1] << 2 | fours[:, :, 2] << 4 | fours[:, :, 3] << 6
    return packed.contiguous(), low, scale


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The 2-bit codes of :func:`pack_keys` as fp32 [H, d, P]."""
    shifts = torch.tensor(SHIFTS, dtype=torch.uint8, device=codes.device)[:, None]
    return ((codes.unsqueeze(2) >> shifts) & 3).flatten(1, 2).float()


def _check(q, codes, low, scale, chunk):
    H, G, d = q.shape
    if codes.dim() != 3 or codes.shape[:2] != (H, d // 4) or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 [H, d/4, P] = [{H}, {d // 4}, P], got {tuple(codes.shape)} {codes.dtype}")
    if low.shape != (H, d) or scale.shape != (H, d):
        raise ValueError(f"low and scale must be [{H}, {d}], got {tuple(low.shape)}, {tuple(scale.shape)}")
    if chunk < 1 or codes.shape[2] % chunk:
        raise ValueError(f"{codes.shape[2]} tokens do not split into chunks of {chunk}")


def quant_key_scores_torch(q, codes, low, scale, chunk: int) -> torch.Tensor:
    """Chunk scores [H, C] fp32: ``max_g max_t q[h, g] · (low + scale * code[h, :, t])`` over
    the ``chunk`` tokens of each chunk."""
    _check(q, codes, low, scale, chunk)
    qf = q.float()
    logits = torch.bmm(qf * scale[:, None], unpack_codes(codes)) + (qf * low[:, None]).sum(-1, keepdim=True)
    return logits.amax(dim=1).unflatten(1, (-1, chunk)).amax(dim=2)


def _launch_scores(q, codes, low, scale, chunk: int, block_p: int | None = None) -> torch.Tensor:
    _check(q, codes, low, scale, chunk)
    mod = load_triton_module("_quant_keys_triton")
    H, G, d = q.shape
    tokens = codes.shape[2]
    scores = torch.empty(H, tokens // chunk, dtype=torch.float32, device=q.device)
    if H == 0 or tokens == 0:
        return scores
    if chunk & (chunk - 1):
        raise RuntimeError(f"the Triton 2-bit key scores need a power-of-two chunk, got {chunk}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    codes = codes if codes.stride(-1) == 1 else codes.contiguous()
    low, scale = low.float().contiguous(), scale.float().contiguous()
    block_p = max(16, chunk, next_power_of_2(block_p or 128))
    mod.quant_key_scores_kernel[(H, cdiv(tokens, block_p))](
        q, codes, low, scale, scores, G, tokens, d,
        q.stride(0), q.stride(1), codes.stride(0), codes.stride(1), scores.stride(0),
        CHUNK=chunk, BLOCK_G=max(16, next_power_of_2(G)), BLOCK_P=block_p,
        BLOCK_D=max(16, next_power_of_2(d)), num_warps=4,
    )
    return scores


def quant_key_topk(q, codes, low, scale, chunk: int, k: int, backend: str = "auto") -> torch.Tensor:
    """Top-``k`` chunks per head by their best 2-bit-key logit.

    Parameters
    ----------
    q : Tensor [H, G, d]
        Decode queries, grouped by KV head.
    codes, low, scale
        A head's prompt keys as :func:`pack_keys` gives them (P = C · chunk tokens).
    chunk : int
        Tokens per chunk.
    k : int
        Chunks wanted per head; ``min(k, C)`` are returned.
    backend : {"auto", "torch", "triton"}

    Returns
    -------
    Tensor [H, min(k, C)] int64
        Chunk ids, ascending per head; ties: lowest id wins (as :func:`chunk_topk`).
    """
    if resolve_backend(backend, q, codes) == "triton":
        scores = _launch_scores(q, codes, low, scale, chunk)
        mod = load_triton_module("_chunk_topk_triton")
        H, C = scores.shape
        kk = min(int(k), C)
        ids = torch.empty(H, max(kk, 0), dtype=torch.int64, device=q.device)
        if kk > 0:
            block = next_power_of_2(min(1024, C))
            mod.topk_select_kernel[(H,)](scores, ids, ids, C, kk, scores.stride(0), ids.stride(0),
                                         BLOCK=block, num_warps=4)
        return ids
    return _topk_ids_from_scores(quant_key_scores_torch(q, codes, low, scale, chunk), k)
