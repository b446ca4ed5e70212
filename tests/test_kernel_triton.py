"""Triton kernels against their torch references.

Runs under the Triton interpreter on CPU (``TRITON_INTERPRET=1`` must be set before triton is
first imported; ``test_kernels.py::test_triton_kernels_under_interpreter`` starts this file in
such a subprocess) or compiled when CUDA is available. Shapes are small: the interpreter is
~100x slower than torch. Block sizes and split counts are forced small so that several blocks,
splits and partial blocks are exercised.
"""

from __future__ import annotations

import pytest
import torch

import hybridkv_kernels as hk
from hybridkv_kernels.testing import assert_close, ragged_store

if not hk.HAS_TRITON:
    pytest.skip("triton not installed", allow_module_level=True)
INTERPRET = hk.triton_interpreting()
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 before triton is imported (run by "
                "test_kernels.py::test_triton_kernels_under_interpreter)", allow_module_level=True)

DEV = torch.device("cpu" if INTERPRET else "cuda")


def _store(lengths, d, dtype, gap=3, seed=0):
    return ragged_store(lengths, d, dtype, gap, seed, DEV)

def _f32(*ts):
    return [None if t is None else t.float() for t in ts]


# --------------------------------------------------------------------------- decode attention

LENGTHS = [1, 7, 0, 33, 130]


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.float16, 1e-2),
                                        (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("G", [1, 2, 7])
@pytest.mark.parametrize("n_gen", [0, 5])
def test_ragged_decode_attention(dtype, rtol, G, n_gen):
    d = 32
    keys, values, offsets, lengths = _store(LENGTHS, d, dtype)
    H = len(LENGTHS)
    q = torch.randn(H, G, d).to(dtype).to(DEV)
    gen_k = torch.randn(H, 8, d).to(dtype).to(DEV)
    gen_v = torch.randn(H, 8, d).to(dtype).to(DEV)
    # bf16 under the interpreter goes through the in-kernel fp32 cast (UPCAST)
    out = hk.ragged_decode_attention_triton(q, keys, values, offsets, lengths, gen_k, gen_v,
                                            n_gen, num_splits=3, block_n=16)
    assert out.dtype == dtype and out.shape == (H, G, d)
    ref = hk.ragged_decode_attention_torch(*_f32(q, keys, values), offsets, lengths,
                                           *_f32(gen_k, gen_v), n_gen)
    assert_close(ref, out, rtol, f"{dtype} G={G} n_gen={n_gen}")
    if n_gen == 0:
        assert torch.count_nonzero(out[2]) == 0  # empty head -> zeros, not NaN


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_ragged_decode_attention_of_a_chunk(dtype, rtol):
    """A chunk (q_len positions, its own generated rows causal) as one batched launch of a view
    per position, against the torch reference's mask."""
    d, G, q_len, n_gen = 32, 2, 5, 7
    keys, values, offsets, lengths = _store(LENGTHS, d, dtype)
    H = len(LENGTHS)
    q = torch.randn(H, G * q_len, d).to(dtype).to(DEV)
    gen_k = torch.randn(H, 9, d).to(dtype).to(DEV)
    gen_v = torch.randn(H, 9, d).to(dtype).to(DEV)
    out = hk.ragged_decode_attention(q, keys, values, offsets, lengths, gen_k, gen_v, n_gen, backend="triton",
                                     q_len=q_len)
    assert out.dtype == dtype and out.shape == (H, G * q_len, d)
    ref = hk.ragged_decode_attention_torch(*_f32(q, keys, values), offsets, lengths, *_f32(gen_k, gen_v), n_gen,
                                           q_len=q_len)
    assert_close(ref, out, rtol, f"{dtype} chunk")


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_chunk_decode_attention_of_several_stores(dtype, rtol):
    """Several sequences' chunks, of different lengths over stores of different shapes, in one
    launch: each as the torch reference attends it alone."""
    d, G = 32, 2
    cases = [([5, 0, 33], 4, 3), ([130, 7, 1], 1, 1), ([2, 2, 2], 9, 6)]  # lengths, n_gen, q_len
    queries, stores, refs = [], [], []
    for i, (lens, n_gen, q_len) in enumerate(cases):
        keys, values, offsets, lengths = _store(lens, d, dtype, seed=i)
        gen_k, gen_v = (torch.randn(len(lens), n_gen + 2, d).to(dtype).to(DEV) for _ in range(2))
        q = torch.randn(len(lens), G * q_len, d).to(dtype).to(DEV)
        queries.append(q)
        stores.append(hk.RaggedKV(keys, values, offsets, lengths, gen_k, gen_v, n_gen, max(lens)))
        refs.append(hk.ragged_decode_attention_torch(*_f32(q, keys, values), offsets, lengths, *_f32(gen_k, gen_v),
                                                     n_gen, q_len=q_len))
    outs = hk.chunk_decode_attention(queries, stores, [c[2] for c in cases], backend="triton")
    for i, (ref, out) in enumerate(zip(refs, outs)):
        assert out.dtype == dtype and out.shape == queries[i].shape
        assert_close(ref, out, rtol, f"{dtype} chunk {i}")


def test_ragged_decode_default_heuristics_and_odd_d():
    d, G = 24, 7  # d not a power of two: padded to 32 and masked
    keys, values, offsets, lengths = _store([130, 0, 33], d, torch.float16, seed=1)
    q = torch.randn(3, G, d).half().to(DEV)
    gk = torch.randn(3, 4, d).half().to(DEV)
    out = hk.ragged_decode_attention(q, keys, values, offsets, lengths, gk, gk, 4,
                                     scale=0.2, backend="triton")
    ref = hk.ragged_decode_attention_torch(*_f32(q, keys, values), offsets, lengths,
                                           *_f32(gk, gk), 4, scale=0.2)
    assert_close(ref, out, 1e-2)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_batched_decode_attention(dtype, rtol):
    """Several sequences' stores (each its own tensors, own generated rows and count) in one
    launch, against the reference store by store."""
    d, G = 32, 3
    shapes = [([5, 0, 33], 0, 8), ([130, 7, 1], 5, 8), ([2, 2, 2], 1, 16)]  # lengths, n_gen, capacity
    stores, ref_stores = [], []
    for i, (lens, n_gen, cap) in enumerate(shapes):
        keys, values, offsets, lengths = _store(lens, d, dtype, seed=i)
        gen_k = torch.randn(3, cap, d).to(dtype).to(DEV)
        gen_v = torch.randn(3, cap, d).to(dtype).to(DEV)
        stores.append(hk.RaggedKV(keys, values, offsets, lengths, gen_k, gen_v, n_gen, max(lens)))
        ref_stores.append(hk.RaggedKV(*_f32(keys, values), offsets, lengths, *_f32(gen_k, gen_v), n_gen, max(lens)))
    q = torch.randn(9, G, d).to(dtype).to(DEV)
    out = hk.batched_decode_attention(q, stores, backend="triton")
    assert out.dtype == dtype and out.shape == (9, G, d)
    assert_close(hk.batched_decode_attention(q.float(), ref_stores, backend="torch"), out, rtol, f"{dtype}")
    assert torch.count_nonzero(out[1]) == 0  # the empty head of the first store: zeros


def test_counted_segment_table_serves_later_steps():
    """A table built once with device counts: after new generated rows are written and the
    counts raised in place, the same table gives the reference result at the new counts."""
    d, G, cap = 32, 2, 8
    stores, counts = [], torch.tensor([2, 5], device=DEV)
    for i, lens in enumerate(([5, 0, 33], [130, 7, 1])):
        keys, values, offsets, lengths = _store(lens, d, torch.float32, seed=i)
        stores.append(hk.RaggedKV(keys, values, offsets, lengths, torch.randn(3, cap, d, device=DEV),
                                  torch.randn(3, cap, d, device=DEV), int(counts[i]), max(lens)))
    table = hk.segment_table(stores, counts)
    q = torch.randn(6, G, d, device=DEV)
    for _ in range(2):
        assert_close(hk.batched_decode_attention(q, stores, backend="torch"),
                     hk.batched_decode_attention(q, stores, backend="triton", table=table), 1e-4)
        counts.add_(1)
        stores = [s._replace(n_gen=s.n_gen + 1) for s in stores]


def test_counted_segment_table_refuses_a_copy():
    keys, values, offsets, lengths = _store([3, 9], 7, torch.float32, gap=1)
    gen = torch.randn(2, 5, 7, device=DEV)
    with pytest.raises(ValueError, match="in place"):
        hk.segment_table([hk.RaggedKV(keys[1:], values[1:], offsets - 1, lengths, gen, gen, 3, 9)],
                         torch.tensor([3], device=DEV))


def test_batched_decode_attention_copies_what_is_not_aligned():
    """Views starting off a 16-byte boundary (odd d, a store sliced at row 1, generated rows
    whose head stride is not a multiple of 16 bytes) give the reference result."""
    d = 7
    stores = []
    for i in range(2):
        keys, values, offsets, lengths = _store([3, 9], d, torch.float32, gap=1, seed=i)
        gen = torch.randn(2, 5, d).to(DEV)
        stores.append(hk.RaggedKV(keys[1:], values[1:], offsets - 1, lengths, gen, gen.flip(1), 3, 9))
    q = torch.randn(4, 2, d).to(DEV)
    assert_close(hk.batched_decode_attention(q, stores, backend="torch"),
                 hk.batched_decode_attention(q, stores, backend="triton"), 1e-4)


def test_ragged_decode_empty_store():
    d, H, G = 16, 3, 2
    keys, values, offsets, lengths = _store([0, 0, 0], d, torch.float32)
    q = torch.randn(H, G, d, device=DEV)
    out = hk.ragged_decode_attention_triton(q, keys, values, offsets, lengths, num_splits=2)
    assert torch.equal(out, torch.zeros_like(out))
    gk, gv = torch.randn(H, 4, d, device=DEV), torch.randn(H, 4, d, device=DEV)
    out = hk.ragged_decode_attention_triton(q, keys, values, offsets, lengths, gk, gv, 3)
    ref = hk.ragged_decode_attention_torch(q, keys, values, offsets, lengths, gk, gv, 3)
    assert_close(ref, out, 1e-4)


def test_dense_decode_attention():
    H, G, N, d = 2, 7, 40, 32
    q, k, v = (torch.randn(H, G, d, device=DEV), torch.randn(H, N, d, device=DEV),
               torch.randn(H, N, d, device=DEV))
    assert_close(hk.dense_decode_attention(q, k, v, backend="torch"),
                 hk.dense_decode_attention(q, k, v, backend="triton"), 1e-4)


# --------------------------------------------------------------------------- chunk top-k


@pytest.mark.parametrize("G,C,k,kind", [
    (1, 37, 5, "float"), (7, 37, 100, "float"), (7, 300, 64, "int8"), (2, 300, 299, "fp16"),
    (7, 100, 17, "bf16"), (7, 2500, 300, "int8"),
])
def test_chunk_topk(G, C, k, kind):
    H, d = 3, 32
    q = torch.randn(H, G, d)
    lm = torch.randn(H, C, d)
    scale = None
    if kind == "int8":
        lm = torch.randint(-127, 128, (H, C, d), dtype=torch.int8)
        scale = (torch.rand(H, C) * 0.02).to(DEV)
    elif kind in ("fp16", "bf16"):  # scored in fp32 in-kernel (also right under the interpreter)
        dt = torch.float16 if kind == "fp16" else torch.bfloat16
        q, lm = q.to(dt), lm.to(dt)
    q, lm = q.to(DEV), lm.to(DEV)
    ids, scores = hk.chunk_topk_triton(q, lm, k, scale, block_c=64,
                                       block_select=None if C > 1000 else 64, return_scores=True)
    ref_scores = hk.chunk_scores_torch(q, lm, scale)
    ref_ids = hk.chunk_topk(q, lm, k, scale, backend="torch")
    assert_close(ref_scores, scores, 1e-5)
    assert ids.shape == ref_ids.shape == (H, min(k, C)) and ids.dtype == torch.int64
    assert torch.all(ids[:, 1:] > ids[:, :-1])  # ascending and distinct
    # near-ties may differ in the last bits between backends: compare the chosen scores
    assert_close(ref_scores.gather(1, ref_ids).sort(1).values,
                 ref_scores.gather(1, ids).sort(1).values, 1e-5)


def test_chunk_topk_ties_match_reference_exactly():
    H, G, C, d = 3, 7, 70, 16
    g = torch.Generator().manual_seed(0)
    # small integers: every product and sum is exact, so scores tie exactly and repeatedly
    lm = torch.randint(-2, 3, (H, C, d), generator=g).float().to(DEV)
    q = torch.randint(-1, 2, (H, G, d), generator=g).float().to(DEV)
    lm[:, 0] = 0.0
    lm[:, 1] = -0.0
    for k in (1, 9, 33, 70):
        ids = hk.chunk_topk_triton(q, lm, k, block_c=16, block_select=32)
        assert torch.equal(ids, hk.chunk_topk(q, lm, k, backend="torch")), k


@pytest.mark.parametrize("G,P,d,chunk,k", [(1, 40, 64, 1, 7), (7, 160, 128, 4, 9), (3, 48, 32, 16, 2),
                                          (9, 300, 64, 2, 64)])
def test_quant_key_topk(G, P, d, chunk, k):
    """The packed 2-bit scores kernel (several token blocks, a partial last one) against the
    torch reference; the selection then as ``chunk_topk``'s."""
    from hybridkv_kernels.quant_keys import launch_scores

    H = 3
    g = torch.Generator().manual_seed(P)
    q, keys = torch.randn(H, G, d, generator=g).to(DEV), torch.randn(H, P, d, generator=g).to(DEV)
    codes, bounds = hk.pack_keys(keys)
    ref = hk.quant_key_scores_torch(q, codes, bounds, chunk)
    assert_close(ref, launch_scores(q, codes, bounds, chunk, block_p=32), 1e-5)
    ids = hk.quant_key_topk(q, codes, bounds, chunk, k, backend="triton")
    ref_ids = hk.quant_key_topk(q, codes, bounds, chunk, k, backend="torch")
    assert ids.shape == ref_ids.shape and torch.all(ids[:, 1:] > ids[:, :-1])
    assert_close(ref.gather(1, ref_ids).sort(1).values, ref.gather(1, ids).sort(1).values, 1e-5)


def test_quant_key_topk_reads_host_codes_in_place():
    """``--landmark host-keys``: the codes stay in host memory (pinned on CUDA, where the kernel
    reads them through UVA); the ranking is the one of device codes, and on CUDA pageable host
    codes are refused with a reason rather than read through a bad pointer."""
    from hybridkv_kernels.quant_keys import launch_scores

    g = torch.Generator().manual_seed(5)
    q, keys = torch.randn(3, 7, 64, generator=g).to(DEV), torch.randn(3, 200, 64, generator=g).to(DEV)
    codes, bounds = hk.pack_keys(keys)
    host = codes.cpu().pin_memory() if DEV.type == "cuda" else codes.cpu().clone()
    assert torch.equal(hk.quant_key_topk(q, host, bounds, 1, 20, backend="triton"),
                       hk.quant_key_topk(q, codes, bounds, 1, 20, backend="triton"))
    assert torch.equal(hk.quant_key_topk(q, host, bounds, 1, 20, backend="torch"),
                       hk.quant_key_topk(q, codes, bounds, 1, 20, backend="torch"))
    if DEV.type == "cuda":
        with pytest.raises(ValueError, match="pinned host memory"):
            launch_scores(q, codes.cpu(), bounds, 1)


# --------------------------------------------------------------------------- chunk gather


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_gather_matches_torch(dtype):
    H, C, c, d, n = 3, 13, 8, 16, 5
    g = torch.Generator().manual_seed(0)
    host_k = torch.randn(H, C, c, d, generator=g).to(dtype)
    host_v = torch.randn(H, C, c, d, generator=g).to(dtype)
    if DEV.type == "cuda":
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    slot_base = torch.tensor([4, 60, 110], device=DEV)
    T = 160
    stores = {b: [torch.zeros(T, d, dtype=dtype, device=DEV) for _ in range(2)]
              + [torch.full((H, n), -1, device=DEV)] for b in ("torch", "triton")}
    per_chunk = c * d * 2 * host_k.element_size()
    want = torch.stack([torch.randperm(C, generator=g)[:n] for _ in range(H)]).to(DEV)
    want2 = want.clone()
    for i in range(H):
        fresh = [x for x in range(C) if x not in want[i].tolist()][:2]
        want2[i, 0], want2[i, 4] = fresh[0], fresh[1]
    for w, expect in ((want, H * n), (want.flip(1), 0), (want2, 2 * H)):
        for b, (sk, sv, res) in stores.items():
            moved = hk.chunk_gather(host_k, host_v, sk, sv, slot_base, res, w, backend=b)
            assert moved == expect * per_chunk, (b, moved)
        (tk, tv, tr), (xk, xv, xr) = stores["torch"], stores["triton"]
        assert torch.equal(tr, xr) and torch.equal(tk, xk) and torch.equal(tv, xv)
    sk, _, res = stores["triton"]
    for i in range(H):
        assert sorted(res[i].tolist()) == sorted(want2[i].tolist())
        for s in range(n):
            r = int(slot_base[i]) + s * c
            assert torch.equal(sk[r:r + c].cpu(), host_k[i, int(res[i, s])])


@pytest.mark.parametrize("n", [1, 64, 150])
def test_fused_gather_plan_pairs_slots_like_the_torch_plan(n):
    """The zero-copy path plans on the device in one kernel (walking the wanted ids in blocks of
    64): same slot contents, same bytes as the torch plan, with hits, misses and empty slots."""
    H, C, c, d = 3, 400, 2, 16
    g = torch.Generator().manual_seed(n)
    host_k, host_v = torch.randn(H, C, c, d, generator=g), torch.randn(H, C, c, d, generator=g)
    if DEV.type == "cuda":
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    slot_base = torch.tensor([0, n * c, 2 * n * c], device=DEV)
    per_chunk = c * d * 2 * host_k.element_size()
    first = torch.stack([torch.randperm(C, generator=g)[:n] for _ in range(H)])
    start = first.clone()
    start[1, : n // 3] = -1  # head 1 starts with some empty slots
    keep = torch.randperm(n, generator=g)[: n // 2]  # half of the chunks stay wanted, in a new order
    then = torch.cat([first[:, keep], torch.arange(C - (n - len(keep)), C).expand(H, -1)], 1)
    then = then[:, torch.randperm(n, generator=g)]
    results = {}
    for backend in ("torch", "triton"):
        sk, sv = torch.zeros(3 * n * c, d, device=DEV), torch.zeros(3 * n * c, d, device=DEV)
        res = start.clone().to(DEV)
        moved = [int(hk.chunk_gather(host_k, host_v, sk, sv, slot_base, res, w.to(DEV), backend=backend))
                 for w in (first, then)]
        results[backend] = (res.cpu(), sk.cpu(), sv.cpu(), moved)
    assert all(torch.equal(a, b) for a, b in zip(results["torch"][:3], results["triton"][:3]))
    assert results["torch"][3] == results["triton"][3] and results["triton"][3][1] % per_chunk == 0


def _plan_reference(resident: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """The plan's rule in plain Python (the ids may include -1: an empty slot "holds" it)."""
    assign = torch.full_like(resident, -1)
    for h in range(resident.shape[0]):
        res, wanted = resident[h].tolist(), want[h].tolist()
        free = [s for s, r in enumerate(res) if r not in wanted]
        missing = [w for w in wanted if w not in res]
        for s, w in zip(free, missing):
            assign[h, s] = w
    return torch.where(assign >= 0, assign, -1)


@pytest.mark.parametrize("block_n,block_j", [(16, 8), (8, 32)])
@pytest.mark.parametrize("order", ["any", "ascending", "ascending, -1 last"])
def test_gather_plan_kernel_tiles_match_the_reference(block_n, block_j, order):
    """The plan kernel walks the slots and the wanted ids in tiles smaller than n (as at real slot
    counts), by binary search when the wanted ids ascend (chunk_topk's order, padding last in
    TABLE rows) and by comparing all pairs otherwise: the plan of :func:`gather_plan`, with
    hits, misses, empty slots and a partial tile."""
    from hybridkv_kernels.dispatch import load_triton_module

    mod = load_triton_module("_chunk_gather_triton")
    H, C, n = 3, 300, 70
    g = torch.Generator().manual_seed(block_n)
    resident = torch.stack([torch.randperm(C, generator=g)[:n] for _ in range(H)])
    resident[1, ::3] = -1
    fresh = [torch.tensor([c for c in range(C) if c not in set(r.tolist())]) for r in resident]
    want = torch.stack([torch.cat([r[r >= 0][: n // 2], f])[:n] for r, f in zip(resident, fresh)])  # distinct
    want = want[:, torch.randperm(n, generator=g)]
    if order != "any":
        want = want.sort(dim=1).values
    if order == "ascending, -1 last":
        want[:, n - 5:] = -1
        resident[0, :5] = -1  # head 0 holds the padding id in some slots
    expect = _plan_reference(resident, want)
    if order != "ascending, -1 last":
        assert torch.equal(expect, hk.gather_plan(resident, want, C))
    res, assign = resident.clone().to(DEV), torch.empty(H, n, dtype=torch.int64, device=DEV)
    moved = torch.zeros((), dtype=torch.int64, device=DEV)
    mod.gather_plan_kernel[(H,)](res, want.to(DEV), assign, moved, moved, n, 10, 7, res.stride(0), n, n,
                                 BLOCK_N=block_n, BLOCK_J=block_j)
    assert torch.equal(assign.cpu(), expect)
    assert torch.equal(res.cpu(), torch.where(expect >= 0, expect, resident))
    assert int(moved) == 10 * int((expect >= 0).sum()) + 7 * H  # the copies and each head's ranking reads


# --------------------------------------------------------------------------- dispatch


@pytest.mark.skipif(not INTERPRET, reason="interpreter only")
def test_auto_uses_interpreter_on_cpu():
    assert hk.resolve_backend("auto", torch.zeros(1)) == "triton"


# --------------------------------------------------------------------------- retrieval of many sequences


def _retrieval_part(heads, chunks, chunk, slots, d, dtype, seed, two_bit=False):
    """One sequence's dynamic heads: int8 landmarks (or its keys at 2 bits), host chunks, a store
    with its slots after some other rows, half the slots already holding a chunk."""
    g = torch.Generator().manual_seed(seed)
    host_k = torch.randn(heads, chunks, chunk, d, generator=g).to(dtype)
    host_v = torch.randn(heads, chunks, chunk, d, generator=g).to(dtype)
    if two_bit:
        codes, scale = (t.to(DEV) for t in hk.pack_keys(host_k.flatten(1, 2)))
    else:
        codes = torch.randint(-127, 128, (heads, chunks, d), generator=g, dtype=torch.int8).to(DEV)
        scale = (torch.rand(heads, chunks, generator=g) + 0.5).to(DEV)
    if DEV.type == "cuda":
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    rows = slots * chunk
    slot_base = (torch.arange(heads) * (rows + 3) + 2).to(DEV)
    store_k = torch.zeros(heads * (rows + 3) + 2, d, dtype=dtype, device=DEV)
    resident = torch.stack([torch.randperm(chunks, generator=g)[:slots] for _ in range(heads)])
    resident[:, slots // 2:] = -1
    return hk.RetrievalPart(codes, scale, host_k, host_v, store_k, store_k.clone(), slot_base, resident.to(DEV),
                            torch.zeros((), dtype=torch.int64, device=DEV))


def _copy(part):
    return part._replace(**{f: t.clone() for f, t in part._asdict().items() if torch.is_tensor(t) and t.device == DEV})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_retrieve_is_each_part_alone(dtype):
    """Three sequences with different head, chunk and slot counts and chunk lengths, in one pass:
    exactly the slots, resident ids and byte counts of chunk_topk + chunk_gather part by part."""
    d, G = 16, 3
    parts = [_retrieval_part(2, 9, 8, 4, d, dtype, 0), _retrieval_part(1, 40, 16, 6, d, dtype, 1),
             _retrieval_part(3, 5, 8, 2, d, dtype, 2)]
    alone = [_copy(p) for p in parts]
    q = torch.randn(6, G, d).to(dtype).to(DEV)
    for step in range(2):  # the second step keeps the hits of the first
        hk.chunk_retrieve(list(torch.split(q * (step + 1), [2, 1, 3])), parts, backend="triton")
        for p, rows in zip(alone, torch.split(q * (step + 1), [2, 1, 3])):
            want = hk.chunk_topk_triton(rows, p.landmarks, p.resident.shape[1], p.landmark_scale)
            p.moved.add_(hk.chunk_gather_triton(p.host_k, p.host_v, p.store_k, p.store_v, p.slot_base, p.resident,
                                                want))
        for a, b in zip(parts, alone):
            assert torch.equal(a.resident, b.resident) and int(a.moved) == int(b.moved) > 0
            assert torch.equal(a.store_k, b.store_k) and torch.equal(a.store_v, b.store_v)


@pytest.mark.parametrize("limit,block,bonus", [(1, 256, 0.0), (5, 256, 0.75), (40, 1024, 0.0), (0, 256, 1.25)])
def test_the_capped_selection_is_its_torch_reference(limit, block, bonus):
    """The cap inside the selection's launch (residents parked at +inf, the others past the
    ``limit``-th set to -inf, one selection) chooses what ``cap_scores`` + top-k choose, ties
    (rounded scores) and rows of several blocks included; a row with an empty slot is not capped."""
    from hybridkv_kernels.chunk_topk import _topk_ids_from_scores, launch_topk

    g = torch.Generator().manual_seed(limit)
    rows, chunks, k = 4, 700, 24
    scores = (torch.randn(rows, chunks, generator=g) * 4).round() / 4  # many ties
    resident = torch.stack([torch.randperm(chunks, generator=g)[:k] for _ in range(rows)])
    resident[3, 5] = -1
    expected = _topk_ids_from_scores(hk.cap_scores(scores, resident, limit, bonus), k)
    assert limit >= k or not torch.equal(expected, _topk_ids_from_scores(scores, k))  # the cap or bonus binds
    got = launch_topk(scores.clone().to(DEV), k, resident=resident.to(DEV), limit=limit, block=block, bonus=bonus)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("chunk,swaps,stickiness,host,packed", [
    (1, 0, 0.0, False, True), (4, 0, 0.0, False, True), (1, 3, 0.5, False, True), (1, 0, 1.0, False, True),
    (1, 0, 0.0, True, True), (1, 0, 0.0, False, False)])
def test_chunk_retrieve_with_two_bit_keys_is_each_part_alone(chunk, swaps, stickiness, host, packed):
    """Parts ranked by 2-bit keys (different head, token and slot counts), in one pass: the slots,
    resident ids and byte counts of quant_key_topk + chunk_gather part by part. ``host``: the
    codes in host memory (pinned on CUDA), each head's ranking reading all of its codes a step,
    counted in the part's bytes. ``packed``: code rows padded to whole lines as ``pack_keys``
    lays them out (else contiguous: the table carries each part's row stride)."""
    d, G = 16, 3
    parts = [_retrieval_part(2, 48, chunk, 8, d, torch.float32, 0, True),
             _retrieval_part(1, 150, chunk, 12, d, torch.float32, 1, True),
             _retrieval_part(3, 20, chunk, 4, d, torch.float32, 2, True)]
    assert all(p.landmarks.stride(1) % 128 == 0 for p in parts)
    if not packed:
        parts = [p._replace(landmarks=p.landmarks.contiguous()) for p in parts]
    if host:
        parts = [p._replace(landmarks=p.landmarks.cpu().pin_memory() if DEV.type == "cuda" else p.landmarks,
                            read=p.landmarks[0].numel()) for p in parts]
    alone = [_copy(p) for p in parts]
    q = torch.randn(6, G, d).to(DEV)
    for step in range(2):
        table = hk.retrieval_table(parts)
        hk.chunk_retrieve(list(torch.split(q * (step + 1), [2, 1, 3])), parts, backend="triton", table=table,
                          swaps=swaps, stickiness=stickiness)
        for p, rows in zip(alone, torch.split(q * (step + 1), [2, 1, 3])):
            want = hk.quant_key_topk(rows, p.landmarks, p.landmark_scale, chunk, p.resident.shape[1], "triton",
                                     resident=p.resident, swaps=swaps, stickiness=stickiness)
            p.moved.add_(hk.chunk_gather_triton(p.host_k, p.host_v, p.store_k, p.store_v, p.slot_base, p.resident,
                                                want) + p.read * p.resident.shape[0])
        for a, b in zip(parts, alone):
            assert torch.equal(a.resident, b.resident) and int(a.moved) == int(b.moved) > 0
            assert torch.equal(a.store_k, b.store_k) and torch.equal(a.store_v, b.store_v)
