"""Stage 1 and 2 of HybridKV on constructed attention: classification, budgets, text prior."""

import math

import pytest
import torch

from hybridkv_cli.compression.allocate import adaptive_split, nearest_power_of_two, plan_layer
from hybridkv_cli.compression.classify import classify_static, sparsity_scores
from hybridkv_cli.compression.selection import keep_top
from hybridkv_cli.compression.static_prune import text_prior_keep


def concentrated(n: int, hot: list[int]) -> torch.Tensor:
    a = torch.full((n,), 0.02 / n)
    a[hot] = (1 - a.sum() + a[hot].sum()) / len(hot)
    return a / a.sum()


def test_concentrated_is_static_diffuse_is_dynamic():
    n = 400
    attn = torch.stack([concentrated(n, [3, 50, 399]), torch.full((n,), 1 / n)])
    static, scores = classify_static(attn, theta=0.9, topk_share=0.05)
    assert static.tolist() == [True, False]
    assert scores[1].item() == pytest.approx(math.ceil(0.05 * n) / n)


def test_theta_and_p_are_respected():
    n = 100
    attn = torch.full((1, n), 0.2 / 90)
    attn[0, :10] = 0.08  # 80% of the mass on 10% of the positions
    assert sparsity_scores(attn, 0.10).item() == pytest.approx(0.8)
    assert sparsity_scores(attn, 0.05).item() == pytest.approx(0.4)
    assert classify_static(attn, theta=0.79, topk_share=0.10)[0].item()
    assert not classify_static(attn, theta=0.81, topk_share=0.10)[0].item()
    assert not classify_static(attn, theta=0.79, topk_share=0.05)[0].item()


def test_nearest_power_of_two():
    assert [nearest_power_of_two(x) for x in (0.2, 0.6, 1, 2.9, 3, 5, 6.5, 12, 13, 100)] == [0, 1, 1, 2, 2, 4, 8, 8, 16, 128]


def plan(static, n=1000, budget=0.1, window=32, share=0.75, chunk=8, alpha=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    pooled = torch.rand(len(static), n, generator=g)
    return plan_layer(pooled, torch.tensor(static), target=round(budget * n * len(static)), window=window, share=share,
                      chunk=chunk, alpha=alpha)


@pytest.mark.parametrize("static", [[True, False, True, False], [True, True, False, True], [False] * 4, [True] * 4])
@pytest.mark.parametrize("budget", [0.05, 0.1, 0.2, 0.4])
def test_layer_total_is_budget_plus_reported_rounding(static, budget):
    p = plan(static, budget=budget)
    assert int(p.entries.sum()) == p.target + p.rounding
    assert p.target == round(budget * 1000 * 4)
    if all(static):  # no power-of-two rounding: exact
        assert p.rounding == 0
    assert (p.entries <= 1000).all()


def test_dynamic_heads_get_r_times_average_rounded_to_power_of_two_chunks():
    p = plan([True, False, True, False], n=2000, budget=0.2)  # B̄ = 400, r·B̄ = 300
    num_chunks, tail = (2000 - 32) // 8, 2000 - ((2000 - 32) // 8) * 8
    assert p.chunks == nearest_power_of_two((300 - tail) / 8) <= num_chunks
    dyn = p.entries[torch.tensor([1, 3])]
    assert (dyn == p.chunks * 8 + tail).all()
    # The rounding difference is taken from / given to the static share: the layer total holds.
    assert int(p.entries.sum()) == p.target


def test_share_clipping_and_all_dynamic_layer_takes_whole_budget():
    # r = 3 with 3 of 4 heads dynamic: B_dyn = min(3·B̄·3, 4·B̄) = 4·B̄ -> the dynamic type takes it all.
    p = plan([True, False, False, False], n=4096, budget=0.25, share=3.0)
    dyn_each = 4 * 0.25 * 4096 / 3
    assert p.chunks == nearest_power_of_two((dyn_each - 32) / 8)
    all_dyn = plan([False] * 4, n=4096, budget=0.25)  # B̄ = 1024 entries per head, all dynamic
    assert all_dyn.target - 4 * 8 < int(all_dyn.entries.sum()) <= all_dyn.target


def test_budget_one_gives_every_head_everything():
    for static in ([True, False, True, False], [False] * 4, [True] * 4, [True, False, False, False]):
        for n in (100, 999, 1000):
            p = plan(static, n=n, budget=1.0)
            assert (p.entries == n).all(), (static, n, p.entries)


def test_adaptive_split_floor_and_cap():
    pooled = torch.zeros(3, 50)
    pooled[0] = 1.0  # head 0 wins every global top entry
    counts = adaptive_split(pooled, 60, alpha=0.2)
    assert counts.sum() == 60
    # floor = 0.2 * 60 / 3 = 4 each; head 0 wins the global top but cannot exceed N = 50.
    assert counts[0] == 50 and counts[1] >= 4 and counts[2] >= 4
    assert adaptive_split(pooled, 1000, alpha=0.2).tolist() == [50, 50, 50]


def test_keep_top_per_head_counts():
    pri = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.4, 0.3, 0.2, 0.1]])
    keep = keep_top(pri, torch.tensor([2, 0]))
    assert keep.tolist() == [[False, True, True, False], [False] * 4]


def test_text_prior_keeps_every_text_token_before_any_visual():
    n, window = 200, 16
    visual = torch.zeros(n, dtype=torch.bool)
    visual[20:150] = True
    pooled = torch.rand(2, n)
    pooled[:, 20:150] += 10  # visual tokens score far higher than text: the prior must still win
    pooled.clamp_(max=1.0)
    text_count = int((~visual).sum())
    budgets = torch.tensor([text_count, text_count + 30])
    keep = text_prior_keep(pooled, visual, window, budgets)
    assert keep[0].sum() == text_count and not keep[0, visual].any()
    assert keep[1, ~visual].all() and keep[1, visual].sum() == 30
    # With a budget smaller than the text, the window comes first.
    keep = text_prior_keep(pooled, visual, window, torch.tensor([window, window + 3]))
    assert keep[0, -window:].all() and keep[0].sum() == window
    assert keep[1, -window:].all() and not keep[1, visual].any()


def test_rounding_never_overruns_an_all_dynamic_layer():
    # 0.1 · 16384 = 1638.4 entries per head: 200.8 chunks would round up to 256 (2080 entries).
    p = plan([False] * 4, n=16384, budget=0.1)
    assert int(p.entries.sum()) <= p.target
    assert p.target - int(p.entries.sum()) < 4 * 8  # what is left is less than one chunk per head
