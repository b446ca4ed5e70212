"""Triton kernel of ``chunk_gather``: zero-copy load of missing chunks from pinned host memory.

Loaded by :func:`hybridkv_kernels.dispatch.load_triton_module`; plan, launcher and torch
reference are in ``chunk_gather.py``.

On CUDA the host tensors are pinned, so through unified virtual addressing their CPU address
is also a device address (the Triton launcher accepts such pointers): each program reads its
chunk straight over PCIe and writes it into its slot. No CPU gather, no staging buffer, and
the grid is the full (head, slot) grid so it can be launched without knowing how many chunks
miss (no host sync before the copy); programs of slots that keep their chunk exit at once.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_gather_kernel(
    HK, HV, SK, SV, SLOT_BASE, ASSIGN, c, D,
    stride_hkh, stride_hkc, stride_hkt, stride_hvh, stride_hvc, stride_hvt,
    stride_skt, stride_svt, stride_ah,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (h, s): if ASSIGN[h, s] >= 0 copy host chunk ASSIGN[h, s] of head h (K and V,
    [c, D]) to store rows SLOT_BASE[h] + s * c ... + c."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    cid = tl.load(ASSIGN + h * stride_ah + s)
    if cid >= 0:
        off_t = tl.arange(0, BLOCK_T)
        off_d = tl.arange(0, BLOCK_D)
        mask = (off_t[:, None] < c) & (off_d[None, :] < D)
        rows = tl.load(SLOT_BASE + h).to(tl.int64) + s.to(tl.int64) * c + off_t
        k = tl.load(HK + h.to(tl.int64) * stride_hkh + cid * stride_hkc
                    + off_t[:, None] * stride_hkt + off_d[None, :], mask=mask)
        tl.store(SK + rows[:, None] * stride_skt + off_d[None, :], k, mask=mask)
        v = tl.load(HV + h.to(tl.int64) * stride_hvh + cid * stride_hvc
                    + off_t[:, None] * stride_hvt + off_d[None, :], mask=mask)
        tl.store(SV + rows[:, None] * stride_svt + off_d[None, :], v, mask=mask)
