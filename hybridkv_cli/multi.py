"""One compression, many questions: a media prefix prefilled and compressed once, then each
question answered from a fresh copy of that compressed state.

:func:`compress_prefix` runs the prompt up to the end of the media (question-agnostic, as
``generate(..., defer_question=True)`` does) and keeps a :class:`CompressedPrefix`: the
compressed layers, the policy's reports and per-run state (the refresh controller), the tokens
seen, the per-token inputs of the prefix, and the model's mRoPE offset (``rope_deltas``).
:func:`answer` copies that state (:func:`hybridkv_cli.graph.clone`), feeds the question and the
chat-template tail one token per step through the copy and decodes with transformers' greedy
``generate``, so nothing of one question reaches the next, and each answer is the one a separate
``--defer-question`` run gives (tested for every method).

A question's tokens after the prefix are ``head + question_ids(question) + tail``
(:class:`QuestionTemplate`), what :func:`hybridkv_cli.prompt.build_prompt` splices, read from
one prompt built at compression time, so a saved prefix (``.hkv``) needs no media to be asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv_cli.compression import Policy
from hybridkv_cli.compression.cache import PolicyCache, policy_attention
from hybridkv_cli.generation import Generation, Meter, now, per_token, question_length
from hybridkv_cli.graph import clone
from hybridkv_cli.prompt import Prompt, question_ids

#: The question a prefix's template prompt is built with (any question gives the same template).
TEMPLATE_QUESTION = "?"


@dataclass
class QuestionTemplate:
    """The tokens around the question after the prefix: ``head`` (e.g. ``<|vision_end|>``) and
    ``tail`` (the end of the user turn and the assistant header)."""

    head: list[int]
    tail: list[int]

    @classmethod
    def of(cls, tokenizer, prompt: Prompt, question: str) -> "QuestionTemplate":
        """Read from ``prompt``, built for ``question``: where its question tokens sit after the media."""
        ids = prompt.inputs["input_ids"][0].tolist()
        cut = prompt.length - question_length(prompt)
        q = question_ids(tokenizer, question.strip())
        for start in range(len(ids) - len(q), cut - 1, -1):
            if ids[start:start + len(q)] == q:
                return cls(ids[cut:start], ids[start + len(q):])
        raise RuntimeError("the question's tokens were not found in its prompt")

    def suffix(self, tokenizer, question: str) -> list[int]:
        return [*self.head, *question_ids(tokenizer, question), *self.tail]


def rope_owner(model):
    """The module holding Qwen2-VL-style ``rope_deltas`` (None: a model without mRoPE state)."""
    for module in (model, getattr(model, "model", None)):
        if module is not None and "rope_deltas" in vars(module):
            return module
    return None


@dataclass
class CompressedPrefix:
    """A media (or text context) prefix, prefilled and compressed once (see the module docstring).

    ``state`` is ``(layers, reports, run)``: each layer's ``LayerKV`` in order, the policy's
    report of each layer, and the per-generation dict the layers share. It is never decoded
    through; :meth:`cache` hands out copies.
    """

    policy: Policy
    state: tuple
    seen: int
    visual: torch.Tensor  # BoolTensor [seen]: roles of the prefix tokens
    prefix: dict  # per-token tensors [1, seen] of the prefix (ids, attention mask, token types)
    rope_deltas: torch.Tensor | None
    template: QuestionTemplate
    prefill_s: float = 0.0  # vision encoder + prefill + compression, wall clock
    compress_seconds: float = 0.0
    prefill_peak_bytes: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    info: dict = field(default_factory=dict)  # what the record's "input" says about the media
    role: str = "visual"  # the prefix's bulk tokens: "visual" (media) or "context" (a text prompt)

    def cache(self, num_layers: int, device: torch.device) -> PolicyCache:
        """A fresh cache holding an independent copy of the compressed state."""
        layers, reports, run = clone(self.state)
        cache = PolicyCache(self.policy, num_layers, self.visual)
        for layer, kv in zip(cache.layers, layers):
            layer.kv, layer.seen, layer.device, layer.is_initialized = kv, self.seen, device, True
        cache.reports, cache.run = reports, run
        cache.prefill_peak_bytes, cache.compress_seconds = self.prefill_peak_bytes, self.compress_seconds
        return cache


def compress_prefix(model, prompt: Prompt, policy: Policy, template: QuestionTemplate) -> CompressedPrefix:
    """Prefill and compress ``prompt`` up to the end of its media (the question is not read)."""
    device = model.device
    cut = prompt.length - question_length(prompt)
    if cut == prompt.length:
        raise RuntimeError("the prompt has no question after its media")
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in prompt.inputs.items()}
    tokens = per_token(inputs)
    prefix_inputs = {k: v[:, :cut] if k in tokens else v for k, v in inputs.items()}
    layers = model.config.get_text_config().num_hidden_layers
    cache = PolicyCache(policy, layers, prompt.visual[:cut])
    owner = rope_owner(model)
    start = now(device)
    with torch.inference_mode(), policy_attention(model):
        if owner is not None:
            owner.rope_deltas = None  # computed afresh from this prompt
        model(**prefix_inputs, cache=cache, use_cache=True)
    prefill_s = now(device) - start
    rope = owner.rope_deltas.clone() if owner is not None and owner.rope_deltas is not None else None
    return CompressedPrefix(
        policy=policy,
        state=([layer.kv for layer in cache.layers], cache.reports, cache.run),
        seen=cut,
        visual=prompt.visual[:cut].clone(),
        prefix={k: v[:, :cut].clone() for k, v in tokens.items()},
        rope_deltas=rope,
        template=template,
        prefill_s=prefill_s,
        compress_seconds=cache.compress_seconds,
        prefill_peak_bytes=cache.prefill_peak_bytes,
        device_bytes=cache.device_bytes(),
        host_bytes=cache.host_bytes(),
        role=prompt.role,
    )


def question_prompt(prefix: CompressedPrefix, suffix: list[int]) -> Prompt:
    """The whole prompt of one question: the prefix's per-token tensors, then ``suffix`` (text)."""
    n = len(suffix)
    inputs = {}
    for key, value in prefix.prefix.items():
        if key == "input_ids":
            tail = torch.tensor([suffix], dtype=value.dtype, device=value.device)
        elif key == "attention_mask":
            tail = torch.ones(1, n, dtype=value.dtype, device=value.device)
        else:  # token types: text
            tail = torch.zeros(1, n, dtype=value.dtype, device=value.device)
        inputs[key] = torch.cat([value, tail], dim=1)
    visual = torch.cat([prefix.visual.cpu(), torch.zeros(n, dtype=torch.bool)])
    return Prompt(inputs=inputs, visual=visual, role=prefix.role)


def answer(model, prefix: CompressedPrefix, suffix: list[int], max_new_tokens: int = 128) -> tuple[Generation, Prompt]:
    """Answer one question (its tokens after the prefix: ``suffix``) from a copy of ``prefix``.

    ``prefill_s`` of the result is this question's own time to its first token: copying the
    compressed state, the question tokens through the compressed cache, the first token."""
    device = model.device
    prompt = question_prompt(prefix, suffix)
    inputs = {k: v.to(device) for k, v in prompt.inputs.items()}
    owner = rope_owner(model)
    meter = Meter(device)  # the copy of the compressed state counts as this question's
    cache = prefix.cache(model.config.get_text_config().num_hidden_layers, device)
    with torch.inference_mode(), policy_attention(model):
        if owner is not None:
            owner.rope_deltas = None if prefix.rope_deltas is None else prefix.rope_deltas.to(device)
        for token in inputs["input_ids"][0, prefix.seen:-1]:
            model(input_ids=token.view(1, 1), cache=cache, use_cache=True)
        generation = meter.decode(model, inputs, cache, prompt.length, max_new_tokens, prefix.device_bytes)
    return generation, prompt
