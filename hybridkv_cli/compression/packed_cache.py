"""Several generations' suffixes read in one forward pass: one ``Cache`` over their caches.

Members that join a batch together read their suffixes (a question after a kept prefix) as one
sequence, side by side: the projections, norms and MLPs of every layer run once over all their
tokens, while each member's span of new keys and values goes to its own cache and its span of
queries attends only that cache, as one chunk (:meth:`LayerKV.attend`, as in a read alone). So
no member sees another's tokens, and each gets the logits it gets alone (tested token for token).
The members' step work and attention run together, as a batch step's do: one retrieval pass for
all their dynamic heads and one attention launch for all their chunks (on the CPU, the chunks one
by one).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from hybridkv_cli.compression.batch_cache import step_parts
from hybridkv_cli.compression.cache import AttendingCache, MembersLayer, PolicyCache
from hybridkv_kernels import chunk_decode_attention


class PackedLayer(MembersLayer):
    """Layer ``index`` of a packed read: each member's span of the new tokens into its own layer."""

    def update(self, key_states, value_states, *args, **kwargs):
        for cache, (start, end) in zip(self.owner.members, self.owner.spans):
            cache.layers[self.index].update(key_states[:, :, start:end], value_states[:, :, start:end])
        return key_states, value_states


class PackedCache(AttendingCache):
    """The cache of one packed read: ``members``' compressed caches, ``lengths[i]`` new tokens
    each, in that order along the sequence (see the module docstring)."""

    def __init__(self, members: list[PolicyCache], lengths: list[int]):
        self.members, self.lengths = members, list(lengths)
        ends = list(accumulate(lengths))
        self.spans = list(zip([0, *ends[:-1]], ends))
        super().__init__([PackedLayer(i, self) for i in range(len(members[0].layers))])

    @property
    def last(self) -> torch.Tensor:
        """The index of each member's last token in the packed sequence (its logits give its first token)."""
        return torch.tensor([end - 1 for _, end in self.spans], dtype=torch.long)

    def attention(self, module, query, key, value, attention_mask, scaling, dropout, kwargs):
        """Each member's span of queries attends its own layer as one chunk (:meth:`LayerKV.attend`
        of each alone): the step work of all of them in one pass (:func:`step_parts`), then all
        their chunks in one attention (:func:`chunk_decode_attention`)."""
        heads, dim = key.shape[1], query.shape[-1]
        layers = [cache.layers[module.layer_idx].kv for cache in self.members]
        # each member's [H_kv, G * q_len, d], row g * q_len + t: one sequence's chunk
        queries = [q.reshape(heads, -1, dim) for q in query[0].split(self.lengths, dim=1)]
        outs = chunk_decode_attention(queries, step_parts(layers, queries, scaling), self.lengths, scaling)
        # [1, H, n, d] each (H query heads) side by side along the tokens, as [1, tokens, H, d]
        rows = [o.view(1, query.shape[1], n, dim) for o, n in zip(outs, self.lengths)]
        return (torch.cat(rows, dim=2) if len(rows) > 1 else rows[0]).transpose(1, 2), None
