"""Runs over many inputs: one model load, one JSON line per input, resume, error records.

The CLI (``hybridkv ask``) is a thin layer over this module:

* :func:`plan_inputs` turns the media arguments into :class:`Item` s (one prompt each): all paths
  as one input (an image set), each path its own input (``--each``; a directory expands to the
  media files in it, natural order), or one path per line from stdin (``-``).
* :class:`Runner` answers one item at a time through :func:`hybridkv_cli.api.ask`; it loads the
  model once, when the first input's media has loaded, and turns device out-of-memory and
  over-long prompts into one-line errors.
* :func:`run_batch` runs the items, writing one JSON line per input as soon as it is done (to
  stdout and/or an append-only file, flushed and fsynced line by line), a record
  ``{"input": ..., "error": {"type": ..., "message": ...}}`` for each failed one, progress on
  stderr, and ``--resume`` (skip inputs already answered in the file).

Heavy imports (torch, transformers, media decoders) happen on first use, so ``--help`` stays fast.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import unicodedata
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterator, TextIO

from hybridkv_cli.errors import HybridKVError, MediaError, ModelError, UsageError

#: Exit codes of a run: all inputs answered / at least one failed / interrupted (Ctrl-C).
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


class ContextLengthError(HybridKVError):
    """The prompt (+ the tokens to generate) does not fit the model's context window."""


class OutOfMemoryError(HybridKVError):
    """The device (or host) ran out of memory on this input."""


# --- the question ---------------------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 except \t \n, DEL, C1


def clean_question(question: str) -> str:
    """Normalise a question typed on a command line or read from a file.

    ANSI escape sequences are removed; CRLF, CR, U+2028 and U+2029 become ``\\n``; every other
    control character (C0 except tab and newline, DEL, C1) is removed; lone surrogates (bytes
    that were not UTF-8) become U+FFFD; the text is NFC-normalised and stripped. An empty result
    is a :class:`UsageError`. Chat-template tokens such as ``<|im_start|>`` are left in the text:
    the prompt builder tokenises them as plain text (see :func:`hybridkv_cli.prompt.build_prompt`).
    """
    q = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in question)
    q = _ANSI.sub("", q)
    q = q.replace("\r\n", "\n").replace("\r", "\n").replace("\u2028", "\n").replace("\u2029", "\n")
    q = _CONTROL.sub("", q)
    q = unicodedata.normalize("NFC", q).strip()
    if not q:
        raise UsageError("the question is empty" + (" (after removing control characters)" if question.strip() else ""),
                         "QUESTION")
    return q


# --- inputs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    """One prompt's media: the paths as the user gave them. ``error`` marks an input known to be
    bad before loading (e.g. a directory with no media files under ``--each``)."""

    paths: tuple[str, ...]
    error: HybridKVError | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        """The ``input`` of an error record, and the ``input.label`` of a success record for the
        same input (a path as given; an image set of several files: ``first + N more``)."""
        first = self.paths[0] if self.paths else "<no input>"
        return first if len(self.paths) <= 1 else f"{first} + {len(self.paths) - 1} more"


def read_context(path: str, stdin: TextIO | None = None) -> str:
    """The text of a ``--context`` file (``-``: all of ``stdin``), as UTF-8."""
    if path == "-":
        return (stdin or sys.stdin).read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MediaError("no such file", path) from None
    except IsADirectoryError:
        raise MediaError("is a directory, not a text file", path) from None
    except UnicodeDecodeError as e:
        raise MediaError(f"not UTF-8 text (byte {e.start})", path) from None
    except OSError as e:
        raise MediaError(f"cannot read ({e.strerror or e})", path) from None


def read_paths(stream: TextIO) -> list[str]:
    """One path per line (read to the end of input). Only the line ending is removed, so names
    with spaces work; blank lines are ignored; bytes that are not UTF-8 survive (surrogateescape)."""
    raw = getattr(stream, "buffer", None)
    if raw is not None:
        lines = [os.fsdecode(b) for b in raw.read().split(b"\n")]
    else:
        lines = stream.read().split("\n")
    if lines and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]
    return [line[:-1] if line.endswith("\r") else line for line in lines if line.strip()]


def _media_extensions() -> set[str]:
    from hybridkv_cli.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS

    return VIDEO_EXTENSIONS | IMAGE_EXTENSIONS


def each_in_directory(directory: str) -> list[Item]:
    """``--each`` over a directory: every video and image file in it (not recursive, hidden files
    ignored), natural order, each its own input. Other entries are skipped with a ``MediaWarning``."""
    import natsort

    from hybridkv_cli.media import MediaWarning

    try:
        entries = list(os.scandir(directory))
    except PermissionError:
        return [Item((directory,), MediaError("permission denied (cannot list directory)", directory))]
    except OSError as e:
        return [Item((directory,), MediaError(f"cannot list directory: {e.strerror or e}", directory))]
    exts = _media_extensions()
    media, skipped = [], []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        if is_dir:
            skipped.append(entry.name + "/")
        elif os.path.splitext(entry.name)[1].lower() in exts:
            media.append(entry.name)
        else:
            skipped.append(entry.name)
    alg = natsort.ns.PATH | natsort.ns.IGNORECASE
    if skipped:
        skipped = natsort.natsorted(skipped, alg=alg)
        listed = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        warnings.warn(f"{directory}: skipped {len(skipped)} non-media entr{'ies' if len(skipped) > 1 else 'y'}: "
                      f"{listed}", MediaWarning, stacklevel=2)
    if not media:
        return [Item((directory,), MediaError(
            f"no media files in directory (supported: {', '.join(sorted(exts))})", directory))]
    return [Item((os.path.join(directory, name),)) for name in natsort.natsorted(media, alg=alg)]


def plan_inputs(paths: list[str], *, each: bool, stdin: TextIO | None = None) -> list[Item]:
    """The inputs of a run (see the module docstring). ``-`` must be the only media argument."""
    if "-" in paths:
        if len(paths) > 1:
            raise UsageError("'-' (read paths from stdin) cannot be combined with other media arguments", "MEDIA")
        if stdin is None:
            raise UsageError("no stdin to read paths from", "MEDIA")
        return [it for p in read_paths(stdin) for it in (_expand_one(p) if each else [Item((p,))])]
    if not paths:
        raise UsageError("give one or more media files (or a directory) followed by the question", "arguments")
    if not each:
        return [Item(tuple(paths))]
    return [it for p in paths for it in _expand_one(p)]


def _expand_one(path: str) -> list[Item]:
    return each_in_directory(path) if path and os.path.isdir(path) else [Item((path,))]


# --- answering one input --------------------------------------------------------------------------
@dataclass(frozen=True)
class AskOptions:
    """Everything an input's answer depends on besides the media and the question."""

    model: str = "Qwen/Qwen2.5-VL-7B-Instruct"
    device: str = "auto"
    dtype: str = "auto"
    method: str = "hybridkv"
    method_options: dict = field(default_factory=dict)  # budget, window, theta, ...
    frames: int = 64
    fps: float | None = None
    max_pixels: int | None = None
    max_new_tokens: int = 128
    defer_question: bool = False  # compress before the question is read (generation.generate)

    def policy(self):
        """A fresh policy (policies keep per-run state); raises UsageError for bad options."""
        from hybridkv_cli.compression import make_policy

        return make_policy(self.method, **self.method_options)


def _one_line(value, limit: int = 400) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def visual_token_count(processor, media) -> int:
    """Visual tokens the processor will emit for ``media`` (sizes are multiples of patch*merge)."""
    ip = getattr(processor, "image_processor", None)
    factor = int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", 2))
    temporal = int(getattr(ip, "temporal_patch_size", 2))
    if media.kind == "video":
        t, _, h, w = media.video.shape
        return -(-int(t) // temporal) * (int(h) // factor) * (int(w) // factor)
    return sum((im.size[1] // factor) * (im.size[0] // factor) for im in media.images)


def prompt_length(processor, media, question: str) -> tuple[int, int]:
    """(visual, text) token counts of the prompt :func:`~hybridkv_cli.prompt.build_prompt` would
    build, without running the image/video processor."""
    from hybridkv_cli.prompt import VISUAL_PAD_TOKENS, chat_text, question_ids

    tok = processor.tokenizer
    pads = {tok.convert_tokens_to_ids(t) for t in VISUAL_PAD_TOKENS}
    template = tok(chat_text(processor, media, ""), add_special_tokens=False)["input_ids"]
    text = sum(1 for i in template if i not in pads) + len(question_ids(tok, question.strip()))
    return visual_token_count(processor, media), text


def check_context(loaded, media, question: str, max_new_tokens: int, source: str | None = None,
                  context: str | None = None) -> None:
    """Raise :class:`ContextLengthError` when prompt + ``max_new_tokens`` exceed the text model's
    ``max_position_embeddings`` (a :class:`UsageError` when the question alone does). ``media``
    None: a text prompt about ``context``."""
    if media is not None:
        loaded.refuse_media(source or media.label)
    limit = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
    if not limit:
        return
    if media is None:
        from hybridkv_cli.prompt import build_text_prompt

        prompt = build_text_prompt(loaded.tokenizer, context or "", question)  # tokenising only: cheap
        bulk, text, role, fix = prompt.visual_tokens, prompt.text_tokens, "context", "shorten the context"
    else:
        bulk, text = prompt_length(loaded.processor, media, question)
        role, fix = "visual", "use fewer --frames, a lower --max-pixels"
    if text + max_new_tokens > limit:
        raise UsageError(f"the question is too long: {text} text tokens + {max_new_tokens} new tokens exceed the "
                         f"model's context of {limit} tokens", "QUESTION")
    if bulk + text + max_new_tokens > limit:
        raise ContextLengthError(
            f"the prompt needs {bulk + text} tokens ({bulk} {role} + {text} text) + {max_new_tokens} new, "
            f"more than the model's context of {limit} tokens; {fix}, or a lower --max-new-tokens",
            source or (media.label if media is not None else "--context"))


def _is_oom(e: BaseException) -> bool:
    """torch's device OOM, Python's MemoryError, or torch's CPU allocator failing."""
    import torch

    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and re.search(r"can't allocate memory|not enough memory", str(e)) is not None)


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _oom_error(where: str, reason: str, source: str | None) -> OutOfMemoryError:
    m = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]?i?B)", reason)
    detail = f" (tried to allocate {m.group(1)})" if m else ""
    return OutOfMemoryError(f"out of {where} memory{detail}; try a lower --budget, fewer --frames or a lower "
                            "--max-pixels", source)


class Runner:
    """Answers inputs one at a time with one model, loaded on first need (after the first input's
    media loaded, so a bad first file fails before the model load). ``stage(message)`` returns a
    context manager shown while a slow step runs (a spinner, a progress description)."""

    def __init__(self, options: AskOptions, *, loaded=None,
                 stage: Callable[[str], ContextManager] | None = None):
        self.options = options
        self.loaded = loaded
        self.loads = 0
        self.stage = stage or (lambda message: nullcontext())

    def model(self):
        if self.loaded is None:
            from hybridkv_cli.models import load_model

            o = self.options
            failed = None
            with self.stage(f"loading {o.model} ..."):
                try:
                    self.loaded = load_model(o.model, device=o.device, dtype=o.dtype)
                except HybridKVError:
                    raise
                except Exception as e:
                    if not _is_oom(e):
                        raise ModelError(f"cannot load the model ({type(e).__name__}: {_one_line(e)})",
                                         o.model) from e
                    failed = _one_line(e)
            if failed is not None:
                _free_device_memory()
                raise ModelError(f"out of memory while loading the model ({failed})", o.model)
            self.loads += 1
        return self.loaded

    def answer(self, item: Item, question: str, context: str | None = None) -> dict:
        """The result record for ``item`` (no paths: a text prompt about ``context``); raises a
        :class:`HybridKVError` for a bad input."""
        if item.error is not None:
            raise item.error
        from hybridkv_cli.api import ask
        from hybridkv_cli.media import load_media
        from hybridkv_cli.models import max_pixels_for

        o = self.options
        policy = o.policy()
        max_pixels = max_pixels_for(o.model, o.max_pixels)
        media = load_media(list(item.paths), frames=o.frames, fps=o.fps, max_pixels=max_pixels) if item.paths else None
        loaded = self.model()
        check_context(loaded, media, question, o.max_new_tokens, source=item.key if item.paths else "--context",
                      context=context)
        failed = None
        with self.stage(f"answering ({policy.name}, budget {policy.budget:g}) ..."):
            try:
                return ask(loaded, media, question, context=context, method=policy, max_new_tokens=o.max_new_tokens,
                           defer_question=o.defer_question)
            except Exception as e:
                if not _is_oom(e):
                    raise
                import torch

                where = "device" if isinstance(e, torch.OutOfMemoryError) else "host"
                failed = str(e)
        del media  # here the exception and its frames are gone: the memory can be released
        _free_device_memory()
        raise _oom_error(where, failed, item.key)


# --- output ---------------------------------------------------------------------------------------
def error_record(key: str, exc: BaseException) -> dict:
    """``{"input": key, "error": {"type": ..., "message": <one line>}}``."""
    if isinstance(exc, HybridKVError):
        message = exc.reason if exc.source in (None, key) else str(exc)
    else:
        message = str(exc) or type(exc).__name__
    return {"input": key, "error": {"type": type(exc).__name__, "message": _one_line(message)}}


def record_key(record) -> str | None:
    """The input a JSONL line answered (None for error records and foreign lines)."""
    if not isinstance(record, dict) or "error" in record:
        return None
    inp = record.get("input")
    return inp.get("label") if isinstance(inp, dict) and isinstance(inp.get("label"), str) else None


@contextmanager
def _deferred_sigint() -> Iterator[None]:
    """Hold Ctrl-C until the block is done (a record line is written whole or not at all)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    except (ValueError, OSError):  # pragma: no cover - signals unavailable here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt


class JsonlFile:
    """An append-only JSON-lines file: whole lines, each flushed and fsynced, so a crash never
    leaves half a line behind; a half last line left by an earlier crash (kill -9, full disk)
    is removed, with a warning, when the file is opened."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd: int | None = None

    def done(self) -> set[str]:
        """Inputs answered successfully in the file (error records do not count: they are retried)."""
        keys: set[str] = set()
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return keys
        except OSError as e:
            raise HybridKVError(f"cannot read: {e.strerror or e}", str(self.path)) from None
        bad = 0
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                key = record_key(json.loads(line))
            except ValueError:
                bad += i < len(lines) - 1  # a half last line (no newline) is repaired by open()
                continue
            if key is not None:
                keys.add(key)
        if bad:
            from hybridkv_cli.media import MediaWarning

            warnings.warn(f"{self.path}: ignored {bad} unreadable line{'s' if bad > 1 else ''}", MediaWarning,
                          stacklevel=2)
        return keys

    def open(self) -> None:
        shown = str(self.path)
        try:
            self._repair_tail()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except IsADirectoryError:
            raise HybridKVError("is a directory, expected a file", shown) from None
        except OSError as e:
            raise HybridKVError(f"cannot write: {e.strerror or e}", shown) from None

    def _repair_tail(self) -> None:
        try:
            f = open(self.path, "rb+")
        except FileNotFoundError:
            return
        with f:
            end = f.seek(0, os.SEEK_END)
            if end == 0:
                return
            f.seek(end - 1)
            if f.read(1) == b"\n":
                return
            pos, tail = end, b""
            while pos > 0 and b"\n" not in tail:  # read backwards to the last newline
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                tail = f.read(step) + tail
            cut = pos + tail.rfind(b"\n") + 1  # 0 when the file is one half line
            try:
                json.loads(tail[tail.rfind(b"\n") + 1:])
                complete = True
            except ValueError:
                complete = False
            if complete:  # a whole record without its newline: keep it
                f.write(b"\n")
            else:
                f.truncate(cut)
                from hybridkv_cli.media import MediaWarning

                warnings.warn(f"{self.path}: removed an incomplete last line ({end - cut} bytes) left by an "
                              "interrupted run", MediaWarning, stacklevel=3)
            f.flush()
            os.fsync(f.fileno())

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        try:
            with _deferred_sigint():
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                os.fsync(self._fd)
        except OSError as e:
            raise HybridKVError(f"cannot write: {e.strerror or e}", str(self.path)) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# --- progress -------------------------------------------------------------------------------------
def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Progress over inputs on ``console`` (stderr): a rich progress bar with ETA on a terminal,
    one plain line per finished input otherwise (logs); nothing when ``quiet``."""

    def __init__(self, console, total: int, *, quiet: bool = False):
        self.console, self.total, self.quiet = console, total, quiet
        self.done = 0
        self.start = time.perf_counter()
        self._bar = None
        self._task = None
        self._key = ""

    def __enter__(self):
        if not self.quiet and self.console.is_terminal:
            import sys

            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._bar = Bar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
                            redirect_stdout=sys.stdout.isatty(), redirect_stderr=False)
            self._bar.__enter__()
            self._task = self._bar.add_task("", total=self.total)
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False

    def begin(self, item: Item) -> None:
        self._key = item.key
        if self._bar is not None:
            self._bar.update(self._task, description=self._short(item.key))

    def stage(self, message: str) -> ContextManager:
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self._short(self._key)}: {message}")
        return nullcontext()

    def finish(self, item: Item, ok: bool, seconds: float) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=self._short(item.key))
        elif not self.quiet:
            left = self.total - self.done
            eta = (time.perf_counter() - self.start) / self.done * left
            self.console.print(f"[{self.done}/{self.total}] {'ok' if ok else 'failed'}: {item.key} "
                               f"({seconds:.1f} s{f', ETA {_clock(eta)}' if left else ''})",
                               markup=False, highlight=False, soft_wrap=True)

    @staticmethod
    def _short(text: str, width: int = 40) -> str:
        from rich.markup import escape

        return escape(text if len(text) <= width else "…" + text[-(width - 1):])


# --- the batch ------------------------------------------------------------------------------------
@dataclass
class Summary:
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.interrupted else EXIT_FAILED if self.failed else EXIT_OK


def run_batch(items: list[Item], question: str, runner: Runner, *, console, jsonl: TextIO | None = None,
              human=None, output: str | os.PathLike | None = None, resume: bool = False, quiet: bool = False,
              debug: bool = False) -> Summary:
    """Answer every item; one record per input (success or error), in order.

    ``jsonl``: a stream that gets every record line (flushed per line); ``human``: a rich console
    that gets the human report of each answer; ``output``: a JSON-lines file the records are
    appended to (``resume``: skip inputs it already answered). Errors are also printed on
    ``console`` as ``error: <input>: <reason>``; progress goes there unless ``quiet``. A
    :class:`UsageError` (a command-line problem) or :class:`ModelError` (the model cannot load)
    would fail every input the same way and stops the run; any other failure is recorded and
    the run goes on (``debug``: unexpected exceptions propagate).
    Ctrl-C stops after the completed lines (``Summary.interrupted``).
    """
    from rich.markup import escape

    summary = Summary()
    sink = JsonlFile(output) if output is not None else None
    if sink is not None:
        if resume:
            done = sink.done()
            todo = [it for it in items if it.key not in done]
            summary.skipped = len(items) - len(todo)
            if summary.skipped and not quiet:
                console.print(f"resume: skipping {summary.skipped} input{'s' if summary.skipped > 1 else ''} "
                              f"already answered in {escape(str(output))}", highlight=False, soft_wrap=True)
            items = todo
        sink.open()

    def emit(record: dict) -> None:
        line = json.dumps(record)
        if sink is not None:
            sink.write(line)
        if jsonl is not None:
            jsonl.write(line + "\n")
            jsonl.flush()

    progress = Progress(console, len(items), quiet=quiet)
    runner.stage = progress.stage
    try:
        with progress:
            for item in items:
                progress.begin(item)
                started = time.perf_counter()
                try:
                    result = runner.answer(item, question)
                except (UsageError, ModelError):  # the same for every input: stop the run
                    raise
                except Exception as e:
                    if debug and not isinstance(e, HybridKVError):
                        raise
                    record = error_record(item.key, e)
                    emit(record)
                    summary.failed += 1
                    kind = "" if isinstance(e, HybridKVError) else f"{type(e).__name__}: "
                    console.print(f"[red]error:[/red] {escape(item.key)}: {escape(kind + record['error']['message'])}",
                                  highlight=False, soft_wrap=True)
                    progress.finish(item, False, time.perf_counter() - started)
                    continue
                emit(result)
                summary.ok += 1
                if human is not None:
                    from hybridkv_cli.report import render

                    if summary.ok > 1:
                        human.print()
                    human.print(f"[bold]── {escape(item.key)}[/bold]", highlight=False, soft_wrap=True)
                    render(result, human)
                progress.finish(item, True, time.perf_counter() - started)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        if sink is not None:
            sink.close()
    done = summary.ok + summary.failed
    where = f"; the completed lines are in {output} (run again with --resume to continue)" if output else ""
    if summary.interrupted:
        console.print(f"interrupted after {done} of {len(items)} input{'s' if len(items) != 1 else ''}{escape(where)}",
                      highlight=False, soft_wrap=True)
    elif not quiet:
        skipped = f", {summary.skipped} skipped (already answered)" if summary.skipped else ""
        console.print(f"done: {summary.ok} answered, {summary.failed} failed{skipped} in "
                      f"{_clock(time.perf_counter() - progress.start)}", highlight=False, soft_wrap=True)
    return summary


@contextmanager
def one_line_warnings(print_line: Callable[[str], None]) -> Iterator[None]:
    """Show Python warnings (e.g. the media layer's skipped files) as ``warning: <message>``
    lines, every time, instead of the default two-line format."""
    with warnings.catch_warnings():
        # our own notices (MediaWarning, resume repairs) every time, not once per location
        warnings.filterwarnings("always", category=UserWarning, module=r"hybridkv_cli(\.|$)")

        def show(message, category, filename, lineno, file=None, line=None):
            print_line(_one_line(message, limit=1000))

        warnings.showwarning = show
        yield
