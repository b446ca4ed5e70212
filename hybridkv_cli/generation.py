"""Prefill + greedy decode through a compression policy, with timing and KV memory accounting."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from hybridkv_cli.compression import Policy
from hybridkv_cli.compression.cache import PolicyCache, policy_attention
from hybridkv_cli.prompt import Prompt


def now(device: torch.device) -> float:
    """Wall clock after the device's queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StepClock(BaseStreamer):
    """Timestamps every token ``generate`` emits (the first put is the prompt itself)."""

    def __init__(self, device: torch.device, on_first_token=None):
        self.device = device
        self.on_first_token = on_first_token
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.stamps.append(now(self.device))
        if len(self.stamps) == 1 and self.on_first_token is not None:
            self.on_first_token()

    def end(self):
        pass


@dataclass
class Generation:
    """Tokens and measurements of one greedy generation."""

    tokens: list[int]
    prefill_s: float
    step_s: list[float]  # wall time of each decode step (the first token comes from prefill)
    cache: PolicyCache
    device_bytes_after_prefill: int
    cuda_peak_bytes: int | None = None


class Meter:
    """The measurements of one generation, from the meter's construction (CUDA's peak memory
    reset, the clock started) to the last token :meth:`decode` emits."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        self.start = time.perf_counter()

    def decode(self, model, inputs: dict, cache: PolicyCache, prompt_length: int, max_new_tokens: int,
               after_prefill: int | None = None) -> Generation:
        """Decode ``inputs`` (the whole prompt; ``generate`` feeds what ``cache`` has not seen)
        with transformers' greedy ``generate``, every token timed. ``after_prefill``: the device
        bytes after the compressed prefill; None: read from the cache when the first token
        arrives, before it is appended (only then, so no other read sits in a timed step)."""
        measured: list[int] = []
        read = None if after_prefill is not None else lambda: measured.append(cache.device_bytes())
        clock = StepClock(self.device, on_first_token=read)
        out = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False,
                             streamer=clock, use_cache=True)
        stamps = [self.start, *clock.stamps]
        return Generation(
            tokens=out[0, prompt_length:].tolist(),
            prefill_s=stamps[1] - stamps[0] if len(stamps) > 1 else 0.0,
            step_s=[b - a for a, b in zip(stamps[1:], stamps[2:])],
            cache=cache,
            device_bytes_after_prefill=after_prefill if after_prefill is not None else (
                measured[0] if measured else cache.device_bytes()),
            cuda_peak_bytes=None if self.base is None else torch.cuda.max_memory_allocated(self.device) - self.base,
        )


def question_length(prompt: Prompt) -> int:
    """Prompt tokens after the media (or text context): the question and the chat-template tail."""
    roles = prompt.visual.nonzero()
    return prompt.length - (int(roles.max()) + 1) if len(roles) else 0


def generate(model, prompt: Prompt, policy: Policy, max_new_tokens: int = 128,
             defer_question: bool = False) -> Generation:
    """Greedy-decode ``prompt`` with the KV cache owned by ``policy``.

    With ``defer_question`` only the prompt up to the end of the media is prefilled and
    compressed; the question and the template tail then go through the compressed cache one
    token per step, as a question about an already-compressed video would (the policy cannot
    see it when it decides). The prompt tokens and the full-cache answer are the same.

    Either way the answer is decoded by one loop, transformers' own greedy ``generate`` (its
    end-of-sequence rule, and its logits processors from the model's generation config), and
    every token is timed when it arrives. The device-byte count after prefill is read when the
    prompt (deferred: its media part) has been compressed, before any later token is appended.
    """
    device = model.device
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in prompt.inputs.items()}
    cut = prompt.length - (question_length(prompt) if defer_question else 0)
    cache = PolicyCache(policy, model.config.get_text_config().num_hidden_layers, prompt.visual[:cut])
    meter = Meter(device)
    with torch.inference_mode(), policy_attention(model):
        if cut == prompt.length:
            return meter.decode(model, inputs, cache, prompt.length, max_new_tokens)
        after_prefill = _feed_prefix(model, inputs, cut, cache)
        return meter.decode(model, per_token(inputs), cache, prompt.length, max_new_tokens, after_prefill)


def per_token(inputs: dict) -> dict:
    """The per-token tensors of ``inputs`` (ids, attention mask, token types), not the pixels."""
    shape = inputs["input_ids"].shape
    return {k: v for k, v in inputs.items() if torch.is_tensor(v) and v.shape == shape and not v.is_floating_point()}


def _feed_prefix(model, inputs: dict, cut: int, cache: PolicyCache) -> int:
    """Prefill the first ``cut`` prompt tokens (compressed as they go), then feed the rest but
    the last one token per step; ``generate`` reads the last one. Returns the device bytes
    right after the compressed prefill."""
    ids = inputs["input_ids"]
    prefix = {k: v[:, :cut] if k in per_token(inputs) else v for k, v in inputs.items()}
    model(**prefix, cache=cache, use_cache=True)
    after_prefill = cache.device_bytes()
    for token in ids[0, cut:-1]:
        model(input_ids=token.view(1, 1), cache=cache, use_cache=True)
    return after_prefill
