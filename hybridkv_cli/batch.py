"""The batch loop: many inputs, one model load, one JSON line per input, resume, error records.

:func:`run_batch` answers the items through a :class:`~hybridkv_cli.session.Session`, writing
one JSON line per input as soon as it is done (to stdout and/or an append-only file, see
:mod:`hybridkv_cli.jsonl`), a record ``{"input": ..., "error": {"type": ..., "message": ...}}``
for each failed one, and progress on stderr (:mod:`hybridkv_cli.progress`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from hybridkv_cli import signals
from hybridkv_cli.errors import HybridKVError, ModelError, UsageError, one_line
from hybridkv_cli.inputs import Item
from hybridkv_cli.jsonl import JsonlFile
from hybridkv_cli.progress import Progress, clock

if TYPE_CHECKING:  # pragma: no cover - the session imports torch; the batch loop itself does not
    from hybridkv_cli.session import Session

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
    from hybridkv_cli.jsonl import record_key

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


def run_batch(items: list[Item], question: str | None, session: Session, *, console, jsonl: TextIO | None = None,
              human=None, output: str | os.PathLike | None = None, resume: bool = False, quiet: bool = False,
              debug: bool = False, questions: list[tuple[str, tuple[str, ...]]] | None = None,
              context: str | None = None) -> Summary:
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
    that cache, one record per question (:meth:`Session.answer_all`); ``resume`` skips the
    (input, question) pairs already answered and an input whose questions all are.
    """
    from rich.markup import escape

    summary = Summary()
    sink = JsonlFile(output) if output is not None else None
    if sink is not None:
        if resume:
            if questions is None:
                done = sink.done()
                todo = [it for it in items if it.key not in done]
            else:
                answered = answered_pairs(output)
                todo = [it for it in items if any((it.key, q) not in answered for q, _ in questions)]
            summary.skipped = len(items) - len(todo)
            if summary.skipped and not quiet:
                console.print(f"resume: skipping {summary.skipped} input{'s' if summary.skipped > 1 else ''} "
                              f"already answered in {escape(str(output))}", highlight=False, soft_wrap=True)
            items = todo
        sink.open()

    def emit(record: dict, count: str | None = None) -> None:
        """Write ``record``'s line; ``count``: the summary counter the line completes."""
        line = json.dumps(record)
        try:
            if sink is not None:
                sink.write(line)
        except KeyboardInterrupt:  # a stop signal held during the write is raised after it: the line is in
            if count:
                setattr(summary, count, getattr(summary, count) + 1)
            raise
        if jsonl is not None:
            jsonl.write(line + "\n")
            jsonl.flush()
        if count:
            setattr(summary, count, getattr(summary, count) + 1)

    progress = Progress(console, len(items), quiet=quiet)
    shown = 0  # records rendered for people
    session.stage = progress.stage
    try:
        with progress:
            for item in items:
                signals.raise_if_stopped()  # a stop whose exception a destructor swallowed
                progress.begin(item.key)
                started = time.perf_counter()
                try:
                    if questions is None:
                        results = [session.answer(item, question)]
                    else:
                        wanted = [(q, a) for q, a in questions if not resume or (item.key, q) not in answered]
                        results = session.answer_all(item, [q for q, _ in wanted], context=context)
                        for result, (_, answers) in zip(results, wanted):
                            if answers:
                                from hybridkv_cli.bench import is_correct

                                result["expected"] = list(answers)
                                result["correct"] = is_correct(result["answer"], answers)
                except (UsageError, ModelError):  # the same for every input: stop the run
                    raise
                except Exception as e:
                    if debug and not isinstance(e, HybridKVError):
                        raise
                    record = error_record(item.key, e)
                    emit(record, "failed")
                    kind = "" if isinstance(e, HybridKVError) else f"{type(e).__name__}: "
                    console.print(f"[red]error:[/red] {escape(item.key)}: {escape(kind + record['error']['message'])}",
                                  highlight=False, soft_wrap=True)
                    progress.finish(item.key, False, time.perf_counter() - started)
                    continue
                for n, result in enumerate(results):  # the input is answered once its last line is written
                    emit(result, "ok" if n == len(results) - 1 else None)
                    if human is not None:
                        from hybridkv_cli.report import render

                        if shown:
                            human.print()
                        shown += 1
                        title = item.key if len(results) == 1 else f"{item.key} · {result['question']}"
                        human.print(f"[bold]── {escape(title)}[/bold]", highlight=False, soft_wrap=True)
                        render(result, human)
                progress.finish(item.key, True, time.perf_counter() - started)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (hybridkv_cli.signals)
        summary.stopped_by = signals.signal_of(e)
    finally:
        if sink is not None:
            sink.close()
    if summary.interrupted:
        console.print(escape(stop_line(summary, len(items), output)), highlight=False, soft_wrap=True)
    elif not quiet:
        skipped = f", {summary.skipped} skipped (already answered)" if summary.skipped else ""
        console.print(f"done: {summary.ok} answered, {summary.failed} failed{skipped} in "
                      f"{clock(time.perf_counter() - progress.start)}", highlight=False, soft_wrap=True)
    return summary
