"""The session: one model, loaded once, answering inputs along one straight line.

    inputs -> media -> prompt -> prefill(policy) -> decode(jobs) -> record

``hybridkv ask`` (one input or many), ``profile`` and ``bench`` all answer through a
:class:`Session`. It loads the model on first need (after the first input's media, so a bad
first file fails before a long model load), builds each prompt once (the chat template rendered
once; the context check reads the built prompt), runs one generation per policy, and maps
every failure -- out-of-memory included -- to a one-line :class:`~hybridkv_cli.io.errors.HybridKVError`
here and nowhere else.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

from hybridkv_cli.compression import MethodOptions, Policy
from hybridkv_cli.engine import Job, Limits, Prefix, decode, prefill, prompt_job
from hybridkv_cli.engine.stream import Streaming, streamed
from hybridkv_cli.io import signals
from hybridkv_cli.io.errors import ContextLengthError, HybridKVError, ModelError, UsageError, one_line
from hybridkv_cli.media import MediaInput, load_media, load_media_stream
from hybridkv_cli.models import registry
from hybridkv_cli.models.loaded import LoadedModel
from hybridkv_cli.models.prompt import Prompt, QuestionTemplate, build_prompt, build_text_prompt
from hybridkv_cli.runs.guards import (check_length, check_new_tokens, check_stream_memory, failure, free_memory,
                                      guarded, is_oom, warn_if_large)
from hybridkv_cli.runs.inputs import Item
from hybridkv_cli.runs.record import input_record, make_record, prefix_record


@dataclass(frozen=True)
class AskOptions:
    """Everything an input's answer depends on besides the media and the question."""

    model: str = registry.DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    method: str | None = "hybridkv"  # None: no policy of the session's own (bench and route build one per run)
    method_options: MethodOptions = MethodOptions()  # budget, window, theta, ... (None: not given)
    frames: int = 64
    fps: float | None = None
    max_frames: int | str | None = None  # a video read as a stream of at most this many frames ("all": no cap)
    max_pixels: int | None = None
    max_new_tokens: int = 128
    defer_question: bool = False  # compress before the question is read (its tokens then decode as a suffix)
    method_given: bool = True  # --method was given (a .hkv input with another method is refused)
    streaming: Streaming = Streaming()  # when and how a long prompt is prefilled in chunks


@dataclass
class Prepared:
    """One input made ready: its media (None: a text prompt), the built prompt, the question,
    and the name errors give it."""

    media: MediaInput | None
    prompt: Prompt
    question: str
    source: str


#: ``--max-frames all`` without ``--fps``: every frame of the video.
EVERY_FRAME = 1 << 40

#: The question a prefix's template prompt is built with (any question gives the same template).
TEMPLATE_QUESTION = "?"


class Session:
    """Answers inputs with one model (see the module docstring).

    Parameters
    ----------
    options : AskOptions
    loaded : LoadedModel, optional
        A model already loaded (else ``options.model`` is loaded on first need).
    stage : callable, optional
        ``stage(message)`` returns a context manager shown while a slow step runs (a spinner,
        a progress description).
    progress : callable, optional
        ``progress(frames_read, frames)`` while a video is read as its prompt is prefilled.
    """

    def __init__(self, options: AskOptions, *, loaded: LoadedModel | None = None,
                 stage: Callable[[str], ContextManager] | None = None,
                 progress: Callable[[int, int], None] | None = None):
        self.options = options
        self.loaded = loaded
        self.stage = stage or (lambda message: nullcontext())
        self.progress = progress  # (frames read, frames) of a video read while prefilling
        # Built now, so a bad method or option is refused before any input is read; a policy
        # is configuration only and serves every generation of the session.
        self.policy = options.method_options.policy(options.method) if options.method else None
        if options.method == "full" and options.streaming.kv_tokens is not None:
            raise UsageError("full keeps the whole cache: no --stream-kv-tokens", "--stream-kv-tokens")
        self._sized: set = set()  # the media whose size was checked: one warning per input, however many runs

    # --- the steps ---------------------------------------------------------------------------
    def model(self) -> LoadedModel:
        """The model, loaded on the first call; a failure is a one-line :class:`ModelError`."""
        if self.loaded is None:
            o = self.options
            failed = None
            with self.stage(f"loading {o.model} ..."):
                try:
                    self.loaded = registry.load_model(o.model, device=o.device, dtype=o.dtype)
                except HybridKVError:
                    raise
                except Exception as e:
                    if not is_oom(e):
                        raise ModelError(f"cannot load the model ({type(e).__name__}: {one_line(e)})",
                                         o.model) from e
                    failed = one_line(e)
            if failed is not None:  # outside the handler: the failed load's memory can be released
                free_memory()
                raise ModelError(f"out of memory while loading the model ({failed})", o.model)
        return self.loaded

    def load_media(self, paths) -> MediaInput:
        """One input's media, at the model's own frame size unless ``--max-pixels`` says otherwise."""
        o = self.options
        max_pixels = registry.max_pixels_for(o.model, o.max_pixels)
        if o.max_frames is not None:  # decoded while the prompt is read: --fps, else --max-frames spread over it
            cap = None if o.max_frames == "all" else o.max_frames
            return load_media_stream(list(paths), frames=None if o.fps else cap or EVERY_FRAME, fps=o.fps,
                                     max_frames=cap, max_pixels=max_pixels)
        return load_media(list(paths), frames=o.frames, fps=o.fps, max_pixels=max_pixels)

    def prepare(self, media: MediaInput | None, question: str, *, context: str | None = None,
                source: str | None = None) -> Prepared:
        """Build the prompt for ``question`` about ``media`` (None: about the text ``context``)
        and check that it fits the model's context with the tokens to generate."""
        loaded = self.model()
        if media is None:
            source = source or "--context"
            prompt = build_text_prompt(loaded.tokenizer, context or "", question)
        else:
            if context is not None:
                raise UsageError("give media or a text context, not both", "--context")
            source = source or media.label
            loaded.refuse_media(source)
            prompt = guarded(source, build_prompt, loaded.processor, media, question)
        check_length(prompt, loaded.context_limit, self.options.max_new_tokens, source)
        if media is not None and media.stream is not None:
            check_stream_memory(media, prompt, loaded, source)
            prompt.inputs["pixel_values_videos"].on_read = self.progress
        elif media is not None and media.sources not in self._sized:
            self._sized.add(media.sources)
            warn_if_large(media, prompt.visual_tokens)
        return Prepared(media, prompt, question, source)

    def prepare_task(self, task) -> Prepared:
        """:meth:`prepare` for a task row (bench's format: ``media`` paths or a text ``context``)."""
        return self.prepare(self.load_media(task.media) if task.media else None, task.question,
                            context=task.context, source=task.id)

    def run(self, prepared: Prepared, policy: Policy, *, max_new_tokens: int | None = None) -> dict:
        """Generate with ``policy`` and return the result record (README, "JSON output")."""
        with self.stage(f"answering ({policy.name}, budget {policy.budget:g}) ..."):
            (_, record), = self.decode_together([(None, lambda: prepared)], policy, Limits(), max_new_tokens)
        if isinstance(record, BaseException):
            raise record
        return record

    # --- the straight line -------------------------------------------------------------------
    def answer(self, item: Item, question: str, context: str | None = None, limits: Limits = Limits()) -> dict:
        """The result record for ``item`` (no paths: a text prompt about ``context``); raises a
        :class:`HybridKVError` for a bad input."""
        (_, record), = self.answer_batched([item], question, limits, context)
        if isinstance(record, BaseException):
            raise record
        return record

    def prepare_item(self, item: Item, question: str, context: str | None = None) -> Prepared:
        """``item``'s media loaded and its prompt built (no paths: a text prompt about ``context``)."""
        if item.error is not None:
            raise item.error
        media = self.load_media(item.paths) if item.paths else None
        return self.prepare(media, question, context=context, source=item.key if item.paths else None)

    def answer_batched(self, items, question: str, limits: Limits, context: str | None = None):
        """``(item, record)`` of every item, decoded together under ``limits``, in the order they
        finish; a failed input's record is its :class:`HybridKVError` (or the exception) instead.
        A batching run's records say how they were batched (``batch``). ``items`` are read as the
        batch has room for them."""
        jobs = ((item, lambda item=item: self.prepare_item(item, question, context)) for item in items)
        return self.decode_together(jobs, self.policy, limits)

    def decode_together(self, jobs, policy: Policy, limits: Limits, max_new_tokens: int | None = None):
        """``(tag, record or error)`` of ``jobs`` (``(tag, prepare)`` pairs, ``prepare()`` giving
        a :class:`Prepared`): each prefilled up to its question (all of it unless the question is
        deferred) and decoded under ``limits`` (see :func:`hybridkv_cli.engine.jobs.decode`)."""
        o = self.options

        def job(tag, prepare) -> Job:
            prepared = prepare()
            job = prompt_job(self.model().model, prepared.prompt, policy, o.defer_question, tag=tag, about=prepared,
                             streaming=o.streaming)
            unguarded = job.prefill
            job.prefill = lambda: guarded(prepared.source, unguarded)
            return job

        engine_jobs = ((tag, lambda tag=tag, prepare=prepare: job(tag, prepare)) for tag, prepare in jobs)
        for outcome in self._decode(engine_jobs, limits, max_new_tokens):
            p = outcome.job.about
            if outcome.error is not None:
                yield outcome.job.tag, failure(p.source if p else "", outcome.error)
                continue
            deferred = o.defer_question or streamed(p.prompt, o.streaming)
            yield outcome.job.tag, make_record(self.model(), input_record(p.media, p.prompt), p.question, policy,
                                               outcome.generation, deferred, outcome.batch)

    def _decode(self, jobs, limits: Limits, max_new_tokens: int | None = None):
        return decode(lambda: self.model().model, jobs, max_new_tokens=max_new_tokens or self.options.max_new_tokens,
                      limits=limits, on_step=signals.raise_if_stopped)

    # --- one compression, many questions --------------------------------------------------------
    def compress(self, item: Item, context: str | None = None) -> Prefix:
        """``item``'s prefix (media, or the text ``context``) prefilled and compressed once, with
        no question read; a ``.hkv`` item is loaded from its file instead."""
        from hybridkv_cli.engine import hkv

        if item.error is not None:
            raise item.error
        if item.paths and len(item.paths) == 1 and hkv.is_cache_path(item.paths[0]):
            return self.load_cache(item.paths[0])
        media = self.load_media(item.paths) if item.paths else None
        return self.compress_media(media, context=context, source=item.key if item.paths else None)

    def compress_media(self, media: MediaInput | None, *, context: str | None = None, source: str | None = None,
                       policy: Policy | None = None) -> Prefix:
        """``media`` (None: the text ``context``) prefilled and compressed with ``policy`` (default:
        the session's), no question read: a shared prefix every question decodes a copy of."""
        policy = policy or self.policy
        prepared = self.prepare(media, TEMPLATE_QUESTION, context=context, source=source)
        prompt = prepared.prompt
        if prompt.question_start == prompt.length:
            raise HybridKVError("the prompt has no question after its media", prepared.source)
        with self.stage(f"compressing ({policy.name}, budget {policy.budget:g}) ..."):
            prefix = guarded(prepared.source, prefill, self.model().model, prompt, policy,
                             prompt.question_start, shared=True, streaming=self.options.streaming)
        prefix.template = QuestionTemplate.of(self.model().tokenizer, prompt, prepared.question)
        info = input_record(media, prompt)
        info.pop("text_tokens", None)  # the question's: set per record
        prefix.info = info
        return prefix

    def load_cache(self, path: str) -> Prefix:
        """The compressed prefix saved in the ``.hkv`` file ``path`` (a :class:`CacheFileError` if
        it is not one, or not for this model, dtype, method or its options)."""
        from hybridkv_cli.engine import hkv

        o = self.options
        header = hkv.read_header(path)
        hkv.check_header(header, self.model(), path, o.method if o.method_given else None)
        stored = header.get("options") or {}
        for key, value in o.method_options.given().items():
            if key in stored and stored[key] != value:
                flag = "--" + key.replace("_", "-")
                raise hkv.CacheFileError(f"compressed with {flag} {stored[key]}, not {value}; drop {flag} or "
                                         "compress again", path)
        with self.stage("loading the compressed cache ..."):
            return guarded(path, hkv.load, path, self.model(), o.method if o.method_given else None)

    def ask_prefix(self, prefix: Prefix, questions: list[str], *, limits: Limits = Limits(), source: str = "",
                   cache_file: str | None = None):
        """``(index, record or error)`` of each question answered from a copy of ``prefix``, in
        the order they finish (decoded together under ``limits``); a question too long for the
        model's context is its own :class:`ContextLengthError`."""
        loaded, o = self.model(), self.options
        check_new_tokens(o.max_new_tokens, loaded.context_limit)
        context_tokens = prefix.seen - int(prefix.visual.sum())
        job = lambda i: self.question_job(prefix, questions[i], i, source=source)
        stage = f"answering {len(questions)} question{'s' if len(questions) > 1 else ''} ..."
        with self.stage(stage):
            for outcome in self._decode(((i, lambda i=i: job(i)) for i in range(len(questions))), limits):
                i = outcome.job.tag
                if outcome.error is not None:
                    yield i, failure(source, outcome.error)
                    continue
                text = context_tokens + len(outcome.job.suffix)
                record = make_record(loaded, {**prefix.info, "text_tokens": text}, questions[i], prefix.policy,
                                     outcome.generation, True, outcome.batch)
                yield i, prefix_record(record, prefix, index=i, of=len(questions), cache_file=cache_file)

    def question_job(self, prefix: Prefix, question: str, tag, *, source: str = "",
                     max_new_tokens: int | None = None) -> Job:
        """The job of ``question`` asked about a copy of the shared ``prefix`` (``max_new_tokens``:
        its own limit, else the session's); a :class:`ContextLengthError` when the prompt and the
        tokens to generate do not fit the model's context."""
        loaded = self.model()
        new, limit = max_new_tokens or self.options.max_new_tokens, loaded.context_limit
        suffix = prefix.template.suffix(loaded.tokenizer, question)
        if limit and prefix.seen + len(suffix) + new > limit:
            raise ContextLengthError(f"the prompt needs {prefix.seen + len(suffix)} tokens + {new} new, more than "
                                     f"the model's context of {limit} tokens", source)
        return Job(tag, suffix, prefix=prefix, max_new_tokens=max_new_tokens)

    def answer_all(self, item: Item, questions: list[str], context: str | None = None,
                   failed: Callable[[str, HybridKVError], dict] | None = None,
                   each: Callable[[int, dict], None] | None = None, limits: Limits = Limits()) -> list[dict]:
        """One record per question about ``item``, compressed once (a ``.hkv`` item: loaded), in
        question order. ``failed(question, error)``: the record of a question that fails on its own
        (too long for the context, out of memory), so the other questions keep their answers (None:
        raise). ``each(index, record)`` is called with every record as soon as it exists (the run
        writes it then: a stop loses at most the questions in flight)."""
        from hybridkv_cli.engine import hkv

        prefix = self.compress(item, context=context)
        cache_file = item.paths[0] if item.paths and hkv.is_cache_path(item.paths[0]) else None
        if cache_file is not None:
            prefix.info = {**prefix.info, "media_label": prefix.info.get("label"), "label": item.key}
        records: dict[int, dict] = {}
        for i, record in self.ask_prefix(prefix, questions, limits=limits, cache_file=cache_file,
                                         source=item.key if item.paths else "--context"):
            if isinstance(record, BaseException):
                if isinstance(record, (UsageError, ModelError)) or failed is None or not isinstance(
                        record, HybridKVError):
                    raise record
                record = failed(questions[i], record)
            records[i] = record
            if each is not None:
                each(i, record)
        return [records[i] for i in sorted(records)]
