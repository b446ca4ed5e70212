"""What a batched decode-attention launch reads: each sequence's layer (:class:`RaggedKV`) and
the address table of their segments (:func:`segment_table`), for ``batched_decode_attention``."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["RaggedKV", "SegmentTable", "segment_table"]


class RaggedKV(NamedTuple):
    """One sequence's layer as a decode step reads it: the arguments of
    :func:`ragged_decode_attention` after ``q`` (``max_length``: a host bound on ``lengths``)."""

    keys: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    gen_k: torch.Tensor | None
    gen_v: torch.Tensor | None
    n_gen: int
    max_length: int

    @property
    def num_heads(self) -> int:
        return self.offsets.numel()


def _rows(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` [..., d] in ``dtype`` with unit-stride rows of ``d`` and a 16-byte aligned start."""
    t = t.to(dtype)
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] or t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _generated(gen: torch.Tensor, n_gen: int, dtype) -> torch.Tensor:
    """``gen`` [H, cap, d] with every head's first row 16-byte aligned (a copy of its first
    ``n_gen`` rows, padded, when the head stride does not keep them so)."""
    gen = _rows(gen, dtype)
    if gen.stride(0) * gen.element_size() % 16:
        step = 16 // math.gcd(gen.shape[-1] * gen.element_size(), 16)  # rows per 16-byte multiple
        cap = -(-n_gen // step) * step
        padded = gen.new_zeros(gen.shape[0], cap, gen.shape[-1])
        padded[:, :n_gen] = gen[:, :n_gen]
        gen = padded
    return gen


class SegmentTable(NamedTuple):
    """The ``SEG`` table of the stage-1 kernel for some stores, with what a launch needs beside it.

    seg : [S, 5] int64 on the device: per segment (KV head), the addresses of its store's keys
        and values, of its first generated key and value row, and its generated-row count (or,
        ``counted``, the address of that count on the device).
    offsets, lengths : [S] int64, the segments' rows in their stores.
    max_total : a host bound on any segment's rows (prompt + generated).
    alive : the tensors the addresses point into (kept alive with the table).
    """

    seg: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    max_total: int
    counted: bool
    alive: list


def segment_table(stores: list[RaggedKV], counts: torch.Tensor | None = None) -> SegmentTable:
    """The address table of ``stores`` for :func:`batched_decode_attention`.

    Built on the host from tensor metadata only (no device read); on CUDA it travels in one
    asynchronous copy from pinned memory. Every address is 16-byte aligned (the kernel's loads
    are vectorised on that promise): a tensor that is not is copied.

    counts : LongTensor [len(stores)] on the device, optional
        Each store's generated-row count, read by the kernel at every launch: the table then
        serves every later step as long as the stores' tensors stay where they are (their
        generated rows allocated up front), with the split count fixed by the rows' capacity,
        so the launches of one step repeat exactly in the next (a CUDA graph can replay them).
        No tensor may need a copy then. None: each store's ``n_gen`` now, for this step only.
    """
    dtype = stores[0].keys.dtype
    rows, alive = [], []
    for i, s in enumerate(stores):
        keys, values = _rows(s.keys, dtype), _rows(s.values, dtype)
        gen_k = gen_v = None
        rows_gen = s.n_gen if counts is None else s.gen_k.shape[1]
        if rows_gen > 0:
            gen_k, gen_v = _generated(s.gen_k, rows_gen, dtype), _generated(s.gen_v, rows_gen, dtype)
        if counts is not None and any(a is not None and a is not b for a, b in
                                      zip((keys, values, gen_k, gen_v), (s.keys, s.values, s.gen_k, s.gen_v))):
            raise ValueError("a counted segment table reads the stores in place: they need unit-stride, "
                             "16-byte aligned rows of one dtype")
        alive += [keys, values, gen_k, gen_v]
        size = keys.element_size()
        count = int(s.n_gen) if counts is None else counts[i:].data_ptr()
        for h in range(s.num_heads):
            gk = keys.data_ptr() if gen_k is None else gen_k.data_ptr() + h * gen_k.stride(0) * size
            gv = values.data_ptr() if gen_v is None else gen_v.data_ptr() + h * gen_v.stride(0) * size
            rows.append((keys.data_ptr(), values.data_ptr(), gk, gv, count))
    device = stores[0].keys.device
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    if counts is not None:
        alive.append(counts)
    max_total = max(s.max_length + (s.n_gen if counts is None else s.gen_k.shape[1]) for s in stores)
    return SegmentTable(table, torch.cat([s.offsets for s in stores]), torch.cat([s.lengths for s in stores]),
                        max_total, counts is not None, alive)
