"""``hybridkv bench``: compression methods × budgets over a set of inputs, scored against the full cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from hybridkv_cli.commands.options import (ALL_OPTIONS, BATCH_SIZE, CUDA_GRAPHS, DEBUG, DEFER, DEVICE, DTYPE, FPS,
                                           FRAMES, GPUS_PER_WORKER, KV_MEMORY, MAX_PIXELS, MODEL, QUIET, RAY, WORKERS,
                                           decode_limits, method_options)
from hybridkv_cli.io.console import err, status
from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.io.questions import split_args


@method_options(tuple(n for n in ALL_OPTIONS if n != "budget"))  # --budgets sweeps
def bench(
    args: Optional[list[str]] = typer.Argument(None, metavar="MEDIA... QUESTION", help="One input: a video, image "
                                               "files or a directory, then the question."),
    tasks: Optional[Path] = typer.Option(None, "--tasks", metavar="FILE.jsonl", help="Inputs, one JSON object a line."),
    answer: Optional[list[str]] = typer.Option(None, metavar="TEXT",
                                               help="Expected answer of MEDIA... QUESTION (repeat: any counts)."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated methods (default: every one but full, "
                                          "which always runs, and route, which needs --route)."),
    budgets: str = typer.Option("0.05,0.1,0.2", help="Comma-separated budgets."),
    model: str = MODEL, defer_question: bool = DEFER,
    frames: int = FRAMES, fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(32, min=1, help="Tokens generated per run (greedy)."),
    per_video: bool = typer.Option(False, "--per-video", help="Questions about the same media share one "
                                   "compression per method and budget (each answered from a copy of it, as a "
                                   "deferred question: the answers of --defer-question, in less time)."),
    out: Optional[Path] = typer.Option(None, help="Directory for bench.csv, bench.json and bench.png."),
    device: str = DEVICE, dtype: str = DTYPE, workers: Optional[int] = WORKERS, ray: Optional[str] = RAY,
    as_json: bool = typer.Option(False, "--json", help="Print the JSON (config, aggregates, items), not the table."),
    quiet: bool = QUIET, debug: bool = DEBUG, gpus_per_worker: float = GPUS_PER_WORKER,
    batch_size: Optional[int] = BATCH_SIZE, kv_memory: Optional[str] = KV_MEMORY, cuda_graphs: bool = CUDA_GRAPHS,
    options=None,
):
    from rich.console import Console

    from hybridkv_cli.io.bench_report import render_bench, save
    from hybridkv_cli.runs.bench import Task, parse_budgets, parse_methods, read_tasks, run_bench
    from hybridkv_cli.runs.inputs import Item
    from hybridkv_cli.runs.session import AskOptions, Session

    names, sweep = parse_methods(methods), parse_budgets(budgets)
    limits = decode_limits(batch_size, kv_memory, cuda_graphs)
    options.per_method(names)  # refuses what no method takes before anything loads
    if tasks is not None:
        if args or answer:
            raise UsageError("give either --tasks FILE or MEDIA... QUESTION [--answer A], not both", "--tasks")
        inputs = read_tasks(tasks)
    else:
        paths, question = split_args(args, None, alternative="(or --tasks FILE)")
        inputs = [Task(Item(tuple(paths)).key, question, tuple(answer or ()), media=tuple(paths))]
    session = Session(AskOptions(model=model, device=device, dtype=dtype, method=None, frames=frames, fps=fps,
                                 max_pixels=max_pixels, max_new_tokens=max_new_tokens,
                                 defer_question=defer_question), stage=status(quiet))
    kw = dict(console=err, quiet=quiet, debug=debug, per_video=per_video, options=options, limits=limits)
    if workers or ray:
        from hybridkv_cli.runs.distributed import run_bench_distributed  # imports Ray only when it runs

        result = run_bench_distributed(session.options, inputs, names, sweep, workers=workers, address=ray,
                                       gpus_per_worker=gpus_per_worker, **kw)
    else:
        result = run_bench(session, inputs, names, sweep, **kw)
    if out is not None:
        err.print(f"wrote {', '.join(str(p) for p in save(result, out))}", highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        render_bench(result, Console())
    return 1 if any(row["errors"] for row in result["aggregates"]) else 0
