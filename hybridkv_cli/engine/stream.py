"""Streamed prefill: a long prompt read in chunks, with a bounded working set of KV on the device.

A one-shot prefill holds, while it reads, every frame's pixels, the vision tower's and the
layers' activations over the whole prompt, and each layer's full KV while it is compressed; for
an hour of video that is more than a GPU has. A streamed prefill reads the
prompt in chunks that never split an image or a video's temporal group
(:mod:`hybridkv_cli.models.chunks`):

* each layer's attention over a chunk sees the layer's *working set* (at most ``window`` earlier
  tokens, on the device) and the chunk itself, causally;
* after the chunk the working set keeps the ``window`` tokens the chunk's last queries attend to
  most (text tokens and the first :data:`SINKS` always); the others move to host memory, into
  the layer's full-length host buffer;
* after the last chunk each layer's whole KV, assembled in host memory, is handed to the policy
  with the trailing queries, as a one-shot prefill hands it, and what the policy keeps on the
  device is moved there: the device never holds more than the working sets, one chunk and the
  compressed layers.

Later chunks attend to at most ``window`` earlier tokens, so their hidden states approximate the
one-shot's once the prompt is longer than that; what the policy compresses is everything read.
With ``window`` at least the prompt nothing moves and the tokens are the one-shot prefill's.
Positions (3-D mRoPE on Qwen2/2.5-VL) are computed once for the whole prompt; each chunk is given
its own.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hybridkv_cli.compression import Policy
from hybridkv_cli.compression.cache import AttendingCache, PolicyCache, layer_count, policy_attention
from hybridkv_cli.compression.host_memory import host_empty
from hybridkv_cli.compression.store import tensor_bytes
from hybridkv_cli.engine.graph import to_device
from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.models.chunks import chunk_bounds, chunk_inputs, visual_units

SINKS = 4  # the first tokens every working set keeps (attention sinks)
OBSERVED = 32  # a chunk's last queries whose attention decides what its working set keeps
MODES = ("auto", "on", "off")
#: ``--stream auto`` streams media longer than this: past it a one-pass prefill's activations
#: (and, for a 7B model, each layer's full KV) cost gigabytes, below it one pass reads the
#: question with the media (a streamed prompt reads it after compression).
AUTO_TOKENS = 65536


@dataclass(frozen=True)
class Streaming:
    """How a prompt is prefilled: ``mode`` ``auto`` streams media longer than
    :data:`AUTO_TOKENS` tokens, ``on`` every prompt, ``off`` none; ``chunk`` tokens a chunk
    (about), ``window`` tokens each layer's working set keeps on the device while reading;
    ``kv_tokens`` caps what the method keeps of a streamed prompt, whatever its length (the
    budget becomes ``min(b, kv_tokens / N)``), so device KV stays flat as a video grows."""

    mode: str = "auto"
    chunk: int = 2048
    window: int = 16384
    kv_tokens: int | None = None  # the compressed KV a head keeps at most, in tokens (None: the budget's share)

    def __post_init__(self):
        if self.mode not in MODES:
            raise UsageError(f"--stream must be one of {', '.join(MODES)}, got '{self.mode}'", "--stream")
        for flag, value in (("--stream-chunk", self.chunk), ("--stream-window", self.window),
                            ("--stream-kv-tokens", 1 if self.kv_tokens is None else self.kv_tokens)):
            if type(value) is not int or value < 1:
                raise UsageError(f"{flag} must be a positive number of tokens, got {value}", flag)

    def applies(self, length: int) -> bool:
        return self.mode == "on" or (self.mode == "auto" and length > AUTO_TOKENS)


class WorkingLayer(CacheLayerMixin):
    """One layer while streaming: the working set on the device, the rest in ``host`` [H, N, d]."""

    is_compileable = False
    is_sliding = False

    def __init__(self, length: int):
        super().__init__()
        self.length = length
        self.seen = 0
        self.index = torch.empty(0, dtype=torch.long)  # prompt position of each working-set token
        self.keys = self.values = None  # [H, M, d] on the device
        self.host_k = self.host_v = None  # [H, N, d] host buffers (pinned on CUDA)
        self.tail = None  # the latest queries [Hq, T, d], what the policy scores with at the end

    def lazy_initialization(self, key_states, value_states) -> None:
        heads, dim = key_states.shape[1], key_states.shape[-1]
        self.host_k = host_empty((heads, self.length, dim), key_states.dtype, key_states.is_cuda)
        self.host_v = host_empty((heads, self.length, dim), key_states.dtype, key_states.is_cuda)
        self.keys, self.values = key_states[0, :, :0], value_states[0, :, :0]
        self.index = self.index.to(key_states.device)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = torch.arange(self.seen, self.seen + key_states.shape[-2], device=self.index.device)
        self.seen += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states[0]], dim=1)
        self.values = torch.cat([self.values, value_states[0]], dim=1)
        self.index = torch.cat([self.index, new])
        return self.keys[None], self.values[None]

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen, 0

    def get_max_length(self) -> int:
        return -1

    def device_bytes(self) -> int:
        return tensor_bytes(self.keys, self.values)

    def keep(self, query: torch.Tensor, scale: float, window: int, visual: torch.Tensor) -> None:
        """After a chunk: keep the ``window`` tokens its last queries attend to most (and every
        text token and sink); move the others to the host buffer."""
        heads, total, dim = self.keys.shape
        if total <= window:
            return
        q = query[0, :, -OBSERVED:].float()  # [Hq, w, d]
        seen = q.shape[1]
        logits = torch.einsum("hwd,hnd->hwn", q, self.keys.float().repeat_interleave(q.shape[0] // heads, 0)) * scale
        own = self.index[-seen:]  # a query sees the tokens up to its own position
        logits.masked_fill_(self.index[None, None, :] > own[None, :, None], float("-inf"))
        score = torch.softmax(logits, dim=-1).mean(dim=1).unflatten(0, (heads, -1)).amax(dim=(0, 1))
        forced = ~visual[self.index] | (self.index < SINKS)
        score = score.masked_fill(forced, float("inf"))
        kept = torch.zeros(total, dtype=torch.bool, device=self.keys.device)
        kept[score.topk(max(window, int(forced.sum()))).indices] = True
        gone = self.index[~kept].to(self.host_k.device)  # blocking copies: the host reads them at once
        self.host_k[:, gone] = self.keys[:, ~kept].to(self.host_k.device)
        self.host_v[:, gone] = self.values[:, ~kept].to(self.host_v.device)
        self.keys, self.values, self.index = self.keys[:, kept], self.values[:, kept], self.index[kept]

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole KV [H, N, d] in host memory (the working set written back)."""
        at = self.index.to(self.host_k.device)
        self.host_k[:, at] = self.keys.to(self.host_k.device)
        self.host_v[:, at] = self.values.to(self.host_v.device)
        self.keys = self.values = None
        return self.host_k, self.host_v


class StreamCache(AttendingCache):
    """The cache of a streamed prefill (see the module docstring)."""

    def __init__(self, num_layers: int, length: int, window: int, visual: torch.Tensor, tail: int):
        super().__init__([WorkingLayer(length) for _ in range(num_layers)])
        self.window, self.visual, self.tail = window, visual, tail
        self.scale = None
        self.peak_bytes = 0

    def attention(self, module, query, key, value, attention_mask, scaling, dropout, kwargs):
        layer = self.layers[module.layer_idx]
        length = query.shape[2]
        earlier = key.shape[2] - length
        mask = None
        if earlier:  # every working-set token, then the chunk causally
            mask = torch.ones(length, key.shape[2], dtype=torch.bool, device=query.device).tril_(earlier)[None, None]
        out = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
        self.peak_bytes = max(self.peak_bytes, self.device_bytes())
        self.scale = scaling
        tail = query[0] if layer.tail is None else torch.cat([layer.tail.to(query.device), query[0]], dim=1)
        layer.tail = tail[:, -self.tail:]
        layer.keep(query, scaling, self.window, self.visual.to(query.device))
        return out

    def device_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers if layer.keys is not None)


def streamed(prompt, streaming: Streaming | None) -> bool:
    """Whether ``prompt``'s media is prefilled in chunks: its video is decoded as it is read, or
    ``streaming`` applies to the media's length. A streamed prompt's question is then read after
    compression (as with ``--defer-question``): in the last chunk it would attend to the working
    sets only, not to the whole media (on the dev needles, 2 of 8 right with a 64-token window,
    against 7 of 8 read after compression: docs/streaming.md)."""
    return prompt.read_while_prefilling or (streaming is not None and streaming.applies(prompt.question_start))


def positions(model, inputs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The whole prompt's position ids and its mRoPE offset, as the model computes them (None,
    None for a model that derives positions from the cache length)."""
    owner = next((m for m in (model, getattr(model, "model", None)) if m is not None and hasattr(m, "get_rope_index")),
                 None)
    if owner is None or (inputs.get("pixel_values") is None and inputs.get("pixel_values_videos") is None):
        return None, None
    accepted = inspect.signature(owner.get_rope_index).parameters
    return owner.get_rope_index(**{k: v for k, v in inputs.items() if k in accepted})


def stream_prefill(model, inputs: dict, visual: torch.Tensor, policy: Policy, streaming: Streaming,
                   ) -> tuple[PolicyCache, torch.Tensor, torch.Tensor | None]:
    """``inputs`` (one prompt's, on the model's device, cut at the prefix's end) prefilled in
    chunks and compressed by ``policy``: ``(cache, logits, rope_deltas)``; ``cache.streamed``
    says how (chunks, tokens a chunk, working window, the device KV peak while reading -- the
    working sets, before the compressed state takes their place --, the cap in tokens and the
    budget it left)."""
    length = inputs["input_ids"].shape[1]
    units = visual_units(model.config, inputs)
    bounds = chunk_bounds(units, length, streaming.chunk)
    pos, rope = positions(model, inputs)
    layers = layer_count(model)
    stream = StreamCache(layers, length, streaming.window, visual, tail=max(streaming.chunk, OBSERVED))
    with torch.inference_mode(), policy_attention(model):
        for start, end in bounds:
            extra = {} if pos is None else {"position_ids": pos[..., start:end]}
            logits = model(**chunk_inputs(inputs, units, start, end), **extra, cache=stream, use_cache=True,
                           logits_to_keep=1).logits[:, -1].float()
        read_peak = stream.peak_bytes
        cache = PolicyCache(policy, layers, visual)
        for index, layer in enumerate(stream.layers):
            keys, values = layer.full()
            tail = layer.tail
            cache.compress_layer(index, tail[None].to(keys.device), keys[None], values[None], stream.scale,
                                 device=model.device, budget_cap=streaming.kv_tokens)
            layer.host_k = layer.host_v = layer.tail = None
            stream.peak_bytes = max(stream.peak_bytes, stream.device_bytes() + cache.device_bytes())
        # What the policy keeps on the device goes there; its host state stays (pinned).
        kvs, cache.reports, cache.run = to_device(([layer.kv for layer in cache.layers], cache.reports, cache.run),
                                                  model.device)
        for layer, kv in zip(cache.layers, kvs):
            layer.kv, layer.seen, layer.device, layer.is_initialized = kv, length, model.device, True
    cache.prefill_peak_bytes = stream.peak_bytes
    budget = policy.budget if streaming.kv_tokens is None else min(policy.budget, streaming.kv_tokens / length)
    cache.streamed = {"chunks": len(bounds), "chunk_tokens": streaming.chunk, "window": streaming.window,
                      "read_peak_bytes": read_peak, "kv_tokens": streaming.kv_tokens, "budget": budget}
    return cache, logits, rope
