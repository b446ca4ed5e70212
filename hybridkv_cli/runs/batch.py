"""The batch loop: many inputs, one model load, one JSON line per input, resume, error records.

:func:`run_batch` answers the items through a :class:`~hybridkv_cli.runs.session.Session`, writing
one JSON line per input as soon as it is done (to stdout and/or an append-only file, see
:mod:`hybridkv_cli.io.jsonl`), a record ``{"input": ..., "error": {"type": ..., "message": ...}}``
for each failed one, and progress on stderr (:mod:`hybridkv_cli.io.progress`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from hybridkv_cli.io import signals
from hybridkv_cli.io.errors import HybridKVError, ModelError, UsageError, one_line
from hybridkv_cli.io.jsonl import JsonlFile
from hybridkv_cli.io.progress import Progress, clock
from hybridkv_cli.runs.answers import is_correct
from hybridkv_cli.runs.inputs import Item

if TYPE_CHECKING:  # pragma: no cover - the session imports torch; the batch loop itself does not
    from hybridkv_cli.runs.session import Session

#: Exit codes of a run: all inputs answered / at least one failed / interrupted (Ctrl-C; SIGTERM
#: gives 143 and SIGHUP 129, 128 + the signal number).
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


def error_record(key: str, exc: BaseException) -> dict:
    """``{"input": key, "error": {"type": ..., "message": <one line>}}``."""
    if isinstance(exc, HybridKVError):
        message = exc.reason if exc.source in (None, key) else str(exc)
    else:
        message = str(exc) or type(exc).__name__
    return {"input": key, "error": {"type": type(exc).__name__, "message": one_line(message)}}


def stop_line(summary: Summary, total: int, output) -> str:
    """The one line a stopped run ends with: what was interrupted and how to go on."""
    done = summary.ok + summary.failed
    what = f"{signals.describe(summary.stopped_by)} after {done} of {total} input{'s' if total != 1 else ''}"
    if output:
        return f"{what}; the completed lines are in {output} (run the same command with --resume to continue)"
    return f"{what} (a run with --output FILE can continue where it stopped with --resume)"


def answered_pairs(path: str | os.PathLike) -> set[tuple[str, str]]:
    """(input, question) pairs answered successfully in the JSON-lines file ``path``."""
    from hybridkv_cli.io.jsonl import record_key

    pairs: set[tuple[str, str]] = set()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                key = record_key(record)
                if key is not None and isinstance(record.get("question"), str):
                    pairs.add((key, record["question"]))
    except FileNotFoundError:
        pass
    return pairs


@dataclass
class Summary:
    """How a run went: inputs answered, failed, skipped (``--resume``), and the signal that stopped
    it (Ctrl-C, SIGTERM, SIGHUP), if one did."""

    ok: int = 0
    failed: int = 0
    skipped: int = 0
    stopped_by: int | None = None

    @property
    def interrupted(self) -> bool:
        return self.stopped_by is not None

    @property
    def exit_code(self) -> int:
        if self.stopped_by is not None:
            return signals.exit_code(self.stopped_by)
        return EXIT_FAILED if self.failed else EXIT_OK


def plan_resume(items: list[Item], output, questions, *, console, quiet: bool) -> tuple[list[Item], set | None]:
    """``--resume``: the items ``output`` has not answered yet (all of them for a multi-question run
    while one question is missing), and with ``questions`` the (input, question) pairs it has."""
    from rich.markup import escape

    answered = None
    if questions is None:
        done = JsonlFile(output).done()
        todo = [it for it in items if it.key not in done]
    else:
        answered = answered_pairs(output)
        todo = [it for it in items if any((it.key, q) not in answered for q, _ in questions)]
    skipped = len(items) - len(todo)
    if skipped and not quiet:
        console.print(f"resume: skipping {skipped} input{'s' if skipped > 1 else ''} "
                      f"already answered in {escape(str(output))}", highlight=False, soft_wrap=True)
    return todo, answered


def request_of(item: Item, question: str | None, questions=None, answered: set | None = None,
               context: str | None = None):
    """The :class:`~hybridkv_cli.runs.requests.Request` of one input: its ``question``, or with
    ``questions`` (``(question, expected answers)`` pairs) those not ``answered`` already
    (``--resume``), asked after one shared compression. Its tag: the ``(question, expected)``
    pairs asked."""
    from hybridkv_cli.runs.requests import Request

    wanted = [(question, ())] if questions is None else [
        (q, a) for q, a in questions if not answered or (item.key, q) not in answered]
    return Request(wanted, tuple(q for q, _ in wanted), item=item, context=context, shared=questions is not None)


def result_of(answer) -> dict:
    """The line of one question answered (:class:`~hybridkv_cli.runs.requests.Answer`): its record,
    marked against the expected answers when there are any, or its error record with its question."""
    request = answer.request
    question, expected = request.tag[answer.index]
    if answer.error is not None:
        return {**error_record(request.item.key, answer.error), "question": question}
    record = answer.record
    if expected:
        record["expected"] = list(expected)
        record["correct"] = is_correct(record["answer"], expected)
    return record


def item_events(session: Session, requests, limits, debug: bool = False):
    """What a run writes, from :meth:`Session.answer` of one request per input (:func:`request_of`):
    ``("line", request, line)`` for each question of a shared request as soon as it is answered,
    ``("done", request, lines)`` when the input's last answer came, or ``("failed", request,
    error)`` when its media, its compression or its one question failed. A :class:`UsageError` or
    :class:`ModelError` (every input would fail the same way), or with ``debug`` an unexpected
    exception, is raised."""
    lines: dict[int, list] = {}  # the lines so far of each input in flight
    for answer in session.answer(requests, limits):
        request, error = answer.request, answer.error
        if error is not None and (isinstance(error, (UsageError, ModelError)) or (
                debug and not isinstance(error, HybridKVError))):
            raise error
        if answer.index is None or (error is not None and not request.shared):
            lines.pop(id(request), None)
            yield "failed", request, error
            continue
        done = lines.setdefault(id(request), [])
        done.append(result_of(answer))
        if request.shared:
            yield "line", request, done[-1]
        if len(done) == len(request.questions):
            del lines[id(request)]
            yield "done", request, done


def error_kind(exc: BaseException) -> str:
    """What an error line puts before the message: nothing for our one-line errors, else the type."""
    return "" if isinstance(exc, HybridKVError) else f"{type(exc).__name__}: "


class Recorder:
    """Where a run's records go, shared by :func:`run_batch` and the distributed driver
    (:mod:`hybridkv_cli.runs.distributed`): the JSONL file (``sink``), the ``jsonl`` stream, the human
    report, error lines on ``console``, and the :class:`Summary` counts."""

    def __init__(self, summary: Summary, *, console, sink: JsonlFile | None = None, jsonl: TextIO | None = None,
                 human=None):
        self.summary, self.console, self.sink, self.jsonl, self.human = summary, console, sink, jsonl, human
        self.shown = 0  # records rendered for people

    @classmethod
    def start(cls, items: list[Item], output, resume: bool, questions, *, console, jsonl=None, human=None,
              quiet: bool = False) -> tuple["Recorder", list[Item], set | None]:
        """A run's recorder with its output file open, the items still to answer (``resume``: those
        the file has not answered) and the (input, question) pairs answered already (or None)."""
        summary = Summary()
        sink = JsonlFile(output) if output is not None else None
        answered = None
        if sink is not None:
            if resume:
                todo, answered = plan_resume(items, output, questions, console=console, quiet=quiet)
                summary.skipped = len(items) - len(todo)
                items = todo
            sink.open()
        return cls(summary, console=console, sink=sink, jsonl=jsonl, human=human), items, answered

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()

    def emit(self, record: dict, count: str | None = None) -> None:
        """Write ``record``'s line; ``count``: the summary counter the line completes."""
        line = json.dumps(record)
        with signals.deferred_signals():  # the file's line, the stream's line and the count go together
            if self.sink is not None:
                self.sink.write(line)
            if self.jsonl is not None:
                self.jsonl.write(line + "\n")
                self.jsonl.flush()
            if count:
                setattr(self.summary, count, getattr(self.summary, count) + 1)

    def failed(self, key: str, record: dict, kind: str = "") -> None:
        """Input ``key`` failed: its error ``record`` and one ``error:`` line (``kind``: see :func:`error_kind`)."""
        self.emit(record, "failed")
        self._error_line(key, kind + record["error"]["message"])

    def _error_line(self, where: str, message: str) -> None:
        from rich.markup import escape

        self.console.print(f"[red]error:[/red] {escape(where)}: {escape(message)}", highlight=False, soft_wrap=True)

    def answered(self, key: str, results: list[dict], streamed: bool = False) -> bool:
        """Input ``key`` is answered: its records, one per question (it counts once its last line is
        written, as failed when one of them is a question's error record); False in that case.
        ``streamed``: the lines were written already, one by one (:meth:`question`)."""
        count = "failed" if any("error" in r for r in results) else "ok"
        if streamed:
            with signals.deferred_signals():
                setattr(self.summary, count, getattr(self.summary, count) + 1)
            return count == "ok"
        for n, result in enumerate(results):
            self.question(key, result, len(results) == 1, count if n == len(results) - 1 else None)
        return count == "ok"

    def question(self, key: str, result: dict, single: bool, count: str | None = None) -> None:
        """One record of input ``key`` (``single``: its only question): its line, then its error
        line or its human report."""
        from rich.markup import escape

        self.emit(result, count)
        if "error" in result:
            self._error_line(f"{key} · {one_line(result['question'], 80)}", result["error"]["message"])
        elif self.human is not None:
            from hybridkv_cli.io.report import render

            if self.shown:
                self.human.print()
            self.shown += 1
            title = key if single else f"{key} · {result['question']}"
            self.human.print(f"[bold]── {escape(title)}[/bold]", highlight=False, soft_wrap=True)
            render(result, self.human)

    def last_line(self, total: int, output, seconds: float, quiet: bool) -> None:
        """The line a run ends with: the stop line, or ``done: ...`` (unless ``quiet``)."""
        from rich.markup import escape

        summary = self.summary
        if summary.interrupted:
            self.console.print(escape(stop_line(summary, total, output)), highlight=False, soft_wrap=True)
        elif not quiet:
            skipped = f", {summary.skipped} skipped (already answered)" if summary.skipped else ""
            self.console.print(f"done: {summary.ok} answered, {summary.failed} failed{skipped} in "
                               f"{clock(seconds)}", highlight=False, soft_wrap=True)


def run_batch(items: list[Item], question: str | None, session: Session, *, console, jsonl: TextIO | None = None,
              human=None, output: str | os.PathLike | None = None, resume: bool = False, quiet: bool = False,
              debug: bool = False, questions: list[tuple[str, tuple[str, ...]]] | None = None,
              context: str | None = None, limits=None) -> Summary:
    """Answer every item; one record per input (success or error), in order.

    ``jsonl``: a stream that gets every record line (flushed per line); ``human``: a rich console
    that gets the human report of each answer; ``output``: a JSON-lines file the records are
    appended to (``resume``: skip inputs it already answered). Errors are also printed on
    ``console`` as ``error: <input>: <reason>``; progress goes there unless ``quiet``. A
    :class:`UsageError` (a command-line problem) or :class:`ModelError` (the model cannot load)
    would fail every input the same way and stops the run; any other failure is recorded and
    the run goes on (``debug``: unexpected exceptions propagate).
    Ctrl-C, SIGTERM or SIGHUP stop after the completed lines (``Summary.stopped_by``).

    ``questions`` (``(question, expected answers)`` pairs; then ``question`` is unused): every
    item is compressed once (or loaded from its ``.hkv`` file) and each question answered from
    that cache, one record per question, each written as soon as it is answered; ``resume``
    skips the (input, question) pairs already answered and an input whose questions all are.

    Every item is a :class:`~hybridkv_cli.runs.requests.Request` to
    :meth:`Session.answer`: with ``limits`` (an :class:`~hybridkv_cli.engine.Limits` that
    batches) the questions of all inputs decode together and their lines come in the order they
    finish; without, one at a time, in order.
    """
    from hybridkv_cli.engine import Limits

    recorder, items, answered = Recorder.start(items, output, resume, questions, console=console, jsonl=jsonl,
                                               human=human, quiet=quiet)
    summary = recorder.summary
    progress = Progress(console, len(items), quiet=quiet)
    session.stage = progress.stage
    started: dict[str, float] = {}
    single = questions is not None and len(questions) == 1

    def requests():
        for item in items:
            signals.raise_if_stopped()  # a stop whose exception a destructor swallowed
            progress.begin(item.key)
            started[item.key] = time.perf_counter()
            yield request_of(item, question, questions, answered, context)

    try:
        with progress:
            for event, request, data in item_events(session, requests(), limits or Limits(), debug):
                key = request.item.key
                if event == "line":
                    recorder.question(key, data, single)  # written as soon as it is answered
                    continue
                if event == "failed":
                    recorder.failed(key, error_record(key, data), error_kind(data))
                ok = event == "done" and recorder.answered(key, data, streamed=request.shared)
                progress.finish(key, ok, time.perf_counter() - started.pop(key))
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (hybridkv_cli.io.signals)
        summary.stopped_by = signals.signal_of(e)
    finally:
        recorder.close()
    recorder.last_line(len(items), output, time.perf_counter() - progress.start, quiet)
    return summary
