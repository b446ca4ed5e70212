"""Comparison helpers shared by the kernel tests and the benchmark (fla-style relative error)."""

from __future__ import annotations

import torch

__all__ = ["assert_close", "rel_err"]


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in fp64 (0 when both are all zeros)."""
    ref = ref.detach().double().cpu()
    out = out.detach().double().cpu()
    if ref.shape != out.shape:
        raise AssertionError(f"shape mismatch: ref {tuple(ref.shape)} vs out {tuple(out.shape)}")
    err = (out - ref).abs().max().item() if ref.numel() else 0.0
    base = ref.abs().max().item() if ref.numel() else 0.0
    if base == 0.0:
        return err
    return err / base


def assert_close(ref: torch.Tensor, out: torch.Tensor, rtol: float, name: str = "") -> None:
    """Raise if ``rel_err(ref, out) > rtol`` or ``out`` has NaN/inf."""
    if not torch.isfinite(out).all():
        raise AssertionError(f"{name}: output has NaN/inf")
    e = rel_err(ref, out)
    if e > rtol:
        raise AssertionError(f"{name}: relative error {e:.3e} > {rtol:.1e}")


def ragged_store(lengths, d, dtype, gap=3, seed=0, device="cpu"):
    """A flat ragged store with unused rows between (and before) the head segments.

    Returns ``(keys, values, offsets, lengths)`` as the decode-attention op takes them.
    """
    g = torch.Generator().manual_seed(seed)
    offsets, row = [], gap
    for n in lengths:
        offsets.append(row)
        row += n + gap
    keys = torch.randn(row, d, generator=g).to(dtype)
    values = torch.randn(row, d, generator=g).to(dtype)
    return (keys.to(device), values.to(device), torch.tensor(offsets, device=device),
            torch.tensor(lengths, device=device))
