"""``hybridkv ask``: one input, many inputs (a JSON line each), or several questions per input."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from hybridkv_cli.commands.options import (ALL_OPTIONS, ASK_ARGS, ASK_MODEL, BATCH_SIZE, CONTEXT, CUDA_GRAPHS, DEBUG,
                                           DEFER, DEVICE, DTYPE, EACH, FPS, FRAMES, FREQUENCY_PENALTY, GPUS_PER_WORKER,
                                           JSON, JSONL, KV_MEMORY, MAX_FRAMES, MAX_PIXELS, OUTPUT, PRESENCE_PENALTY,
                                           QUESTION, QUESTIONS, QUIET, RAY, RESUME, SEED, STREAM, STREAM_CHUNK,
                                           STREAM_KV_TOKENS, STREAM_WINDOW, SYSTEM, TEMPERATURE, TOP_P, WORKERS,
                                           decode_limits, max_frames_arg, method_options, sampling, streaming)
from hybridkv_cli.io.console import err, print_warning, status
from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.io.questions import split_args


@method_options(ALL_OPTIONS)
def ask(
    args: Optional[list[str]] = ASK_ARGS, model: Optional[str] = ASK_MODEL,
    method: Optional[str] = typer.Option(None, help="Compression method (see `hybridkv methods`) [default: "
                                         "hybridkv; a .hkv input: the file's]."),
    question_opt: Optional[list[str]] = QUESTION, questions_file: Optional[str] = QUESTIONS, frames: int = FRAMES,
    fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(128, min=1, help="Answer length limit (tokens)."),
    temperature: float = TEMPERATURE, top_p: float = TOP_P, seed: Optional[int] = SEED,
    presence_penalty: float = PRESENCE_PENALTY, frequency_penalty: float = FREQUENCY_PENALTY,
    defer_question: bool = DEFER, device: str = DEVICE, dtype: str = DTYPE, as_json: bool = JSON,
    each: bool = EACH, jsonl: bool = JSONL, output: Optional[Path] = OUTPUT, resume: bool = RESUME,
    quiet: bool = QUIET, debug: bool = DEBUG, context: Optional[str] = CONTEXT, workers: Optional[int] = WORKERS,
    ray: Optional[str] = RAY, gpus_per_worker: float = GPUS_PER_WORKER, batch_size: Optional[int] = BATCH_SIZE,
    kv_memory: Optional[str] = KV_MEMORY, cuda_graphs: bool = CUDA_GRAPHS, max_frames: Optional[str] = MAX_FRAMES,
    stream: str = STREAM, stream_chunk: int = STREAM_CHUNK, stream_window: int = STREAM_WINDOW,
    stream_kv_tokens: Optional[int] = STREAM_KV_TOKENS, system: Optional[str] = SYSTEM, options=None,
):
    from hybridkv_cli.runs.multi_run import plan_questions, resolve_cache_inputs
    from hybridkv_cli.runs.session import AskOptions, Session

    asked = plan_questions(question_opt, questions_file)
    if asked is None:
        paths, question = split_args(args, context)
        if "\n" not in question and len(question) < 4096 and os.path.exists(question):
            print_warning(f"the question '{question}' is an existing path; the question comes last (MEDIA... QUESTION)")
    else:
        paths, question = list(args or []) if context is None else [], None
        if context is not None and args:
            raise UsageError("with --context and --question/--questions give no arguments", "arguments")
    if context is not None and (each or workers or ray):
        raise UsageError("--context is one text input; --each and --workers take media inputs", "--context")
    model, dtype, caches = resolve_cache_inputs(paths, model, dtype)
    multi = asked is not None or caches  # one compression (or a .hkv file), one record per question
    limits = decode_limits(batch_size, kv_memory, cuda_graphs)
    streams = streaming(stream, stream_chunk, stream_window, stream_kv_tokens)
    settings = AskOptions(model=model, device=device, dtype=dtype, method=method or "hybridkv",
                          method_given=method is not None, method_options=options, frames=frames, fps=fps,
                          max_frames=max_frames_arg(max_frames, fps, max_pixels, streams), max_pixels=max_pixels,
                          max_new_tokens=max_new_tokens, defer_question=defer_question or multi, streaming=streams,
                          system=system, sampling=sampling(temperature, top_p, seed, presence_penalty,
                                                                     frequency_penalty))
    stages = status(quiet)
    # refuses a bad method or option before any input is read
    session = Session(settings, stage=stages, progress=stages.frames)
    scale = dict(workers=workers, address=ray, gpus_per_worker=gpus_per_worker)
    if multi:
        from hybridkv_cli.runs.multi_run import ask_questions

        return ask_questions(session, paths, asked or [(question, ())], context=context, each=each, caches=caches,
                             as_json=as_json, jsonl=jsonl, output=output, resume=resume, quiet=quiet, debug=debug,
                             limits=limits, **scale)
    batch = each or "-" in paths or jsonl or output is not None or workers or ray
    if as_json and jsonl:
        raise UsageError("--json and --jsonl exclude each other (--jsonl: one line per input)", "--json")
    if as_json and batch:
        raise UsageError("--json prints one object for one input; use --jsonl with --each, - or --output", "--json")
    if resume and output is None:
        raise UsageError("--resume needs --output FILE (the file to resume)", "--resume")
    if not batch or context is not None and output is None:
        return _one(session, paths, question, context, limits, as_json or jsonl)
    return _many(session, paths, question, limits, context=context, each=each, jsonl=jsonl, output=output,
                 resume=resume, quiet=quiet, debug=debug, **scale)


def _one(session, paths: list[str], question: str, context: str | None, limits, as_json: bool) -> int:
    """One input: its errors are raised, its report rendered (or printed as one JSON object)."""
    from hybridkv_cli.runs.inputs import Item, read_context
    from hybridkv_cli.runs.requests import Request

    text = read_context(context) if context is not None else None
    try:
        result = session.ask(Request(questions=(question,), item=Item(tuple(paths)), context=text), limits)
    except UsageError as e:
        if len(paths) > 1 and "one video per prompt" in e.reason:
            e.reason += "; add --each to ask the question about each file separately"
        raise
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        from rich.console import Console

        from hybridkv_cli.io.report import render

        render(result, Console())
    return 0


def _many(session, paths: list[str], question: str, limits, *, context: str | None, each: bool, jsonl: bool,
          output: Path | None, resume: bool, quiet: bool, debug: bool, workers, address, gpus_per_worker) -> int:
    """Many inputs (or the one text ``context``, to ``--output``), one JSON line (or report) each,
    on this device or on Ray workers."""
    from rich.console import Console

    from hybridkv_cli.runs.inputs import Item, plan_inputs, read_context

    if "-" in paths and sys.stdin is not None and sys.stdin.isatty() and not quiet:
        err.print("reading media paths from stdin, one per line (end with Ctrl-D) ...")
    items = [Item(())] if context is not None else plan_inputs(paths, each=each, stdin=sys.stdin)
    if not items:
        print_warning("no input paths on stdin; nothing to do")
        return 0
    kw = dict(console=err, jsonl=sys.stdout if jsonl else None, human=Console() if not jsonl and output is None
              else None, output=output, resume=resume, quiet=quiet, debug=debug)
    if workers or address:
        from hybridkv_cli.runs.distributed import run_distributed  # imports Ray only when it runs

        return run_distributed(items, question, session.options, workers=workers, address=address,
                               gpus_per_worker=gpus_per_worker, limits=limits, **kw).exit_code
    from hybridkv_cli.runs.batch import run_batch

    text = read_context(context) if context is not None else None
    return run_batch(items, question, session, limits=limits, context=text, **kw).exit_code
