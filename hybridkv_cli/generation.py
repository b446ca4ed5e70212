"""Prefill + greedy decode through a compression policy, with timing and KV memory accounting."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from hybridkv_cli.compression import Policy
from hybridkv_cli.compression.cache import PolicyCache, use_policy_attention
from hybridkv_cli.prompt import Prompt


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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
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
    extra: dict = field(default_factory=dict)


def generate(model, prompt: Prompt, policy: Policy, max_new_tokens: int = 128) -> Generation:
    """Greedy-decode ``prompt`` with the KV cache owned by ``policy``.

    The device-byte count after prefill is read when the first token arrives, before any
    generated token is appended.
    """
    use_policy_attention(model)
    device = model.device
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in prompt.inputs.items()}
    cache = PolicyCache(policy, model.config.get_text_config().num_hidden_layers, prompt.visual)
    after_prefill: list[int] = []
    clock = StepClock(device, on_first_token=lambda: after_prefill.append(cache.device_bytes()))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    with torch.inference_mode(), cache.active():
        out = model.generate(
            **inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False,
            streamer=clock, use_cache=True,
        )
    new = out[0, prompt.length:].tolist()
    stamps = [start, *clock.stamps]
    return Generation(
        tokens=new,
        prefill_s=stamps[1] - stamps[0] if len(stamps) > 1 else 0.0,
        step_s=[b - a for a, b in zip(stamps[1:], stamps[2:])],
        cache=cache,
        device_bytes_after_prefill=after_prefill[0] if after_prefill else cache.device_bytes(),
        cuda_peak_bytes=torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None,
    )
