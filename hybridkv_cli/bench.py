"""``hybridkv bench``: compression methods × budgets over a set of inputs, scored against the full cache.

Every input (media + question, or a text prompt: context + question) is answered once with the
full cache — the fidelity reference — and then once per method and budget, all greedy with the
same ``max_new_tokens``; the input's media is loaded once for all its runs. Per (method, budget)
the runs are aggregated (:func:`aggregate`) into

* accuracy: the share of runs whose output contains the expected answer (after
  :func:`~hybridkv_cli.answers.normalise`; any of several answers counts), over the inputs that have one;
* fidelity: mean ROUGE-L F1 of the output against the full-cache output of the same input;
* mean device KV ratio vs the full cache, mean ms per decoded token, mean host->device bytes
  per decode step (retrieval methods only).

Rendering (table, CSV, JSON, PNG) lives in :mod:`hybridkv_cli.bench_report`.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path

from hybridkv_cli.answers import is_correct
from hybridkv_cli.errors import HybridKVError, UsageError

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


def method_options(methods: list[str], options: dict) -> dict[str, dict]:
    """Per method, the given ``options`` (None: not given) that it takes; an option none of
    ``methods`` takes, or a value a method refuses, is a usage error naming its flag."""
    from hybridkv_cli.compression import METHODS, make_policy

    given = {k: v for k, v in options.items() if v is not None}
    taken = {m: {k: v for k, v in given.items() if k in METHODS[m].options()} for m in methods}
    for option in sorted(given):
        if not any(option in kw for kw in taken.values()):
            raise UsageError(f"does not apply to any of the methods {', '.join(methods)}",
                             "--" + option.replace("_", "-"))
    for method, kw in taken.items():
        make_policy(method, **kw)  # refuses bad values before any input runs
    return taken


# --- tasks ----------------------------------------------------------------------------------------
def read_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL task file: one object per line (blank lines skipped) with ``question``,
    optional ``id`` (default ``FILE:LINE``), ``answer`` (string or list), ``context`` (text),
    ``media`` (path or list of paths, relative to the file's directory); exactly one of
    ``context`` and ``media``; other keys are ignored. A bad row is a :class:`UsageError`
    naming ``FILE:LINE``."""
    from hybridkv_cli.questions import clean_question, strings
    from hybridkv_cli.user_files import loads, read_text

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
        from hybridkv_cli.fidelity import rouge_l

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
              quiet: bool = False, debug: bool = False, per_video: bool = False, limits=None, **options) -> dict:
    """Run every task through :func:`plan_runs` with ``session`` and aggregate; returns
    ``{"config", "aggregates", "items"}``.

    Each task's media is loaded and its prompt built once for all its runs; frames, pixels,
    ``max_new_tokens`` and ``defer_question`` are the session's options. ``options`` (window,
    theta, ...; None: not given) go to every method that takes them (:func:`method_options`). A run that fails (its input's media, the
    device memory, ...) becomes an item with ``error`` set and the others go on; ``debug``
    re-raises unexpected exceptions. Progress and errors are shown on ``console`` (stderr)
    unless ``quiet``.

    ``per_video``: the tasks about one media (or one text context) share one compression per
    (method, budget), and every question is answered from a copy of it
    (a shared prefix, :meth:`Session.ask_prefix`), as a deferred question; the answers are those
    of a run with ``defer_question`` and no grouping (tested), in less time.

    ``limits`` (an :class:`~hybridkv_cli.engine.Limits` that batches): every run decodes all the
    inputs together (:meth:`Session.decode_together`; with ``per_video``, the questions of each
    media); the answers are the same.
    """
    from rich.markup import escape

    from hybridkv_cli.batch import error_record
    from hybridkv_cli.compression import make_policy
    from hybridkv_cli.engine import Limits
    from hybridkv_cli.progress import Progress
    from hybridkv_cli.record import note

    loaded, settings = session.model(), session.options
    runs = plan_runs(methods, budgets)
    per_method = {REFERENCE: {}, **method_options(methods, options)}
    policies = {(m, b): make_policy(m, budget=b, **per_method[m]) for m, b in runs}  # one per run, for every input
    items: list[dict] = []
    units = len(group_by_media(tasks)) if per_video else len(tasks)
    progress = Progress(console, units * len(runs), quiet=quiet or console is None)
    warm = False

    def failed(key: str, e: Exception) -> dict:
        if debug and not isinstance(e, HybridKVError):
            raise e
        error = error_record(key, e)["error"]
        if console is not None:
            console.print(f"[red]error:[/red] {escape(key)}: {escape(error['message'])}", highlight=False,
                          soft_wrap=True)
        return error

    limits = limits or Limits()
    batched = limits.batched
    if per_video:
        items = _run_grouped(session, tasks, policies, progress, failed, limits)
    elif batched:
        items = _run_batched(session, tasks, policies, progress, failed, limits)
    with (nullcontext() if per_video or batched else progress):
        for task in ([] if per_video or batched else tasks):
            prepared, errors = _prepare(session, task, runs, failed, progress)
            if prepared is None:
                items += errors
                continue
            if not warm:
                warm = True
                _warm_up(session, prepared, policies)
            reference = None
            for method, budget in runs:
                key = f"{task.id} {method} b={budget:g}"
                progress.begin(key)
                started = time.perf_counter()
                try:
                    result = session.run(prepared, policies[method, budget])
                except Exception as e:
                    items.append(_record(task, method, budget, error=failed(key, e)))
                    progress.finish(key, False, time.perf_counter() - started)
                    continue
                if method == REFERENCE:
                    reference = result["answer"]
                items.append(_record(task, method, budget, result, reference))
                progress.finish(key, True, time.perf_counter() - started)
    config = {"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
              "methods": methods, "budgets": budgets, "max_new_tokens": settings.max_new_tokens,
              "options": {**{k: v for k, v in options.items() if v is not None},
                          "defer_question": settings.defer_question or per_video, "per_video": per_video},
              "frames": settings.frames,
              "fps": settings.fps, "max_pixels": settings.max_pixels, "inputs": len(tasks), "note": note(loaded)}
    return {"config": config, "aggregates": aggregate(items, runs), "items": items}


def _prepare(session, task: Task, runs, failed, progress) -> tuple:
    """``(prepared, [])``, or ``(None, the error's record for every run)`` when the task's media fail."""
    try:
        media = session.load_media(task.media) if task.media else None
        return session.prepare(media, task.question, context=task.context, source=task.id), []
    except Exception as e:
        error = failed(task.id, e)
        for method, budget in runs:
            progress.finish(f"{task.id} {method} b={budget:g}", False, 0.0)
        return None, [_record(task, method, budget, error=error) for method, budget in runs]


def _warm_up(session, prepared, policies: dict) -> None:
    """One-time costs out of every ms/token: a first generation (a failure shows in the real run)."""
    with suppress(Exception):
        session.run(prepared, policies[REFERENCE, 1.0], max_new_tokens=2)


def _keep(results: dict, references: dict, task: Task, method: str, budget: float, result: dict) -> None:
    """Keep one run's item; the reference run's answer is what the others' fidelity compares with
    (it runs first)."""
    if method == REFERENCE:
        references[task.id] = result["answer"]
    results[task.id, method, budget] = _record(task, method, budget, result, references.get(task.id))


def _run_batched(session, tasks: list[Task], policies: dict, progress, failed, limits) -> list[dict]:
    """Every run (the reference first) decodes all the tasks together (see :func:`run_bench`)."""
    runs = list(policies)
    results: dict = {}
    prepared: dict = {}
    with progress:
        for task in tasks:
            prepared[task.id], errors = _prepare(session, task, runs, failed, progress)
            results.update(((task.id, r["method"], r["budget"]), r) for r in errors)
        prepared = {key: p for key, p in prepared.items() if p is not None}
        if prepared:
            _warm_up(session, next(iter(prepared.values())), policies)
        todo = [task for task in tasks if task.id in prepared]
        reference: dict[str, str] = {}
        for method, budget in runs:
            started = time.perf_counter()
            jobs = [(task, lambda p=prepared[task.id]: p) for task in todo]
            for task, result in session.decode_together(jobs, policies[method, budget], limits):
                key = f"{task.id} {method} b={budget:g}"
                if isinstance(result, BaseException):
                    results[task.id, method, budget] = _record(task, method, budget, error=failed(key, result))
                    progress.finish(key, False, time.perf_counter() - started)
                    continue
                _keep(results, reference, task, method, budget, result)
                progress.finish(key, True, time.perf_counter() - started)
    return [results[task.id, method, budget] for task in tasks for method, budget in runs]


def _run_grouped(session, tasks: list[Task], policies: dict, progress, failed, limits) -> list[dict]:
    """``run_bench(per_video=True)``: one compression per media group and run (``policies``, by
    (method, budget)), then its questions."""
    from contextlib import suppress

    runs = list(policies)
    results: dict[tuple[str, str, float], dict] = {}
    warm = False
    with progress:
        for group in group_by_media(tasks):
            head = group[0]
            try:
                media = session.load_media(head.media) if head.media else None
            except Exception as e:
                error = failed(head.id, e)
                for task in group:
                    for method, budget in runs:
                        results[task.id, method, budget] = _record(task, method, budget, error=error)
                continue
            if not warm:  # the first generation pays one-time costs: keep them out of every ms/token
                warm = True
                with suppress(Exception):
                    prefix = session.compress_media(media, context=head.context, source=head.id,
                                                    policy=policies[REFERENCE, 1.0])
                    list(session.ask_prefix(prefix, [head.question], source=head.id))
            references: dict[str, str] = {}
            for method, budget in runs:
                key = f"{head.id} (+{len(group) - 1}) {method} b={budget:g}"
                progress.begin(key)
                started = time.perf_counter()
                try:
                    prefix = session.compress_media(media, context=head.context, source=head.id,
                                                    policy=policies[method, budget])
                except Exception as e:
                    error = failed(key, e)
                    for task in group:
                        results[task.id, method, budget] = _record(task, method, budget, error=error)
                    progress.finish(key, False, time.perf_counter() - started)
                    continue
                ok = True
                asked = session.ask_prefix(prefix, [task.question for task in group], source=head.id,
                                           limits=limits)
                for i, result in asked:
                    task = group[i]
                    if isinstance(result, BaseException):
                        results[task.id, method, budget] = _record(task, method, budget,
                                                                   error=failed(f"{task.id} {method} b={budget:g}", result))
                        ok = False
                        continue
                    _keep(results, references, task, method, budget, result)
                progress.finish(key, ok, time.perf_counter() - started)
    return [results[task.id, method, budget] for task in tasks for method, budget in runs]


def aggregate(items: list[dict], runs: list[tuple[str, float]]) -> list[dict]:
    """One row per (method, budget) of ``runs``: n, errors and the means over the runs that
    completed (accuracy over those with an expected answer; None where nothing to average), and
    ``accuracy_ci`` / ``fidelity_ci``: the 95 % percentile-bootstrap interval ``[lo, hi]`` of
    those two means over the same runs (:func:`hybridkv_cli.stats.bootstrap_ci`; None likewise)."""
    from hybridkv_cli.stats import bootstrap_ci

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
