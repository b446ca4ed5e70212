"""hybridkv_kernels: torch references against definitions, dispatch, and the Triton suite.

The Triton-vs-reference cases live in ``test_kernel_triton.py``. The Triton interpreter only
works when ``TRITON_INTERPRET=1`` is set before triton is first imported (triton's own
``tl.zeros``/``tl.max``/``tl.sum`` are ``@jit`` functions built at import), and the rest of the
suite imports it early (transformers' Qwen2.5-VL module does). So
:func:`test_triton_kernels_under_interpreter` runs that file in a fresh pytest subprocess
with ``TRITON_INTERPRET=1``; when this process is itself interpreting (the variable was set
for the whole run) or has CUDA, the file runs in-process instead and the subprocess test skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hybridkv_kernels as hk
from hybridkv_kernels.testing import assert_close, ragged_store

ROOT = Path(__file__).resolve().parents[1]


def _store(lengths, d, dtype, gap=3, seed=0):
    return ragged_store(lengths, d, dtype, gap, seed)

def _attention_by_definition(q, keys, values, offsets, lengths, gen_k, gen_v, n_gen, scale):
    """Per query head, fp64 softmax over the explicit concatenation of its rows."""
    H, G, d = q.shape
    out = torch.zeros(H, G, d, dtype=torch.float64)
    for h in range(H):
        o, n = int(offsets[h]), int(lengths[h])
        k = torch.cat([keys[o:o + n], gen_k[h, :n_gen]]).double()
        v = torch.cat([values[o:o + n], gen_v[h, :n_gen]]).double()
        if k.shape[0] == 0:
            continue
        p = torch.softmax(q[h].double() @ k.T * scale, dim=-1)
        out[h] = p @ v
    return out


# --------------------------------------------------------------------------- decode attention


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float16, 5e-3),
                                        (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("G", [1, 2, 7])
@pytest.mark.parametrize("n_gen", [0, 5])
def test_ragged_attention_torch_matches_definition(dtype, rtol, G, n_gen):
    d = 32
    lengths = [1, 7, 0, 33, 130]
    keys, values, offsets, lens = _store(lengths, d, dtype)
    H = len(lengths)
    q = torch.randn(H, G, d).to(dtype)
    gen_k = torch.randn(H, 8, d).to(dtype)
    gen_v = torch.randn(H, 8, d).to(dtype)
    out = hk.ragged_decode_attention(q, keys, values, offsets, lens, gen_k, gen_v, n_gen,
                                     backend="torch")
    assert out.dtype == dtype and out.shape == (H, G, d)
    ref = _attention_by_definition(q, keys, values, offsets, lens, gen_k, gen_v, n_gen, d ** -0.5)
    assert_close(ref, out, rtol)
    if n_gen == 0:
        assert torch.count_nonzero(out[2]) == 0  # empty head -> zeros


def test_ragged_attention_scale_and_dense():
    H, G, N, d = 3, 2, 20, 16
    q, k, v = torch.randn(H, G, d), torch.randn(H, N, d), torch.randn(H, N, d)
    out = hk.dense_decode_attention(q, k, v, scale=0.3, backend="torch")
    ref = F.scaled_dot_product_attention(q[:, :, None], k[:, None], v[:, None], scale=0.3)[:, :, 0]
    assert_close(ref, out, 1e-5)


def test_ragged_attention_validates_shapes():
    q = torch.randn(2, 3, 16)
    keys = torch.randn(10, 16)
    with pytest.raises(ValueError):
        hk.ragged_decode_attention(q, keys, keys, torch.tensor([0]), torch.tensor([5]))
    with pytest.raises(ValueError):  # n_gen without generated tensors
        hk.ragged_decode_attention(q, keys, keys, torch.tensor([0, 5]), torch.tensor([5, 5]),
                                   n_gen=2)


@pytest.mark.parametrize("G,q_len", [(1, 4), (3, 5), (2, 1)])
def test_ragged_attention_chunk_is_each_position_by_definition(G, q_len):
    """A chunk of q_len positions (row g * q_len + t): position t attends the prompt rows and the
    generated rows before n_gen - q_len + 1 + t (its own and the earlier positions')."""
    d, n_gen = 16, 7
    lengths = [1, 7, 0, 33]
    keys, values, offsets, lens = _store(lengths, d, torch.float32)
    H = len(lengths)
    q = torch.randn(H, G * q_len, d)
    gen_k, gen_v = torch.randn(H, 9, d), torch.randn(H, 9, d)
    out = hk.ragged_decode_attention(q, keys, values, offsets, lens, gen_k, gen_v, n_gen, backend="torch",
                                     q_len=q_len).unflatten(1, (G, q_len))
    for t in range(q_len):
        ref = _attention_by_definition(q.unflatten(1, (G, q_len))[:, :, t], keys, values, offsets, lens, gen_k,
                                       gen_v, n_gen - q_len + 1 + t, d ** -0.5)
        assert_close(ref, out[:, :, t], 1e-5)
    with pytest.raises(ValueError, match="q_len"):  # rows not a multiple of the positions
        hk.ragged_decode_attention(q[:, :-1], keys, values, offsets, lens, gen_k, gen_v, n_gen, q_len=4)
    with pytest.raises(ValueError, match="q_len"):  # the chunk's own rows not appended
        hk.ragged_decode_attention(q, keys, values, offsets, lens, gen_k, gen_v, 3, q_len=4)


def _stores(shapes, d, n_gen_of, seed):
    """RaggedKVs of ``shapes`` (head lengths each), with 8 generated rows of which ``n_gen_of(i)`` count."""
    out = []
    for i, lengths in enumerate(shapes):
        keys, values, offsets, lens = _store(lengths, d, torch.float32, seed=seed + i)
        gen = torch.randn(2, len(lengths), 8, d, generator=torch.Generator().manual_seed(seed + i))
        out.append(hk.RaggedKV(keys, values, offsets, lens, gen[0], gen[1], n_gen_of(i), max(lengths)))
    return out


@pytest.mark.parametrize("copied", [True, False], ids=["padded-copy", "in-place"])
@pytest.mark.parametrize("n_gen", [0, 3])
def test_batched_attention_torch_is_each_store_alone(n_gen, copied, monkeypatch):
    """The torch path attends stores of one shape together (here two pairs, interleaved, one with an
    empty head), small stores from a padded copy of their heads and larger ones in place (here
    forced): exactly each store's output alone, and the reference's."""
    if not copied:
        monkeypatch.setattr(sys.modules["hybridkv_kernels.decode_attention_torch"], "COPIED_BYTES", 0)
    d, G = 16, 3
    stores = _stores([[5, 0, 9], [4, 7], [5, 0, 9], [4, 7], [2]], d, lambda i: n_gen if i < 4 else 1, 0)
    heads = [s.num_heads for s in stores]
    q = torch.randn(sum(heads), G, d)
    out = hk.batched_decode_attention(q, stores, scale=0.3, backend="torch")
    for part, got, s in zip(q.split(heads), out.split(heads), stores):
        assert torch.equal(got, hk.batched_decode_attention(part, [s], scale=0.3, backend="torch"))
        assert_close(hk.ragged_decode_attention_torch(part, *s[:7], scale=0.3), got, 1e-6)
    if n_gen == 0:
        assert torch.count_nonzero(out[1]) == 0  # empty head -> zeros


def test_split_heuristic():
    # long store, few heads: many splits, each a multiple of the block and covering the store
    s, length = hk.decode_split_heuristic(65536, 4, 64)
    assert s > 1 and length % 64 == 0 and s * length >= 65536 and (s - 1) * length < 65536
    # short store: never splits below 4 blocks per split
    s, length = hk.decode_split_heuristic(100, 4, 64)
    assert s == 1 and length >= 100


# --------------------------------------------------------------------------- chunk top-k


def _topk_by_sorting(scores, k):
    """Stable descending sort: ties keep ascending ids, so the lowest ids win."""
    kk = min(k, scores.shape[1])
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :kk]
    return order.sort(dim=1).values


@pytest.mark.parametrize("G", [1, 7])
@pytest.mark.parametrize("C,k", [(37, 5), (37, 37), (37, 100), (300, 64), (1, 4)])
def test_chunk_topk_torch(G, C, k):
    H, d = 3, 16
    q, lm = torch.randn(H, G, d), torch.randn(H, C, d)
    ids = hk.chunk_topk(q, lm, k, backend="torch")
    assert ids.dtype == torch.int64 and ids.shape == (H, min(k, C))
    scores = torch.einsum("hgd,hcd->hgc", q.double(), lm.double()).amax(1)
    assert torch.equal(ids, _topk_by_sorting(scores, k))
    assert_close(scores, hk.chunk_scores_torch(q, lm), 1e-6)


def test_chunk_topk_ties_lowest_id_wins():
    H, C, d = 2, 40, 16
    lm = torch.zeros(H, C, d)
    lm[:, [3, 10, 20, 30], 0] = 2.0  # four equal best chunks
    lm[:, [5, 6], 0] = -1.0  # below the zero-score ties
    q = torch.ones(H, 1, d)
    ids = hk.chunk_topk(q, lm, 6, backend="torch")
    assert ids.tolist() == [[0, 1, 3, 10, 20, 30]] * H
    lm[:, 0, 0] = -0.0  # -0.0 ties with +0.0
    assert hk.chunk_topk(q, lm, 6, backend="torch").tolist() == [[0, 1, 3, 10, 20, 30]] * H


def test_chunk_topk_int8_and_k0():
    H, G, C, d = 2, 3, 50, 16
    q = torch.randn(H, G, d)
    lm8 = torch.randint(-127, 128, (H, C, d), dtype=torch.int8)
    sc = torch.rand(H, C) * 0.02
    ids = hk.chunk_topk(q, lm8, 10, landmark_scale=sc, backend="torch")
    deq = lm8.float() * sc[..., None]
    assert torch.equal(ids, hk.chunk_topk(q, deq, 10, backend="torch"))
    assert hk.chunk_topk(q, lm8, 0, landmark_scale=sc, backend="torch").shape == (H, 0)
    with pytest.raises(ValueError):
        hk.chunk_topk(q, lm8, 3, backend="torch")  # int8 without a scale


# --------------------------------------------------------------------------- 2-bit keys


def test_pack_keys_round_trips_the_codes_and_bounds_the_error():
    """Every key is within half a step of its channel's grid, the grid's ends are the
    channel's min and max, and the packed bytes decode to the codes."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 50, 16, generator=g) * torch.linspace(0.1, 4, 16)  # channels of unequal spread
    codes, bounds = hk.pack_keys(keys)
    low, scale = bounds.unbind(1)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 4, 50) and codes.nbytes == 3 * 50 * 16 // 4
    approx = (low[:, :, None] + scale[:, :, None] * hk.unpack_codes(codes)).transpose(1, 2)
    assert (approx - keys).abs().le(scale[:, None] / 2 + 1e-6).all()
    assert torch.allclose(approx.amin(1), keys.amin(1)) and torch.allclose(approx.amax(1), keys.amax(1), atol=1e-6)
    with pytest.raises(ValueError, match="divisible by 4"):
        hk.pack_keys(torch.randn(1, 4, 6))


@pytest.mark.parametrize("G,P,chunk,k", [(1, 40, 1, 7), (3, 48, 2, 10), (7, 64, 16, 2), (3, 30, 3, 50)])
def test_quant_key_topk_torch_is_the_best_token_of_each_chunk(G, P, chunk, k):
    H, d = 2, 32
    g = torch.Generator().manual_seed(P)
    q, keys = torch.randn(H, G, d, generator=g), torch.randn(H, P, d, generator=g)
    codes, bounds = hk.pack_keys(keys)
    low, scale = bounds.unbind(1)
    approx = (low[:, :, None] + scale[:, :, None] * hk.unpack_codes(codes)).double()  # [H, d, P]
    logits = torch.einsum("hgd,hdp->hgp", q.double(), approx).amax(1)
    want = logits.unflatten(1, (-1, chunk)).amax(2)
    assert_close(want, hk.quant_key_scores_torch(q, codes, bounds, chunk), 1e-5)
    ids = hk.quant_key_topk(q, codes, bounds, chunk, k, backend="torch")
    assert torch.equal(ids, _topk_by_sorting(want, k))


def test_quant_key_topk_finds_one_matching_token_that_a_mean_hides():
    """One key aligned with the query inside a chunk of 16 noise keys wins by its own logit."""
    H, d, chunk = 1, 64, 16
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(H, 20 * chunk, d, generator=g)
    q = torch.randn(H, 1, d, generator=g)
    keys[0, 7 * chunk + 5] = 3 * q[0, 0] / q[0, 0].norm() * 8  # one strong token in chunk 7
    codes, bounds = hk.pack_keys(keys)
    assert hk.quant_key_topk(q, codes, bounds, chunk, 1, backend="torch").tolist() == [[7]]


# --------------------------------------------------------------------------- chunk gather


def _gather_fixture(dtype=torch.float32, H=3, C=13, c=8, d=16, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    host_k = torch.randn(H, C, c, d, generator=g).to(dtype)
    host_v = torch.randn(H, C, c, d, generator=g).to(dtype)
    slot_base = torch.tensor([4 + i * (n * c + 7) for i in range(H)])  # gaps between heads
    T = int(slot_base[-1]) + n * c + 5
    store_k = torch.zeros(T, d, dtype=dtype)
    store_v = torch.zeros(T, d, dtype=dtype)
    resident = torch.full((H, n), -1, dtype=torch.int64)
    return host_k, host_v, store_k, store_v, slot_base, resident


def _check_slots(host_k, host_v, store_k, store_v, slot_base, resident, want):
    H, n = resident.shape
    c = host_k.shape[2]
    for i in range(H):
        assert sorted(resident[i].tolist()) == sorted(want[i].tolist())
        for s in range(n):
            r = int(slot_base[i]) + s * c
            assert torch.equal(store_k[r:r + c], host_k[i, resident[i, s]])
            assert torch.equal(store_v[r:r + c], host_v[i, resident[i, s]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_gather_torch_hits_misses_bytes(dtype):
    hk_, hv_, sk, sv, base, res = _gather_fixture(dtype)
    H, C, c, d = hk_.shape
    n = res.shape[1]
    per_chunk = c * d * 2 * hk_.element_size()
    want = torch.stack([torch.randperm(C, generator=torch.Generator().manual_seed(i))[:n]
                        for i in range(H)])
    assert hk.chunk_gather(hk_, hv_, sk, sv, base, res, want, backend="torch") == H * n * per_chunk
    _check_slots(hk_, hv_, sk, sv, base, res, want)
    # same set, another order: all hits, nothing moves, nothing changes
    before = (sk.clone(), res.clone())
    assert hk.chunk_gather(hk_, hv_, sk, sv, base, res, want.flip(1), backend="torch") == 0
    assert torch.equal(sk, before[0]) and torch.equal(res, before[1])
    # two new chunks per head: only they move, into the two freed slots
    want2 = want.clone()
    for i in range(H):
        fresh = [x for x in range(C) if x not in want[i].tolist()][:2]
        want2[i, 1], want2[i, 3] = fresh[0], fresh[1]
    kept = torch.stack([torch.isin(res[i], want2[i]) for i in range(H)])
    snapshot = res.clone()
    assert hk.chunk_gather(hk_, hv_, sk, sv, base, res, want2, backend="torch") == 2 * H * per_chunk
    assert torch.equal(res[kept], snapshot[kept])  # hits stay in their slots
    _check_slots(hk_, hv_, sk, sv, base, res, want2)


def test_gather_plan_pairs_free_slots_in_order():
    resident = torch.tensor([[4, -1, 7, 2]])
    want = torch.tensor([[9, 2, 8, 4]])
    # slot 0 (4) and 3 (2) are hits; free slots 1, 2 get the missing ids 9, 8 in want order
    assert hk.gather_plan(resident, want, 10).tolist() == [[-1, 9, 8, -1]]


def test_gather_plan_matches_its_definition_on_random_slots():
    """The plan as its docstring defines it, one head at a time in plain Python: the free slots
    (empty, or holding an unwanted chunk), in slot order, get the wanted ids not resident, in want order."""
    g = torch.Generator().manual_seed(5)
    for _ in range(300):
        chunks = int(torch.randint(1, 30, (1,), generator=g))
        heads, slots = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, chunks + 1, (1,), generator=g))
        resident = torch.stack([torch.randperm(chunks, generator=g)[:slots] for _ in range(heads)])
        resident[torch.rand(heads, slots, generator=g) < 0.3] = -1
        want = torch.stack([torch.randperm(chunks, generator=g)[:slots] for _ in range(heads)])
        expect = []
        for res, wanted in zip(resident.tolist(), want.tolist()):
            missing = iter([w for w in wanted if w not in res])
            expect.append([-1 if r in wanted else next(missing) for r in res])
        assert hk.gather_plan(resident, want, chunks).tolist() == expect


def _part(heads, chunks, chunk, slots, d, seed, two_bit):
    """One sequence's dynamic heads for ``chunk_retrieve``: half their slots already hold a chunk."""
    g = torch.Generator().manual_seed(seed)
    host_k, host_v = torch.randn(2, heads, chunks, chunk, d, generator=g)
    if two_bit:
        codes, scale = hk.pack_keys(host_k.flatten(1, 2))
    else:
        codes = torch.randint(-127, 128, (heads, chunks, d), generator=g, dtype=torch.int8)
        scale = torch.rand(heads, chunks, generator=g) + 0.5
    store = torch.zeros(heads * (slots * chunk + 3) + 2, d)
    resident = torch.stack([torch.randperm(chunks, generator=g)[:slots] for _ in range(heads)])
    resident[:, slots // 2:] = -1
    return hk.RetrievalPart(codes, scale, host_k, host_v, store, store.clone(),
                            torch.arange(heads) * (slots * chunk + 3) + 2, resident, torch.zeros((), dtype=torch.long))


@pytest.mark.parametrize("two_bit,swaps,stickiness,read", [(False, 0, 0.0, 0), (True, 0, 0.0, 0), (True, 2, 0.0, 0),
                                                          (True, 0, 1.0, 0), (True, 0, 0.0, 96)])
def test_chunk_retrieve_torch_is_each_part_alone(two_bit, swaps, stickiness, read):
    """The torch path ranks and plans parts of one geometry together (here two of three, with
    different head counts): exactly the slots, resident ids and byte counts of each part alone
    (``read``: host bytes each head's ranking reads a step, as host keys do, counted too)."""
    d, G = 16, 3
    parts = [_part(2, 24, 4, 6, d, 0, two_bit), _part(1, 30, 2, 5, d, 1, two_bit), _part(3, 24, 4, 6, d, 2, two_bit)]
    parts = [p._replace(read=read) for p in parts]
    alone = [p._replace(**{f: t.clone() for f, t in p._asdict().items() if torch.is_tensor(t)}) for p in parts]
    q = torch.randn(6, G, d)
    for step in range(2):  # the second step keeps the hits of the first
        hk.chunk_retrieve(list(torch.split(q * (step + 1), [2, 1, 3])), parts, backend="torch", swaps=swaps,
                          stickiness=stickiness)
        for p, rows in zip(alone, torch.split(q * (step + 1), [2, 1, 3])):
            n, chunk = p.resident.shape[1], p.host_k.shape[2]
            want = (hk.quant_key_topk(rows, p.landmarks, p.landmark_scale, chunk, n, "torch", resident=p.resident,
                                      swaps=swaps, stickiness=stickiness) if two_bit
                    else hk.chunk_topk(rows, p.landmarks, n, landmark_scale=p.landmark_scale, backend="torch"))
            hk.chunk_gather(p.host_k, p.host_v, p.store_k, p.store_v, p.slot_base, p.resident, want, "torch", p.moved)
            p.moved.add_(read * p.resident.shape[0])
        for a, b in zip(parts, alone):
            assert torch.equal(a.resident, b.resident) and int(a.moved) == int(b.moved) > 0
            assert torch.equal(a.store_k, b.store_k) and torch.equal(a.store_v, b.store_v)


@pytest.mark.parametrize("chunk", [1, 4])
def test_copies_of_one_prefix_rank_and_copy_from_its_tensors_once_as_each_alone(chunk):
    """Parts whose 2-bit codes and host KV are one prefix's tensors (the questions or members of
    one kept prefix) are ranked from those codes unpacked once and their missing rows gathered
    from the host once: the same scores bit for bit as each part alone, and the same slots,
    resident ids and byte counts."""
    d, G, heads = 16, 3, 2
    first = _part(heads, 24 // chunk, chunk, 6, d, 0, True)
    parts = [first] + [_part(heads, 24 // chunk, chunk, 6, d, seed, True)._replace(
        landmarks=first.landmarks, landmark_scale=first.landmark_scale, host_k=first.host_k, host_v=first.host_v)
        for seed in (1, 2)]
    alone = [p._replace(**{f: t.clone() for f, t in p._asdict().items() if torch.is_tensor(t)}) for p in parts]
    q = torch.randn(3 * heads, G, d)
    shared = hk.quant_key_scores_torch(q, first.landmarks, first.landmark_scale, chunk)
    assert torch.equal(shared, torch.cat([hk.quant_key_scores_torch(rows, first.landmarks, first.landmark_scale, chunk)
                                          for rows in q.split(heads)]))
    hk.chunk_retrieve(list(q.split(heads)), parts, backend="torch")
    for p, rows in zip(alone, q.split(heads)):
        want = hk.quant_key_topk(rows, p.landmarks, p.landmark_scale, chunk, p.resident.shape[1], "torch")
        hk.chunk_gather(p.host_k, p.host_v, p.store_k, p.store_v, p.slot_base, p.resident, want, "torch", p.moved)
    for a, b in zip(parts, alone):
        assert torch.equal(a.resident, b.resident) and int(a.moved) == int(b.moved) > 0
        assert torch.equal(a.store_k, b.store_k) and torch.equal(a.store_v, b.store_v)
    with pytest.raises(ValueError, match="codes must be"):
        hk.quant_key_scores_torch(q[:5], first.landmarks, first.landmark_scale, chunk)  # not whole groups of heads


@pytest.mark.parametrize("limit", [1, 3, 7])
def test_a_capped_selection_is_the_best_of_the_held_and_the_limit_best_others(limit):
    """``cap_scores`` + top-k: the top ``n`` of the held chunks and the ``limit`` best others (so at
    most ``limit`` new), checked against a brute-force choice; a row with an empty slot is not capped."""
    g = torch.Generator().manual_seed(limit)
    rows, chunks, n = 5, 40, 8
    scores = torch.randn(rows, chunks, generator=g)
    resident = torch.stack([torch.randperm(chunks, generator=g)[:n] for _ in range(rows)])
    resident[4, 3] = -1
    want = hk.quant_keys._topk_ids_from_scores(hk.cap_scores(scores, resident, limit), n)
    for r in range(rows):
        held = set(resident[r].tolist()) - {-1}
        others = sorted(set(range(chunks)) - held, key=lambda c: -scores[r, c])
        pool = list(held) + (others if r == 4 else others[:limit])
        expected = sorted(sorted(pool, key=lambda c: -scores[r, c])[:n])
        assert want[r].tolist() == expected
        assert r == 4 or len(set(expected) - held) <= limit


def test_stickiness_lets_a_newcomer_in_only_when_it_beats_a_held_chunk_by_the_margin():
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.9, 1.0]])
    resident = torch.tensor([[0, 3]])  # holds 5.0 and 2.9
    pick = lambda bonus: hk.quant_keys._topk_ids_from_scores(hk.cap_scores(scores, resident, 0, bonus), 2).tolist()
    assert pick(0.0) == [[0, 1]]  # 4.0 displaces 2.9
    assert pick(0.5) == [[0, 1]]  # 4.0 > 2.9 + 0.5
    assert pick(1.5) == [[0, 3]]  # 4.0 < 2.9 + 1.5: the held chunk stays


# --------------------------------------------------------------------------- window scores


def _window_by_definition(q_win, k, scale):
    H, G, w, d = q_win.shape
    N = k.shape[1]
    attn = torch.zeros(H, N, dtype=torch.float64)
    for i in range(w):
        pos = N - w + i
        s = torch.einsum("hgd,hnd->hgn", q_win[:, :, i].double(), k[:, :pos + 1].double()) * scale
        attn[:, :pos + 1] += torch.softmax(s, -1).sum(1)
    return attn / (G * w)


@pytest.mark.parametrize("G,w,N", [(1, 4, 4), (2, 5, 33), (7, 8, 130)])
def test_window_scores(G, w, N):
    H, d = 3, 16
    q_win, k = torch.randn(H, G, w, d), torch.randn(H, N, d)
    attn, pooled = hk.window_scores(q_win, k)
    ref = _window_by_definition(q_win, k, d ** -0.5)
    assert_close(ref, attn, 1e-5)
    assert torch.allclose(attn.sum(-1), torch.ones(H), atol=1e-5)
    assert torch.equal(pooled, F.max_pool1d(attn[:, None], 7, 1, 3)[:, 0])
    # bf16 inputs are scored in fp32 (not rounded to bf16 before the exp)
    attn2, _ = hk.window_scores(q_win.bfloat16(), k.bfloat16(), scale=0.1)
    assert_close(_window_by_definition(q_win.bfloat16(), k.bfloat16(), 0.1), attn2, 1e-5)


# --------------------------------------------------------------------------- dispatch


def test_dispatch_rules():
    x = torch.zeros(1)
    assert hk.resolve_backend("torch", x) == "torch"
    with pytest.raises(ValueError):
        hk.resolve_backend("cuda", x)
    if not hk.HAS_TRITON:
        assert hk.resolve_backend("auto", x) == "torch"
        return
    if hk.triton_interpreting():
        assert hk.resolve_backend("triton", x) == "triton"
    elif not os.environ.get("TRITON_INTERPRET") == "1":
        assert hk.resolve_backend("auto", x) == "torch"
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            hk.resolve_backend("triton", x)


def _run(args, env_extra, timeout, cwd=ROOT):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, timeout=timeout,
                          capture_output=True, text=True)


def test_import_without_triton_and_no_toplevel_kernels(tmp_path):
    """Outside the repo: the installed package is ``hybridkv_kernels`` only (no top-level
    ``kernels``), and imports and runs its torch paths with triton missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import importlib.util, torch, hybridkv_kernels as hk\n"
        "spec = importlib.util.find_spec('kernels')\n"
        f"assert spec is None or not str(spec.origin).startswith({str(ROOT)!r}), spec\n"
        f"assert hk.__file__.startswith({str(ROOT / 'hybridkv_kernels')!r}), hk.__file__\n"
        "assert not hk.HAS_TRITON\n"
        "q = torch.randn(2, 3, 16); kv = torch.randn(10, 16)\n"
        "o = hk.ragged_decode_attention(q, kv, kv, torch.tensor([0, 5]), torch.tensor([5, 5]))\n"
        "assert o.shape == (2, 3, 16)\n"
        "print(hk.chunk_topk(q, torch.randn(2, 9, 16), 4).shape)\n"
    )
    r = _run(["-c", code], {"TRITON_INTERPRET": "1"}, 120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_triton_kernels_under_interpreter():
    """Run test_kernel_triton.py in a fresh process with TRITON_INTERPRET=1 (module docstring)."""
    if not hk.HAS_TRITON:
        pytest.skip("triton not installed")
    if hk.triton_interpreting() or torch.cuda.is_available():
        pytest.skip("test_kernel_triton.py runs in this process")
    r = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
              str(ROOT / "tests" / "test_kernel_triton.py")], {"TRITON_INTERPRET": "1"}, 600)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    last = r.stdout.strip().splitlines()[-1]
    assert "passed" in last and "skipped" not in last and "failed" not in last, tail


# --------------------------------------------------------------------------- compile for sm_90

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "i8",
       torch.int64: "i64"}


def _compile_sm90(kernel, args: dict, constexprs: dict, num_warps=4):
    """Compile a kernel for sm_90 without a GPU, specialised like a JIT launch: tensors are
    16-byte aligned and ints divisible by 16 get the divisibility hint. Returns (kernel, ptxas
    -v report)."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, torch.dtype):
            sig[name] = "*" + _TY[v]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        r = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                           capture_output=True, text=True)
    return compiled, r.stderr


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills():
    """The interpreter does not type-check like the compiler: compile every kernel for an
    H100/H200 (no GPU needed) at 7B geometry and check the decode kernel does not spill."""
    if not hk.HAS_TRITON or hk.triton_interpreting():
        pytest.skip("needs triton in compiled mode")
    from hybridkv_kernels.dispatch import load_triton_module

    bf16, i64, f32 = torch.bfloat16, torch.int64, torch.float32
    dec = load_triton_module("_decode_attention_triton")
    # table: a batch's segments; counted: their generated-row counts read on the device
    for dt, table, counted in ((bf16, False, False), (torch.float16, False, False), (bf16, True, False),
                               (bf16, True, True)):
        _, report = _compile_sm90(dec.ragged_decode_stage1_kernel, dict(
            Q=dt, K=dt, V=dt, GK=dt, GV=dt, OFF=i64, LEN=i64, SEG=i64, O_PART=f32, LSE_PART=f32,
            n_gen=7, split_len=1024, qk_scale=0.1, G=7, D=128, stride_qh=896, stride_qg=128,
            stride_kt=128, stride_vt=128, stride_gkh=32768, stride_gkt=128, stride_gvh=32768,
            stride_gvt=128, stride_oh=57344, stride_os=896, stride_og=128, stride_lh=448,
            stride_ls=7), dict(BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, UPCAST=False, PREC="tf32", TABLE=table,
                             COUNTS=counted))
        assert " 0 bytes spill stores" in report, report
    _compile_sm90(dec.merge_splits_kernel, dict(
        O_PART=f32, LSE_PART=f32, OUT=bf16, S=64, D=128, stride_oh=57344, stride_os=896,
        stride_og=128, stride_lh=448, stride_ls=7, stride_outh=896, stride_outg=128),
        dict(BLOCK_S=64, BLOCK_D=128))
    top = load_triton_module("_chunk_topk_triton")
    gat = load_triton_module("_chunk_gather_triton")
    for table in (False, True):  # table: the rows of several sequences (chunk_retrieve)
        for lm_dt, has_scale in ((torch.int8, True), (bf16, False)):
            _compile_sm90(top.chunk_scores_kernel, dict(
                Q=bf16, LM=lm_dt, LM_SCALE=f32, SCORES=f32, TAB=i64, G=7, C=8188, D=128, stride_qh=896,
                stride_qg=128, stride_lh=8188 * 128, stride_lc=128, stride_sch=8188, stride_sh=8188),
                dict(HAS_SCALE=has_scale, BLOCK_G=16, BLOCK_C=64, BLOCK_D=128, TABLE=table))
        _compile_sm90(top.topk_select_kernel, dict(SCORES=f32, OUT=i64, TAB=i64, C=8188, K=512,
                                                   stride_sh=8188, stride_oh=512), dict(BLOCK=1024, TABLE=table))
        _compile_sm90(gat.gather_plan_kernel, dict(
            RESIDENT=i64, WANT=i64, ASSIGN=i64, MOVED=i64, TAB=i64, n=512, chunk_bytes=4096, read=131072, stride_rh=512,
            stride_wh=512, stride_ah=512), dict(BLOCK_N=64, BLOCK_J=64, TABLE=table))
        _compile_sm90(gat.chunk_gather_kernel, dict(
            HK=bf16, HV=bf16, SK=bf16, SV=bf16, SLOT_BASE=i64, ASSIGN=i64, TAB=i64, c=8, D=128,
            stride_hkh=8188 * 1024, stride_hkc=1024, stride_hkt=128, stride_hvh=8188 * 1024,
            stride_hvc=1024, stride_hvt=128, stride_skt=128, stride_svt=128, stride_ah=512),
            dict(BLOCK_T=8, BLOCK_D=128, TABLE=table))


@pytest.mark.parametrize("tokens", [1, 127, 128, 300])
def test_code_rows_start_on_whole_lines(tokens):
    """``pack_keys`` pads each code row to a multiple of 128 bytes (zeros after the tokens), so a
    kernel's tile of a row in host memory is whole lines; the codes read as the unpadded ones."""
    keys = torch.randn(3, tokens, 16, generator=torch.Generator().manual_seed(tokens))
    codes, bounds = hk.pack_keys(keys)
    assert codes.shape == (3, 4, tokens) and codes.stride() == (4 * hk.code_row(tokens), hk.code_row(tokens), 1)
    assert hk.code_row(tokens) % 128 == 0 and hk.code_row(tokens) - tokens < 128
    padded = codes.as_strided((3, 4, hk.code_row(tokens)), codes.stride())
    assert not padded[:, :, tokens:].any()
    q = torch.randn(3, 2, 16)
    assert torch.equal(hk.quant_key_scores_torch(q, codes, bounds, 1),
                       hk.quant_key_scores_torch(q, codes.contiguous(), bounds, 1))
