"""The Triton top-k selection (``chunk_topk.launch_topk``) against ``torch.topk``.

Runs under the Triton interpreter on CPU (started with ``TRITON_INTERPRET=1`` by
``test_kernels.py``, or by hand) or compiled on CUDA. Shapes are small, blocks forced to the
minimum (256 scores a loop step) so that every pass walks several blocks and a partial one.
The rule (``chunk_topk`` module docstring): the ``min(k, C)`` largest scores, ties to the lowest
id, ids ascending; -0.0 equals +0.0.
"""

from __future__ import annotations

import pytest
import torch

import hybridkv_kernels as hk

if not hk.HAS_TRITON:
    pytest.skip("triton not installed", allow_module_level=True)
INTERPRET = hk.triton_interpreting()
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from hybridkv_kernels.chunk_topk import launch_topk  # noqa: E402

DEV = torch.device("cpu" if INTERPRET else "cuda")


def _expected(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The rule from torch: a stable sort by descending score keeps tied ids in order."""
    order = torch.sort(-(scores + 0.0), dim=1, stable=True).indices[:, :k]
    return order.sort(dim=1).values


@pytest.mark.parametrize("C,k", [(1, 1), (700, 1), (700, 70), (700, 699), (700, 700), (1000, 2000)])
def test_topk_matches_torch_topk(C, k):
    g = torch.Generator().manual_seed(C + k)
    scores = torch.randn(3, C, generator=g) * torch.tensor([[1.0], [1e-30], [1e30]])  # exponents far apart
    ids = launch_topk(scores.to(DEV), k, block=256).cpu()
    kk = min(k, C)
    ref = torch.topk(scores, kk, dim=1).indices.sort(dim=1).values  # distinct scores: no tie to break
    assert ids.shape == (3, kk) and ids.dtype == torch.int64
    assert torch.equal(ids, ref)


@pytest.mark.parametrize("k", [40, 39, 41])
def test_search_that_stops_at_the_first_byte(k):
    """40 scores near 100 and the rest near 1 differ in their top byte: at k = 40 the first
    pass's bucket holds exactly the top k (the search stops there); 39 and 41 go on."""
    g = torch.Generator().manual_seed(k)
    scores = 1.0 + torch.rand(2, 500, generator=g)
    high = torch.randperm(500, generator=g)[:40]
    scores[:, high] = 100.0 + torch.rand(2, 40, generator=g)
    ids = launch_topk(scores.to(DEV), k, block=256).cpu()
    assert torch.equal(ids, _expected(scores, k))


def test_ties_go_to_the_lowest_ids():
    """Few distinct values (many ties, a tie at the k-th), signed zeros, infinities."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (4, 600), generator=g).float()
    scores[0, ::7] = -0.0
    scores[1, :50] = float("inf")
    scores[2, 100:] = float("-inf")
    scores[3] = 1.5  # all equal
    for k in (1, 37, 300, 599):
        ids = launch_topk(scores.to(DEV), k, block=256).cpu()
        assert torch.equal(ids, _expected(scores, k)), k
        # torch.topk picks the same score multiset (its own tie order is unspecified)
        assert torch.equal(scores.gather(1, ids).sort(1).values,
                           torch.topk(scores, k, dim=1).values.sort(1).values), k


def test_table_rows_take_their_own_count_and_k():
    """``TABLE`` mode (several sequences' rows): row i selects its own k_i among its own C_i."""
    from hybridkv_kernels.batched_retrieval import COLUMNS

    counts, ks = [300, 700, 520], [10, 600, 520]
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, max(counts), generator=g)
    table = torch.zeros(3, len(COLUMNS), dtype=torch.int64)
    table[:, COLUMNS.index("chunks")] = torch.tensor(counts)
    table[:, COLUMNS.index("slots")] = torch.tensor(ks)
    out = torch.full((3, max(ks)), -1, dtype=torch.int64, device=DEV)
    launch_topk(scores.to(DEV), max(ks), out=out, table=table.to(DEV), block=256)
    out = out.cpu()
    for i, (c, k) in enumerate(zip(counts, ks)):
        assert torch.equal(out[i, :k], _expected(scores[i:i + 1, :c], k)[0]), i
        assert torch.all(out[i, k:] == -1), i
