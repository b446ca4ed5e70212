"""``prefill(model, prompt, policy, upto) -> Prefix``: the first half of every generation.

The model runs over the prompt's first ``upto`` tokens (all of it for a plain question; up to
the end of the media when the question is read after compression) and the policy compresses
each layer as its attention finishes, so the peak is one layer of full KV beside the compressed
layers. The :class:`Prefix` is what is left: the compressed cache, the positions (the model's
mRoPE offset), the next-token logits, and the measurements of the prefill.

A prefix is decoded from by :func:`hybridkv_cli.engine.jobs.decode`. An unshared prefix (a
plain question) hands its own cache to the one job that decodes it; a ``shared`` one (``-Q``,
``.hkv`` files) hands each job an independent copy, so nothing of one question reaches the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from hybridkv_cli.compression import Policy
from hybridkv_cli.compression.cache import PolicyCache, layer_count, policy_attention
from hybridkv_cli.compression.store import to_host
from hybridkv_cli.engine.graph import Cloner, flatten, rebuild
from hybridkv_cli.engine.measure import Meter, now
from hybridkv_cli.engine.stream import Streaming, positions, stream_prefill
from hybridkv_cli.models.prompt import Prompt, QuestionTemplate


def rope_owner(model):
    """The module holding Qwen2-VL-style ``rope_deltas`` (None: a model without mRoPE state)."""
    for module in (model, getattr(model, "model", None)):
        if module is not None and "rope_deltas" in vars(module):
            return module
    return None


def per_token(inputs: dict) -> dict:
    """The per-token tensors of ``inputs`` (ids, attention mask, token types), not the pixels."""
    shape = inputs["input_ids"].shape
    return {k: v for k, v in inputs.items() if torch.is_tensor(v) and v.shape == shape and not v.is_floating_point()}


@dataclass(eq=False)
class Prefix:
    """A prompt's first ``seen`` tokens, prefilled and compressed (see the module docstring)."""

    policy: Policy
    cache: PolicyCache | None  # None once an unshared prefix's job has taken it
    seen: int
    visual: torch.Tensor  # BoolTensor [seen]: roles of the prefix tokens
    tokens: dict  # per-token tensors [1, seen] of the prefix (ids, attention mask, token types)
    rope_deltas: torch.Tensor | None
    logits: torch.Tensor | None = None  # [1, V] fp32 after the last prefix token (None: read from a file)
    shared: bool = False
    template: QuestionTemplate | None = None  # the tokens around a question asked after the prefix
    meter: Meter | None = None  # started at prefill: an unshared prefix's first token is timed from it
    prefill_s: float = 0.0  # vision encoder + prefill + compression, wall clock
    compress_seconds: float = 0.0
    prefill_peak_bytes: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    info: dict = field(default_factory=dict)  # what a record's "input" says about the media
    role: str = "visual"  # the prefix's bulk tokens: "visual" (media) or "context" (a text prompt)
    text_deltas: torch.Tensor | None = None  # mRoPE offset of the text after the prefix (None: rope_deltas)
    parked: bool = False  # its device state is in host memory (:meth:`park`): decoded only after :meth:`unpark`
    _flat: tuple | None = field(default=None, repr=False)  # a shared prefix's state flattened once, to clone
    _cloner: Cloner | None = field(default=None, repr=False)  # its copies' maker, made from ``_flat`` once

    def rope_for_suffix(self) -> torch.Tensor | None:
        """The mRoPE offset of the text after the prefix -- a question read after it, then the
        answer's tokens: text goes on one position a token, as the model's own ``generate`` and
        one forward pass over prompt and answer place it (not past the media's last time step,
        which may lie beyond the text)."""
        return self.text_deltas if self.text_deltas is not None else self.rope_deltas

    @property
    def state(self) -> tuple:
        """``(layers, reports, run)``: each layer's ``LayerKV``, the policy's report of each
        layer, and the per-generation dict the layers share (what a ``.hkv`` file saves)."""
        cache = self.cache
        return [layer.kv for layer in cache.layers], cache.reports, cache.run

    @classmethod
    def cache_of(cls, policy: Policy, state: tuple, seen: int, visual: torch.Tensor, device, *,
                 prefill_peak_bytes: int = 0, compress_seconds: float = 0.0, streamed: dict | None = None
                 ) -> PolicyCache:
        """A cache holding ``state`` (see :attr:`state`) after ``seen`` tokens, with the
        measurements of the prefill that made it."""
        layers, reports, run = state
        cache = PolicyCache(policy, len(layers), visual)
        cache.prefill_peak_bytes, cache.compress_seconds = prefill_peak_bytes, compress_seconds
        cache.streamed = streamed
        for layer, kv in zip(cache.layers, layers):
            layer.kv, layer.seen, layer.device, layer.is_initialized = kv, seen, device, True
        cache.reports, cache.run = reports, run
        return cache

    def take(self, device: torch.device) -> tuple[PolicyCache, Meter]:
        """The cache a job decodes through, and the meter its generation is timed by: this
        prefix's own (unshared, once) or a fresh copy timed from now (shared)."""
        if self.parked:
            raise RuntimeError("a parked prefix is unparked before it is decoded")
        if not self.shared:
            if self.cache is None:
                raise RuntimeError("an unshared prefix is decoded once")
            cache, self.cache = self.cache, None
            return cache, self.meter
        meter = Meter(device)  # the copy counts as the job's own time
        if self._cloner is None:  # a shared prefix is never decoded itself: its state is copied, the
            self._flat = self._flat or flatten(self.state)  # same way for every question
            self._cloner = Cloner(*self._flat)
        return self.cache_of(self.policy, self._cloner(), self.seen, self.visual, device,
                             prefill_peak_bytes=self.prefill_peak_bytes, compress_seconds=self.compress_seconds,
                             streamed=self.cache.streamed), meter

    def park(self) -> Prefix:
        """This shared prefix with its device state copied to host memory (pinned where CUDA is):
        what a prefix cache keeps when the device's room for kept prefixes is full. The device
        copy is freed with this object (and any copy a decoding job shares). Nothing is copied
        where the device is the CPU."""
        storages, info, tree = self._flat or flatten(self.state)
        host = {key: to_host(data) if info[key]["device"] != "cpu" else data for key, data in storages.items()}
        return replace(self, cache=self._rebuilt(host, tree), parked=True, _flat=(host, info, tree), _cloner=None,
                       logits=None if self.logits is None else self.logits.cpu())  # read with .to(device)

    def unpark(self) -> Prefix:
        """A parked prefix's device state copied back where it was: a prefix to decode from."""
        host, info, tree = self._flat
        with torch.inference_mode():
            back = {key: data.to(info[key]["device"], non_blocking=True) if info[key]["device"] != "cpu" else data
                    for key, data in host.items()}
        return replace(self, cache=self._rebuilt(back, tree), parked=False, _flat=None, _cloner=None)

    def _rebuilt(self, storages: dict, tree) -> PolicyCache:
        return self.cache_of(self.policy, rebuild(storages, tree, checked=False), self.seen, self.visual,
                             self.cache.layers[0].device if self.cache.layers else None,
                             prefill_peak_bytes=self.prefill_peak_bytes, compress_seconds=self.compress_seconds,
                             streamed=self.cache.streamed)


def prefill(model, prompt: Prompt, policy: Policy, upto: int | None = None, *, shared: bool = False,
            streaming: Streaming | None = None) -> Prefix:
    """``prompt``'s first ``upto`` tokens (None: all) prefilled and compressed by ``policy``: in
    one pass, or in chunks when ``streaming`` applies to its length or its video is decoded as it
    is read (:mod:`~hybridkv_cli.engine.stream`).

    The model's own mRoPE state is put back as it was; the offset this prompt gives is kept in
    the prefix. Only the last position's logits are computed (a 150k-word vocabulary over a
    16k-token prompt would be gigabytes)."""
    device = model.device
    upto = prompt.length if upto is None else upto
    whole = {k: v.to(device) if torch.is_tensor(v) else v for k, v in prompt.inputs.items()}
    tokens = per_token(whole)
    inputs = {k: v[:, :upto] if k in tokens else v for k, v in whole.items()}
    owner = rope_owner(model)
    saved = owner.rope_deltas if owner is not None else None
    meter = Meter(device)
    try:
        if owner is not None:
            owner.rope_deltas = None  # computed afresh from this prompt
        if prompt.read_while_prefilling or (streaming is not None and streaming.applies(upto)):
            cache, logits, rope = stream_prefill(model, inputs, prompt.visual[:upto], policy, streaming or Streaming())
        else:
            cache = PolicyCache(policy, layer_count(model), prompt.visual[:upto])
            with torch.inference_mode(), policy_attention(model):
                logits = model(**inputs, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
            rope = owner.rope_deltas if owner is not None else None
        text = None
        if rope is not None:
            # Where the text after the prefix goes is the whole prompt's to say (Qwen's text after
            # a video starts past its height and width, not past its time): a question read
            # later at its place in the prompt, an answer one past the prompt's last token.
            at = positions(model, whole)[0][0]
            text = (at[:, upto] - upto if upto < prompt.length else at[:, -1] + 1 - upto)[:, None]
        rope = rope.clone() if rope is not None else None
    finally:
        if owner is not None:
            owner.rope_deltas = saved
    prefill_s = now(device) - meter.start
    return Prefix(
        policy=policy, cache=cache, seen=upto, visual=prompt.visual[:upto].clone(),
        tokens={k: v[:, :upto].clone() for k, v in tokens.items()}, rope_deltas=rope, text_deltas=text, logits=logits,
        shared=shared, meter=meter, prefill_s=prefill_s, compress_seconds=cache.compress_seconds,
        prefill_peak_bytes=cache.prefill_peak_bytes, device_bytes=cache.device_bytes(),
        host_bytes=cache.host_bytes(), role=prompt.role,
    )
