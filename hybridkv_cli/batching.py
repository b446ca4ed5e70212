"""Many inputs decoded together: continuous batching over per-sequence compressed caches.

Each input is prefilled and compressed on its own, exactly as a single run does
(:func:`~hybridkv_cli.generation.generate` with one new token: the same prefill, compression and
first token), then joins the batch. A batch step feeds every member's last token through the
model at once (``[B, 1]`` ids, each at its own position), each layer's attention reads all the
members' stores in one launch (:class:`~hybridkv_cli.compression.cache.BatchCache`), and the
next token of each member comes from the model's own logits processors and end-of-sequence rule,
so every input gets the tokens of a single run (tested for every method). A member that finishes
leaves at once and its store goes with it; inputs join while the batch has room.

Room (:class:`BatchLimits`): at most ``batch_size`` members, and with ``kv_memory`` a device-KV
cap. A member's device KV is measured when it joins, with its generated rows allocated then for
all ``max_new_tokens`` (so it cannot grow while it decodes): the members' sum never exceeds the
cap. Before an input is prefilled its KV is predicted from the bytes per prompt token of the
members so far; an input that turns out not to fit is let go and prefilled again once room is
measured free, and an input over the cap on its own is an error record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from hybridkv_cli.compression.cache import BatchCache, policy_attention
from hybridkv_cli.errors import OutOfMemoryError, UsageError
from hybridkv_cli.generation import Generation, generate, now
from hybridkv_cli.multi import rope_owner
from hybridkv_cli.prompt import Prompt
from hybridkv_cli.report import human_bytes
from hybridkv_cli.step_replay import StepReplay


@dataclass(frozen=True)
class BatchLimits:
    """How many inputs decode together: ``batch_size`` members at most (None: no count limit)
    and, with ``kv_memory``, at most that many bytes of device KV among them; ``cuda_graphs``:
    replay the batch's decode steps as CUDA graphs (:mod:`~hybridkv_cli.step_replay`)."""

    batch_size: int | None = None
    kv_memory: int | None = None
    cuda_graphs: bool = False

    @property
    def batched(self) -> bool:
        return self.kv_memory is not None or (self.batch_size or 1) > 1 or self.cuda_graphs

    @classmethod
    def of(cls, batch_size: int | None, kv_memory: str | None, refused: str | None = None,
           cuda_graphs: bool = False) -> "BatchLimits":
        """The limits ``--batch-size``, ``--kv-memory`` and ``--cuda-graphs`` give: a UsageError
        for a bad size, or when they batch and ``refused`` names the options given that cannot."""
        limits = cls(batch_size, None if kv_memory is None else parse_size(kv_memory, "--kv-memory"), cuda_graphs)
        if limits.batched and refused:
            flag = ("--batch-size" if batch_size is not None and batch_size > 1 else
                    "--kv-memory" if kv_memory is not None else "--cuda-graphs")
            raise UsageError(f"decodes many inputs with one question on this device, not with {refused}", flag)
        return limits


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str, flag: str) -> int:
    """Bytes of a size such as ``4GiB``, ``512MB`` or ``1e9`` (a UsageError naming ``flag`` if not one)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if unit not in _UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"expected a size such as 4GiB or 512MB, got '{text}'", flag)
    size = float(m.group(1)) * _UNITS[unit]
    if not size < 2**63:  # 1e999GiB is infinite
        raise UsageError(f"'{text}' is too large (at most 8 EiB)", flag)
    if size < 1:
        raise UsageError(f"'{text}' is less than one byte", flag)
    return int(size)


@dataclass(eq=False)  # members are told apart by identity
class Member:
    """One input in the batch: its generation so far and its logits processors."""

    tag: Any
    prepared: Any  # what ``prepare`` built: has ``.prompt``
    generation: Generation
    processors: Any  # the model's logits processors (an empty list for most models)
    ids: torch.Tensor | None  # [1, L] prompt + generated tokens, kept only for processors to read
    bytes: int
    joined: int  # the batch step it joined at
    sizes: list[int] = field(default_factory=list)  # members in each of its steps
    kv_peak: int = 0  # most device KV of the batch during its steps
    replayed: int = 0  # its steps replayed as a CUDA graph

    def info(self, limits: BatchLimits) -> dict:
        """What the record says of the batch it decoded in."""
        return batch_info(limits, self.joined, self.sizes, self.kv_peak or self.bytes, self.replayed)


def batch_info(limits: BatchLimits, joined: int, sizes: list[int], kv_peak: int, replayed: int = 0) -> dict:
    """A record's ``batch``: when the input joined, the batch sizes of its steps, the most device
    KV of the batch meanwhile, its steps replayed as a CUDA graph, and the run's limits."""
    return {
        "joined_step": joined,
        "size_max": max(sizes, default=1),
        "size_mean": sum(sizes) / len(sizes) if sizes else 1.0,
        "kv_device_bytes_peak": kv_peak,
        "graph_replayed_steps": replayed,
        "graph_warning": graph_warning(limits, len(sizes), replayed),
        "batch_size": limits.batch_size,
        "kv_memory": limits.kv_memory,
        "cuda_graphs": limits.cuda_graphs,
    }


def graph_warning(limits: BatchLimits, steps: int, replayed: int) -> str | None:
    """What the record warns of ``--cuda-graphs`` when it replayed none of an input's ``steps``
    (the first step of a set of members runs eagerly and the second is captured, so an input
    decoding 3 steps or more with the same members replays at least one)."""
    if not limits.cuda_graphs or replayed or steps < 3:
        return None
    why = "no CUDA device" if not torch.cuda.is_available() else "a member's step is not replayable or the members changed"
    return f"--cuda-graphs replayed none of its {steps} steps ({why})"


@dataclass
class Outcome:
    """One input done: its generation (or the error that stopped it) and its batch info."""

    tag: Any
    prepared: Any = None
    generation: Generation | None = None
    error: BaseException | None = None
    batch: dict | None = None


class Decoder:
    """The batch being decoded (see the module docstring). Its per-step inputs live on the
    device as batch tensors (the tokens to feed and their positions) updated in place, so a
    step's device work (:meth:`_device_step`) reads and writes the same tensors every step until
    members join or leave; with ``cuda_graphs`` it is replayed as a CUDA graph."""

    def __init__(self, model, max_new_tokens: int, cuda_graphs: bool = False):
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.replay = StepReplay(self._device_step, cuda_graphs)
        # the kernels are the device's default either way: --cuda-graphs only replays them
        self.cache = BatchCache(model.config.get_text_config().num_hidden_layers, model.device)
        self.members: list[Member] = []
        self.owner = rope_owner(model)
        self.rows = 4 if self.owner is not None else 1  # mRoPE: the text position, then 3 rotary ones
        self.feed = torch.empty(0, 1, dtype=torch.long, device=model.device)  # [B, 1] next tokens
        self.position = torch.empty(self.rows, 0, 1, dtype=torch.long, device=model.device)  # [R, B, 1]
        self.logits = None  # [B, V] fp32: the step's output
        self.config = _generation_config(model, max_new_tokens)
        eos = self.config.eos_token_id
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self.steps = 0

    def finished(self, generation: Generation) -> bool:
        tokens = generation.tokens
        return len(tokens) >= self.max_new_tokens or (bool(tokens) and tokens[-1] in self.eos)

    def join(self, tag, prepared, generation: Generation, rope_deltas) -> Member:
        """Add a prefilled generation (its first token chosen) to the batch."""
        prompt = prepared.prompt
        cache = generation.cache
        cache.reserve(self.max_new_tokens - len(generation.tokens))
        device = self.model.device
        seen = cache.get_seq_length()  # the position of the token fed next
        delta = int(rope_deltas.flatten()[0]) if rope_deltas is not None else 0
        token = torch.tensor([[generation.tokens[-1]]], device=device)
        position = torch.tensor([seen] + [seen + delta] * (self.rows - 1), device=device).view(self.rows, 1, 1)
        ids = torch.cat([prompt.inputs["input_ids"].to(device), token], dim=1)
        processors = self.model._get_logits_processor(generation_config=self.config, input_ids_seq_length=prompt.length,
                                                      encoder_input_ids=ids[:, :prompt.length], device=device,
                                                      model_kwargs={})
        member = Member(tag, prepared, generation, processors, ids if processors else None, cache.device_bytes(),
                        self.steps)
        self.members.append(member)
        self.cache.join(cache)
        self.feed = torch.cat([self.feed, token])
        self.position = torch.cat([self.position, position], dim=1)
        self._changed()
        return member

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
        device = self.model.device
        for cache in self.cache.members:
            cache.advance()  # the host's count of the token fed now (the device keeps its own)
        start = now(device)
        replays = self.replay.replays
        with torch.inference_mode(), policy_attention(self.model):
            self.replay(self.cache.planned)
            logits = self.logits
            if any(m.processors for m in members):
                logits = torch.cat([m.processors(m.ids, logits[b:b + 1]) if m.processors else logits[b:b + 1]
                                    for b, m in enumerate(members)])
            self.feed.copy_(logits.argmax(dim=-1, keepdim=True))  # [B, 1]
            self.position.add_(1)
        tokens = self.feed.flatten().tolist()  # the step's one read on the host: who has finished
        elapsed = now(device) - start
        self.steps += 1
        kv = self.device_bytes()
        done = []
        for b, (m, token) in enumerate(zip(members, tokens)):
            m.generation.tokens.append(token)
            m.generation.step_s.append(elapsed)
            m.sizes.append(len(members))
            m.kv_peak = max(m.kv_peak, kv)
            m.replayed += self.replay.replays - replays
            if m.ids is not None:
                m.ids = torch.cat([m.ids, self.feed[b:b + 1]], dim=1)
            if self.finished(m.generation):
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
        self._changed()
        for m in members:
            m.ids = None


def prefill(model, prompt: Prompt, policy, defer_question: bool = False) -> tuple[Generation, Any]:
    """``prompt`` prefilled and compressed by ``policy``, its first token chosen, as a single run
    does it; with the model's mRoPE offset for this prompt (None without mRoPE)."""
    generation = generate(model, prompt, policy, max_new_tokens=1, defer_question=defer_question)
    owner = rope_owner(model)
    return generation, None if owner is None or owner.rope_deltas is None else owner.rope_deltas.clone()


def _generation_config(model, max_new_tokens: int):
    """The generation config ``generate`` would use for a greedy run of ``max_new_tokens``."""
    config, _ = model._prepare_generation_config(None, max_new_tokens=max_new_tokens, do_sample=False)
    return config


def decode_batched(load_model: Callable[[], Any], jobs: Iterable[tuple[Any, Callable[[], Any]]],
                   prefill: Callable[[Any], tuple], *, max_new_tokens: int, limits: BatchLimits,
                   on_step: Callable[[], None] | None = None) -> Iterator[Outcome]:
    """Decode ``jobs`` together, yielding each input's :class:`Outcome` as it finishes.

    ``load_model()``: the model, called once the first input is prepared (a bad first file fails
    before a long load). ``jobs``: ``(tag, prepare)`` pairs, read as room frees up; ``prepare()`` builds the input
    (an object with its ``.prompt``; its errors become the input's outcome). ``prefill(prepared)``
    returns the prefilled :class:`Generation` (its first token chosen) and the model's mRoPE
    offset for it. ``on_step``: called before every batch step (a stop signal raised there ends
    the run after the outcomes already yielded). A batch step that fails (out of memory) ends
    its members with that error; the inputs after them go on.
    """
    decoder = None
    pending = iter(jobs)
    waiting: list = []  # (tag, prepared, measured bytes or None): prepared, not yet admitted
    per_token = 0.0  # most device bytes per prompt token of any member so far
    exhausted = False
    cap = limits.kv_memory

    def room_for(prompt: Prompt, measured: int | None) -> bool:
        if decoder is None:
            return True
        if limits.batch_size is not None and len(decoder.members) >= limits.batch_size:
            return False
        if cap is None or not decoder.members:
            return True
        need = measured if measured is not None else per_token * prompt.length
        return decoder.device_bytes() + need <= cap

    while True:
        # admit while there is room
        while True:
            if not waiting and not exhausted:
                try:
                    tag, prepare = next(pending)
                except StopIteration:
                    exhausted = True
                    continue
                try:
                    prepared = prepare()
                except Exception as e:
                    yield Outcome(tag, error=e)
                    continue
                waiting.append((tag, prepared, None))
            if not waiting or not room_for(waiting[0][1].prompt, waiting[0][2]):
                break
            tag, prepared, _ = waiting.pop(0)
            try:
                decoder = decoder or Decoder(load_model(), max_new_tokens, limits.cuda_graphs)
                generation, rope = prefill(prepared)
            except Exception as e:
                yield Outcome(tag, prepared, error=e)
                continue
            if decoder.finished(generation):
                # done at its first token: it never joined
                yield Outcome(tag, prepared, generation,
                              batch=batch_info(limits, decoder.steps, [], generation.device_bytes_after_prefill))
                continue
            member = decoder.join(tag, prepared, generation, rope)
            per_token = max(per_token, member.bytes / max(prepared.prompt.length, 1))
            if cap is not None and decoder.device_bytes() > cap:
                decoder.leave(member)
                if not decoder.members:
                    yield Outcome(tag, prepared, error=OutOfMemoryError(
                        f"its KV cache needs {human_bytes(member.bytes)} on the device, more than --kv-memory {human_bytes(cap)}"))
                else:  # measured now: wait for that much room, then prefill again
                    waiting.insert(0, (tag, prepared, member.bytes))
                del member, generation
                if decoder.members:
                    break
        if decoder is None or not decoder.members:
            if exhausted and not waiting:
                return
            continue
        if on_step is not None:
            on_step()
        try:
            done = decoder.step()
        except Exception as e:  # (a stop signal is a KeyboardInterrupt: it ends the run)
            done, failed = [], list(decoder.members)
            decoder.leave(*failed)
            for m in failed:
                yield Outcome(m.tag, m.prepared, error=e)
        for m in done:
            yield Outcome(m.tag, m.prepared, m.generation, batch=m.info(limits))
