"""Refresh of pruned heads (RCR): controller, re-selection, detector, and the branch-free decision."""

from __future__ import annotations

import copy

import pytest
import torch
from test_methods import CONTEXT, QUESTION, tiny_text_model

from hybridkv_cli.compression import make_policy
from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.compression.detector import LowRankKeys
from hybridkv_cli.compression.refresh import RateController, Refresher, RefreshOptions
from hybridkv_cli.engine import generate
from hybridkv_cli.models.demo import build_demo
from hybridkv_cli.models.prompt import build_text_prompt


def test_controller_holds_the_target_rate_whatever_the_drift_scale():
    g = torch.Generator().manual_seed(0)
    for scale in (1e-4, 1e-2, 0.5):  # drift magnitudes differ by orders across samples
        controller = RateController(RefreshOptions(rate=0.4), torch.device("cpu"))
        fired = [bool(RateController.trigger_all([controller], torch.rand(1, generator=g) * scale))
                 for _ in range(3000)]
        assert abs(sum(fired[1000:]) / 2000 - 0.4) < 0.05


def test_low_rank_logits_rank_like_exact_logits_on_low_rank_keys():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 300, 6, generator=g) @ torch.randn(2, 6, 64, generator=g)  # rank 6 < 8
    q = torch.randn(2, 3, 64, generator=g)
    approx = LowRankKeys.build(keys, rank=8).logits(q)
    exact = torch.bmm(q, keys.transpose(1, 2))
    top = lambda s: set(s.amax(1).topk(10, dim=1).indices.flatten().tolist())  # noqa: E731
    assert len(top(approx) & top(exact)) >= 18
    assert LowRankKeys.build(keys, 8).device_bytes() == LowRankKeys.bytes_for(2, 300, 64, 8)


def layer(n=160, heads=2, group=2, dim=32, seed=0) -> PrefillLayer:
    g = torch.Generator().manual_seed(seed)
    return PrefillLayer(index=0, num_layers=1, query=torch.randn(heads, group, n, dim, generator=g),
                        keys=torch.randn(heads, n, dim, generator=g), values=torch.randn(heads, n, dim, generator=g),
                        visual=torch.zeros(n, dtype=torch.bool), scale=dim**-0.5)


def slot_positions(kv) -> list[set[int]]:
    r = kv.refresher
    return [set(row.tolist()) for row in r.resident]


def test_refresh_every_step_with_all_candidates_keeps_the_exact_top_tokens():
    prefill = layer()
    kv = make_policy("rcr", budget=0.25, refresh="periodic", refresh_period=1).compress(prefill).kv
    r = kv.refresher
    r.options = RefreshOptions(kind="periodic", period=1, candidates=1000)  # every token a candidate
    q = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(5))
    kv.attend(q, prefill.scale)
    span = r.host_k.shape[1]
    exact = torch.bmm(q, prefill.keys[:, :span].transpose(1, 2)).amax(dim=1)
    want = exact.topk(r.resident.shape[1], dim=1).indices
    assert slot_positions(kv) == [set(row.tolist()) for row in want]
    # the slots hold those tokens' keys and values
    for h in range(2):
        rows = kv.store.keys[int(r.slot_base[h]): int(r.slot_base[h]) + r.resident.shape[1]]
        torch.testing.assert_close(rows, prefill.keys[h, r.resident[h]])


def test_periodic_refresh_fires_on_the_first_step_and_every_t_th():
    prefill = layer()
    kv = make_policy("rcr", budget=0.25, refresh="periodic", refresh_period=3).compress(prefill).kv
    g = torch.Generator().manual_seed(2)
    for _ in range(7):
        kv.attend(torch.randn(2, 2, 32, generator=g), prefill.scale)
    assert int(kv.refresher.refreshes) == 3  # steps 1, 4, 7
    assert kv.transferred_bytes() > 0


def test_untriggered_steps_move_nothing():
    prefill = layer()
    kv = make_policy("rcr", budget=0.25, refresh="periodic", refresh_period=100).compress(prefill).kv
    g = torch.Generator().manual_seed(3)
    kv.attend(torch.randn(2, 2, 32, generator=g), prefill.scale)  # step 1 fires
    moved = kv.transferred_bytes()
    before = slot_positions(kv)
    for _ in range(5):
        kv.attend(torch.randn(2, 2, 32, generator=g), prefill.scale)
    assert kv.transferred_bytes() == moved and slot_positions(kv) == before


@pytest.fixture(scope="module")
def llama():
    return tiny_text_model("llama", build_demo().tokenizer)


@pytest.mark.parametrize("method,options", [("rcr", {}), ("hybridkv", {"refresh": "rcr", "theta": 0.0})])
def test_branch_free_refresh_gives_the_tokens_of_the_branching_one(llama, monkeypatch, method, options):
    prompt = build_text_prompt(llama.tokenizer, CONTEXT, QUESTION)

    def run():
        policy = make_policy(method, budget=0.1, **options)
        out = generate(llama.model, prompt, policy, max_new_tokens=12)
        return out.tokens, out.cache.summary()["refresh"]

    original = Refresher.refresh_all

    def with_branching(flag):
        def refresh_all(items, scale):
            for r, *_ in items:
                r.branching = flag
            return original(items, scale)
        return staticmethod(refresh_all)

    monkeypatch.setattr(Refresher, "refresh_all", with_branching(False))  # the device path
    tokens, summary = run()
    assert 0 < summary["refreshes"] < summary["layer_steps"]  # some layer-steps fired, not all
    monkeypatch.setattr(Refresher, "refresh_all", with_branching(True))  # the host branch (CPU default)
    assert run() == (tokens, summary)


def test_only_the_moving_slots_are_re_selected_the_best_stay():
    prefill = layer()
    kv = make_policy("rcr", budget=0.25, refresh="periodic", refresh_period=1, refresh_slots=4).compress(prefill).kv
    r = kv.refresher
    assert r.resident.shape[1] == 4 and r.fixed.shape[1] > 0
    r.options = RefreshOptions(kind="periodic", period=1, slots=4, candidates=1000)  # every token a candidate
    fixed_rows = [kv.store.keys[int(r.slot_base[h]) + 4: int(r.slot_base[h]) + 4 + r.fixed.shape[1]].clone()
                  for h in range(2)]
    q = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(6))
    kv.attend(q, prefill.scale)
    span = r.host_k.shape[1]
    exact = torch.bmm(q, prefill.keys[:, :span].transpose(1, 2)).amax(dim=1)
    exact.scatter_(1, r.fixed, float("-inf"))  # fixed positions are never candidates
    want = exact.topk(4, dim=1).indices
    assert slot_positions(kv) == [set(row.tolist()) for row in want]
    for h in range(2):  # the fixed entries did not move
        rows = kv.store.keys[int(r.slot_base[h]) + 4: int(r.slot_base[h]) + 4 + r.fixed.shape[1]]
        assert torch.equal(rows, fixed_rows[h])
        torch.testing.assert_close(rows, prefill.keys[h, r.fixed[h].sort().values])


@pytest.mark.parametrize("options", [{}, {"refresh": "periodic", "refresh_period": 2}])
@pytest.mark.parametrize("branching", [True, False])
def test_refresh_all_is_each_refresher_alone(options, branching):
    """The torch path refreshes the refreshers of one geometry together (here two of three: the
    third holds more slots): exactly the slots, stores, counters and thresholds of each alone."""
    kvs = [make_policy("rcr", budget=b, **options).compress(layer(seed=s)).kv for s, b in ((0, .25), (1, .25), (2, .3))]
    for kv in kvs:
        kv.refresher.branching = branching
    alone = copy.deepcopy(kvs)
    g = torch.Generator().manual_seed(7)
    scale = 32 ** -0.5
    for _ in range(6):
        queries = [torch.randn(2, 2, 32, generator=g) for _ in kvs]
        Refresher.refresh_all([(kv.refresher, q, kv.store, None) for kv, q in zip(kvs, queries)], scale)
        for kv, q in zip(alone, queries):
            kv.refresher.refresh(q, kv.store, scale)
        for pair in zip(kvs, alone):
            new = torch.randn(2, 2, 1, 32, generator=g)
            for kv in pair:
                kv.append(*new)
    fired = [int(kv.refresher.refreshes) for kv in kvs]
    assert 0 < min(fired) and max(fired) < 6  # some steps fired, not all
    for a, b in zip(kvs, alone):
        for name in ("resident", "refreshes", "transferred", "key_reads", "clock"):
            assert torch.equal(getattr(a.refresher, name), getattr(b.refresher, name)), name
        assert torch.equal(a.refresher.controller.tau, b.refresher.controller.tau)
        assert torch.equal(a.store.keys, b.store.keys) and torch.equal(a.store.values, b.store.values)
