"""The measurements of one generation: its clock, CUDA peak memory and the :class:`Generation` it ends with.

Everything that reports a generation's timing or memory -- the engine's decode loop and the
library's ``with compress(model)`` around a caller's own ``generate`` -- builds it here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hybridkv_cli.compression.cache import PolicyCache


def now(device: torch.device) -> float:
    """Wall clock after the device's queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Generation:
    """Tokens and measurements of one generation."""

    tokens: list[int]
    prefill_s: float  # to the first token: prefill and compression, or (from a shared prefix) its own suffix
    step_s: list[float]  # wall time of each decode step after the first token
    cache: PolicyCache
    device_bytes_after_prefill: int
    compressed: int  # prompt tokens the policy compressed (the budget's base)
    cuda_peak_bytes: int | None = None
    logprobs: list | None = None  # when asked: each token's (log probability, [(id, log probability)] best first)


class Meter:
    """One generation's clock and CUDA peak, from construction (the peak reset, the clock
    started) to :meth:`finish`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        self.start = time.perf_counter()
        self.first: float | None = None  # seconds to the first token
        self.steps: list[float] = []
        self._last = self.start

    def token(self, at: float | None = None, step: float | None = None) -> None:
        """A token arrived (``at``: when, if the caller read the clock already); ``step``: how
        long the step that made it took (a batch step), else the time since the last token."""
        at = now(self.device) if at is None else at
        if self.first is None:
            self.first = at - self.start
        else:
            self.steps.append(at - self._last if step is None else step)
        self._last = at

    def finish(self, tokens: list[int], cache: PolicyCache, after_prefill: int, compressed: int) -> Generation:
        return Generation(
            tokens=tokens,
            prefill_s=self.first or 0.0,
            step_s=list(self.steps),
            cache=cache,
            device_bytes_after_prefill=after_prefill,
            compressed=compressed,
            cuda_peak_bytes=None if self.base is None else torch.cuda.max_memory_allocated(self.device) - self.base,
        )
