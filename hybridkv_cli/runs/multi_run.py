"""The command-line side of one compression, many questions: ``ask -Q ... -Q ...``,
``ask --questions FILE``, ``ask clip.hkv QUESTION`` and ``hybridkv compress`` (one cache file per
input, ``--each`` into a folder, ``--resume``). The work itself is the session's (one shared
prefix, a job per question: :meth:`~hybridkv_cli.runs.session.Session.answer`) and
:mod:`hybridkv_cli.engine.hkv` (the file format); the loops
report one line per failure and go on, like :func:`hybridkv_cli.runs.batch.run_batch`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hybridkv_cli.io.errors import HybridKVError, ModelError, UsageError


def plan_questions(given: list[str] | None, path: str | None) -> list[tuple[str, tuple[str, ...]]] | None:
    """``(question, expected answers)`` from ``--question`` (repeated) then ``--questions FILE``;
    None when neither is given (the question is then the last argument)."""
    from hybridkv_cli.io.questions import clean_question, read_questions

    if not given and path is None:
        return None
    asked = [(clean_question(q), ()) for q in given or []]
    if path is not None:
        asked += read_questions(path)
    return asked


def resolve_cache_inputs(paths: list[str], model: str | None, dtype: str) -> tuple[str, str, bool]:
    """``(model, dtype, caches)``: with ``.hkv`` inputs (then every input must be one) the model
    and, for ``--dtype auto``, the dtype default to those the first file was written with."""
    from hybridkv_cli.engine import hkv
    from hybridkv_cli.models.registry import DEFAULT_MODEL

    caches = [p for p in paths if hkv.is_cache_path(p)]
    if not caches:
        return model or DEFAULT_MODEL, dtype, False
    if len(caches) != len(paths):
        raise UsageError("give either .hkv cache files or media, not both", "MEDIA")
    if model is None or dtype == "auto":
        for path in caches:  # the first readable file decides; a bad one fails later, on its own
            try:
                header = hkv.read_header(path)
            except HybridKVError:
                continue
            model = model or (header.get("model") or {}).get("name")
            dtype = header.get("dtype", dtype) if dtype == "auto" else dtype
            break
    return model or DEFAULT_MODEL, dtype, True


def ask_questions(session, paths: list[str], asked: list[tuple[str, tuple[str, ...]]], *, context: str | None,
                  each: bool, caches: bool, as_json: bool, jsonl: bool, output, resume: bool, quiet: bool,
                  debug: bool, workers: int | None = None, address: str | None = None,
                  gpus_per_worker: float = 0.0, limits=None) -> int:
    """Answer every question about every input (each compressed once, or read from its ``.hkv``
    file); one record per question, the questions of an input decoded together under ``limits``
    (an :class:`~hybridkv_cli.engine.Limits`; batching, the questions of all inputs together).
    ``workers`` / ``address``: on Ray workers
    (:func:`~hybridkv_cli.runs.distributed.run_distributed`, the same records). Returns the exit status."""
    from rich.console import Console

    from hybridkv_cli.io.console import err
    from hybridkv_cli.runs.batch import run_batch
    from hybridkv_cli.runs.inputs import Item, plan_inputs, read_context

    if as_json and jsonl:
        raise UsageError("--json and --jsonl exclude each other (--jsonl: one line per input)", "--json")
    if resume and output is None:
        raise UsageError("--resume needs --output FILE (the file to resume)", "--resume")
    if context is not None:
        items, text = [Item(())], read_context(context)
    else:
        text = None
        if not paths:
            raise UsageError("give one or more media files (or a directory, or .hkv cache files)", "arguments")
        items = [Item((p,)) for p in paths] if caches else plan_inputs(paths, each=each, stdin=sys.stdin)
    if as_json:
        if len(items) != 1 or len(asked) != 1:
            raise UsageError("--json prints one object for one question about one input; use --jsonl", "--json")
        from hybridkv_cli.runs.requests import Request

        record = session.ask(Request(questions=(asked[0][0],), item=items[0], context=text, shared=True), limits)
        print(json.dumps(record), flush=True)
        return 0
    single = len(items) == 1 and output is None and not jsonl
    kw = dict(console=err, jsonl=sys.stdout if jsonl else None, human=Console() if not jsonl and output is None
              else None, output=output, resume=resume, quiet=quiet or single, debug=debug, questions=asked)
    if workers or address:
        from hybridkv_cli.runs.distributed import run_distributed

        return run_distributed(items, None, session.options, workers=workers, address=address,
                               gpus_per_worker=gpus_per_worker, limits=limits, **kw).exit_code
    return run_batch(items, None, session, context=text, limits=limits, **kw).exit_code


def cache_targets(items, output: Path, each: bool) -> list[Path]:
    """Where each input's cache goes: ``output`` itself for one input (a folder or a name ending
    in ``/``: ``NAME.hkv`` inside it), else ``OUTDIR/NAME.hkv`` with NAME the input's file name
    (a second input of the same name gets ``-2``, ...)."""
    from hybridkv_cli.engine import hkv
    from hybridkv_cli.io.user_files import check_output

    check_output(output, "--output", folder=True)  # -o /dev/full: refused, not /dev/full.hkv
    folder = each or len(items) > 1 or output.is_dir() or str(output).endswith(os.sep)
    if not folder:
        return [output if hkv.is_cache_path(str(output)) else output.with_name(output.name + hkv.SUFFIX)]
    targets, used = [], set()
    for item in items:
        name = Path(item.key.split(" + ")[0]).name or "input"
        target, n = output / f"{name}{hkv.SUFFIX}", 1
        while target in used:
            n += 1
            target = output / f"{name}-{n}{hkv.SUFFIX}"
        used.add(target)
        targets.append(target)
    return targets


def run_compress(session, items, output: Path, *, each: bool, resume: bool, console, quiet: bool,
                 debug: bool, jsonl=None) -> int:
    """``hybridkv compress``: write one ``.hkv`` file per input. ``resume``: an input whose file
    already holds the cache this command writes (:func:`hkv.matches`), whole and matching its
    checksum (:func:`hkv.intact`), is skipped; one made with another model, method, options or
    system prompt, or damaged, is written again. A failed input is one error line (and a JSON line
    ``{"input", "error"}`` with ``jsonl``); the others go on. Returns the exit status."""
    from rich.markup import escape

    from hybridkv_cli.engine import hkv
    from hybridkv_cli.io import signals
    from hybridkv_cli.runs.batch import Summary, error_record

    summary, stale = Summary(), 0
    targets = cache_targets(items, output, each)
    try:
        for item, target in zip(items, targets):
            header = None
            if resume and target.exists():
                try:
                    header = hkv.read_header(target)
                except HybridKVError:
                    pass  # not a finished cache: write it again
                if (header is not None and hkv.matches(header, session.model(), session.policy, session.options.system)
                        and hkv.intact(target)):
                    summary.skipped += 1
                    continue
            signals.raise_if_stopped()  # a stop whose exception a destructor swallowed
            started = time.perf_counter()
            try:
                prefix = session.compress(item)
                size = hkv.save(target, prefix, session.model())
            except (UsageError, ModelError):
                raise
            except Exception as e:
                if debug and not isinstance(e, HybridKVError):
                    raise
                record = error_record(item.key, e)
                summary.failed += 1
                console.print(f"[red]error:[/red] {escape(item.key)}: {escape(record['error']['message'])}",
                              highlight=False, soft_wrap=True)
                if jsonl is not None:
                    jsonl.write(json.dumps(record) + "\n")
                    jsonl.flush()
                continue
            summary.ok += 1
            stale += header is not None
            line = {"input": item.key, "cache": str(target), "file_bytes": size, "device_bytes": prefix.device_bytes,
                    "host_bytes": prefix.host_bytes, "prefill_s": prefix.prefill_s, "method": prefix.policy.name,
                    "budget": prefix.policy.budget, "seconds": time.perf_counter() - started}
            if jsonl is not None:
                jsonl.write(json.dumps(line) + "\n")
                jsonl.flush()
            if not quiet:
                console.print(f"{escape(item.key)} -> {escape(str(target))} ({size / 2**20:.1f} MiB; device "
                              f"{prefix.device_bytes / 2**20:.1f} MiB + host {prefix.host_bytes / 2**20:.1f} MiB)",
                              highlight=False, soft_wrap=True)
    except KeyboardInterrupt as e:
        summary.stopped_by = signals.signal_of(e)
        console.print(escape(f"{signals.describe(summary.stopped_by)}; finished caches are kept (run again with "
                             "--resume to continue)"), highlight=False, soft_wrap=True)
    if not quiet and not summary.interrupted:
        skipped = f", {summary.skipped} skipped (already compressed)" if summary.skipped else ""
        again = f" ({stale} replacing a cache of another model, method, options or system prompt)" if stale else ""
        console.print(f"done: {summary.ok} compressed{again}, {summary.failed} failed{skipped}", highlight=False,
                      soft_wrap=True)
    return summary.exit_code
