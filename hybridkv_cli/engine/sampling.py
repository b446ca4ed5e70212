"""Sampled tokens that do not depend on the batch: ``temperature`` / ``top_p`` with a seed.

A token is drawn by the Gumbel-max rule: the argmax of ``logits / temperature + g``, where ``g``
is Gumbel noise, one value per vocabulary entry, over the tokens of the top-``p`` nucleus -- a
draw from the softmax at that temperature, restricted to the nucleus. The noise is not taken
from a random generator shared by the batch but computed from ``(seed, index of the token in its
answer, vocabulary id)`` by an integer hash, so a member's tokens are the same alone or beside
any others, on the CPU or a GPU, and the same seed gives the same answer again. All of it is
tensor work on the device over the batch (no host read, no loop over members); a batch in which
nobody samples takes the plain argmax.
"""

from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass, replace

import torch

MASK32 = 0xFFFFFFFF
#: the largest temperature served (OpenAI's bound)
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class Sampling:
    """How one answer's tokens are chosen: ``temperature`` 0 is greedy (``top_p`` then changes
    nothing); ``seed`` fixes the draws."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError("top_p must be above 0 and at most 1")
        if not -2**63 <= self.seed < 2**64:
            raise ValueError("the seed must be a 64-bit integer")

    @classmethod
    def of(cls, temperature: float, top_p: float = 1.0, seed: int | None = None) -> Sampling:
        """A request's sampling: greedy at temperature 0, else drawn with ``seed`` or a fresh one
        (which the record names, so the answer can be drawn again)."""
        if temperature == 0:
            return GREEDY
        return cls(temperature, top_p, secrets.randbits(63) if seed is None else seed)

    def nth(self, index: int) -> Sampling:
        """The sampling of answer ``index`` of several to one request (OpenAI's ``n``): its seed +
        ``index``, modulo 2**64, so each is drawn again alone with that seed (answer 0: this one)."""
        return self if self.greedy or index == 0 else replace(self, seed=(self.seed + index) % 2**64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seed64(self) -> int:
        """The seed's 64 bits as a signed int64 (what a tensor holds)."""
        bits = self.seed % 2**64
        return bits - 2**64 if bits >= 2**63 else bits


GREEDY = Sampling()


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c`` modulo 2**32 for ``x`` in [0, 2**32), in int64 without overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (the "lowbias32" constants) of int64 ``x`` in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 in (0, 1): the noise of draw ``index[b]`` of seed ``seed[b]`` (int64 [B],
    the seed's two 32-bit halves mixed in turn)."""
    key = hash32(hash32(hash32(seed & MASK32) ^ ((seed >> 32) & MASK32)) ^ (index & MASK32))
    bits = hash32(key[:, None] ^ _vocab_hashes(vocab, seed.device)[None, :]) >> 8  # 24 bits: exact in float32
    return (bits.float() + 0.5) * 2.0**-24


@functools.lru_cache(maxsize=4)
def _vocab_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """The mixed vocabulary ids, made once per vocabulary size and device."""
    return hash32(torch.arange(vocab, dtype=torch.int64, device=device))


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
           index: torch.Tensor, nucleus: bool) -> torch.Tensor:
    """[B] int64: each row's token of ``logits`` ([B, V] float32, after the logits processors):
    the argmax where ``temperature`` is 0, else a draw at that temperature from the top-``p``
    nucleus (``nucleus``: some row has ``top_p`` < 1; else no sort is made)."""
    sampled = temperature > 0
    scaled = logits / torch.where(sampled, temperature, 1.0)[:, None]
    if nucleus:
        order = scaled.sort(dim=-1, descending=True)
        probs = order.values.softmax(dim=-1)
        outside = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # the mass before a token already covers p
        outside &= (top_p < 1)[:, None]
        scaled = scaled.masked_fill(torch.zeros_like(outside).scatter(1, order.indices, outside), -math.inf)
    gumbel = -torch.log(-torch.log(uniform(seed, index, logits.shape[-1])))
    return torch.where(sampled[:, None], scaled + gumbel, logits).argmax(dim=-1)


class BatchSampling:
    """The batch's sampling, one row per member, as device tensors beside the decoder's feed: what
    :func:`choose` reads, and each member's count of tokens drawn (advanced every step in place)."""

    def __init__(self, device, samplings: list[Sampling] = (), drawn: list[int] = ()):
        self.samplings = list(samplings)
        self.temperature = torch.tensor([s.temperature for s in self.samplings], dtype=torch.float32, device=device)
        self.top_p = torch.tensor([s.top_p for s in self.samplings], dtype=torch.float32, device=device)
        self.seed = torch.tensor([s.seed64 for s in self.samplings], dtype=torch.int64, device=device)
        self.drawn = torch.tensor(list(drawn), dtype=torch.int64, device=device)

    @property
    def sampled(self) -> bool:
        return any(not s.greedy for s in self.samplings)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[B] int64: each member's next token of ``logits`` [B, V] (see :func:`choose`); its draw
        counted."""
        if not self.sampled:
            tokens = logits.argmax(dim=-1)
        else:
            nucleus = any(not s.greedy and s.top_p < 1 for s in self.samplings)
            tokens = choose(logits, self.temperature, self.top_p, self.seed, self.drawn, nucleus)
        self.drawn.add_(1)
        return tokens

    def join(self, other: BatchSampling) -> None:
        self.samplings += other.samplings
        for name in ("temperature", "top_p", "seed", "drawn"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))

    def keep(self, keep: list[int], index: torch.Tensor) -> None:
        """Only the members at ``keep`` (``index``: the same on the device) stay."""
        self.samplings = [self.samplings[b] for b in keep]
        for name in ("temperature", "top_p", "seed", "drawn"):
            setattr(self, name, getattr(self, name).index_select(0, index))
