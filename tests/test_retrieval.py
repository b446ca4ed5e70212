"""Dynamic heads: chunk retrieval from the host store, landmarks, hits and traffic."""

import torch

from hybridkv_cli.compression.hybridkv import HybridLayerKV
from hybridkv_cli.compression.landmarks import quantize_landmarks
from hybridkv_cli.compression.retrieval import DynamicHeads
from hybridkv_cli.compression.store import RaggedStore

CHUNK, WINDOW = 8, 16


def dynamic_layer(keys, values, chunks):
    """Every head dynamic, `chunks` retrieval slots each."""
    heads, n, _ = keys.shape
    num_chunks = (n - WINDOW) // CHUNK
    keep = torch.zeros(heads, n, dtype=torch.bool)
    keep[:, num_chunks * CHUNK:] = True
    store = RaggedStore.build(keys, values, keep, torch.full((heads,), chunks * CHUNK))
    dyn = DynamicHeads.offload(keys, values, torch.arange(heads), store, chunks=chunks, chunk=CHUNK, num_chunks=num_chunks)
    return HybridLayerKV(store, dyn)


def dense_attention(q, keys, values, scale):
    scores = torch.einsum("hgd,hnd->hgn", q, keys) * scale
    return torch.einsum("hgn,hnd->hgd", scores.softmax(-1), values)


def test_planted_key_is_retrieved():
    torch.manual_seed(0)
    heads, n, dim = 2, 203, 16
    keys = 0.1 * torch.randn(heads, n, dim)
    values = torch.randn(heads, n, dim)
    needle = torch.randn(dim)
    needle /= needle.norm()
    keys[0, 37] = 8 * needle  # chunk 4 of head 0
    keys[1, 150] = 8 * needle  # chunk 18 of head 1
    layer = dynamic_layer(keys, values, chunks=2)
    q = needle.expand(heads, 3, dim).clone()  # GQA group of 3
    layer.attend(q, dim**-0.5)
    assert 37 // CHUNK in layer.dynamic.resident[0].tolist()
    assert 150 // CHUNK in layer.dynamic.resident[1].tolist()


def test_all_chunks_retrieved_equals_full_attention_and_hits_cost_nothing():
    torch.manual_seed(1)
    heads, n, dim = 2, 171, 16
    keys, values = torch.randn(heads, n, dim), torch.randn(heads, n, dim)
    num_chunks = (n - WINDOW) // CHUNK
    layer = dynamic_layer(keys, values, chunks=num_chunks)
    q = torch.randn(heads, 2, dim)
    out = layer.attend(q, dim**-0.5)
    torch.testing.assert_close(out, dense_attention(q, keys, values, dim**-0.5), rtol=1e-5, atol=1e-5)
    entry = 2 * dim * 4
    assert layer.transferred_bytes() == heads * num_chunks * CHUNK * entry
    layer.attend(torch.randn(heads, 2, dim), dim**-0.5)  # everything is resident: no traffic
    assert layer.transferred_bytes() == heads * num_chunks * CHUNK * entry
    assert layer.host_bytes() == heads * num_chunks * CHUNK * entry


def test_generated_tokens_are_attended():
    torch.manual_seed(2)
    heads, n, dim = 1, 64, 16
    keys, values = torch.randn(heads, n, dim), torch.randn(heads, n, dim)
    layer = dynamic_layer(keys, values, chunks=(n - WINDOW) // CHUNK)
    new_k, new_v = torch.randn(heads, 1, dim), torch.randn(heads, 1, dim)
    layer.append(new_k, new_v)
    q = torch.randn(heads, 1, dim)
    expected = dense_attention(q, torch.cat([keys, new_k], 1), torch.cat([values, new_v], 1), dim**-0.5)
    torch.testing.assert_close(layer.attend(q, dim**-0.5), expected, rtol=1e-5, atol=1e-5)


def test_int8_landmarks_rank_chunks_like_full_precision():
    torch.manual_seed(3)
    landmarks = torch.randn(4, 100, 64)
    q8, scale = quantize_landmarks(landmarks)
    assert q8.dtype == torch.int8 and scale.shape == (4, 100)
    q = torch.randn(4, 64)
    exact = torch.einsum("hd,hcd->hc", q, landmarks).topk(8).indices.sort().values
    approx = torch.einsum("hd,hcd->hc", q, q8.float() * scale[..., None]).topk(8).indices.sort().values
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(exact, approx)) / exact.numel()
    assert overlap >= 0.9
