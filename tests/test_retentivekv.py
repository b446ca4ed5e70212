"""``retentivekv``: the group plan, entropy-weighted state entries, reactivation from the host."""

from __future__ import annotations

import pytest
import torch

from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.compression.retentivekv import RetentiveKV, plan_groups
from hybridkv_cli.compression.scoring import window_attention


@pytest.mark.parametrize("n,entries,window", [(1000, 100, 32), (16384, 1638, 32), (600, 60, 30), (200, 20, 10)])
def test_plan_fills_the_budget_and_covers_every_evicted_token(n, entries, window):
    kept, states, group = plan_groups(n, entries, window)
    assert window + kept + states + group == entries
    evicted = n - window - kept
    assert states * max(group, 1) >= evicted or group == 0
    if group:
        assert states == -(-evicted // group)  # ceil: every evicted token in exactly one group


def layer(n=400, heads=2, dim=16, seed=0) -> PrefillLayer:
    g = torch.Generator().manual_seed(seed)
    return PrefillLayer(index=0, num_layers=1, query=torch.randn(heads, 2, n, dim, generator=g),
                        keys=torch.randn(heads, n, dim, generator=g), values=torch.randn(heads, n, dim, generator=g),
                        visual=torch.ones(n, dtype=torch.bool), scale=dim ** -0.5)


def test_states_are_entropy_weighted_means_of_their_groups():
    pre = layer()
    kv, report = RetentiveKV(budget=0.2, window=8).compress(pre)
    attn, _, _ = window_attention(pre, 8)
    host_k, host_v = kv.host_k, kv.host_v
    heads, states, group = host_k.shape[:3]
    assert report == {"kept": report["kept"], "states": states, "group": group} and group > 1
    h, s = 1, 3  # a full group (not the padded last one)
    rows = kv.state_rows[h, s]
    # which positions form the group: match the host copy's keys against the prompt's
    positions = [int((pre.keys[h] == host_k[h, s, i]).all(dim=1).nonzero()) for i in range(group)]
    p = attn[h, positions]
    w = -p * torch.log(p) + 1e-9
    w = w / w.sum()
    torch.testing.assert_close(kv.store.keys[rows], (w[:, None] * pre.keys[h, positions]).sum(0))
    torch.testing.assert_close(kv.store.values[rows], (w[:, None] * pre.values[h, positions]).sum(0))


def test_the_group_whose_state_ranks_first_is_reactivated():
    pre = layer()
    kv, _ = RetentiveKV(budget=0.2, window=8).compress(pre)
    heads, states, group = kv.host_k.shape[:3]
    query = torch.randn(heads, 2, 16, generator=torch.Generator().manual_seed(3))
    state_keys = kv.store.keys[kv.state_rows]  # [H, S, d]
    expected = torch.einsum("hgd,hsd->hgs", query, state_keys).amax(dim=1).argmax(dim=1)
    kv.attend(query, pre.scale)
    assert kv.resident.flatten().tolist() == expected.tolist()
    for h in range(heads):
        base = int(kv.slot_base[h])
        assert torch.equal(kv.store.keys[base:base + group], kv.host_k[h, int(expected[h])])
    assert kv.transferred_bytes() == heads * group * 16 * 2 * 4
    kv.attend(query, pre.scale)  # the same group again: nothing moves
    assert kv.transferred_bytes() == heads * group * 16 * 2 * 4


def test_a_budget_without_room_for_a_group_keeps_states_only():
    pre = layer(n=400)
    kv, report = RetentiveKV(budget=0.05, window=4).compress(pre)  # 20 entries a head minus indices
    assert report["states"] > 0
    assert kv.resident is None or report["group"] > 0
