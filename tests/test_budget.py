"""The budget holds at every prompt length: device-resident prompt KV <= b x full (+0.01).

Every registered method that saves memory (``full`` and ``quest`` keep the whole cache on the
device by design), and HybridKV's variants, compress constructed layers of a small GQA geometry
(3 KV heads of dimension 64, as SmolLM2) at N = 200, 600 and 4.5k. Landmarks, detectors,
indices and rounding are all in ``device_bytes``.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.compression.base import PrefillLayer
from method_options import needed

FULL_BY_DESIGN = {"full", "quest"}
VARIANTS = [(name, needed(name)) for name in sorted(set(METHODS) - FULL_BY_DESIGN)] + [
    ("hybridkv", {"refresh": "rcr"}),
    ("hybridkv", {"landmark": "detector"}),
    ("hybridkv", {"landmark": "minmax"}),
    ("hybridkv", {"landmark": "mean"}),
    ("hybridkv", {"theta": 1.0}),  # every head dynamic
    ("hybridkv", {"theta": 0.0, "refresh": "rcr"}),  # every head static, refreshed
    ("rcr", {"refresh": "periodic"}),
]
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
@pytest.mark.parametrize("name,options", [("hybridkv", {}), ("hybridkv", {"theta": 1.0})], ids=lambda v: str(v))
def test_bf16_side_structures_stay_within_budget(name, options, n):
    """In bf16 a side structure costs twice its fp32 share of the cache (2-bit keys: 1/16 of a
    head's KV); the budget still holds."""
    prefill = layer(n, dtype=torch.bfloat16)
    kv = make_policy(name, budget=0.1, **options).compress(prefill).kv
    full = prefill.keys.nbytes + prefill.values.nbytes
    assert kv.device_bytes() <= (0.1 + TOLERANCE) * full, kv.device_bytes() / full


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
