"""Sampled tokens that do not depend on the batch: ``temperature`` / ``top_p`` with a seed.

A token is drawn by the Gumbel-max rule: the argmax of ``logits / temperature + g``, where ``g``
is Gumbel noise, one value per vocabulary entry, over the tokens of the top-``p`` nucleus -- a
draw from the softmax at that temperature, restricted to the nucleus. The noise is not taken
from a random generator shared by the batch but computed from ``(seed, index of the token in its
answer, vocabulary id)`` by an integer hash, so a member's tokens are the same alone or beside
any others, on the CPU or a GPU, and the same seed gives the same answer again. All of it is
tensor work on the device over the batch (no host read, no loop over members); a batch in which
nobody samples takes the plain argmax.

``presence_penalty`` / ``frequency_penalty`` (OpenAI's) lower the logits of the tokens the answer
has generated: by the presence penalty once a token is there, and by the frequency penalty times
its count. The counts are kept on the device, a row per member, advanced by each step's tokens.
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
#: the largest penalty either way (OpenAI's bound)
MAX_PENALTY = 2.0


@dataclass(frozen=True)
class Sampling:
    """How one answer's tokens are chosen: ``temperature`` 0 is greedy (``top_p`` then changes
    nothing); ``seed`` fixes the draws; the penalties lower the logits of the tokens it has
    generated (greedy or not)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError("top_p must be above 0 and at most 1")
        if not -2**63 <= self.seed < 2**64:
            raise ValueError("the seed must be a 64-bit integer")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (math.isfinite(getattr(self, name)) and abs(getattr(self, name)) <= MAX_PENALTY):
                raise ValueError(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}")

    @classmethod
    def of(cls, temperature: float, top_p: float = 1.0, seed: int | None = None, presence_penalty: float = 0.0,
           frequency_penalty: float = 0.0) -> Sampling:
        """A request's sampling: greedy at temperature 0, else drawn with ``seed`` or a fresh one
        (which the record names, so the answer can be drawn again); with its penalties."""
        if temperature == 0:
            return replace(GREEDY, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
        return cls(temperature, top_p, secrets.randbits(63) if seed is None else seed, presence_penalty,
                   frequency_penalty)

    def nth(self, index: int) -> Sampling:
        """The sampling of answer ``index`` of several to one request (OpenAI's ``n``): its seed +
        ``index``, modulo 2**64, so each is drawn again alone with that seed (answer 0: this one)."""
        return self if self.greedy or index == 0 else replace(self, seed=(self.seed + index) % 2**64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

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
    :func:`choose` reads, each member's count of tokens drawn (advanced every step in place) and,
    when a member has a penalty, every member's count of each token it has generated and the
    logit penalty that makes (``counts``, ``penalty`` [B, V]; None: nobody is penalised). A step
    subtracts the penalty and updates both at the B tokens it chose (no pass over the counts)."""

    def __init__(self, device, samplings: list[Sampling] = (), answers: list[list[int]] = (), vocab: int = 0):
        self.samplings = list(samplings)
        self.temperature = torch.tensor([s.temperature for s in self.samplings], dtype=torch.float32, device=device)
        self.top_p = torch.tensor([s.top_p for s in self.samplings], dtype=torch.float32, device=device)
        self.seed = torch.tensor([s.seed64 for s in self.samplings], dtype=torch.int64, device=device)
        self.drawn = torch.tensor([len(a) for a in answers], dtype=torch.int64, device=device)
        self.presence = torch.tensor([s.presence_penalty for s in self.samplings], dtype=torch.float32, device=device)
        self.frequency = torch.tensor([s.frequency_penalty for s in self.samplings], dtype=torch.float32,
                                      device=device)
        self.counts = self.penalty = None
        if any(s.penalised for s in self.samplings):
            self.counts = torch.zeros(len(self.samplings), vocab, dtype=torch.float32, device=device)
            for row, tokens in zip(self.counts, answers):  # when it joins: the answer's tokens so far
                row.index_put_((torch.tensor(tokens, dtype=torch.long, device=device),),
                               torch.ones(len(tokens), device=device), accumulate=True)
            self.penalty = self.frequency[:, None] * self.counts + self.presence[:, None] * (self.counts > 0)

    @property
    def sampled(self) -> bool:
        return any(not s.greedy for s in self.samplings)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[B] int64: each member's next token of ``logits`` [B, V] (see :func:`choose`), after
        its penalties; its draw counted."""
        if self.penalty is not None:
            logits = logits - self.penalty
        if not self.sampled:
            tokens = logits.argmax(dim=-1)
        else:
            nucleus = any(not s.greedy and s.top_p < 1 for s in self.samplings)
            tokens = choose(logits, self.temperature, self.top_p, self.seed, self.drawn, nucleus)
        self.drawn.add_(1)
        if self.penalty is not None:  # the chosen tokens: counted, and penalised from the next step on
            at = tokens[:, None]
            held = self.counts.gather(1, at)
            self.penalty.scatter_add_(1, at, self.frequency[:, None] + self.presence[:, None] * (held == 0))
            self.counts.scatter_add_(1, at, torch.ones_like(held))
        return tokens

    def join(self, other: BatchSampling) -> None:
        """``other``'s members after these (a member without a penalty counts nothing: its
        counts, zeros, are multiplied by zeros)."""
        if (self.counts is None) != (other.counts is None):
            vocab = (self.counts if self.counts is not None else other.counts).shape[1]
            for side in (self, other):
                if side.counts is None:
                    side.counts = side.presence.new_zeros(len(side.samplings), vocab)
                    side.penalty = side.presence.new_zeros(len(side.samplings), vocab)
        self.samplings += other.samplings
        for name in self._rows():
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))

    def keep(self, keep: list[int], index: torch.Tensor) -> None:
        """Only the members at ``keep`` (``index``: the same on the device) stay."""
        self.samplings = [self.samplings[b] for b in keep]
        for name in self._rows():
            setattr(self, name, getattr(self, name).index_select(0, index))
        if self.counts is not None and not any(s.penalised for s in self.samplings):
            self.counts = self.penalty = None

    def _rows(self) -> tuple[str, ...]:
        return ("temperature", "top_p", "seed", "drawn", "presence", "frequency") + (
            ("counts", "penalty") if self.counts is not None else ())
