"""Candidate re-ranking from 2-bit keys in host memory: stage 2 of a two-stage ranking.

A cheap device index has already picked M candidate tokens per head; every channel's key at
2 bits (``k ≈ low + scale * code``, the quantisation of :func:`~hybridkv_kernels.pack_keys`)
now scores them, ``max_g q_g · k̂_t``, and the best k are kept with
:func:`~hybridkv_kernels.chunk_topk`'s tie rule (lowest id wins, ids ascending).

The codes stay in host memory, token-major (:func:`pack_keys_by_token`): one candidate's d/4
bytes are contiguous, so on CUDA the Triton kernel reads them from pinned memory through UVA in
one burst a candidate, with no CPU gather and no host sync. The torch reference gathers the
candidates' bytes on the codes' device and copies them to the queries' (on CUDA a blocking
copy: a host sync a call).
"""

from __future__ import annotations

import torch

from .chunk_topk import _topk_ids_from_scores, launch_topk
from .dispatch import cdiv, load_triton_module, next_power_of_2, resolve_backend
from .quant_keys import TILE_TOKENS, pack_keys, unpack_codes

__all__ = ["candidate_key_scores_torch", "candidate_key_topk", "launch_candidate_scores", "pack_keys_by_token"]


def pack_keys_by_token(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` [H, P, d] (d divisible by 4) at 2 bits per channel, token-major.

    Returns ``(codes, bounds)``: uint8 [H, P, d/4] (byte ``j`` of token ``p`` holds channels
    ``4j .. 4j+3``, low bits first; one token's bytes contiguous) and fp32 [H, 2, d], each
    channel's ``low`` and ``scale``: exactly :func:`pack_keys`'s codes, transposed.
    """
    codes, bounds = pack_keys(keys)
    return codes.transpose(1, 2).contiguous(), bounds


def _check(q, codes, bounds, candidates):
    if q.dim() != 3:
        raise ValueError(f"q must be [H, G, d], got {tuple(q.shape)}")
    H, G, d = q.shape
    if d % 4:
        raise ValueError(f"2-bit keys need a head dimension divisible by 4, got {d}")
    if codes.dim() != 3 or codes.shape[0] != H or codes.shape[2] != d // 4 or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 [H, P, d/4] = [{H}, P, {d // 4}] (token-major, "
                         f"pack_keys_by_token), got {tuple(codes.shape)} {codes.dtype}")
    if bounds.shape != (H, 2, d):
        raise ValueError(f"bounds must be [{H}, 2, {d}], got {tuple(bounds.shape)}")
    if candidates.dim() != 2 or candidates.shape[0] != H or candidates.dtype != torch.int64:
        raise ValueError(f"candidates must be int64 [H, M] = [{H}, M], got {tuple(candidates.shape)} "
                         f"{candidates.dtype}")
    if candidates.device != q.device:
        raise ValueError(f"candidates must be on q's device {q.device}, got {candidates.device}")


def candidate_key_scores_torch(q, codes, bounds, candidates) -> torch.Tensor:
    """Candidate scores [H, M] fp32: ``max_g q[h, g] · (low + scale * code[h, candidates[h, m]])``.

    The candidates' bytes ([H, M, d/4], 1/64 of their fp32 keys) are gathered where the codes
    are and moved to q's device; on CUDA with host codes that copy blocks the host (the Triton
    path reads them in place). Unpacked about 512 candidates at a time, as
    :func:`~hybridkv_kernels.quant_key_scores_torch` does its tokens (a tile stays in cache).
    """
    _check(q, codes, bounds, candidates)
    qf = q.float()
    low, scale = bounds.to(device=q.device, dtype=torch.float32).unbind(1)
    scaled, bias = qf * scale[:, None], (qf * low[:, None]).sum(-1, keepdim=True)
    idx = candidates.to(codes.device)
    rows = codes.gather(1, idx[:, :, None].expand(-1, -1, codes.shape[2])).to(q.device)  # [H, M, d/4]
    best = torch.empty(candidates.shape, dtype=torch.float32, device=q.device)
    for start in range(0, rows.shape[1], TILE_TOKENS):
        part = rows[:, start:start + TILE_TOKENS].transpose(1, 2)  # [H, d/4, tile], as unpack_codes takes
        best[:, start:start + part.shape[2]] = (torch.bmm(scaled, unpack_codes(part)) + bias).amax(dim=1)
    return best


def launch_candidate_scores(q, codes, bounds, candidates, *, block_m: int | None = None) -> torch.Tensor:
    """The Triton scores kernel: [H, M] fp32 on q's device.

    On CUDA ``codes`` is read in place: on the device, or pinned host memory (through UVA; a
    pageable host tensor is refused, it has no device address). ``bounds`` (8·d bytes a head) is
    moved to q's device if it is not there.

    Parameters (beyond the op's)
    ----------------------------
    block_m : int, optional
        Candidates a program (default 64: a few thousand candidates then give hundreds of
        programs, many UVA reads in flight at once); tests use small ones to cover several blocks.
    """
    _check(q, codes, bounds, candidates)
    H, G, d = q.shape
    M = candidates.shape[1]
    if q.is_cuda and not (codes.is_cuda or codes.is_pinned()):
        raise ValueError("the Triton candidate scores need codes on the device or in pinned host memory")
    if codes.stride(-1) != 1:
        raise ValueError("the Triton candidate scores need unit stride along d/4 (a copy would move the host codes)")
    scores = torch.empty(H, M, dtype=torch.float32, device=q.device)
    if H == 0 or M == 0:
        return scores
    mod = load_triton_module("_candidate_keys_triton")
    q = q if q.stride(-1) == 1 else q.contiguous()
    candidates = candidates if candidates.stride(-1) == 1 else candidates.contiguous()
    bounds = bounds.to(device=q.device, dtype=torch.float32).contiguous()
    block_m = max(16, next_power_of_2(block_m or 64))
    block_d = max(16, next_power_of_2(d))
    mod.candidate_scores_kernel[(H, cdiv(M, block_m))](
        q, codes, bounds, candidates, scores, G, M, d,
        q.stride(0), q.stride(1), codes.stride(0), codes.stride(1), candidates.stride(0), scores.stride(0),
        BLOCK_G=max(16, next_power_of_2(G)), BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_DK=min(32, block_d),
        num_warps=4,
    )
    return scores


def candidate_key_topk(q, codes, bounds, candidates, k: int, backend: str = "auto") -> torch.Tensor:
    """Top-``k`` of each head's candidate tokens by their 2-bit-key logit.

    Parameters
    ----------
    q : Tensor [H, G, d]
        Decode queries, grouped by KV head.
    codes : Tensor [H, P, d/4] uint8
        Every prompt token's 2-bit key, token-major (:func:`pack_keys_by_token`); in host memory
        (pinned, for the Triton path on CUDA) or on q's device.
    bounds : Tensor [H, 2, d] fp32
        Each channel's ``low`` and ``scale`` (from :func:`pack_keys_by_token`), on q's device.
    candidates : Tensor [H, M] int64
        Stage 1's token ids per head, on q's device: ascending per head (as
        :func:`~hybridkv_kernels.chunk_topk` gives them), distinct, in [0, P).
    k : int
        Tokens wanted per head; ``min(k, M)`` are returned.
    backend : {"auto", "torch", "triton"}

    Returns
    -------
    Tensor [H, min(k, M)] int64
        Token ids, a subset of each head's candidates: ascending when the candidates are. Ties:
        the lower candidate position, so the lower id, wins (as :func:`chunk_topk`).
    """
    if resolve_backend(backend, q, candidates) == "triton":  # (the host codes are not a device tensor)
        positions = launch_topk(launch_candidate_scores(q, codes, bounds, candidates), k)
    else:
        positions = _topk_ids_from_scores(candidate_key_scores_torch(q, codes, bounds, candidates), k)
    return candidates.gather(1, positions)  # positions ascend, so do the ids of ascending candidates
