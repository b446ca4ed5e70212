"""The session: one model, loaded once, answering inputs along one straight line.

    inputs -> media -> prompt -> prefill(policy) -> decode(jobs) -> record

``hybridkv ask`` (one input or many, one question or many), ``profile``, ``bench``, the library
and the server all answer through a :class:`Session`, in one currency: a
:class:`~hybridkv_cli.runs.requests.Request` (media, a ``.hkv`` file, a built prompt or a ready
prefix; its questions; its policy). :meth:`Session.answer` plans requests into engine jobs (the
memory guard inside each job's prefill, every failure an answer of its own, so the engine never
calls back up) and builds every record with one :meth:`Session.record`. It loads the model on
first need (after the first input's media, so a bad first file fails before a long model load),
builds each prompt once (the chat template rendered once; the context check reads the built
prompt), and maps every failure -- out-of-memory included -- to a one-line
:class:`~hybridkv_cli.io.errors.HybridKVError` here and nowhere else.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Callable, ContextManager, Iterable, Iterator

from hybridkv_cli.compression import MethodOptions, Policy
from hybridkv_cli.engine import Job, Limits, Prefix, decode, prefill, prompt_job
from hybridkv_cli.engine.sampling import GREEDY, Sampling
from hybridkv_cli.engine.stream import Streaming, streamed
from hybridkv_cli.io import signals
from hybridkv_cli.io.errors import ContextLengthError, HybridKVError, ModelError, UsageError, one_line
from hybridkv_cli.media import MediaInput, load_media, load_media_stream
from hybridkv_cli.models import registry
from hybridkv_cli.models.loaded import LoadedModel
from hybridkv_cli.models.prompt import (Prompt, QuestionTemplate, build_prompt, build_text_prompt,
                                        conversation_tokens)
from hybridkv_cli.runs.guards import (check_length, check_new_tokens, check_stream_memory, failure, free_memory,
                                      guarded, is_oom, warn_if_large)
from hybridkv_cli.runs.inputs import Item
from hybridkv_cli.runs.record import input_record, make_record, prefix_record
from hybridkv_cli.runs.requests import Answer, Prepared, Request


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
    sampling: Sampling = GREEDY  # how answer tokens are chosen (temperature 0: greedy)
    defer_question: bool = False  # compress before the question is read (its tokens then decode as a suffix)
    method_given: bool = True  # --method was given (a .hkv input with another method is refused)
    streaming: Streaming = Streaming()  # when and how a long prompt is prefilled in chunks
    system: str | None = None  # the system prompt every prompt is rendered with (None: the template's default)


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
        self._turns: dict = {}  # the chat template's (tail, turn) tokens by prompt role, read once

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
                source: str | None = None, system: str | None = None) -> Prepared:
        """Build the prompt for ``question`` about ``media`` (None: about the text ``context``),
        after a ``system`` prompt if given, and check that it fits the model's context with the
        tokens to generate."""
        loaded = self.model()
        system = self.options.system if system is None else system
        if media is None:
            source = source or "--context"
            prompt = build_text_prompt(loaded.tokenizer, context or "", question, system)
        else:
            if context is not None:
                raise UsageError("give media or a text context, not both", "--context")
            source = source or media.label
            loaded.refuse_media(source)
            prompt = guarded(source, build_prompt, loaded.processor, media, question, system)
        check_length(prompt, loaded.context_limit, self.options.max_new_tokens, source)
        if media is not None and media.stream is not None:
            check_stream_memory(media, prompt, loaded, source)
            prompt.inputs["pixel_values_videos"].on_read = self.progress
        elif media is not None and media.sources not in self._sized:
            self._sized.add(media.sources)
            warn_if_large(media, prompt.visual_tokens)
        return Prepared(media, prompt, question, source)

    def prepare_item(self, item: Item, question: str, context: str | None = None) -> Prepared:
        """``item``'s media loaded and its prompt built (no paths: a text prompt about ``context``)."""
        if item.error is not None:
            raise item.error
        media = self.load_media(item.paths) if item.paths else None
        return self.prepare(media, question, context=context, source=item.key if item.paths else None)

    def prepare_task(self, task) -> Prepared:
        """:meth:`prepare` for a task row (bench's format: ``media`` paths or a text ``context``)."""
        return self.prepare(self.load_media(task.media) if task.media else None, task.question,
                            context=task.context, source=task.id)

    # --- one compression, many questions --------------------------------------------------------
    def compress(self, item: Item, context: str | None = None, policy: Policy | None = None) -> Prefix:
        """``item``'s prefix (media, or the text ``context``) prefilled and compressed once with
        ``policy`` (default: the session's), with no question read; a ``.hkv`` item is loaded
        from its file instead (its records then name the file)."""
        from hybridkv_cli.engine import hkv

        if item.error is not None:
            raise item.error
        if item.paths and len(item.paths) == 1 and hkv.is_cache_path(item.paths[0]):
            prefix = self.load_cache(item.paths[0])
            if self.options.system is not None and self.options.system != prefix.info.get("system"):
                raise UsageError(f"{item.paths[0]} was compressed with another system prompt (it is in the file); "
                                 "drop --system or compress again", "--system")
            prefix.info = {**prefix.info, "media_label": prefix.info.get("label"), "label": item.key,
                           "cache_file": item.paths[0]}
            return prefix
        media = self.load_media(item.paths) if item.paths else None
        return self.compress_media(media, context=context, source=item.key if item.paths else None, policy=policy)

    def compress_media(self, media: MediaInput | None, *, context: str | None = None, source: str | None = None,
                       policy: Policy | None = None, system: str | None = None) -> Prefix:
        """``media`` (None: the text ``context``), after a ``system`` prompt if given, prefilled
        and compressed with ``policy`` (default: the session's), no question read: a shared
        prefix every question decodes a copy of."""
        return self.compress_prepared(self.prepare(media, TEMPLATE_QUESTION, context=context, source=source,
                                                   system=system), policy)

    def compress_prepared(self, prepared: Prepared, policy: Policy | None = None) -> Prefix:
        """:meth:`compress_media` of a prompt built already (with :data:`TEMPLATE_QUESTION`)."""
        policy = policy or self.policy
        prompt = prepared.prompt
        if prompt.question_start == prompt.length:
            raise HybridKVError("the prompt has no question after its media", prepared.source)
        with self.stage(f"compressing ({policy.name}, budget {policy.budget:g}) ..."):
            prefix = guarded(prepared.source, prefill, self.model().model, prompt, policy,
                             prompt.question_start, shared=True, streaming=self.options.streaming)
        prefix.template = QuestionTemplate.of(self.model().tokenizer, prompt, prepared.question)
        info = input_record(prepared.media, prompt)
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

    # --- answering requests --------------------------------------------------------------------
    def answer(self, requests: Iterable[Request], limits: Limits = Limits()) -> Iterator[Answer]:
        """An :class:`Answer` for each question of ``requests``, decoded together under ``limits``
        in the order they finish (see :func:`hybridkv_cli.engine.jobs.decode`). ``requests`` are
        read as the batch has room for them: a shared request is compressed (or loaded from its
        ``.hkv`` file) when its first question can join, once for all its questions."""
        o = self.options
        jobs = decode(lambda: self.model().model, self._plan(requests), max_new_tokens=o.max_new_tokens,
                      limits=limits, on_step=signals.raise_if_stopped)
        for outcome in jobs:
            request, index = outcome.job.tag
            answer = None
            if outcome.error is None:
                try:
                    answer = Answer(request, index, record=self.record(outcome))
                except Exception as e:  # its record failed: its answer is that error, the others go on
                    outcome.error = e
            yield answer or Answer(request, index, error=failure(request.source, outcome.error))

    def ask(self, request: Request, limits: Limits = Limits()) -> dict:
        """The record of ``request``'s one question (:meth:`answer`); raises its error."""
        policy = request.policy or (request.prefix.policy if request.prefix is not None else self.policy)
        with self.stage(f"answering ({policy.name}, budget {policy.budget:g}) ..."):
            answer, = self.answer([request], limits)
        if answer.error is not None:
            raise answer.error
        return answer.record

    def _plan(self, requests: Iterable[Request]):
        """The engine's ``(tag, make)`` jobs of ``requests``, tagged ``(request, question index)``
        (index None: the request's own failure, before any question)."""
        for request in requests:
            if not request.shared:
                for i in range(len(request.questions)):
                    yield (request, i), lambda request=request, i=i: self._prompt_job(request, i)
                continue
            try:
                prefix = self._prefix(request)
            except Exception as e:  # its questions cannot be asked: one failure for the request
                yield (request, None), lambda e=e: _raise(e)
                continue
            for i in range(len(request.questions)):
                yield (request, i), lambda request=request, i=i, prefix=prefix: self.question_job(prefix, request, i)

    def _prompt_job(self, request: Request, index: int) -> Job:
        """The job of a question read in its prompt, prefilled through the request's policy when
        it is admitted (the memory guard inside: a failure names the input)."""
        prepared = request.prepared or self.prepare_item(request.item, request.questions[index], request.context)
        job = prompt_job(self.model().model, prepared.prompt, request.policy or self.policy,
                         self.options.defer_question, tag=(request, index), about=prepared,
                         streaming=self.options.streaming)
        job.max_new_tokens, job.sampling = request.max_new_tokens, request.sampling or self.options.sampling
        job.logprobs = request.logprobs
        unguarded = job.prefill
        job.prefill = lambda: guarded(prepared.source, unguarded)
        return job

    def _prefix(self, request: Request) -> Prefix:
        """A shared request's prefix: given, or :meth:`compress` of its item now."""
        if request.prefix is not None:
            return request.prefix
        check_new_tokens(request.max_new_tokens or self.options.max_new_tokens, self.model().context_limit)
        return self.compress(request.item, request.context, request.policy)

    def question_job(self, prefix: Prefix, request: Request, index: int, tag=None) -> Job:
        """The job of question ``index`` of ``request`` asked about a copy of the shared
        ``prefix`` (``tag``: the engine's tag, by default ``(request, index)``); a
        :class:`ContextLengthError` when the prompt and the tokens to generate do not fit the
        model's context."""
        loaded = self.model()
        new, limit = request.max_new_tokens or self.options.max_new_tokens, loaded.context_limit
        turn = self._turn(prefix, request) if request.history else None
        suffix = prefix.template.suffix(loaded.tokenizer, request.questions[index], request.history, turn)
        if limit and prefix.seen + len(suffix) + new > limit:
            raise ContextLengthError(f"the prompt needs {prefix.seen + len(suffix)} tokens + {new} new, more than "
                                     f"the model's context of {limit} tokens", request.source)
        return Job((request, index) if tag is None else tag, suffix, prefix=prefix, about=(request, index),
                   max_new_tokens=request.max_new_tokens, sampling=request.sampling or self.options.sampling,
                   logprobs=request.logprobs)

    def _turn(self, prefix: Prefix, request: Request) -> list[int]:
        """The tokens between an answer and the next question of a conversation after ``prefix``
        (a :class:`UsageError` when the model's chat template has none that fit its prompt)."""
        if prefix.role not in self._turns:
            self._turns[prefix.role] = conversation_tokens(self.model().processor, prefix.role)
        found = self._turns[prefix.role]
        if found is None or found[0] != prefix.template.tail:
            raise UsageError(f"{self.model().name}'s chat template does not continue a conversation after a kept "
                             "prefix: ask one question", request.source)
        return found[1]

    def record(self, outcome) -> dict:
        """The result record (README, "JSON output") of a job's generation: a question read in
        its prompt, or one read after a shared prefix (then with its ``shared`` fields)."""
        job, loaded = outcome.job, self.model()
        if isinstance(job.about, Prepared):
            p = job.about
            deferred = self.options.defer_question or streamed(p.prompt, self.options.streaming)
            record = make_record(loaded, input_record(p.media, p.prompt), p.question, job.prefix.policy,
                                 outcome.generation, deferred, outcome.batch)
        else:
            (request, index), prefix = job.about, job.prefix
            info = {k: v for k, v in prefix.info.items() if k != "cache_file"}
            info["text_tokens"] = prefix.seen - int(prefix.visual.sum()) + len(job.suffix)
            record = prefix_record(make_record(loaded, info, request.questions[index], prefix.policy,
                                               outcome.generation, True, outcome.batch),
                                   prefix, index=index, of=len(request.questions),
                                   cache_file=prefix.info.get("cache_file"))
        if job.sampling is not None and job.sampling != GREEDY:  # a sampled or penalised answer says how it was drawn
            record["sampling"] = asdict(job.sampling)
        return record


def _raise(error: BaseException):
    raise error
