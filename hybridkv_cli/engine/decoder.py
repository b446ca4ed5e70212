"""The one decode loop: every generation's tokens after its prefix, one batch step at a time.

A member joins with a job (:class:`~hybridkv_cli.engine.jobs.Job`): the cache of its prefix
(the prefix's own, or a copy) and its suffix, the prompt tokens after the prefix (a question
read after compression, or nothing). When it starts, its suffix goes through its compressed
cache in one forward pass (a chunk of ``len(suffix)`` queries, :meth:`LayerKV.attend`), whose
last logits give its first token; so it joins the batch with that token, as a member with no
suffix joins with the token of its prefix's logits. Members that start together read their
suffixes in the same pass, side by side
(:class:`~hybridkv_cli.compression.packed_cache.PackedCache`). A batch step feeds every member's
next token through the model at once (``[B, 1]`` ids, each at its own position); each layer's
attention reads all the members' stores in one launch
(:class:`~hybridkv_cli.compression.batch_cache.BatchCache`). The tokens are the model's own
logits processors' and, per member, the greedy choice or a seeded draw
(:mod:`~hybridkv_cli.engine.sampling`: the same tokens alone or in any batch; the
penalties of OpenAI's API from counts kept on the device). A member that finishes (the model's end of sequence, or
``max_new_tokens``) leaves at once and its store goes with it.

A batch of one is a plain question; the tokens do not depend on the batch (tested for every
method).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv_cli.compression.batch_cache import BatchCache
from hybridkv_cli.compression.cache import PolicyCache, layer_count, policy_attention
from hybridkv_cli.compression.packed_cache import PackedCache
from hybridkv_cli.compression.store import GEN_BLOCK
from hybridkv_cli.engine.measure import Generation, Meter, now
from hybridkv_cli.engine.prefix import rope_owner
from hybridkv_cli.engine.replay import StepReplay
from hybridkv_cli.engine.sampling import GREEDY, BatchSampling


@dataclass(eq=False)  # members are told apart by identity
class Member:
    """One generation in the batch: its job, its cache and meter, its tokens so far."""

    job: Any
    cache: PolicyCache
    meter: Meter
    processors: Any  # the model's logits processors (an empty list for most models)
    ids: torch.Tensor | None  # [1, L] every token fed so far, kept only for processors to read
    bytes: int  # device KV, measured when it joined and when its generated rows grow
    joined: int  # the batch step it joined at
    tokens: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # members in each of its steps
    kv_peak: int = 0  # most device KV of the batch during its steps
    replayed: int = 0  # its steps replayed as a CUDA graph
    logprobs: list | None = None  # when its job asks: each token's log probability and best alternatives

    def generation(self) -> Generation:
        prefix = self.job.prefix
        generation = self.meter.finish(self.tokens, self.cache, prefix.device_bytes, prefix.seen)
        generation.logprobs = self.logprobs
        return generation


class Decoder:
    """The batch being decoded (see the module docstring). Its per-step inputs live on the
    device as batch tensors (the tokens to feed and their positions) updated in place, so a
    step's device work (:meth:`_device_step`) reads and writes the same tensors every step until
    members join or leave; with ``cuda_graphs`` it is replayed as a CUDA graph."""

    def __init__(self, model, max_new_tokens: int, cuda_graphs: bool = False, allocate_all: bool = False):
        self.model = model
        self.allocate_all = allocate_all  # every row a member will write, when it starts (else block by block)
        self.device = model.device
        self.max_new_tokens = max_new_tokens
        self.replay = StepReplay(self._device_step, cuda_graphs)
        # the kernels are the device's default either way: --cuda-graphs only replays them
        self.cache = BatchCache(layer_count(model), self.device)
        self.members: list[Member] = []
        self.rows = position_rows(model)
        self.feed = torch.empty(0, 1, dtype=torch.long, device=self.device)  # [B, 1] next tokens
        self.position = torch.empty(self.rows, 0, 1, dtype=torch.long, device=self.device)  # [R, B, 1]
        self.sampling = BatchSampling(self.device)  # each member's temperature, top-p, seed, penalties and draws
        self.vocab = 0  # the logits' width (known from the first logits)
        self.logits = None  # [B, V] fp32: the step's output
        self.config, _ = model._prepare_generation_config(None, max_new_tokens=max_new_tokens, do_sample=False)
        eos = self.config.eos_token_id
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self.steps = 0

    def limit(self, job) -> int:
        """The most new tokens of ``job``: its own limit, else the run's."""
        return getattr(job, "max_new_tokens", None) or self.max_new_tokens

    def finished(self, tokens: list[int], limit: int | None = None) -> bool:
        return len(tokens) >= (limit or self.max_new_tokens) or (bool(tokens) and tokens[-1] in self.eos)

    def start(self, jobs: list) -> list:
        """The members of ``jobs``, in order, each with its first token: its prefix prefilled now
        if it has none yet, then every suffix read through its cache, all in one pass
        (:meth:`read`), or (no suffix) its prefix's logits. A job that could not start has its
        error in its place (a failed read: every job whose suffix it read). A member joins the
        batch with :meth:`join` unless its first token already finished it."""
        started = []
        for job in jobs:
            try:
                started.append(self._take(job))
            except Exception as e:
                started.append(e)
        reading = [m for m in started if isinstance(m, Member) and m.job.suffix]
        if reading:
            try:
                rows = iter(self.read([m.cache for m in reading], [list(m.job.suffix) for m in reading],
                                      [m.job.prefix.rope_for_suffix() for m in reading]))
            except Exception as e:
                return [e if isinstance(m, Member) and m.job.suffix else m for m in started]
        members = [m for m in started if isinstance(m, Member)]
        if members:
            self._first(members, [next(rows)[None] if m.job.suffix else m.job.prefix.logits.to(self.device)
                                  for m in members])
        return started

    def _take(self, job) -> Member:
        """``job``'s member before its first token: its prefix (prefilled now if it has none
        yet) and the cache it decodes through."""
        if job.prefix is None:
            job.prefix = job.prefill()
        prefix, suffix = job.prefix, list(job.suffix)
        if not suffix and prefix.logits is None:
            raise RuntimeError("a prefix read from a file needs a question to decode")
        cache, meter = prefix.take(self.device)
        # the suffix's rows and every answer token's fed after it, or (as a store grows by itself) a first block
        cache.reserve(len(suffix) + (self.limit(job) - 1 if self.allocate_all else GEN_BLOCK))
        ids = torch.cat([prefix.tokens["input_ids"].to(self.device),
                         torch.tensor([suffix], dtype=torch.long, device=self.device)], dim=1)
        processors = self.model._get_logits_processor(
            generation_config=self.config, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
            device=self.device, model_kwargs={})
        return Member(job, cache, meter, processors, ids, bytes=0, joined=self.steps,
                      logprobs=None if getattr(job, "logprobs", None) is None else [])

    def _first(self, members: list[Member], logits: list[torch.Tensor]) -> None:
        """Each member's first token, from its [1, V] fp32 ``logits`` after its prompt (the
        tokens read on the host once for them all)."""
        chosen = torch.cat([m.processors(m.ids, row) if m.processors else row for m, row in zip(members, logits)])
        self.vocab = chosen.shape[-1]
        draws = BatchSampling(self.device, [sampling_of(m.job) for m in members], [[]] * len(members), self.vocab)
        for m, first in zip(members, self._chosen(members, chosen, draws.choose(chosen))):
            m.meter.token()
            m.ids = torch.cat([m.ids, m.ids.new_tensor([[first]])], dim=1) if m.processors else None
            m.tokens.append(first)
            m.bytes = m.cache.device_bytes()

    @staticmethod
    def _chosen(members: list[Member], logits: torch.Tensor, tokens: torch.Tensor) -> list[int]:
        """The chosen ``tokens`` ([B] on the device) read on the host, in the same one read with
        the log probabilities of the members that ask for them (after the logits processors, before
        a temperature), which go to their ``logprobs``."""
        k = max((m.job.logprobs for m in members if m.logprobs is not None), default=None)
        if k is None:
            return tokens.tolist()
        log = logits.log_softmax(dim=-1)
        top = log.topk(k, dim=-1)
        rows = torch.cat([tokens[:, None].double(), log.gather(1, tokens[:, None]).double(), top.values.double(),
                          top.indices.double()], dim=1).tolist()
        for m, row in zip(members, rows):
            if m.logprobs is not None:
                best = m.job.logprobs
                m.logprobs.append((row[1], [(int(i), v) for v, i in zip(row[2:2 + best], row[2 + k:2 + k + best])]))
        return [int(row[0]) for row in rows]

    def read(self, caches: list[PolicyCache], suffixes: list[list[int]], ropes: list) -> torch.Tensor:
        """Each of ``suffixes`` through its cache of ``caches``, all in one forward pass
        (:class:`~hybridkv_cli.compression.packed_cache.PackedCache`): each layer attends each
        suffix as one chunk over its own compressed KV (its rows appended, causally), the
        positions of each after its own prefix (``ropes``: their mRoPE offsets). The [n, V] fp32
        logits after each suffix's last token."""
        ids = torch.tensor([[token for suffix in suffixes for token in suffix]], dtype=torch.long, device=self.device)
        position = text_positions(self.rows, [self._span(cache.get_seq_length(), len(suffix), rope)
                                              for cache, suffix, rope in zip(caches, suffixes, ropes)], self.device)
        packed = PackedCache(caches, [len(suffix) for suffix in suffixes])
        with torch.inference_mode(), policy_attention(self.model):
            out = self.model(input_ids=ids, position_ids=position if self.rows > 1 else position[0],
                             cache_position=position[0, 0], cache=packed, use_cache=True,
                             logits_to_keep=packed.last.to(self.device))
        return out.logits[0].float()

    @staticmethod
    def _span(seen: int, count: int, rope: torch.Tensor | None) -> tuple[int, int, int]:
        """``count`` tokens fed after ``seen``, offset by the prefix's ``rope`` deltas, as
        :func:`text_positions` takes them."""
        return seen, count, int(rope.flatten()[0]) if rope is not None else 0

    def join(self, member: Member) -> None:
        """Add a started member to the batch: it decodes from the next step on."""
        rope = member.job.prefix.rope_for_suffix()
        position = text_positions(self.rows, [self._span(member.cache.get_seq_length(), 1, rope)], self.device)
        self.members.append(member)
        self.cache.join(member.cache)
        self.feed = torch.cat([self.feed, torch.tensor([[member.tokens[-1]]], device=self.device)])
        self.position = torch.cat([self.position, position], dim=1)
        self.sampling.join(BatchSampling(self.device, [sampling_of(member.job)], [member.tokens], self.vocab))
        self._changed()

    def device_bytes(self) -> int:
        return sum(m.bytes for m in self.members)

    def _changed(self) -> None:
        self.logits = None
        self.replay.reset()

    def _device_step(self) -> None:
        """The step's device work: append and attend every member's fed token, the logits into
        :attr:`logits`. Only tensors that stay put are read and written (see :class:`StepReplay`)."""
        self.cache.begin_step()
        out = self.model(input_ids=self.feed, position_ids=self.position if self.rows > 1 else self.position[0],
                         cache_position=self.position[0, 0], cache=self.cache, use_cache=True)
        if self.logits is None:
            self.logits = torch.empty(out.logits.shape[0], out.logits.shape[-1], dtype=torch.float32,
                                      device=out.logits.device)
        self.logits.copy_(out.logits[:, -1])

    def step(self) -> list[Member]:
        """One token for every member; returns (and drops) the members that finished."""
        members = self.members
        if not self.allocate_all and self.cache.grow(GEN_BLOCK):
            self.replay.reset()
            for m in members:
                m.bytes = m.cache.device_bytes()
        for cache in self.cache.members:
            cache.advance()  # the host's count of the token fed now (the device keeps its own)
        start = now(self.device)
        replays = self.replay.replays
        with torch.inference_mode(), policy_attention(self.model):
            self.replay(self.cache.planned)
            logits = self.logits
            if any(m.processors for m in members):
                logits = torch.cat([m.processors(m.ids, logits[b:b + 1]) if m.processors else logits[b:b + 1]
                                    for b, m in enumerate(members)])
            self.feed.copy_(self.sampling.choose(logits)[:, None])  # the tokens fed next, in place
            self.position.add_(1)
        tokens = self._chosen(members, logits, self.feed.flatten())  # the step's one read on the host: who has finished
        at = now(self.device)
        self.steps += 1
        kv = self.device_bytes()
        done = []
        for b, (m, token) in enumerate(zip(members, tokens)):
            m.sizes.append(len(members))
            m.kv_peak = max(m.kv_peak, kv)
            m.replayed += self.replay.replays - replays
            if m.ids is not None:
                m.ids = torch.cat([m.ids, self.feed[b:b + 1]], dim=1)
            m.tokens.append(token)
            m.meter.token(at, at - start)
            if self.finished(m.tokens, self.limit(m.job)):
                done.append(m)
        self.leave(*done)
        return done

    def leave(self, *members: Member) -> None:
        """Drop ``members`` from the batch (their caches go with them once their records are made)."""
        if not members:
            return
        keep = [b for b, m in enumerate(self.members) if m not in members]
        self.members[:] = [self.members[b] for b in keep]
        self.cache.keep(keep)
        index = torch.tensor(keep, dtype=torch.long, device=self.feed.device)
        self.feed = self.feed.index_select(0, index)
        self.position = self.position.index_select(1, index)
        self.sampling.keep(keep, index)
        self._changed()
        for m in members:
            m.ids = None


def position_rows(model) -> int:
    """Rows of a model's position ids: 4 with mRoPE (the text position, then 3 rotary ones), else 1."""
    return 4 if rope_owner(model) is not None else 1


def text_positions(rows: int, spans: list[tuple[int, int, int]], device) -> torch.Tensor:
    """[R, 1, n] positions of text tokens, span after span: each ``(seen, count, delta)``, ``count``
    tokens fed after ``seen`` cached ones; the text position, then (mRoPE, ``rows`` = 4) the 3
    rotary ones, offset by ``delta``. Made on the host as one tensor (a read packs many spans)."""
    text = [position for seen, count, _ in spans for position in range(seen, seen + count)]
    rotary = [position + delta for seen, count, delta in spans for position in range(seen, seen + count)]
    return torch.tensor([[text]] + [[rotary]] * (rows - 1), dtype=torch.long, device=device)


def sampling_of(job):
    """How ``job``'s tokens are chosen (greedy unless it says otherwise)."""
    return getattr(job, "sampling", None) or GREEDY
