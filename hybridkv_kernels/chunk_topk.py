"""Chunk retrieval scores and top-k selection for dynamic heads.

Chunk score = max over the G query heads of a KV head of ``q . landmark`` (fp32; int8
landmarks are dequantised as ``int8 * landmark_scale``). The top ``min(k, C)`` chunk ids per
head are returned sorted ascending.

Ties: every backend breaks ties the same way -- among equal scores the lowest chunk id wins
(-0.0 equals +0.0). Scores computed by different backends can still differ in the last bits
(summation order), which can change the choice between near-equal chunks; compare selected
score multisets, not ids, across backends. NaN scores give an unspecified selection.
"""

from __future__ import annotations

import torch

from .dispatch import cdiv, load_triton_module, next_power_of_2, resolve_backend

__all__ = [
    "chunk_scores_torch",
    "chunk_topk",
    "chunk_topk_torch",
    "chunk_topk_triton",
]


def _check(q, landmarks, landmark_scale):
    if q.dim() != 3 or landmarks.dim() != 3 or q.shape[0] != landmarks.shape[0] \
            or q.shape[2] != landmarks.shape[2]:
        raise ValueError(f"q must be [H, G, d] and landmarks [H, C, d], got {tuple(q.shape)}, "
                         f"{tuple(landmarks.shape)}")
    if landmarks.dtype == torch.int8 and landmark_scale is None:
        raise ValueError("int8 landmarks need landmark_scale [H, C]")
    if landmark_scale is not None and landmark_scale.shape != landmarks.shape[:2]:
        raise ValueError(f"landmark_scale must be {tuple(landmarks.shape[:2])}, got "
                         f"{tuple(landmark_scale.shape)}")


def chunk_scores_torch(q, landmarks, landmark_scale=None):
    """Chunk scores [H, C] fp32: ``max_g q[h, g] . landmarks[h, c]`` (x ``landmark_scale``).

    Materialises [H, G, C] fp32 scores and an fp32 copy of the landmarks (1/16 of a head's
    KV at c = 8): small next to the store.
    """
    _check(q, landmarks, landmark_scale)
    s = torch.matmul(q.float(), landmarks.float().transpose(1, 2))  # [H, G, C]
    if landmark_scale is not None:
        s.mul_(landmark_scale.float()[:, None, :])  # per g, before the max (scale sign)
    return s.amax(dim=1)


def _topk_ids_from_scores(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids [H, min(k, C)] of the largest scores, ascending; ties -> lowest id.

    Each score becomes a distinct int64 key that orders as (score, lower id first): its fp32
    bits made monotone, times C, plus C - 1 - id. One ``topk`` of the keys is then exactly the
    selection (no tie pass, no boolean indexing).
    """
    H, C = scores.shape
    kk = min(int(k), C)
    if kk <= 0:
        return torch.empty(H, 0, dtype=torch.int64, device=scores.device)
    return order_keys(scores).topk(kk, dim=1, sorted=False).indices.sort(dim=1).values


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """A distinct int64 per score [H, C] that orders as (score, lower id first)."""
    C = scores.shape[1]
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 -> +0.0, equal scores tie
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long().mul_(C)  # negative floats: order reversed
    return keys.add_(torch.arange(C - 1, -1, -1, device=scores.device))


def chunk_topk_torch(q, landmarks, k, landmark_scale=None):
    """Torch reference of :func:`chunk_topk`."""
    return _topk_ids_from_scores(chunk_scores_torch(q, landmarks, landmark_scale), k)


def chunk_topk_triton(q, landmarks, k, landmark_scale=None, *, block_c=None, block_select=None,
                      return_scores=False):
    """Triton launcher of :func:`chunk_topk`: a scores kernel over (head, chunk block), then one
    selection program per head (:func:`launch_topk`): two launches. Raises ``RuntimeError`` where
    Triton cannot run these tensors.

    Parameters (beyond the op's)
    ----------------------------
    block_c, block_select : int, optional
        Chunk block of the scores kernel (default 64) and of the selection loop (see
        :func:`launch_topk`); tests use small ones to cover several blocks.
    return_scores : bool
        Also return the fp32 scores [H, C].
    """
    resolve_backend("triton", q, landmarks)
    return _launch(q, landmarks, k, landmark_scale, block_c=block_c, block_select=block_select,
                   return_scores=return_scores)


def _launch(q, landmarks, k, landmark_scale=None, *, block_c=None, block_select=None, return_scores=False):
    """:func:`chunk_topk_triton` once the backend is resolved."""
    _check(q, landmarks, landmark_scale)
    mod = load_triton_module("_chunk_topk_triton")
    H, G, d = q.shape
    C = landmarks.shape[1]
    kk = min(int(k), C)
    dev = q.device
    q = q if q.stride(-1) == 1 else q.contiguous()
    landmarks = landmarks if landmarks.stride(-1) == 1 else landmarks.contiguous()
    scores = torch.empty(H, C, dtype=torch.float32, device=dev)
    ids = torch.empty(H, max(kk, 0), dtype=torch.int64, device=dev)
    if H == 0 or C == 0:
        return (ids, scores) if return_scores else ids
    has_scale = landmark_scale is not None
    sc = landmark_scale.float().contiguous() if has_scale else scores  # dummy pointer
    block_c = max(16, next_power_of_2(block_c or 64))
    BLOCK_D = max(16, next_power_of_2(d))
    mod.chunk_scores_kernel[(H, cdiv(C, block_c))](
        q, landmarks, sc, scores, ids, G, C, d,
        q.stride(0), q.stride(1), landmarks.stride(0), landmarks.stride(1), sc.stride(0),
        scores.stride(0),
        HAS_SCALE=has_scale, BLOCK_G=max(16, next_power_of_2(G)), BLOCK_C=block_c,
        BLOCK_D=BLOCK_D, num_warps=4,
    )
    if kk > 0:
        launch_topk(scores, kk, out=ids, block=block_select)
    return (ids, scores) if return_scores else ids


def _select_warps(block: int) -> int:
    """16 scores a thread: up to 8192 a step with 16 warps (105 registers, sm_90), no spill."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def launch_topk(scores, k, *, out=None, table=None, block=None, resident=None, limit=0, bonus=0.0):
    """The Triton selection: ids of the ``min(k, C)`` largest ``scores`` [rows, C] per row,
    ascending (ties: lowest id), written to ``out`` [rows, >= min(k, C)] int64 (new if None).

    One launch, one program per row: an exact radix select of the k-th largest score (8 bits a
    pass, at most 4 passes over the row's scores) and a compaction pass in id order; no host
    sync, no data-dependent shape. Rows of up to 64k candidates (2-bit keys rank every token of
    a 64k prompt) take 8 steps of 8192 scores a pass.

    Parameters
    ----------
    table : Tensor, optional
        ``TABLE`` mode (``batched_retrieval.py``): each row's own chunk count and k come from its
        table row; ``k`` and C are then the largest of them.
    block : int, optional
        Scores a loop step (a power of two, at least 256; default min(8192, next_pow2(C))); tests
        use small ones to cover several blocks.
    resident, limit, bonus
        Each row's held ids [rows, k] (``TABLE`` mode: the table's resident rows), ranked
        ``bonus`` above their scores, with at most ``limit`` ids outside them (0: no cap;
        :mod:`.swap_cap`), in the same one launch; ``scores`` is then overwritten (scratch).
    """
    rows, C = scores.shape
    kk = min(int(k), C)
    if out is None:
        out = torch.empty(rows, max(kk, 0), dtype=torch.int64, device=scores.device)
    if rows == 0 or kk <= 0:
        return out
    mod = load_triton_module("_chunk_topk_triton")
    block_s = max(256, next_power_of_2(block or min(8192, C)))  # >= the histogram's 256 buckets
    if limit > 0 or bonus:
        n = k if resident is None else resident.shape[1]
        save = torch.empty(rows, n, dtype=torch.float32, device=scores.device)
        res = scores if resident is None else resident  # TABLE mode: the table's
        mod.capped_topk_kernel[(rows,)](
            scores, res, save, out, out if table is None else table, C, kk, int(limit), float(bonus),
            scores.stride(0), res.stride(0), save.stride(0), out.stride(0),
            BLOCK=block_s, BLOCK_N=min(1024, next_power_of_2(max(n, 16))), TABLE=table is not None,
            num_warps=_select_warps(block_s),
        )
        return out
    mod.topk_select_kernel[(rows,)](
        scores, out, out if table is None else table, C, kk, scores.stride(0), out.stride(0),
        BLOCK=block_s, TABLE=table is not None, num_warps=_select_warps(block_s),
    )
    return out


def chunk_topk(q, landmarks, k, landmark_scale=None, backend="auto"):
    """Top-k chunks per dynamic head by landmark score.

    Parameters
    ----------
    q : Tensor [H_dyn, G, d]
        Post-RoPE decode queries of the dynamic heads, grouped by KV head.
    landmarks : Tensor [H_dyn, C, d]
        Per-chunk mean keys; float, or int8 with ``landmark_scale``.
    k : int
        Chunks wanted per head; ``min(k, C)`` are returned.
    landmark_scale : Tensor [H_dyn, C] fp32, optional
        Dequantisation scale of int8 landmarks (``int8 * scale``).
    backend : {"auto", "torch", "triton"}

    Returns
    -------
    Tensor [H_dyn, min(k, C)] int64
        Chunk ids, sorted ascending per head. Ties: lowest id wins (see module docstring).
    """
    if resolve_backend(backend, q, landmarks) == "triton":
        return _launch(q, landmarks, k, landmark_scale)
    return chunk_topk_torch(q, landmarks, k, landmark_scale)
