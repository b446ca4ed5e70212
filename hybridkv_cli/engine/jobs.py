"""``decode(load_model, jobs, limits) -> Iterator[Outcome]``: the second half of every generation.

A :class:`Job` is a prefix (:mod:`~hybridkv_cli.engine.prefix`) and its suffix: the prompt
tokens after the prefix (a question read after compression, or nothing). Every mode is a way of
calling :func:`~hybridkv_cli.engine.prefix.prefill` and :func:`decode`: a plain question is one
job with the whole prompt as its prefix and an empty suffix; ``--defer-question`` cuts the
prefix at the end of the media; ``-Q`` and ``.hkv`` inputs are one shared prefix with a job per
question; batching is more than one job at a time. Jobs decode together in one
:class:`~hybridkv_cli.engine.decoder.Decoder` as :class:`Limits` allow, and each job's
:class:`Outcome` is yielded as it finishes. The jobs with a ready prefix that fit when there is
room start together, their suffixes read in one pass (:meth:`Decoder.start`; :func:`packable`).

Room (:class:`Limits`, applied by :class:`~hybridkv_cli.engine.admission.Admission`): at most
``batch_size`` members, and with ``kv_memory`` a device-KV cap.
Under a cap a member's device KV is measured when it starts, with its rows for every token it
will be fed allocated then (so it cannot grow while it decodes): the members' sum never
exceeds the cap. Without one, generated rows are allocated 16 at a time, as they are needed.
Before a job is prefilled its KV is predicted from the bytes per prompt token of the members so
far; a job that turns out not to fit waits, measured, for that much room, and a job over the cap
on its own is an error outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from hybridkv_cli.engine.admission import Admission
from hybridkv_cli.engine.decoder import Decoder
from hybridkv_cli.engine.measure import Generation
from hybridkv_cli.engine.prefix import Prefix, prefill
from hybridkv_cli.engine.sampling import Sampling
from hybridkv_cli.engine.stream import streamed
from hybridkv_cli.io.errors import OutOfMemoryError
from hybridkv_cli.io.report import human_bytes


@dataclass(frozen=True)
class Limits:
    """How many jobs decode together: ``batch_size`` members at most (None: 1, or under
    ``kv_memory`` as many as that many bytes of device KV hold) and ``cuda_graphs``: replay the
    decode steps as CUDA graphs (:mod:`~hybridkv_cli.engine.replay`)."""

    batch_size: int | None = None
    kv_memory: int | None = None
    cuda_graphs: bool = False

    @property
    def most(self) -> int | None:
        """The most members at a time (None: no count limit)."""
        return self.batch_size if self.batch_size is not None else None if self.kv_memory is not None else 1

    @property
    def batched(self) -> bool:
        """More than one job may decode at a time, or the steps are replayed: records say how."""
        return self.most != 1 or self.kv_memory is not None or self.cuda_graphs


@dataclass
class Job:
    """One generation to decode: its prefix -- ready, or built by ``prefill()`` when the batch
    has room for it -- and its ``suffix`` tokens. ``length``: its prompt tokens (prefix and
    suffix), to predict its KV before it is prefilled (with a ready prefix: its length and the
    suffix's). ``tag`` and ``about``: whatever the caller needs back (``about`` is None when
    making the job failed)."""

    tag: Any
    suffix: list[int]
    prefix: Prefix | None = None
    prefill: Callable[[], Prefix] | None = None
    length: int = 0
    about: Any = None
    max_new_tokens: int | None = None  # this job's own limit (None: the run's)
    sampling: Sampling | None = None  # how its tokens are chosen (None: greedy)
    logprobs: int | None = None  # each token's log probability and this many best alternatives (None: none)

    def __post_init__(self):
        if self.prefix is not None and not self.length:
            self.length = self.prefix.seen + len(self.suffix)


@dataclass
class Outcome:
    """One job done: its generation (or the error that stopped it) and how it was batched."""

    job: Job
    generation: Generation | None = None
    error: BaseException | None = None
    batch: dict | None = None


def batch_info(limits: Limits, joined: int, sizes: list[int], kv_peak: int, replayed: int = 0) -> dict | None:
    """A record's ``batch``: when the job joined, the batch sizes of its steps, the most device
    KV of the batch meanwhile, its steps replayed as a CUDA graph, and the run's limits (None for
    a run that does not batch)."""
    if not limits.batched:
        return None
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


def graph_warning(limits: Limits, steps: int, replayed: int) -> str | None:
    """What the record warns of ``--cuda-graphs`` when it replayed none of a job's ``steps``
    (the first step of a set of members runs eagerly and the second is captured, so a job
    decoding 3 steps or more with the same members replays at least one)."""
    if not limits.cuda_graphs or replayed or steps < 3:
        return None
    why = "no CUDA device" if not torch.cuda.is_available() else "a member's step is not replayable or the members changed"
    return f"--cuda-graphs replayed none of its {steps} steps ({why})"


PACK_TOKENS = 2048  # most suffix tokens read in one pass: its activations grow with them


def packable(job: Job, group: list[Job]) -> bool:
    """Whether ``job`` may start with ``group`` (one pass reads their suffixes): its prefix is
    ready (a job to prefill starts alone, so the others' first tokens do not wait on its
    prefill) and the suffixes stay within :data:`PACK_TOKENS`."""
    return job.prefix is not None and len(job.suffix) + sum(len(j.suffix) for j in group) <= PACK_TOKENS


def decode(load_model: Callable[[], Any], jobs: Iterable[tuple[Any, Callable[[], Job]] | None], *, max_new_tokens: int,
           limits: Limits = Limits(), on_step: Callable[[], None] | None = None,
           watch: Callable[[list], Iterable] | None = None, admission: Admission | None = None) -> Iterator[Outcome]:
    """Decode ``jobs`` as ``limits`` allow, yielding each job's :class:`Outcome` as it finishes.

    ``load_model()``: the model, called once the first job is made (a bad first file fails
    before a long load). ``jobs``: ``(tag, make)`` pairs read as room frees up;
    ``make()`` builds the :class:`Job` (loading media, building its prompt), and its errors
    become an outcome of ``Job(tag, [])``. A live source (a server's queue) may give None for
    "nothing waiting now": the members decode a step and it is asked again. ``on_step``: called
    before every batch step (a stop signal raised there ends the run after the outcomes already
    yielded). ``watch(members)``: called as a member joins (its first token is seen at once) and
    after every step, with the members still decoding (their ``tokens`` so far); the members it
    returns stop there (a stop string, a client gone) and their outcomes are yielded with the
    tokens they have. A step that fails (out of memory) ends its members with that error; the
    jobs after them go on. ``admission``: the admission state under ``limits`` (a server passes
    its own, to read what waits; default: a new one).
    """
    decoder = None
    pending = iter(jobs)
    admission = admission or Admission(limits)
    waiting = admission.waiting
    exhausted = False
    members = lambda: decoder.members if decoder is not None else []  # noqa: E731

    def watched() -> list:  # the members watch stops now (they leave)
        stopped = list(watch(list(decoder.members))) if watch is not None and decoder.members else []
        decoder.leave(*stopped)
        return stopped

    def finished(members) -> Iterator[Outcome]:  # members that left: their generations
        for m in members:
            yield Outcome(m.job, m.generation(), batch=batch_info(limits, m.joined, m.sizes, m.kv_peak or m.bytes,
                                                                  m.replayed))

    def gather() -> Iterator[Outcome]:  # returns the jobs that start together now; yields the errors of making them
        nonlocal exhausted
        group, planned = [], 0.0  # their device bytes (measured or predicted)
        while True:
            count = len(members()) + len(group)
            if not waiting and not exhausted:
                if admission.full(count):  # a job is made only when it could join (its errors then come in order)
                    return group
                try:
                    nxt = next(pending)
                except StopIteration:
                    exhausted = True
                    continue
                if nxt is None:  # a live source with nothing waiting now
                    return group
                tag, make = nxt
                try:
                    job = make()
                except Exception as e:
                    yield Outcome(Job(tag, []), error=e)
                    continue
                waiting.append((job, None))
            if group and waiting and not packable(waiting[0][0], group):
                return group
            admitted = admission.admit(count, (decoder.device_bytes() if decoder else 0) + planned)
            if admitted is None:
                return group
            group.append(admitted[0])
            planned += admitted[1]
            if admitted[0].prefix is None:
                return group

    def start(group: list[Job]) -> Iterator[Outcome]:  # returns whether the batch is as full as it gets
        nonlocal decoder
        try:
            if decoder is None:
                decoder = Decoder(load_model(), max_new_tokens, limits.cuda_graphs,
                                  allocate_all=limits.kv_memory is not None)
            started = decoder.start(group)
        except Exception as e:
            started = [e] * len(group)
        full = False
        for job, member in zip(group, started):
            if isinstance(member, BaseException):
                yield Outcome(job, error=member)
            elif decoder.finished(member.tokens, decoder.limit(job)):  # done at its first token: it never joins
                yield Outcome(job, member.generation(), batch=batch_info(limits, decoder.steps, [], member.bytes))
            else:
                decoder.join(member)
                admission.joined(member)
                if not admission.over(decoder.device_bytes()):
                    yield from finished(watched())  # its first token is seen now, not after the next step
                    continue
                decoder.leave(member)
                if not decoder.members:
                    yield Outcome(job, error=OutOfMemoryError(
                        f"its KV cache needs {human_bytes(member.bytes)} on the device, more than --kv-memory "
                        f"{human_bytes(limits.kv_memory)}"))
                else:  # measured now: wait for that much room, then prefill again
                    if not job.prefix.shared:
                        job.prefix = None
                    admission.wait(job, member.bytes)
                    full = True
        return full

    while True:
        while True:  # admit while there is room: the jobs that fit now start together
            group = yield from gather()
            if not group or (yield from start(group)):
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
            failed = list(decoder.members)
            decoder.leave(*failed)
            for m in failed:
                yield Outcome(m.job, error=e)
            continue
        yield from finished(done + watched())


def prompt_job(model, prompt, policy, defer_question: bool = False, *, tag: Any = None, about: Any = None,
               streaming=None) -> Job:
    """The job of one prompt, prefilled through ``policy`` when it is admitted: up to the end of
    the prompt, or with ``defer_question`` of its media (the question and the template tail are
    then its suffix, read through the compressed cache). A prompt :func:`streamed` in chunks
    always defers its question."""
    upto = prompt.question_start if defer_question or streamed(prompt, streaming) else prompt.length
    return Job(tag, prompt.inputs["input_ids"][0, upto:].tolist(), length=prompt.length, about=about,
               prefill=lambda: prefill(model, prompt, policy, upto, streaming=streaming))


def generate(model, prompt, policy, max_new_tokens: int = 128, defer_question: bool = False,
             streaming=None) -> Generation:
    """One prompt greedy-decoded through ``policy``'s compressed cache (:func:`prompt_job`, alone)."""
    job = prompt_job(model, prompt, policy, defer_question, streaming=streaming)
    outcome, = decode(lambda: model, [(None, lambda: job)], max_new_tokens=max_new_tokens)
    if outcome.error is not None:
        raise outcome.error
    return outcome.generation
