"""``hybridkv bench``: compression methods × budgets over a set of inputs, scored against the full cache.

Every input (media + question, or a text prompt: context + question) is answered once with the
full cache — the fidelity reference — and then once per method and budget, all greedy with the
same ``max_new_tokens``; the input's media is loaded once for all its runs. Per (method, budget)
the runs are aggregated (:func:`aggregate`) into

* accuracy: the share of runs whose output contains the expected answer (after
  :func:`~hybridkv_cli.runs.answers.normalise`; any of several answers counts), over the inputs that have one;
* fidelity: mean ROUGE-L F1 of the output against the full-cache output of the same input;
* mean device KV ratio vs the full cache, mean ms per decoded token, mean host->device bytes
  per decode step (retrieval methods only).

Rendering (table, CSV, JSON, PNG) lives in :mod:`hybridkv_cli.io.bench_report`.
"""

from __future__ import annotations

import statistics
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hybridkv_cli.io.errors import HybridKVError, UsageError
from hybridkv_cli.runs.answers import is_correct
from hybridkv_cli.runs.batch import error_record

if TYPE_CHECKING:
    from hybridkv_cli.compression import MethodOptions

REFERENCE = "full"  # the method every input runs once, at budget 1.0


@dataclass(frozen=True)
class Task:
    """One input: ``media`` paths (one video or one image set) or a text ``context``, the
    ``question``, and the accepted ``answers`` (empty: fidelity only)."""

    id: str
    question: str
    answers: tuple[str, ...] = ()
    context: str | None = None
    media: tuple[str, ...] = ()


# --- the command line's lists ---------------------------------------------------------------------
def parse_methods(text: str | None) -> list[str]:
    """Comma-separated method names, in order, without duplicates and without ``full`` (always
    run); None: every registered method except ``full`` and ``route`` (which needs a route
    file), HybridKV first."""
    from hybridkv_cli.compression import METHODS

    if text is None:
        return sorted((m for m in METHODS if m not in (REFERENCE, "route")), key=lambda m: (m != "hybridkv", m))
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise UsageError("give at least one method", "--methods")
    for name in names:
        if name not in METHODS:
            raise UsageError(f"unknown method '{name}' (available: {', '.join(sorted(METHODS))})", "--methods")
    return [n for n in names if n != REFERENCE]


def parse_budgets(text: str) -> list[float]:
    """Comma-separated budgets in (0, 1], sorted, without duplicates."""
    from hybridkv_cli.compression.base import check_budget

    try:
        budgets = sorted({float(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise UsageError(f"not a comma-separated list of numbers: '{text}'", "--budgets") from None
    if not budgets:
        raise UsageError("give at least one budget", "--budgets")
    for b in budgets:
        check_budget(b, "--budgets")
    return budgets


# --- tasks ----------------------------------------------------------------------------------------
def read_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL task file: one object per line (blank lines skipped) with ``question``,
    optional ``id`` (default ``FILE:LINE``), ``answer`` (string or list), ``context`` (text),
    ``media`` (path or list of paths, relative to the file's directory); exactly one of
    ``context`` and ``media``; other keys are ignored. A bad row is a :class:`UsageError`
    naming ``FILE:LINE``."""
    from hybridkv_cli.io.questions import clean_question, strings
    from hybridkv_cli.io.user_files import loads, read_text

    path = Path(path)
    lines = read_text(path, "--tasks").splitlines()  # a regular file of UTF-8, at most 64 MiB; a BOM dropped
    tasks: list[Task] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = loads(line)
        except ValueError as e:
            raise UsageError(f"not valid JSON ({e})", where) from None
        if not isinstance(row, dict):
            raise UsageError("a task must be a JSON object", where)
        if not isinstance(row.get("question"), str):
            raise UsageError("'question' (a string) is missing", where)
        try:
            question = clean_question(row["question"])
        except UsageError as e:
            raise UsageError(e.reason, where) from None
        context = row.get("context")
        if context is not None and not isinstance(context, str):
            raise UsageError("'context' must be a string", where)
        if (context is None) == (row.get("media") is None):
            raise UsageError("a task needs 'context' (a text prompt) or 'media'" if context is None else
                             "a task has 'context' (a text prompt) or 'media', not both", where)
        media = () if row.get("media") is None else strings(row["media"], "media", where)
        answers = () if row.get("answer") is None else strings(row["answer"], "answer", where)
        task_id = row.get("id", f"{path.name}:{number}")
        if not isinstance(task_id, str) or task_id in {t.id for t in tasks}:
            raise UsageError(f"'id' must be a unique string, got {task_id!r}", where)
        tasks.append(Task(task_id, question, answers, context, tuple(str(path.parent / m) for m in media)))
    if not tasks:
        raise UsageError("no tasks in the file", str(path))
    return tasks


# --- scoring --------------------------------------------------------------------------------------
# aggregate column -> item key averaged into it
_MEANS = {"accuracy": "correct", "fidelity": "fidelity", "kv_ratio": "kv_ratio", "ms_per_token": "ms_per_token",
          "h2d_bytes_per_step": "h2d_bytes_per_step"}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


# --- running --------------------------------------------------------------------------------------
def plan_runs(methods: list[str], budgets: list[float]) -> list[tuple[str, float]]:
    """The (method, budget) runs of every input: the full-cache reference first."""
    return [(REFERENCE, 1.0)] + [(m, b) for m in methods for b in budgets]


def _record(task: Task, method: str, budget: float, result: dict | None = None, reference: str | None = None,
            error: dict | None = None) -> dict:
    """One run of one input, as ``items`` of the JSON output."""
    record = {"id": task.id, "method": method, "budget": budget, "answer": None, "expected": list(task.answers) or None,
              "correct": None, "fidelity": None, "kv_ratio": None, "ms_per_token": None,
              "h2d_bytes_per_step": None, "tokens": None, "error": error}
    if result is not None:
        from hybridkv_cli.runs.fidelity import rouge_l

        traffic = result["traffic"]
        record.update(
            answer=result["answer"], correct=is_correct(result["answer"], task.answers),
            fidelity=None if reference is None else rouge_l(result["answer"], reference),
            kv_ratio=result["kv"]["ratio_vs_full"], ms_per_token=result["decode"]["ms_per_token_mean"],
            h2d_bytes_per_step=traffic["h2d_bytes_per_step_mean"] if traffic else None,
            tokens={k: v for k, v in result["input"].items() if k.endswith("_tokens")})
    return record


def group_by_media(tasks: list[Task]) -> list[list[Task]]:
    """Tasks about the same media (or the same text context), in order of first appearance."""
    groups: dict[tuple, list[Task]] = {}
    for task in tasks:
        groups.setdefault((task.media, task.context), []).append(task)
    return list(groups.values())


def run_bench(session, tasks: list[Task], methods: list[str], budgets: list[float], *, console=None,
              quiet: bool = False, debug: bool = False, per_video: bool = False, limits=None,
              options: MethodOptions | None = None) -> dict:
    """Run every task through :func:`plan_runs` with ``session`` and aggregate; returns
    ``{"config", "aggregates", "items"}``.

    Each task's media is loaded and its prompt built once for all its runs; frames, pixels,
    ``max_new_tokens`` and ``defer_question`` are the session's options. ``options`` (window,
    theta, ...) go to every method that takes them (:meth:`MethodOptions.per_method`). A run that
    fails (its input's media, the device memory, ...) becomes an item with ``error`` set and the
    others go on; ``debug`` re-raises unexpected exceptions. Progress and errors are shown on
    ``console`` (stderr) unless ``quiet``.

    The tasks run in waves, each run (method, budget) of a wave decoded under ``limits`` (an
    :class:`~hybridkv_cli.engine.Limits`): one task a wave by default; all of them when
    ``limits`` batches; with ``per_video``, the tasks about one media (or one text context), which
    share one compression per run, every question answered from a copy of it as a deferred
    question (:meth:`Session.answer` of one request). The answers are the same whichever the waves (tested).
    """
    from rich.markup import escape

    from hybridkv_cli.compression import MethodOptions, make_policy
    from hybridkv_cli.engine import Limits
    from hybridkv_cli.io.progress import Progress
    from hybridkv_cli.runs.record import note

    loaded, settings = session.model(), session.options
    options, limits = options or MethodOptions(), limits or Limits()
    runs = plan_runs(methods, budgets)
    per_method = {REFERENCE: {}, **options.per_method(methods)}
    policies = {(m, b): make_policy(m, budget=b, **per_method[m]) for m, b in runs}  # one per run, for every input
    waves = group_by_media(tasks) if per_video else [tasks] if limits.batched else [[task] for task in tasks]
    progress = Progress(console, len(tasks) * len(runs), quiet=quiet or console is None)

    def failed(key: str, e: BaseException) -> dict:
        if debug and not isinstance(e, HybridKVError):
            raise e
        error = error_record(key, e)["error"]
        if console is not None:
            console.print(f"[red]error:[/red] {escape(key)}: {escape(error['message'])}", highlight=False,
                          soft_wrap=True)
        return error

    results: dict[tuple[str, str, float], dict] = {}
    with progress:
        for number, wave in enumerate(waves):
            ready, broken = _prepare(session, wave, failed)
            for task, error in broken:
                for method, budget in runs:
                    results[task.id, method, budget] = _record(task, method, budget, error=error)
                    progress.finish(f"{task.id} {method} b={budget:g}", False, 0.0)
            if number == 0 and ready:  # one-time costs out of every ms/token (a failure shows in the real run)
                from hybridkv_cli.runs.requests import Request

                with suppress(Exception):
                    session.ask(Request(prepared=ready[0][1], policy=policies[REFERENCE, 1.0], max_new_tokens=2))
            references: dict[str, str] = {}  # the full cache's answers, which the others' fidelity compares with
            for method, budget in runs:
                progress.begin(f"{wave[0].id}{f' (+{len(wave) - 1})' if len(wave) > 1 else ''} {method} b={budget:g}")
                started = time.perf_counter()
                for task, result in _answers(session, ready, policies[method, budget], limits, per_video):
                    key = f"{task.id} {method} b={budget:g}"
                    if isinstance(result, HybridKVError) and result.source == task.id:
                        result.source = None  # the key names the task already
                    error = failed(key, result) if isinstance(result, BaseException) else None
                    if error is None and method == REFERENCE:
                        references[task.id] = result["answer"]
                    results[task.id, method, budget] = _record(task, method, budget, None if error else result,
                                                               references.get(task.id), error)
                    progress.finish(key, error is None, time.perf_counter() - started)
    items = [results[task.id, method, budget] for task in tasks for method, budget in runs]
    config = {"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
              "methods": methods, "budgets": budgets, "max_new_tokens": settings.max_new_tokens,
              "options": {**options.given(), "defer_question": settings.defer_question or per_video,
                          "per_video": per_video},
              "frames": settings.frames,
              "fps": settings.fps, "max_pixels": settings.max_pixels, "inputs": len(tasks), "note": note(loaded)}
    return {"config": config, "aggregates": aggregate(items, runs), "items": items}


def _prepare(session, wave: list[Task], failed) -> tuple[list, list]:
    """``(ready, broken)``: ``(task, prepared)`` of the tasks of ``wave`` whose media load (once
    per media; each prompt built once for all runs), and ``(task, error)`` of the others."""
    ready, broken, media = [], [], {}
    for task in wave:
        try:
            if task.media not in media:
                media[task.media] = session.load_media(task.media) if task.media else None
            ready.append((task, session.prepare(media[task.media], task.question, context=task.context,
                                                source=task.id)))
        except Exception as e:
            broken.append((task, failed(task.id, e)))
    return ready, broken


def _answers(session, ready: list, policy, limits, per_video: bool):
    """``(task, record or error)`` of every prepared task under ``policy``: each prefilled and
    decoded, or (``per_video``: one media) all from one compression of their media."""
    from hybridkv_cli.runs.requests import Request

    if not per_video:
        requests = (Request(task, prepared=p, policy=policy) for task, p in ready)
        for answer in session.answer(requests, limits):
            yield answer.request.tag, answer.record if answer.error is None else answer.error
        return
    (head, first), questions = ready[0], tuple(task.question for task, _ in ready)
    try:
        prefix = session.compress_media(first.media, context=head.context, source=head.id, policy=policy)
    except Exception as e:
        yield from ((task, e) for task, _ in ready)
        return
    for answer in session.answer([Request(head.id, questions, prefix=prefix, label=head.id)], limits):
        yield ready[answer.index][0], answer.record if answer.error is None else answer.error


def aggregate(items: list[dict], runs: list[tuple[str, float]]) -> list[dict]:
    """One row per (method, budget) of ``runs``: n, errors and the means over the runs that
    completed (accuracy over those with an expected answer; None where nothing to average), and
    ``accuracy_ci`` / ``fidelity_ci``: the 95 % percentile-bootstrap interval ``[lo, hi]`` of
    those two means over the same runs (:func:`hybridkv_cli.runs.stats.bootstrap_ci`; None likewise)."""
    from hybridkv_cli.runs.stats import bootstrap_ci

    rows = []
    for method, budget in runs:
        group = [r for r in items if r["method"] == method and r["budget"] == budget]
        done = [r for r in group if r["error"] is None]
        intervals = {f"{column}_ci": bootstrap_ci(r[_MEANS[column]] for r in done)
                     for column in ("accuracy", "fidelity")}
        rows.append({"method": method, "budget": budget, "n": len(group), "errors": len(group) - len(done),
                     **{column: _mean(r[key] for r in done) for column, key in _MEANS.items()},
                     **{column: None if ci is None else list(ci) for column, ci in intervals.items()}})
    return rows
