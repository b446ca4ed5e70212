"""The budget holds at every prompt length: device-resident prompt KV <= b x full (+0.01).

Every registered method that saves memory (``full`` and ``quest`` keep the whole cache on the
device by design), and HybridKV's variants, compress constructed layers of a small GQA geometry
(3 KV heads of dimension 64, as SmolLM2) at N = 200, 600 and 4.5k. Landmarks, detectors,
indices and rounding are all in ``device_bytes``. At b = 1 every method, ``quest`` included,
keeps exactly the full cache: every entry, no side structure, nothing on the host. The
:class:`~hybridkv_cli.compression.budget.Budget` arithmetic is checked on its own first.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.compression.budget import STORE_INDEX_BYTES_PER_HEAD, Budget
from method_options import needed

FULL_BY_DESIGN = {"full", "quest"}
HYBRID_VARIANTS = [
    ("hybridkv", {"refresh": "rcr"}),
    ("hybridkv", {"landmark": "detector"}),
    ("hybridkv", {"landmark": "minmax"}),
    ("hybridkv", {"landmark": "mean"}),
    ("hybridkv", {"landmark": "labels"}),
    ("hybridkv", {"landmark": "host-keys"}),
    ("hybridkv", {"theta": 1.0}),  # every head dynamic
    ("hybridkv", {"theta": 0.0, "refresh": "rcr"}),  # every head static, refreshed
    ("rcr", {"refresh": "periodic"}),
]
VARIANTS = [(name, needed(name)) for name in sorted(set(METHODS) - FULL_BY_DESIGN)] + HYBRID_VARIANTS
AT_ONE = [(name, needed(name)) for name in sorted(METHODS)] + HYBRID_VARIANTS
TOLERANCE = 0.01


def layer(n: int, heads=3, group=3, dim=64, seed=0, dtype=torch.float32) -> PrefillLayer:
    g = torch.Generator().manual_seed(seed)
    visual = torch.zeros(n, dtype=torch.bool)
    visual[8 : n - 24] = True
    keys = torch.randn(heads, n, dim, generator=g)
    keys[0, :4] *= 6  # a sink-like head
    return PrefillLayer(index=0, num_layers=1, query=torch.randn(heads, group, n, dim, generator=g).to(dtype),
                        keys=keys.to(dtype), values=torch.randn(heads, n, dim, generator=g).to(dtype), visual=visual,
                        scale=dim**-0.5)


@pytest.mark.parametrize("n", [200, 600, 4500])
@pytest.mark.parametrize("budget", [0.05, 0.1, 0.2])
@pytest.mark.parametrize("name,options", VARIANTS, ids=lambda v: str(v))
def test_prompt_kv_within_budget(name, options, budget, n):
    prefill = layer(n)
    kv = make_policy(name, budget=budget, **options).compress(prefill).kv
    full = prefill.keys.nbytes + prefill.values.nbytes
    assert kv.device_bytes() <= (budget + TOLERANCE) * full, kv.device_bytes() / full


@pytest.mark.parametrize("n", [200, 600, 4500])
@pytest.mark.parametrize("name,options", [("hybridkv", {}), ("hybridkv", {"theta": 1.0}),
                                          ("hybridkv", {"theta": 1.0, "landmark": "labels"}),
                                          ("hybridkv", {"theta": 1.0, "landmark": "host-keys"})], ids=lambda v: str(v))
@pytest.mark.parametrize("budget", [0.05, 0.1])
def test_bf16_side_structures_stay_within_budget(name, options, budget, n):
    """In bf16 a side structure costs twice its fp32 share of the cache (2-bit keys: 1/16 of a
    head's KV); the budget still holds."""
    prefill = layer(n, dtype=torch.bfloat16)
    kv = make_policy(name, budget=budget, **options).compress(prefill).kv
    full = prefill.keys.nbytes + prefill.values.nbytes
    assert kv.device_bytes() <= (budget + TOLERANCE) * full, kv.device_bytes() / full


@pytest.mark.parametrize("name,options", VARIANTS, ids=lambda v: str(v))
def test_decoding_stays_within_budget_plus_generated_block(name, options):
    """Decode steps (retrieval, refresh) never grow the prompt part of the device KV."""
    prefill = layer(600)
    kv = make_policy(name, budget=0.1, **options).compress(prefill).kv
    after_prefill = kv.device_bytes()
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        kv.attend(torch.randn(3, 3, 64, generator=g), 0.125)
        kv.append(torch.randn(3, 1, 64, generator=g), torch.randn(3, 1, 64, generator=g))
    generated_block = 2 * 3 * 16 * 64 * 4  # one 16-row block of generated K and V per head
    assert kv.device_bytes() <= after_prefill + generated_block


# ----------------------------------------------------------------------------------------------
# the Budget arithmetic
# ----------------------------------------------------------------------------------------------


def test_budget_of_a_layer_reads_its_geometry():
    assert Budget.of(0.1, layer(200)) == Budget(0.1, length=200, heads=3, entry_bytes=2 * 64 * 4)
    assert Budget.of(0.1, layer(200, dtype=torch.bfloat16)).entry_bytes == 2 * 64 * 2


def test_entries_pay_the_store_index_and_side_structures():
    budget = Budget(0.1, length=1000, heads=4, entry_bytes=100)  # b·N·H = 400 entries, 40 000 bytes
    index = STORE_INDEX_BYTES_PER_HEAD * 4  # 64 bytes: one entry's worth
    assert budget.entries() == (40_000 - index) // 100 == 399
    assert budget.entries(1000) == (40_000 - 1000 - index) // 100 == 389
    assert budget.entries(40_000) == 0  # the side structures alone exceed the budget
    assert budget.per_head == 100 and budget.head_entries == 100 and budget.pool == 400


def test_below_one_the_index_is_paid_and_uniform_heads_round():
    assert Budget(0.999, length=10, heads=2, entry_bytes=100_000).entries() == 19  # b·N·H = 19.98
    assert Budget(0.96, length=10, heads=1, entry_bytes=10).head_entries == 10  # round(9.6), within N


def test_window_is_at_most_half_a_head():
    budget = Budget(0.1, length=1000, heads=4, entry_bytes=100)
    assert budget.window(32) == 32  # b·N = 100 entries afford the whole window
    assert budget.window(32, entries=40) == 20
    assert budget.window(32, entries=1) == 0
    assert budget.window(16, entries=0) == 0


def test_budget_one_keeps_everything_and_prices_nothing():
    budget = Budget(1.0, length=50, heads=3, entry_bytes=100)
    assert budget.full and not Budget(0.99, length=50, heads=3, entry_bytes=100).full
    assert budget.entries() == budget.entries(10**9) == 150  # side structures are never needed
    assert budget.window(32) == budget.window(32, entries=1) == 32  # the whole window, not half a head
    assert Budget(1.0, length=20, heads=3, entry_bytes=100).window(32) == 20  # within the prompt
    assert budget.head_entries == 50 and budget.pool == 150
    assert budget.counts().tolist() == budget.counts(50).tolist() == [50, 50, 50]


# ----------------------------------------------------------------------------------------------
# every method at b = 1: the full cache, exactly
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [40, 600])
@pytest.mark.parametrize("name,options", AT_ONE, ids=lambda v: str(v))
def test_budget_one_keeps_the_full_cache_on_the_device(name, options, n):
    """Every entry on the device, nothing beside it but the store's index (16 bytes a head, as
    the ``full`` method's own store), nothing on the host and nothing moved while decoding; the
    attention is the full cache's, bit for bit."""
    prefill = layer(n)
    kv = make_policy(name, budget=1.0, **options).compress(prefill).kv
    reference = make_policy("full").compress(prefill).kv
    full = prefill.keys.nbytes + prefill.values.nbytes
    assert kv.device_bytes() <= full + STORE_INDEX_BYTES_PER_HEAD * prefill.num_heads
    assert kv.device_bytes() == reference.device_bytes()
    assert kv.store.entries() == n * prefill.num_heads and kv.host_bytes() == 0
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        q = torch.randn(3, 3, 64, generator=g)
        assert torch.equal(kv.attend(q, 0.125), reference.attend(q, 0.125))
        k, v = torch.randn(3, 1, 64, generator=g), torch.randn(3, 1, 64, generator=g)
        kv.append(k, v)
        reference.append(k, v)
    assert kv.transferred_bytes() == 0


def test_hybridkv_at_budget_one_makes_every_head_static():
    """Before, every dynamic head kept its prompt twice (store and host) and ranked it by
    landmarks on the device (1.047x the full KV at N = 600): now no head is offloaded."""
    compressed = make_policy("hybridkv", budget=1.0).compress(layer(600))
    assert compressed.kv.dynamic is None and compressed.kv.refresher is None
    assert bool(compressed.report.plan.static.all()) and (compressed.report.plan.entries == 600).all()

