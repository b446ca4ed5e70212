"""candidate_key_topk: stage-2 re-ranking of candidate tokens by token-major 2-bit keys.

The torch reference is checked against dense fp32 logits of the unpacked keys; the Triton cases
(marked by ``triton`` in their names) need the interpreter or CUDA. As in ``test_kernels.py``:
``TRITON_INTERPRET=1`` only works when set before triton is first imported, so when this process
neither interprets nor has CUDA, :func:`test_triton_cases_under_interpreter` runs them in a fresh
pytest subprocess with ``TRITON_INTERPRET=1`` and they skip here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridkv_kernels as hk
from hybridkv_kernels.candidate_keys import launch_candidate_scores

ROOT = Path(__file__).resolve().parents[1]
TRITON_HERE = hk.HAS_TRITON and (hk.triton_interpreting() or torch.cuda.is_available())
DEV = torch.device("cuda" if TRITON_HERE and not hk.triton_interpreting() else "cpu")
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="needs CUDA, or TRITON_INTERPRET=1 before triton is "
                                  "imported (run by test_triton_cases_under_interpreter)")


def _case(H, G, P, d, M, seed=0):
    """Queries, keys and M distinct ascending candidates per head."""
    g = torch.Generator().manual_seed(seed)
    q, keys = torch.randn(H, G, d, generator=g), torch.randn(H, P, d, generator=g)
    candidates = torch.stack([torch.randperm(P, generator=g)[:M].sort().values for _ in range(H)])
    return q, keys, candidates


def _on_device(q, codes, bounds, candidates):
    """As a CUDA run holds them: q, bounds and candidates on the device, codes pinned on the host."""
    if DEV.type != "cuda":
        return q, codes, bounds, candidates
    return q.to(DEV), codes.pin_memory(), bounds.to(DEV), candidates.to(DEV)


def test_pack_keys_by_token_is_pack_keys_transposed():
    keys = torch.randn(2, 9, 16)
    codes, bounds = hk.pack_keys_by_token(keys)
    ref_codes, ref_bounds = hk.pack_keys(keys)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 9, 4) and codes.is_contiguous()
    assert torch.equal(codes, ref_codes.transpose(1, 2)) and torch.equal(bounds, ref_bounds)


@pytest.mark.parametrize("G", [1, 7])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_torch_scores_are_the_dense_logits_at_the_candidates(G, d):
    H, P, M = 3, 90, 37
    q, keys, candidates = _case(H, G, P, d, M, seed=d + G)
    codes, bounds = hk.pack_keys_by_token(keys)
    cm_codes, _ = hk.pack_keys(keys)
    low, scale = bounds.unbind(1)
    approx = low[:, :, None] + scale[:, :, None] * hk.unpack_codes(cm_codes)  # [H, d, P] fp32
    dense = torch.bmm(q, approx).amax(1)  # [H, P]
    got = hk.candidate_key_scores_torch(q, codes, bounds, candidates)
    assert got.dtype == torch.float32 and got.shape == (H, M)
    torch.testing.assert_close(got, dense.gather(1, candidates), atol=1e-4, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("G", [1, 7])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_triton_scores_match_torch(G, d):
    """Several candidate blocks and a partial last one (M = 37, blocks of 16)."""
    H, P, M = 3, 90, 37
    q, keys, candidates = _case(H, G, P, d, M, seed=d + G)
    codes, bounds = hk.pack_keys_by_token(keys)
    ref = hk.candidate_key_scores_torch(q, codes, bounds, candidates)
    got = launch_candidate_scores(*_on_device(q, codes, bounds, candidates), block_m=16)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-3, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("M,k", [(37, 5), (37, 37), (37, 100), (20, 1)])
def test_triton_topk_matches_torch(M, k):
    H, G, P, d = 3, 7, 90, 64
    q, keys, candidates = _case(H, G, P, d, M, seed=M + k)
    codes, bounds = hk.pack_keys_by_token(keys)
    ids = hk.candidate_key_topk(*_on_device(q, codes, bounds, candidates), k, backend="triton").cpu()
    ref = hk.candidate_key_topk(q, codes, bounds, candidates, k, backend="torch")
    assert torch.equal(ids, ref)
    assert ids.shape == (H, min(k, M)) and ids.dtype == torch.int64
    assert torch.all(ids[:, 1:] > ids[:, :-1])
    assert all(set(i.tolist()) <= set(c.tolist()) for i, c in zip(ids, candidates))
    if k >= M:
        assert torch.equal(ids, candidates)


def test_torch_topk_is_the_best_candidates_ascending():
    H, G, P, d, M, k = 2, 3, 60, 32, 25, 6
    q, keys, candidates = _case(H, G, P, d, M, seed=5)
    codes, bounds = hk.pack_keys_by_token(keys)
    scores = hk.candidate_key_scores_torch(q, codes, bounds, candidates)
    ids = hk.candidate_key_topk(q, codes, bounds, candidates, k, backend="torch")
    assert ids.shape == (H, k) and torch.all(ids[:, 1:] > ids[:, :-1])
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids, candidates.gather(1, order.sort(1).values))
    assert torch.equal(hk.candidate_key_topk(q, codes, bounds, candidates, 100, backend="torch"), candidates)
    assert hk.candidate_key_topk(q, codes, bounds, candidates, 0, backend="torch").shape == (H, 0)


def _exact_case(H=2, G=3, P=64, d=32, M=20, seed=3):
    """Keys already on each channel's 4-level grid (dyadic low and scale, codes 0 and 3 both present):
    the 2-bit keys are the keys."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randint(-4, 4, (H, 1, d), generator=g).float()
    scale = 2.0 ** -torch.randint(0, 3, (H, 1, d), generator=g).float()
    code = torch.randint(0, 4, (H, P, d), generator=g)
    code[:, 0], code[:, 1] = 0, 3
    keys = low + scale * code
    q = torch.randn(H, G, d, generator=g)
    candidates = torch.stack([torch.randperm(P, generator=g)[:M].sort().values for _ in range(H)])
    return q, keys, candidates


def _assert_top1_is_the_exact_best(ids, q, keys, candidates):
    exact = torch.einsum("hgd,hpd->hgp", q.double(), keys.double()).amax(1).gather(1, candidates)
    top2 = exact.topk(2, dim=1)
    assert torch.all(top2.values[:, 0] - top2.values[:, 1] > 1e-3)  # (the case has a clear winner)
    assert torch.equal(ids.cpu(), candidates.gather(1, top2.indices[:, :1]))


def test_torch_top1_is_the_exact_best_when_keys_are_on_the_grid():
    q, keys, candidates = _exact_case()
    codes, bounds = hk.pack_keys_by_token(keys)
    low, scale = bounds.unbind(1)
    assert torch.equal(low[:, None] + scale[:, None] * hk.unpack_codes(codes.transpose(1, 2)).transpose(1, 2), keys)
    _assert_top1_is_the_exact_best(hk.candidate_key_topk(q, codes, bounds, candidates, 1, backend="torch"),
                                   q, keys, candidates)


@needs_triton
def test_triton_top1_is_the_exact_best_when_keys_are_on_the_grid():
    q, keys, candidates = _exact_case()
    codes, bounds = hk.pack_keys_by_token(keys)
    ids = hk.candidate_key_topk(*_on_device(q, codes, bounds, candidates), 1, backend="triton")
    _assert_top1_is_the_exact_best(ids, q, keys, candidates)


def test_bad_shapes_raise():
    H, G, P, d, M = 2, 3, 20, 16, 5
    q, keys, candidates = _case(H, G, P, d, M)
    codes, bounds = hk.pack_keys_by_token(keys)
    cases = [
        ((q, codes.int(), bounds, candidates), "codes must be uint8"),
        ((q, hk.pack_keys(keys)[0], bounds, candidates), r"codes must be uint8 \[H, P, d/4\]"),  # channel-major
        ((q, codes[:1], bounds, candidates), "codes must be"),
        ((q, codes, bounds[:, :1], candidates), "bounds must be"),
        ((q, codes, bounds, candidates.int()), "candidates must be int64"),
        ((q, codes, bounds, candidates[:1]), "candidates must be int64"),
        ((q, codes, bounds, candidates[0]), "candidates must be int64"),
        ((q[..., :6], codes, bounds, candidates), "divisible by 4"),
        ((q[0], codes, bounds, candidates), "q must be"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            hk.candidate_key_scores_torch(*args)
        with pytest.raises(ValueError, match=match):
            hk.candidate_key_topk(*args, 2, backend="torch")
    with pytest.raises(ValueError, match="divisible by 4"):
        hk.pack_keys_by_token(torch.randn(1, 4, 6))


def test_triton_cases_under_interpreter():
    """Run this file's Triton cases in a fresh process with TRITON_INTERPRET=1 (module docstring)."""
    if not hk.HAS_TRITON:
        pytest.skip("triton not installed")
    if TRITON_HERE:
        pytest.skip("the Triton cases run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-k", "triton and not under_interpreter", __file__],
                       cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    last = r.stdout.strip().splitlines()[-1]
    assert "passed" in last and "skipped" not in last and "failed" not in last, tail
