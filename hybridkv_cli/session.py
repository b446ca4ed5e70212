"""The session: one model, loaded once, answering inputs along one straight line.

    inputs -> media -> prompt -> generate(policy) -> record

``hybridkv ask`` (one input or many), ``profile`` and ``bench`` all answer through a
:class:`Session`. It loads the model on first need (after the first input's media, so a bad
first file fails before a long model load), builds each prompt once (the chat template rendered
once; the context check reads the built prompt), runs one generation per policy, and maps
every failure -- out-of-memory included -- to a one-line :class:`~hybridkv_cli.errors.HybridKVError`
here and nowhere else.
"""

from __future__ import annotations

import gc
import re
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from hybridkv_cli import models, signals
from hybridkv_cli.compression import Policy, make_policy
from hybridkv_cli.errors import (ContextLengthError, HybridKVError, MediaWarning, ModelError, OutOfMemoryError,
                                 UsageError, one_line)
from hybridkv_cli.generation import generate
from hybridkv_cli.inputs import Item
from hybridkv_cli.loaded import LoadedModel
from hybridkv_cli.media import MediaInput, load_media
from hybridkv_cli.prompt import Prompt, build_prompt, build_text_prompt
from hybridkv_cli.multi import TEMPLATE_QUESTION, CompressedPrefix, QuestionTemplate, answer, compress_prefix
from hybridkv_cli.record import input_record, make_record, prefix_record


@dataclass(frozen=True)
class AskOptions:
    """Everything an input's answer depends on besides the media and the question."""

    model: str = models.DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    method: str | None = "hybridkv"  # None: no policy of the session's own (bench and route build one per run)
    method_options: dict = field(default_factory=dict)  # budget, window, theta, ...
    frames: int = 64
    fps: float | None = None
    max_pixels: int | None = None
    max_new_tokens: int = 128
    defer_question: bool = False  # compress before the question is read (generation.generate)
    method_given: bool = True  # --method was given (a .hkv input with another method is refused)


@dataclass
class Prepared:
    """One input made ready: its media (None: a text prompt), the built prompt, the question,
    and the name errors give it."""

    media: MediaInput | None
    prompt: Prompt
    question: str
    source: str


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
    """

    def __init__(self, options: AskOptions, *, loaded: LoadedModel | None = None,
                 stage: Callable[[str], ContextManager] | None = None):
        self.options = options
        self.loaded = loaded
        self.stage = stage or (lambda message: nullcontext())
        # Built now, so a bad method or option is refused before any input is read; a policy
        # is configuration only and serves every generation of the session.
        self.policy = make_policy(options.method, **options.method_options) if options.method else None
        self._sized: set = set()  # the media whose size was checked: one warning per input, however many runs

    # --- the steps ---------------------------------------------------------------------------
    def model(self) -> LoadedModel:
        """The model, loaded on the first call; a failure is a one-line :class:`ModelError`."""
        if self.loaded is None:
            o = self.options
            failed = None
            with self.stage(f"loading {o.model} ..."):
                try:
                    self.loaded = models.load_model(o.model, device=o.device, dtype=o.dtype)
                except HybridKVError:
                    raise
                except Exception as e:
                    if not _is_oom(e):
                        raise ModelError(f"cannot load the model ({type(e).__name__}: {one_line(e)})",
                                         o.model) from e
                    failed = one_line(e)
            if failed is not None:  # outside the handler: the failed load's memory can be released
                _free_memory()
                raise ModelError(f"out of memory while loading the model ({failed})", o.model)
        return self.loaded

    def load_media(self, paths) -> MediaInput:
        """One input's media, at the model's own frame size unless ``--max-pixels`` says otherwise."""
        o = self.options
        max_pixels = models.max_pixels_for(o.model, o.max_pixels)
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
            prompt = self._guarded(source, build_prompt, loaded.processor, media, question)
        _check_length(prompt, loaded.context_limit, self.options.max_new_tokens, source)
        if media is not None and media.sources not in self._sized:
            self._sized.add(media.sources)
            _warn_if_large(media, prompt.visual_tokens)
        return Prepared(media, prompt, question, source)

    def run(self, prepared: Prepared, policy: Policy, *, max_new_tokens: int | None = None) -> dict:
        """Generate with ``policy`` and return the result record (README, "JSON output")."""
        loaded, o = self.model(), self.options
        with self.stage(f"answering ({policy.name}, budget {policy.budget:g}) ..."):
            generation = self._guarded(prepared.source, generate, loaded.model, prepared.prompt, policy,
                                       max_new_tokens=max_new_tokens or o.max_new_tokens,
                                       defer_question=o.defer_question)
        return make_record(loaded, prepared.media, prepared.prompt, prepared.question, policy, generation,
                           o.defer_question)

    # --- the straight line -------------------------------------------------------------------
    def answer(self, item: Item, question: str, context: str | None = None, limits=None) -> dict:
        """The result record for ``item`` (no paths: a text prompt about ``context``); raises a
        :class:`HybridKVError` for a bad input. With ``limits`` that batch (``--cuda-graphs``), it
        is decoded by the batch decoder, alone."""
        if limits is not None and limits.batched:
            (_, record), = self.answer_batched([item], question, limits, context)
            if isinstance(record, BaseException):
                raise record
            return record
        return self.run(self.prepare_item(item, question, context), self.policy)

    def prepare_item(self, item: Item, question: str, context: str | None = None) -> Prepared:
        """``item``'s media loaded and its prompt built (no paths: a text prompt about ``context``)."""
        if item.error is not None:
            raise item.error
        media = self.load_media(item.paths) if item.paths else None
        return self.prepare(media, question, context=context, source=item.key if item.paths else None)

    # --- many inputs decoded together (batching.py) ---------------------------------------------
    def answer_batched(self, items, question: str, limits, context: str | None = None):
        """``(item, record)`` of every item, decoded together under ``limits`` (a
        :class:`~hybridkv_cli.batching.BatchLimits`), in the order they finish; a failed input's
        record is its :class:`HybridKVError` (or the exception) instead. Each record is the one
        :meth:`answer` gives, plus ``batch``: how it was batched. ``items`` are read as the batch
        has room for them."""
        jobs = ((item, lambda item=item: self.prepare_item(item, question, context)) for item in items)
        return self.decode_together(jobs, self.policy, limits)

    def decode_together(self, jobs, policy: Policy, limits):
        """``(tag, record or error)`` of ``jobs`` (``(tag, prepare)`` pairs, ``prepare()`` giving
        a :class:`Prepared`) decoded together with ``policy`` (see :meth:`answer_batched`)."""
        from hybridkv_cli.batching import decode_batched, prefill

        o = self.options

        def first_token(prepared: Prepared):
            return self._guarded(prepared.source, prefill, self.model().model, prepared.prompt, policy,
                                 o.defer_question)

        for outcome in decode_batched(lambda: self.model().model, jobs, first_token, max_new_tokens=o.max_new_tokens,
                                      limits=limits, on_step=signals.raise_if_stopped):
            if outcome.error is not None:
                yield outcome.tag, outcome.error
                continue
            p = outcome.prepared
            record = make_record(self.model(), p.media, p.prompt, p.question, policy, outcome.generation,
                                 o.defer_question)
            record["batch"] = outcome.batch
            yield outcome.tag, record

    # --- one compression, many questions (multi.py, hkv.py) ------------------------------------
    def compress(self, item: Item, context: str | None = None) -> CompressedPrefix:
        """``item``'s prefix (media, or the text ``context``) prefilled and compressed once, with
        no question read; a ``.hkv`` item is loaded from its file instead."""
        from hybridkv_cli import hkv

        if item.error is not None:
            raise item.error
        if item.paths and len(item.paths) == 1 and hkv.is_cache_path(item.paths[0]):
            return self.load_cache(item.paths[0])
        media = self.load_media(item.paths) if item.paths else None
        return self.compress_media(media, context=context, source=item.key if item.paths else None)

    def compress_media(self, media: MediaInput | None, *, context: str | None = None, source: str | None = None,
                       policy: Policy | None = None) -> CompressedPrefix:
        """``media`` (None: the text ``context``) prefilled and compressed with ``policy`` (default:
        the session's), no question read."""
        policy = policy or self.policy
        prepared = self.prepare(media, TEMPLATE_QUESTION, context=context, source=source)
        loaded = self.model()
        template = QuestionTemplate.of(loaded.tokenizer, prepared.prompt, prepared.question)
        with self.stage(f"compressing ({policy.name}, budget {policy.budget:g}) ..."):
            prefix = self._guarded(prepared.source, compress_prefix, loaded.model, prepared.prompt, policy,
                                   template)
        info = input_record(media, prepared.prompt)
        info.pop("text_tokens", None)  # the question's: set per record
        prefix.info = info
        return prefix

    def load_cache(self, path: str) -> CompressedPrefix:
        """The compressed prefix saved in the ``.hkv`` file ``path`` (a :class:`CacheFileError` if
        it is not one, or not for this model, dtype, method or its options)."""
        from hybridkv_cli import hkv

        o = self.options
        header = hkv.read_header(path)
        hkv.check_header(header, self.model(), path, o.method if o.method_given else None)
        stored = header.get("options") or {}
        for key, value in o.method_options.items():
            if value is not None and key in stored and stored[key] != value:
                flag = "--" + key.replace("_", "-")
                raise hkv.CacheFileError(f"compressed with {flag} {stored[key]}, not {value}; drop {flag} or "
                                         "compress again", path)
        with self.stage("loading the compressed cache ..."):
            return self._guarded(path, hkv.load, path, self.model(), o.method if o.method_given else None)

    def ask_prefix(self, prefix: CompressedPrefix, question: str, *, index: int = 0, of: int = 1,
                   source: str = "", cache_file: str | None = None) -> dict:
        """The record of ``question`` answered from a fresh copy of ``prefix``."""
        loaded, o = self.model(), self.options
        suffix = prefix.template.suffix(loaded.tokenizer, question)
        limit = loaded.context_limit
        check_new_tokens(o.max_new_tokens, limit)
        if limit and prefix.seen + len(suffix) + o.max_new_tokens > limit:
            raise ContextLengthError(f"the prompt needs {prefix.seen + len(suffix)} tokens + {o.max_new_tokens} new, "
                                     f"more than the model's context of {limit} tokens", source)
        with self.stage(f"answering question {index + 1} of {of} ..."):
            generation, prompt = self._guarded(source, answer, loaded.model, prefix, suffix, o.max_new_tokens)
        record = make_record(loaded, None, prompt, question, prefix.policy, generation, True)
        return prefix_record(record, prefix, prompt, index=index, of=of, cache_file=cache_file)

    def answer_all(self, item: Item, questions: list[str], context: str | None = None,
                   failed: Callable[[str, HybridKVError], dict] | None = None,
                   each: Callable[[int, dict], None] | None = None) -> list[dict]:
        """One record per question about ``item``, compressed once (a ``.hkv`` item: loaded).
        ``failed(question, error)``: the record of a question that fails on its own (too long for
        the context, out of memory), so the other questions keep their answers (None: raise).
        ``each(index, record)`` is called with every record as soon as it exists (the run writes
        it then: a stop loses at most the question in flight)."""
        from hybridkv_cli import hkv

        prefix = self.compress(item, context=context)
        cache_file = item.paths[0] if item.paths and hkv.is_cache_path(item.paths[0]) else None
        if cache_file is not None:
            prefix.info = {**prefix.info, "media_label": prefix.info.get("label"), "label": item.key}
        records = []
        for i, q in enumerate(questions):
            try:
                records.append(self.ask_prefix(prefix, q, index=i, of=len(questions), cache_file=cache_file,
                                               source=item.key if item.paths else "--context"))
            except (UsageError, ModelError):
                raise
            except HybridKVError as e:
                if failed is None:
                    raise
                records.append(failed(q, e))
            if each is not None:
                each(i, records[-1])
        return records

    @staticmethod
    def _guarded(source: str, step, *args, **kwargs):
        """``step(*args, **kwargs)``, with running out of memory turned into :class:`OutOfMemoryError`."""
        failed = None
        try:
            return step(*args, **kwargs)
        except Exception as e:
            if not _is_oom(e):
                raise
            where = "device" if isinstance(e, torch.OutOfMemoryError) else "host"
            failed = str(e)
        _free_memory()  # here the exception and its frames are gone: the memory can be released
        m = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]?i?B)", failed)
        detail = f" (tried to allocate {m.group(1)})" if m else ""
        raise OutOfMemoryError(f"out of {where} memory{detail}; try a lower --budget, fewer --frames or a lower "
                               "--max-pixels", source)


def check_new_tokens(max_new_tokens: int, limit: int | None) -> None:
    """``--max-new-tokens`` alone must leave room in the model's context (a usage error naming it)."""
    if limit and max_new_tokens >= limit:
        raise UsageError(f"{max_new_tokens} new tokens do not fit the model's context of {limit} tokens",
                         "--max-new-tokens")


def _check_length(prompt: Prompt, limit: int | None, max_new_tokens: int, source: str) -> None:
    """Raise when the built prompt + ``max_new_tokens`` exceed the model's context ``limit``: a
    :class:`UsageError` when the question alone does, else :class:`ContextLengthError`."""
    if not limit:
        return
    check_new_tokens(max_new_tokens, limit)
    bulk, text = prompt.visual_tokens, prompt.text_tokens
    if text + max_new_tokens > limit:
        raise UsageError(f"the question is too long: {text} text tokens + {max_new_tokens} new tokens exceed the "
                         f"model's context of {limit} tokens", "QUESTION")
    if bulk + text + max_new_tokens > limit:
        fix = "shorten the context" if prompt.role == "context" else "use fewer --frames, a lower --max-pixels"
        raise ContextLengthError(
            f"the prompt needs {bulk + text} tokens ({bulk} {prompt.role} + {text} text) + {max_new_tokens} new, "
            f"more than the model's context of {limit} tokens; {fix}, or a lower --max-new-tokens", source)


#: A prompt above either limit gets a warning: it may be far bigger than meant.
LARGE_SET_IMAGES = 256
LARGE_PROMPT_TOKENS = 16384


def _warn_if_large(media: MediaInput, tokens: int) -> None:
    """One warning line when ``media`` is an image set of more than 256 images or its built prompt
    holds more than 16k visual ``tokens`` (a folder of 2000 thumbnails is one 8000-token prompt
    unless --each is given), naming the flags that make it smaller."""
    images = len(media.images) if media.kind == "images" else 0
    if images <= LARGE_SET_IMAGES and tokens <= LARGE_PROMPT_TOKENS:
        return
    if media.kind == "images":
        what = f"one image set of {images} images, {tokens} visual tokens"
        fix = "--each asks about every image separately, a lower --max-pixels makes each image smaller"
    else:  # --each splits only a set of files: a video is smaller with fewer frames or pixels
        what, fix = f"{tokens} visual tokens", "fewer --frames or a lower --max-pixels makes it smaller"
    warnings.warn(f"{media.label}: {what} in one prompt; {fix}", MediaWarning, stacklevel=3)


def _is_oom(e: BaseException) -> bool:
    """torch's device OOM, Python's MemoryError, or torch's CPU allocator failing."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and re.search(r"can't allocate memory|not enough memory", str(e)) is not None)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
