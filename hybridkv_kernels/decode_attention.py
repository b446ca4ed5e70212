"""Decode attention over the ragged per-head KV store (+ generated tokens).

Three pieces, as in FlagAttention: the torch reference
(:func:`ragged_decode_attention_torch`, in ``decode_attention_torch.py`` with the batch's CPU
path), the Triton launcher with its heuristics
(:func:`ragged_decode_attention_triton`; kernels in ``_decode_attention_triton.py``), and the
public op (:func:`ragged_decode_attention`) that dispatches between them.

Layout (batch size 1)
---------------------
q                 [H_kv, G, d]   one decode step, query head j -> KV head j // G, post-RoPE
keys, values      [T, d]         flat store; KV head h owns rows offsets[h] : offsets[h]+lengths[h]
offsets, lengths  [H_kv] int64   on the store's device; a head may have length 0
gen_k, gen_v      [H_kv, cap, d] generated tokens, the first ``n_gen`` rows are valid

A chunk (``q_len`` > 1: several new tokens read in one pass) has ``G = G_q * q_len`` query rows
per KV head, row ``g * q_len + t`` being query head ``g`` at position ``t`` of the chunk (the
order of Hugging Face's ``[heads, q_len]`` queries). Its tokens' own keys are the last ``q_len``
generated rows, attended causally: position ``t`` sees the generated rows before
``n_gen - q_len + 1 + t``. ``q_len`` 1 is the decode step (its row sees all ``n_gen``). The torch
reference masks those rows; Triton runs the chunk as ``q_len`` views of the store, one per
position with the generated rows it sees, in one :func:`batched_decode_attention` launch.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .decode_attention_torch import (batched_decode_attention_torch, check_ragged, chunk_decode_attention_torch,
                                     ragged_decode_attention_torch)
from .dispatch import load_triton_module, next_power_of_2, resolve_backend, triton_interpreting
from .segments import RaggedKV, SegmentTable, segment_table

__all__ = [
    "batched_decode_attention",
    "chunk_decode_attention",
    "dense_decode_attention",
    "ragged_decode_attention",
    "ragged_decode_attention_torch",
    "ragged_decode_attention_triton",
    "decode_split_heuristic",
]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 128  # merge kernel loads all splits of a head in one block


# --------------------------------------------------------------------------- triton


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_split_heuristic(max_total: int, n_heads: int, block_n: int,
                           device=None) -> tuple[int, int]:
    """Split count and split length (tokens, multiple of ``block_n``) for the split-KV pass.

    Aim for about two programs per SM over all KV heads (H_kv is small: 4 for 7B, so one
    program per head would leave >95% of an H200 idle), but keep >= 4 blocks per split so
    the online-softmax loop amortises the q load and the partial-output write, and at most
    ``_MAX_SPLITS`` splits (one block in the merge kernel).

    Returns
    -------
    (num_splits, split_len) : tuple[int, int]
    """
    if device is not None and torch.device(device).type == "cuda":
        idx = torch.device(device).index
        sms = _sm_count(torch.cuda.current_device() if idx is None else idx)
    else:
        sms = 8  # interpreter / unknown: a few splits, enough to exercise the merge
    max_total = max(int(max_total), 1)
    target = max(1, math.ceil(2 * sms / max(n_heads, 1)))
    by_len = math.ceil(max_total / (4 * block_n))
    splits = max(1, min(target, by_len, _MAX_SPLITS))
    split_len = math.ceil(math.ceil(max_total / splits) / block_n) * block_n
    return math.ceil(max_total / split_len), split_len


def ragged_decode_attention_triton(q, keys, values, offsets, lengths, gen_k=None, gen_v=None,
                                   n_gen=0, scale=None, *, max_length=None, num_splits=None,
                                   block_n=None):
    """Triton launcher of :func:`ragged_decode_attention` (split-KV + LSE merge). Raises
    ``RuntimeError`` where Triton cannot run these tensors.

    Parameters (beyond the op's)
    ----------------------------
    max_length : int, optional
        An upper bound on ``lengths.max()`` known on the host (avoids a device sync); rows
        beyond it would be ignored.
    num_splits, block_n : int, optional
        Override the heuristics (tests use this to force several splits and blocks).
    """
    resolve_backend("triton", q, keys)
    return _launch(q, keys, values, offsets, lengths, gen_k, gen_v, n_gen, scale, max_length=max_length,
                   num_splits=num_splits, block_n=block_n)


def _launch(q, keys, values, offsets, lengths, gen_k=None, gen_v=None, n_gen=0, scale=None, *, max_length=None,
            num_splits=None, block_n=None):
    """:func:`ragged_decode_attention_triton` once the backend is resolved."""
    check_ragged(q, keys, values, offsets, lengths, gen_k, gen_v, n_gen)
    H, _, d = q.shape

    def _lastdim(t):  # kernels assume unit stride along d
        return t if t.stride(-1) == 1 else t.contiguous()

    # tl.dot wants one operand dtype: bring the values and the generated rows to the store's
    keys, values = _lastdim(keys), _lastdim(values.to(keys.dtype))
    if n_gen > 0:
        gen_k, gen_v = _lastdim(gen_k.to(keys.dtype)), _lastdim(gen_v.to(keys.dtype))
    else:  # dummies: the generated loop runs zero times
        gen_k = gen_v = keys.new_empty(H, 1, d)
    if max_length is None:
        max_length = int(lengths.max().item()) if H > 0 else 0
    return _run(q, keys, values, gen_k, gen_v, offsets, lengths, None, int(n_gen), int(max_length) + int(n_gen),
                scale, num_splits, block_n)


def _run(q, keys, values, gen_k, gen_v, offsets, lengths, seg, n_gen, max_total, scale, num_splits, block_n,
         counted=False):
    """Launch the split-KV pass and the merge over ``q``'s heads: one store (``seg`` None) or
    the segments of several (``seg``: the table of :func:`batched_decode_attention`)."""
    H, G, d = q.shape
    dev = q.device
    mod = load_triton_module("_decode_attention_triton")
    scale = d ** -0.5 if scale is None else float(scale)
    out_dtype = q.dtype
    q = q.to(keys.dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    offsets = offsets.to(device=dev, dtype=torch.int64)
    lengths = lengths.to(device=dev, dtype=torch.int64)

    BLOCK_D = max(16, next_power_of_2(d))
    BLOCK_G = max(16, next_power_of_2(G))  # tl.dot needs M >= 16
    if block_n is None:
        block_n = 64 if BLOCK_D <= 128 else 32
    block_n = max(16, next_power_of_2(block_n))
    if num_splits is None:
        num_splits, split_len = decode_split_heuristic(max_total, H, block_n, dev)
    else:
        num_splits = max(1, min(int(num_splits), _MAX_SPLITS))
        split_len = math.ceil(math.ceil(max(max_total, 1) / num_splits) / block_n) * block_n
        num_splits = math.ceil(max(max_total, 1) / split_len)

    o_part = torch.empty(H, num_splits, G, d, dtype=torch.float32, device=dev)
    lse_part = torch.empty(H, num_splits, G, dtype=torch.float32, device=dev)
    out = torch.empty(H, G, d, dtype=out_dtype, device=dev)
    if H == 0:
        return out
    upcast = triton_interpreting() and keys.dtype == torch.bfloat16
    prec = "ieee" if keys.dtype == torch.float32 else "tf32"
    mod.ragged_decode_stage1_kernel[(H, num_splits)](
        q, keys, values, gen_k, gen_v, offsets, lengths, offsets if seg is None else seg, o_part, lse_part,
        n_gen, split_len, scale * _LOG2E, G, d,
        q.stride(0), q.stride(1),
        keys.stride(0), values.stride(0),
        gen_k.stride(0), gen_k.stride(1), gen_v.stride(0), gen_v.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        BLOCK_G=BLOCK_G, BLOCK_N=block_n, BLOCK_D=BLOCK_D, UPCAST=upcast, PREC=prec, TABLE=seg is not None,
        COUNTS=counted, num_warps=4,
    )
    mod.merge_splits_kernel[(H, G)](
        o_part, lse_part, out, num_splits, d,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_S=next_power_of_2(num_splits), BLOCK_D=BLOCK_D,
        num_warps=4,
    )
    return out


def batched_decode_attention(q, stores: list[RaggedKV], scale=None, backend="auto", table: SegmentTable | None = None):
    """:func:`ragged_decode_attention` of several sequences' stores in one launch.

    Parameters
    ----------
    q : Tensor [S, G, d]
        The decode queries of every store's KV heads, store after store (S = their heads).
    stores : list of RaggedKV
        Each sequence's own tensors (nothing is copied into one store): Triton reads them
        through a per-segment address table; the torch path attends the stores of one shape
        together (:func:`batched_decode_attention_torch`).
    table : SegmentTable, optional
        :func:`segment_table` of ``stores`` built earlier (a counted one serves many steps);
        None: built now.

    Returns
    -------
    Tensor [S, G, d] in q's dtype.
    """
    heads = [s.num_heads for s in stores]
    if q.dim() != 3 or q.shape[0] != sum(heads):
        raise ValueError(f"q must be [{sum(heads)}, G, d] (the stores' heads), got {tuple(q.shape)}")
    if not stores:
        return q.new_empty(q.shape)
    if resolve_backend(backend, q, stores[0].keys) != "triton":
        return batched_decode_attention_torch(q, stores, scale)
    for p, s in zip(torch.split(q, heads), stores):
        check_ragged(p, *s[:7])
    table = table or segment_table(stores)
    keys = table.alive[0]
    dummy = keys.new_empty(1, 1, keys.shape[-1])
    return _run(q, keys, keys, dummy, dummy, table.offsets, table.lengths, table.seg, 0, table.max_total, scale,
                None, None, counted=table.counted)


# --------------------------------------------------------------------------- public


def ragged_decode_attention(q, keys, values, offsets, lengths, gen_k=None, gen_v=None, n_gen=0,
                            scale=None, backend="auto", *, max_length=None, q_len=1):
    """Softmax attention of one decode step (or a chunk of ``q_len`` new tokens) over each KV
    head's ragged rows + generated rows.

    Parameters
    ----------
    q : Tensor [H_kv, G, d]
        Post-RoPE queries grouped by KV head (query head j belongs to KV head j // G).
    keys, values : Tensor [T, d]
        Flat ragged store of one layer.
    offsets, lengths : Tensor [H_kv] int64
        Head h attends to rows ``offsets[h] : offsets[h] + lengths[h]`` (length 0 allowed).
    gen_k, gen_v : Tensor [H_kv, cap, d], optional
        Generated tokens; the first ``n_gen`` rows are attended by every head.
    n_gen : int
        Number of valid generated rows (0 allowed).
    scale : float, optional
        Softmax scale, default ``d ** -0.5``.
    backend : {"auto", "torch", "triton"}
        See :mod:`hybridkv_kernels.dispatch`.
    max_length : int, optional
        An upper bound on ``max(lengths)`` known on the host; lets the Triton path size its
        grid without a device sync (rows beyond it would be ignored).
    q_len : int
        Positions of a chunk (module docstring): ``G`` holds ``G / q_len`` query heads at each,
        and the last ``q_len`` generated rows are the chunk's own, attended causally.

    Returns
    -------
    Tensor [H_kv, G, d]
        In q's dtype. A head with no rows at all (length 0 and n_gen 0) gets zeros.
    """
    if resolve_backend(backend, q, keys) != "triton":
        return ragged_decode_attention_torch(q, keys, values, offsets, lengths, gen_k, gen_v, n_gen, scale, q_len)
    if q_len == 1:
        return _launch(q, keys, values, offsets, lengths, gen_k, gen_v, n_gen, scale, max_length=max_length)
    if max_length is None:
        max_length = int(lengths.max()) if q.shape[0] else 0
    store = RaggedKV(keys, values, offsets, lengths, gen_k, gen_v, n_gen, max_length)
    return chunk_decode_attention([q], [store], [q_len], scale, backend="triton")[0]


def chunk_decode_attention(queries: list, stores: list[RaggedKV], q_lens: list[int], scale=None,
                           backend="auto") -> list:
    """:func:`ragged_decode_attention` of several sequences' chunks (``queries[i]`` [H_i, G_i, d]
    over ``stores[i]``, a chunk of ``q_lens[i]`` positions; the lengths may differ).

    Triton attends every position of every chunk in one :func:`batched_decode_attention` launch:
    position ``t`` of a chunk is a view of its store with the generated rows it sees. The torch
    path attends the chunks of one shape together (:func:`chunk_decode_attention_torch`).
    """
    if not stores:
        return []
    if resolve_backend(backend, queries[0], stores[0].keys) != "triton":
        return chunk_decode_attention_torch(queries, stores, q_lens, scale)
    views, by_position = [], []
    for q, s, q_len in zip(queries, stores, q_lens):
        check_ragged(q, *s[:7], q_len)
        views += [s._replace(n_gen=s.n_gen - q_len + 1 + t) for t in range(q_len)]
        by_position.append(q.unflatten(1, (-1, q_len)).permute(2, 0, 1, 3).flatten(0, 1))  # [q_len * H, G, d]
    out = batched_decode_attention(torch.cat(by_position), views, scale, backend="triton")
    sizes = [q.shape[0] * q_len for q, q_len in zip(queries, q_lens)]
    return [o.unflatten(0, (q_len, q.shape[0])).permute(1, 2, 0, 3).flatten(1, 2)
            for o, q, q_len in zip(out.split(sizes), queries, q_lens)]


def dense_decode_attention(q, k, v, gen_k=None, gen_v=None, n_gen=0, scale=None, backend="auto"):
    """Full-cache decode attention through the same op (every head has all N prompt rows).

    Parameters
    ----------
    q : Tensor [H_kv, G, d]
    k, v : Tensor [H_kv, N, d]
        The full prompt cache; viewed (no copy when contiguous) as a flat store with
        ``offsets = h * N`` and ``lengths = N``.
    gen_k, gen_v, n_gen, scale, backend
        As in :func:`ragged_decode_attention`.
    """
    H, N, d = k.shape
    offsets = torch.arange(H, device=k.device, dtype=torch.int64) * N
    lengths = torch.full((H,), N, device=k.device, dtype=torch.int64)
    return ragged_decode_attention(q, k.reshape(H * N, d), v.reshape(H * N, d), offsets, lengths,
                                   gen_k, gen_v, n_gen, scale, backend, max_length=N)
