"""The torch path of decode attention: the reference of one sequence and the batch's CPU path.

:func:`ragged_decode_attention_torch` is the reference (and the CPU path of a single sequence's
``ragged_decode_attention``); :func:`batched_decode_attention_torch` attends the stores of a
batch on the CPU, and :func:`chunk_decode_attention_torch` the chunks of several stores (questions
read after their prefixes). The layout is ``decode_attention``'s (its module docstring).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .tensors import joined

__all__ = ["batched_decode_attention_torch", "check_ragged", "chunk_decode_attention_torch", "chunk_mask",
           "ragged_decode_attention_torch"]


def check_ragged(q, keys, values, offsets, lengths, gen_k, gen_v, n_gen, q_len=1):
    """Refuse a step whose tensors do not fit the layout (module docstring of ``decode_attention``)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [H_kv, G, d], got {tuple(q.shape)}")
    H, G, d = q.shape
    if q_len < 1 or G % q_len or (q_len > 1 and n_gen < q_len):
        raise ValueError(f"a chunk of q_len {q_len} needs G a multiple of it (got {G}) and its own {q_len} "
                         f"generated rows (got {n_gen})")
    if keys.dim() != 2 or keys.shape != values.shape or keys.shape[1] != d:
        raise ValueError(f"keys/values must both be [T, {d}], got {tuple(keys.shape)}, "
                         f"{tuple(values.shape)}")
    if offsets.shape != (H,) or lengths.shape != (H,):
        raise ValueError(f"offsets/lengths must be [{H}], got {tuple(offsets.shape)}, "
                         f"{tuple(lengths.shape)}")
    if n_gen < 0:
        raise ValueError(f"n_gen must be >= 0, got {n_gen}")
    if n_gen > 0:
        if gen_k is None or gen_v is None:
            raise ValueError("n_gen > 0 needs gen_k and gen_v")
        if gen_k.dim() != 3 or gen_k.shape[0] != H or gen_k.shape[2] != d \
                or gen_v.shape != gen_k.shape or gen_k.shape[1] < n_gen:
            raise ValueError(f"gen_k/gen_v must be [{H}, cap >= {n_gen}, {d}], got "
                             f"{tuple(gen_k.shape)}, {tuple(gen_v.shape)}")


@lru_cache(maxsize=256)
def chunk_mask(rows: int, n_gen: int, q_len: int, device=None) -> torch.Tensor:
    """[rows, n_gen] bool: True where a query row of a chunk may not look (``decode_attention``'s
    layout): row ``r`` is position ``t = r % q_len`` of the chunk, whose own rows are the last
    ``q_len`` generated ones, so it sees the generated rows before ``n_gen - q_len + 1 + t``.
    Made once for its sizes and shared (every layer of a read asks the same): read it, never write it."""
    position = torch.arange(rows, device=device) % q_len
    return torch.arange(n_gen, device=device) >= (n_gen - q_len + 1 + position).unsqueeze(1)


def ragged_decode_attention_torch(q, keys, values, offsets, lengths, gen_k=None, gen_v=None,
                                  n_gen=0, scale=None, q_len=1):
    """Torch reference of :func:`ragged_decode_attention` (the CPU path of one sequence).

    Softmax in fp32; the two matmuls run in the input dtype (fp32 accumulation inside the
    BLAS) so no fp32 copy of the store is made. With bf16/fp16 inputs the scores are therefore
    rounded to the input dtype before the softmax, as in Hugging Face's eager attention; the
    Triton kernel keeps them in fp32 (the tests compare it with this function on fp32 copies).

    It loops over KV heads (4 for Qwen2.5-VL-7B) on *views* of the store: the vectorised
    alternative would gather every head's rows into a padded [H_kv, max_len, d] tensor, i.e.
    copy the whole KV cache each step; the op is bandwidth-bound, so that copy would about
    double its cost. It needs ``lengths``/``offsets`` on the host (one sync on CUDA).
    """
    check_ragged(q, keys, values, offsets, lengths, gen_k, gen_v, n_gen, q_len)
    H, G, d = q.shape
    scale = d ** -0.5 if scale is None else float(scale)
    hidden = chunk_mask(G, n_gen, q_len, q.device) if q_len > 1 else None
    offs = offsets.tolist()
    lens = lengths.tolist()
    out = torch.zeros(H, G, d, dtype=torch.float32, device=q.device)
    for h in range(H):
        ks, vs = [], []
        if lens[h] > 0:
            ks.append(keys[offs[h]:offs[h] + lens[h]])
            vs.append(values[offs[h]:offs[h] + lens[h]])
        if n_gen > 0:
            ks.append(gen_k[h, :n_gen])
            vs.append(gen_v[h, :n_gen])
        if not ks:
            continue  # empty head -> zeros
        qh = q[h].to(keys.dtype)
        # scores of the parts side by side ([G, len] each, small), one softmax over both
        s = torch.cat([(qh @ k.T).float() for k in ks], dim=-1).mul_(scale)
        if hidden is not None:  # a chunk: each position sees its own and the earlier positions' rows
            s[:, s.shape[1] - n_gen:].masked_fill_(hidden, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o, start = out[h], 0
        for v in vs:
            o += (p[:, start:start + v.shape[0]].to(v.dtype) @ v).float()
            start += v.shape[0]
    return out.to(q.dtype)


def batched_decode_attention_torch(q, stores, scale=None):
    """Torch path of :func:`batched_decode_attention`: :func:`chunk_decode_attention_torch` of
    one-token chunks (``q``: every store's heads, store after store)."""
    return torch.cat(chunk_decode_attention_torch(list(torch.split(q, [s.num_heads for s in stores])), stores,
                                                  [1] * len(stores), scale))


def chunk_decode_attention_torch(queries, stores, q_lens, scale=None):
    """Torch path of :func:`chunk_decode_attention` (the CPU path of a batch step and of a packed
    read): ``queries[i]`` [H_i, G * q_lens[i], d], a chunk of ``q_lens[i]`` positions over ``stores[i]``.

    On the CPU a step's cost is mostly per op, so the stores of one shape (:func:`_shape`, and
    one chunk length: the questions of one prefix share it) are attended together: the scores of
    all their heads go side by side into one padded buffer, masked, scaled and normalised by one op
    each. A small store's heads (:func:`_copied`) are copied into padded ``[heads, width, d]``
    keys and values, so the products of all the group's heads are one ``bmm`` each; a larger
    store's heads are read in place (views: the copy would cost about what the attention reads),
    each head's products its own, and a store's generated rows one ``bmm`` for all its heads. A
    store's numbers do not depend on the others: every op it meets has the shapes it has alone.
    """
    for q, s, q_len in zip(queries, stores, q_lens):
        check_ragged(q, *s[:7], q_len)
    spans = _spans(stores)
    groups: dict[tuple, list[int]] = {}
    for i, (s, heads, q_len) in enumerate(zip(stores, spans, q_lens)):
        groups.setdefault((*_shape(s, heads), q_len, _copied(s, heads)), []).append(i)
    out = [None] * len(stores)
    for (*_, q_len, copied), index in groups.items():
        part = joined([queries[i] for i in index])
        attend = _copied_together if copied else _together
        attended = attend(part, [stores[i] for i in index], [spans[i] for i in index], scale, q_len)
        for i, o in zip(index, attended.split([queries[i].shape[0] for i in index])):
            out[i] = o
    return out


def _spans(stores) -> list[list[tuple[int, int]]]:
    """Each store's heads as (offset, length), read on the host in one go (a read per store
    would cost ops per store)."""
    flat = torch.cat([t for s in stores for t in (s.offsets, s.lengths)]).tolist()
    spans, at = [], 0
    for s in stores:
        heads = s.offsets.numel()
        spans.append(list(zip(flat[at:at + heads], flat[at + heads:at + 2 * heads])))
        at += 2 * heads
    return spans


def _shape(store, spans) -> tuple:
    """What stores attended together share: the padded width (their longest head), the generated
    rows and the element types (``spans``: the store's heads as (offset, length))."""
    return max((length for _, length in spans), default=0), store.n_gen, store.keys.dtype, store.values.dtype


#: A store whose heads' keys and values, padded to its longest head, take at most this many
#: bytes is attended from a padded copy (:func:`_copied_together`): below it the ops a head
#: costs in place outweigh the copy.
COPIED_BYTES = 1 << 19


def _copied(store, spans) -> bool:
    """Whether ``store`` (its heads' ``spans``) is attended from a padded copy of its heads."""
    width = _shape(store, spans)[0]
    return len(spans) * width * store.keys.shape[1] * (store.keys.element_size() + store.values.element_size()) \
        <= COPIED_BYTES


def _copied_together(q, stores, spans, scale, q_len: int = 1):
    """:func:`_together` of small stores: every head's rows gathered into padded
    ``[heads, width, d]`` keys and values (the rows past a head's length masked: weight 0 and
    value 0, as what they copy may be a slot not yet written), so each product is one ``bmm``
    for the whole group."""
    rows, group, d = q.shape
    scale = d ** -0.5 if scale is None else float(scale)
    width, n_gen, key_type, value_type = _shape(stores[0], spans[0])
    keys, values = joined([s.keys for s in stores]), joined([s.values for s in stores])
    first, lengths, base = [], [], 0
    for s, heads in zip(stores, spans):
        first += [base + offset for offset, _ in heads]
        lengths += [length for _, length in heads]
        base += s.keys.shape[0]
    column = torch.arange(width, device=q.device)
    hidden = column >= torch.tensor(lengths, device=q.device)[:, None]  # [rows, width] past a head's rows
    index = (torch.tensor(first, device=q.device)[:, None] + column).clamp_(max=max(base - 1, 0))
    qk = q.to(key_type)
    scores = torch.bmm(qk, keys[index].transpose(1, 2)).masked_fill_(hidden[:, None], float("-inf"))
    if n_gen:
        gen_k = joined([s.gen_k[:, :n_gen] for s in stores])
        scores = torch.cat([scores, torch.bmm(qk, gen_k.transpose(1, 2))], dim=2)
    if q_len > 1:  # a chunk: each position sees its own and the earlier positions' rows
        scores[:, :, width:].masked_fill_(chunk_mask(group, n_gen, q_len, q.device), float("-inf"))
    p = torch.softmax(scores.float().mul_(scale), dim=-1).to(value_type)
    prompt = p[:, :, :width].masked_fill_(hidden[:, None], 0)  # an empty head with no generated rows: zeros
    out = torch.bmm(prompt, values[index].masked_fill_(hidden[:, :, None], 0)).float()
    if n_gen:
        out.add_(torch.bmm(p[:, :, width:], joined([s.gen_v[:, :n_gen] for s in stores])).float())
    return out.to(q.dtype)


def _together(q, stores, spans, scale, q_len: int = 1):
    """:func:`chunk_decode_attention_torch` of stores of one :func:`_shape` and chunk length
    (``q``: their heads)."""
    rows, group, d = q.shape
    scale = d ** -0.5 if scale is None else float(scale)
    width, n_gen, key_type, value_type = _shape(stores[0], spans[0])
    qk = q.to(key_type)
    # [prompt rows | padding | generated rows] of every head; the padding stays -inf (weight 0)
    scores = torch.full((rows, group, width + n_gen), float("-inf"), dtype=key_type, device=q.device)
    for s, heads, at in _walk(stores, spans):
        for h, (offset, length) in enumerate(heads):
            scores[at + h, :, :length].addmm_(qk[at + h], s.keys[offset:offset + length].T, beta=0)
        if n_gen:
            torch.bmm(qk[at:at + len(heads)], s.gen_k[:, :n_gen].transpose(1, 2),
                      out=scores[at:at + len(heads), :, width:])
    if q_len > 1:  # a chunk: each position sees its own and the earlier positions' rows
        scores[:, :, width:].masked_fill_(chunk_mask(group, n_gen, q_len, q.device), float("-inf"))
    p = torch.softmax(scores.float().mul_(scale), dim=-1).to(value_type)
    out = torch.empty(rows, group, d, dtype=value_type, device=q.device)
    gen = torch.empty_like(out) if n_gen else None
    for s, heads, at in _walk(stores, spans):
        for h, (offset, length) in enumerate(heads):
            torch.mm(p[at + h, :, :length], s.values[offset:offset + length], out=out[at + h])
        if n_gen:
            torch.bmm(p[at:at + len(heads), :, width:], s.gen_v[:, :n_gen], out=gen[at:at + len(heads)])
    out = out.float()
    return (out if gen is None else out.add_(gen.float())).to(q.dtype)


def _walk(stores, spans):
    """Each store with its heads' (offset, length) and its first row in the group."""
    at = 0
    for s, heads in zip(stores, spans):
        yield s, heads, at
        at += len(heads)
