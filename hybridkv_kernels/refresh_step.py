"""The refresh step of pruned heads on the device: drift, trigger and re-selection in five launches.

What it computes is ``Refresher.refresh`` of ``hybridkv_cli.compression.refresh`` (the torch
reference, and the CPU path, lives there): the kernels are in ``_refresh_triton.py``. Every
layer-step issues the same launches whether the trigger fires or not (no host branch, so a CUDA
graph can replay it); where it does not fire, the candidates' keys are not read and the wanted
positions are the resident ones, so the gather that follows moves nothing.

1. ``refresh_scores_kernel``: held mask, per-head drift, candidate scores.
2. ``refresh_trigger_kernel``: the layer's drift, the fired flag, the counters.
3. top ``n_cand`` candidates by score (``launch_topk``).
4. ``refresh_candidates_kernel``: their exact logits, keys read in place in host memory.
5. top ``c`` of those (``launch_topk``); then ``where(fired, chosen, resident)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .chunk_topk import launch_topk
from .dispatch import load_triton_module, next_power_of_2

__all__ = ["RefreshState", "refresh_want"]


class RefreshState(NamedTuple):
    """The device tensors of one layer's refresh (see ``Refresher``): which KV heads, their host
    keys [H_r, P, 1, d] (pinned on CUDA), their low-rank detector (basis [H_r, d, R], codes
    [H_r, R, P] int8, scale [H_r, R]), slot bases, moving slots' positions [H_r, c], fixed
    positions [H_r, f], rows held per head in the store (c + f + window), and the counters
    (tau and clock 0-d, refreshes and key_reads 0-d int64)."""

    heads: torch.Tensor
    host_k: torch.Tensor
    basis: torch.Tensor
    codes: torch.Tensor
    lscale: torch.Tensor
    slot_base: torch.Tensor
    resident: torch.Tensor
    fixed: torch.Tensor
    held_rows: int
    tau: torch.Tensor
    clock: torch.Tensor
    refreshes: torch.Tensor
    key_reads: torch.Tensor


def refresh_want(query: torch.Tensor, state: RefreshState, store_k: torch.Tensor, gen_k: torch.Tensor,
                 n_gen: int | torch.Tensor, scale: float, *, kind: str, rate: float, eta: float, period: int,
                 candidates: int) -> torch.Tensor:
    """The positions each moving slot must hold after this step, [H_r, c] (the resident ones
    where the trigger does not fire).

    Parameters
    ----------
    query : Tensor [H_kv, G, d]
        The layer's decode query (every KV head; ``state.heads`` picks the refreshed ones).
    store_k : Tensor [T, d]
        The layer's store keys (each head's held rows from ``state.slot_base``).
    gen_k : Tensor [H_kv, cap, d]
        Generated keys; ``n_gen`` of them valid: a host int, or a device count (1 element) read
        by the kernel (a replayable step).
    kind : {"rcr", "periodic"}
    candidates : int
        Candidates per head (at most the positions that are not fixed).
    """
    for t in (state.heads, state.host_k, state.basis, state.codes, state.lscale, state.slot_base, state.resident,
              state.fixed):
        if not t.is_contiguous():
            raise ValueError("refresh_want needs contiguous state tensors")
    if store_k.stride(-1) != 1 or gen_k.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("refresh_want needs unit stride along d")
    mod = load_triton_module("_refresh_triton")
    heads, span = state.host_k.shape[:2]
    group, dim = query.shape[1:]
    c, n_fixed, rank = state.resident.shape[1], state.fixed.shape[1], state.basis.shape[2]
    dev = query.device
    held = torch.empty(heads, span, dtype=torch.int8, device=dev)
    score = torch.empty(heads, span, dtype=torch.float32, device=dev)
    kept = torch.empty(heads, c, dtype=torch.float32, device=dev)
    drift = torch.empty(heads, dtype=torch.float32, device=dev)
    fired = torch.empty((), dtype=torch.bool, device=dev)
    counted = isinstance(n_gen, torch.Tensor)
    block_g, block_d = max(16, next_power_of_2(group)), max(16, next_power_of_2(dim))
    mod.refresh_scores_kernel[(heads,)](
        query, state.heads, store_k, state.slot_base, gen_k, n_gen if counted else drift, state.basis, state.codes,
        state.lscale, state.resident, state.fixed, held, score, kept, drift,
        group, dim, rank, span, state.held_rows, c, n_fixed, 0 if counted else int(n_gen), scale,
        query.stride(0), query.stride(1), store_k.stride(0), gen_k.stride(0), gen_k.stride(1),
        COUNTED=counted, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_R=max(16, next_power_of_2(rank)),
        BLOCK_N=32, BLOCK_P=64, num_warps=4,
    )
    mod.refresh_trigger_kernel[(1,)](
        drift, state.tau, state.clock, fired, state.refreshes, state.key_reads, heads, float(heads * group),
        float(rate), float(eta), int(period), heads * candidates * dim * state.host_k.element_size(),
        PERIODIC=kind == "periodic", BLOCK_H=next_power_of_2(heads),
    )
    cand = launch_topk(score, candidates)
    exact = torch.empty(heads, candidates, dtype=torch.float32, device=dev)
    mod.refresh_candidates_kernel[(heads,)](
        query, state.heads, state.host_k, cand, exact, fired, group, dim, candidates,
        query.stride(0), query.stride(1), state.host_k.stride(0), state.host_k.stride(1),
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=32, num_warps=4,
    )
    chosen = cand.gather(1, launch_topk(exact, c))
    return torch.where(fired, chosen, state.resident)
