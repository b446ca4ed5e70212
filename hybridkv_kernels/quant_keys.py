"""Chunk scores from 2-bit keys: every prompt token's key at 2 bits per channel ranks the chunks.

A head's keys are kept as ``k ≈ low + scale * code`` with ``code`` in 0..3, one range per
channel, four channels to a byte (:func:`pack_keys`). A chunk's score is the best approximate
logit of its tokens over the query group, ``max_g max_t (q_g · k̂_t)``, so one strongly matching
token shows as sharply as in exact attention; the top chunks are then chosen as
:func:`~hybridkv_kernels.chunk_topk` chooses them (same tie rule, ids ascending).

The Triton kernel reads the packed bytes (1/16 of a bf16 key and value) and unpacks them in
registers, from the device or in place from pinned host memory (through UVA, no host sync); the
torch reference unpacks them into fp32, a tile of tokens at a time.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .chunk_topk import _topk_ids_from_scores, launch_topk
from .dispatch import cdiv, load_triton_module, next_power_of_2, resolve_backend
from .swap_cap import cap_scores

__all__ = ["aligned_rows", "code_row", "pack_keys", "quant_key_scores_torch", "quant_key_topk", "unpack_codes"]

SHIFTS = (0, 2, 4, 6)  # channel 4j + s sits at bits 2s of byte j
TILE_TOKENS = 512  # the fewest tokens the torch path unpacks at a time ...
TILE_BYTES = 1 << 17  # ... and more while one head's tile of fp32 codes stays within this (a small head dim)
ROW_ALIGN = 128  # bytes: a code row starts on a 128-byte line, so a kernel's tile of a row is whole lines


def code_row(tokens: int) -> int:
    """Bytes between the starts of two code rows of ``tokens`` tokens: padded to whole lines."""
    return -(-tokens // ROW_ALIGN) * ROW_ALIGN


def aligned_rows(codes: torch.Tensor, empty=None) -> torch.Tensor:
    """``codes`` [H, d/4, P] copied into rows of :func:`code_row` bytes (a view of their first
    P): read from the host in place, a misaligned row costs a kernel's tile an extra transaction
    a line. ``empty(shape, dtype)`` allocates (default: ``torch.empty`` on the codes' device)."""
    heads, quarters, tokens = codes.shape
    shape = (heads, quarters, code_row(tokens))
    padded = empty(shape, codes.dtype) if empty else torch.empty(shape, dtype=codes.dtype, device=codes.device)
    view = padded[:, :, :tokens]
    padded[:, :, tokens:] = 0
    return view.copy_(codes)


def pack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` [H, P, d] (d divisible by 4) at 2 bits per channel.

    Returns ``(codes, bounds)``: uint8 [H, d/4, P] (byte ``j`` of token ``p`` holds channels
    ``4j .. 4j+3``, low bits first; channel-major, so a query's product is one matmul; each row
    padded to :func:`code_row` bytes, see :func:`aligned_rows`), and fp32 [H, 2, d], each
    channel's ``low`` and ``scale`` with ``k ≈ low + scale * code``.
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
    return aligned_rows(packed), torch.stack([low, scale], dim=1)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The 2-bit codes of :func:`pack_keys` as fp32 [H, d, P]."""
    return ((codes.unsqueeze(2) >> _shifts(codes.device)) & 3).flatten(1, 2).float()


@lru_cache(maxsize=None)
def _shifts(device: torch.device) -> torch.Tensor:
    """[4, 1] uint8: each code's shift in its byte, made once a device."""
    return torch.tensor(SHIFTS, dtype=torch.uint8, device=device)[:, None]


def _check(q, codes, bounds, chunk, shared: bool = False):
    """``shared``: ``codes`` and ``bounds`` may be one sequence's, for each group of their heads' rows of ``q``."""
    H, G, d = q.shape
    if shared and codes.dim() == 3 and codes.shape[0] and H % codes.shape[0] == 0:
        H = codes.shape[0]
    if codes.dim() != 3 or codes.shape[:2] != (H, d // 4) or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 [H, d/4, P] = [{H}, {d // 4}, P], got {tuple(codes.shape)} {codes.dtype}")
    if bounds.shape != (H, 2, d):
        raise ValueError(f"bounds must be [{H}, 2, {d}], got {tuple(bounds.shape)}")
    if chunk < 1 or codes.shape[2] % chunk:
        raise ValueError(f"{codes.shape[2]} tokens do not split into chunks of {chunk}")


def quant_key_scores_torch(q, codes, bounds, chunk: int) -> torch.Tensor:
    """Chunk scores [H, C] fp32: ``max_g max_t q[h, g] · (low + scale * code[h, :, t])`` over
    the ``chunk`` tokens of each chunk.

    ``codes`` and ``bounds`` may also be one sequence's H heads shared by every H rows of ``q``
    (the questions or members of one kept prefix ranked together): then they are unpacked once
    and each group of rows takes the products it takes alone (a batched product of the same
    shapes, so the same numbers as alone).

    Tiled over the tokens, 512 at a time (more with a small head dim, :data:`TILE_BYTES`; never
    by the head count, so a head's numbers are the same in any batch): the unpacked fp32 codes
    of a whole long prompt (16 bytes a code byte) would be a fresh allocation of tens of MB a
    step, whose first touch costs more than the arithmetic (5x slower at 16k tokens on the CPU);
    a tile stays in cache and in the allocator's reuse.
    """
    _check(q, codes, bounds, chunk, shared=True)
    qf = q.float().unflatten(0, (-1, codes.shape[0]))  # [groups, H, G, d]
    low, scale = bounds.float().unbind(1)
    scaled, bias = qf * scale[:, None], (qf * low[:, None]).sum(-1, keepdim=True)

    def best_of(part):  # host codes (HostKeys): a copy a tile
        part = part if part.device == q.device else part.to(q.device)
        # the bias added in place: a fresh [groups, H, G, P] costs more than the addition
        return torch.matmul(scaled, unpack_codes(part)).add_(bias).amax(dim=2).flatten(0, 1)

    tokens = codes.shape[2]
    tile = chunk * max(1, max(TILE_TOKENS, TILE_BYTES // (4 * q.shape[2])) // chunk)
    if tokens <= tile:
        best = best_of(codes)
    else:
        best = torch.empty(q.shape[0], tokens, dtype=torch.float32, device=q.device)
        for start in range(0, tokens, tile):
            best[:, start:start + tile] = best_of(codes[:, :, start:start + tile])
    return best if chunk == 1 else best.unflatten(1, (-1, chunk)).amax(dim=2)


def launch_scores(q, codes, bounds, chunk: int, *, table=None, tokens: int | None = None,
                  block_p: int | None = None) -> torch.Tensor:
    """The Triton scores kernel: [rows, C] fp32.

    ``table`` (``TABLE`` mode, see ``batched_retrieval.py``): each row of ``q`` reads its own codes
    and bounds (``codes``/``bounds`` then only give the element types) and ``tokens`` is the
    largest token count among the rows; the scores of a row's missing chunks are left unwritten.
    """
    rows, G, d = q.shape
    if table is None:
        _check(q, codes, bounds, chunk)
        tokens = codes.shape[2]
        if q.is_cuda and not (codes.is_cuda or codes.is_pinned()):
            raise ValueError("the Triton 2-bit key scores need codes on the device or in pinned host memory")
    if chunk & (chunk - 1):
        raise RuntimeError(f"the Triton 2-bit key scores need a power-of-two chunk, got {chunk}")
    mod = load_triton_module("_quant_keys_triton")
    scores = torch.empty(rows, tokens // chunk, dtype=torch.float32, device=q.device)
    if rows == 0 or tokens == 0:
        return scores
    q = q if q.stride(-1) == 1 else q.contiguous()
    codes = codes if codes.stride(-1) == 1 else codes.contiguous()
    bounds = bounds.float().contiguous()
    block_p = max(16, chunk, next_power_of_2(block_p or 128))
    mod.quant_key_scores_kernel[(rows, cdiv(tokens, block_p))](
        q, codes, bounds, scores, scores if table is None else table, G, tokens, d,
        q.stride(0), q.stride(1), codes.stride(0), codes.stride(1), scores.stride(0),
        CHUNK=chunk, BLOCK_G=max(16, next_power_of_2(G)), BLOCK_P=block_p,
        BLOCK_D=max(16, next_power_of_2(d)), TABLE=table is not None, num_warps=4,
    )
    return scores


def quant_key_topk(q, codes, bounds, chunk: int, k: int, backend: str = "auto", *, resident=None,
                   swaps: int = 0, stickiness: float = 0.0) -> torch.Tensor:
    """Top-``k`` chunks per head by their best 2-bit-key logit.

    Parameters
    ----------
    q : Tensor [H, G, d]
        Decode queries, grouped by KV head.
    codes, bounds
        A head's prompt keys as :func:`pack_keys` gives them (P = C · chunk tokens); ``codes``
        on q's device or in host memory (pinned, for the Triton path on CUDA), ``bounds`` on q's.
        On the torch path they may be one sequence's, shared by every group of their heads' rows
        of ``q`` (:func:`quant_key_scores_torch`).
    chunk : int
        Tokens per chunk.
    k : int
        Chunks wanted per head; ``min(k, C)`` are returned.
    backend : {"auto", "torch", "triton"}
    resident, swaps, stickiness
        The chunks each head holds [H, n] (-1: empty), for a selection that changes less
        (:mod:`~hybridkv_kernels.swap_cap`): a held chunk ranks ``stickiness`` logits (at the
        ``1/sqrt(d)`` scale) above its score, and with ``swaps`` > 0 at most ``swaps`` of the
        returned chunks are not held.

    Returns
    -------
    Tensor [H, min(k, C)] int64
        Chunk ids, ascending per head; ties: lowest id wins (as :func:`chunk_topk`).
    """
    bonus = stickiness * q.shape[-1] ** 0.5 if resident is not None else 0.0  # logits -> raw q·k
    limit = swaps if resident is not None else 0
    if resolve_backend(backend, q, codes) == "triton":  # held chunks' bonus and the cap in the selection's launch
        return launch_topk(launch_scores(q, codes, bounds, chunk), k, resident=resident, limit=limit, bonus=bonus)
    scores = quant_key_scores_torch(q, codes, bounds, chunk)
    if resident is not None:
        scores = cap_scores(scores, resident, limit, bonus)
    return _topk_ids_from_scores(scores, k)
