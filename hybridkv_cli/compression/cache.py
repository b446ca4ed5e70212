"""Glue to transformers: a ``Cache`` whose layers a policy compresses, and the attention function
(a batch of such caches decoded together: :mod:`~hybridkv_cli.compression.batch_cache`).

The text attention of the model calls ``cache.update`` and then the attention function. Inside
:func:`policy_attention` that function is :func:`attend`: at prefill it runs stock SDPA over the
full prompt, then hands the layer (queries included) to the policy, which replaces the full KV
by its compressed form, so the peak prefill cache is one layer of full KV plus the compressed
layers before it. At decode it asks the compressed layer for attention directly.

The attention function finds the cache in its own call's keyword arguments: transformers hands
``cache.update`` the attention call's ``kwargs``, and :meth:`PolicyCache.update` adds itself
there. Nothing is registered at import time, and the model is restored on leaving the block.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hybridkv_cli.compression.base import LayerKV, Policy, PrefillLayer
from hybridkv_cli.compression.store import tensor_bytes

ATTENTION_NAME = "hybridkv"
CACHE_KWARG = "hybridkv_cache"  # the keyword under which the attention call receives its cache


class PolicyLayer(CacheLayerMixin):
    """One layer: the full prompt KV until the policy compresses it, then the policy's ``LayerKV``."""

    is_compileable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.kv: LayerKV | None = None
        self.seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        if self.kv is not None:  # a step's new token, or a chunk's tokens: generated rows
            self.kv.append(key_states[0], value_states[0])
        return key_states, value_states

    def get_seq_length(self) -> int:
        # The logical length (tokens seen), not tokens kept: positions and masks depend on it.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kv, self.seen = None, 0


class MembersLayer(CacheLayerMixin):
    """Layer ``index`` of a cache over other generations' caches (``owner.members``): it holds
    no KV of its own; its length is the longest member's."""

    is_compileable = False
    is_sliding = False

    def __init__(self, index: int, owner):
        super().__init__()
        self.index, self.owner = index, owner
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device

    def get_seq_length(self) -> int:
        return max((cache.layers[self.index].seen for cache in self.owner.members), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class AttendingCache(Cache):
    """A cache whose attention calls find it: :meth:`update` hands it to the attention call that
    follows (see the module docstring), which asks it for the layer's attention (:meth:`attention`)."""

    def attention(self, module, query, key, value, attention_mask, scaling, dropout, kwargs):
        """Layer ``module.layer_idx``'s attention output: at prefill stock SDPA over the full
        prompt, then the layer compressed; once compressed, the compressed layer's attention of
        a decode step (``q_len`` 1, each member of a batch) or of a chunk of new tokens read in
        one pass (``q_len`` > 1, one sequence: :meth:`LayerKV.attend`)."""
        layer = self.layers[module.layer_idx]
        if layer.kv is None:
            out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                         **kwargs)
            self.compress_layer(module.layer_idx, query, key, value, scaling)
            return out
        batch, q_heads, q_len, dim = query.shape
        grouped = query.reshape(batch * key.shape[1], -1, dim)  # [B * H_kv, G * q_len, d], row g * q_len + t
        out = layer.kv.attend(grouped, scaling, q_len)
        return out.reshape(batch, q_heads, q_len, dim).transpose(1, 2), None

    def update(self, key_states, value_states, layer_idx: int, *args, kwargs: dict | None = None, **rest):
        """Cache the new keys and values; hand this cache to the attention call that follows
        (``kwargs`` are that call's keyword arguments)."""
        if kwargs is not None:
            kwargs[CACHE_KWARG] = self
        return super().update(key_states, value_states, layer_idx, *args, kwargs=kwargs, **rest)


class PolicyCache(AttendingCache):
    """The KV cache of one generation, owned by a compression policy.

    Parameters
    ----------
    policy : Policy
    num_layers : int
    visual : BoolTensor [N]
        Roles of the prompt tokens (see ``PrefillLayer.visual``).
    """

    def __init__(self, policy: Policy, num_layers: int, visual: torch.Tensor):
        super().__init__([PolicyLayer() for _ in range(num_layers)])
        self.policy = policy
        self.visual = visual
        self.run: dict = {}  # what the policy shares between the layers of this generation
        self.reports: dict[int, object] = {}  # the policy's report of each compressed layer
        self.prefill_peak_bytes = 0
        self.compress_seconds = 0.0  # classification, allocation, pruning, offload: all of compress()
        self.streamed: dict | None = None  # how a streamed prefill read the prompt (None: in one pass)

    def compress_layer(self, index: int, query, key, value, scale: float, device: torch.device | None = None,
                       budget_cap: int | None = None) -> None:
        """Replace layer ``index``'s full prompt KV by the policy's compressed form (``device``:
        where it will be decoded, when the KV is elsewhere; ``budget_cap``: tokens a head may
        keep at most, see :class:`~hybridkv_cli.compression.base.PrefillLayer`)."""
        start = time.perf_counter()
        full_bytes = tensor_bytes(key, value)
        heads = key.shape[1]
        prefill = PrefillLayer(
            index=index,
            num_layers=len(self.layers),
            query=query[0].unflatten(0, (heads, -1)),
            keys=key[0],
            values=value[0],
            visual=self.visual.to(key.device),
            scale=scale,
            run=self.run,
            device=device,
            budget_cap=budget_cap,
        )
        self.layers[index].kv, self.reports[index] = self.policy.compress(prefill)
        # Peak while prefilling: this layer's full KV beside the layers compressed before it.
        self.prefill_peak_bytes = max(self.prefill_peak_bytes, full_bytes + self.device_bytes())
        self.compress_seconds += time.perf_counter() - start

    def summary(self) -> dict | None:
        """The policy's head report of this generation (read once, at the end)."""
        return self.policy.summary([self.reports[i] for i in sorted(self.reports)])

    def _compressed(self) -> list[LayerKV]:
        return [layer.kv for layer in self.layers if layer.kv is not None]

    def device_bytes(self) -> int:
        return sum(kv.device_bytes() for kv in self._compressed())

    def host_bytes(self) -> int:
        return sum(kv.host_bytes() for kv in self._compressed())

    def transferred_bytes(self) -> int:
        return sum(kv.transferred_bytes() for kv in self._compressed())

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more generated tokens in every layer (:meth:`RaggedStore.reserve`)."""
        for kv in self._compressed():
            kv.reserve(rows)

    def advance(self) -> None:
        """The host's count of one token fed by a batch step (its rows are written on the device)."""
        for layer in self.layers:
            layer.seen += 1
            layer.kv.advance()

    @property
    def replayable(self) -> bool:
        """Every layer's decode step repeats the same device work (``LayerKV.replayable``)."""
        return all(kv.replayable for kv in self._compressed())

    @property
    def generated(self) -> int:
        """Generated rows written to every layer's store so far."""
        return self.layers[0].kv.store.n_gen

    @property
    def room(self) -> int:
        """Generated rows allocated and not yet written (the same in every layer)."""
        store = self.layers[0].kv.store
        return store.gen_k.shape[1] - store.n_gen


def layer_count(model) -> int:
    """The layers of a model's text stack: one cache layer each."""
    return int(model.config.get_text_config().num_hidden_layers)


def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function inside :func:`policy_attention` (see the module docstring)."""
    cache = kwargs.pop(CACHE_KWARG, None)
    if cache is None:  # not generating through a PolicyCache (e.g. a plain forward): behave as SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return cache.attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)


@contextlib.contextmanager
def policy_attention(model):
    """Route the language model's attention through :func:`attend` inside the block.

    A multimodal model (one with sub-configs: text, vision, ...) keeps its own attention
    everywhere but in its text model. On exit the model's attention implementations are what
    they were and the name :data:`ATTENTION_NAME` is registered only if it was before.

    A block inside another one switches nothing (so a caller that decodes many steps can hold
    one block around them all instead of switching the model at every step).

    No attention-mask function is registered under the name, so transformers builds no mask:
    prefill runs SDPA with ``is_causal`` (what stock SDPA does for an unpadded prompt) and
    decoding reads the compressed layers, which need none.
    """
    subs = model.config.sub_configs
    previous = ({key: getattr(model.config, key)._attn_implementation for key in subs} if subs
                else model.config._attn_implementation)
    registered = ATTENTION_NAME in ALL_ATTENTION_FUNCTIONS
    text = previous.get("text_config") if subs else previous
    if registered and ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] is attend and text == ATTENTION_NAME:
        yield model  # inside an enclosing block already (a server's worker holds one): nothing to switch
        return
    ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = attend
    try:
        model.set_attn_implementation({key: ATTENTION_NAME if key == "text_config" else previous[key] for key in subs}
                                      if subs else ATTENTION_NAME)
        yield model
    finally:
        model.set_attn_implementation(previous)
        if not registered:
            del ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]
