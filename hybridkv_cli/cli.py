"""Command line: parse, hand the inputs to a session, render. Errors become one line and an exit code.

Heavy imports (torch, transformers, media decoders) happen inside the commands, so ``--help``
and usage errors stay fast.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from hybridkv_cli.cli_options import (  # noqa: F401 - options and help texts of the commands
    ARGS, ASK_ARGS, MODEL, CONTEXT, BUDGET, WINDOW, THETA, TOPK, SHARE, CHUNK, SINK_AWARE, LANDMARK, REFRESH,
    REFRESH_RATE, REFRESH_PERIOD, REFRESH_SLOTS, SINKS, PAGE_SIZE, ROUTE, HEAD_SCORES, FRAMES, FPS, DEFER,
    MAX_PIXELS, DEVICE, DTYPE, JSON, DEBUG, QUIET, EACH, JSONL, OUTPUT, ASK_MODEL, QUESTION, QUESTIONS,
    RESUME, ASK_HELP, BENCH_HELP, COMPRESS_HELP, METHOD_OPTIONS, WORKERS, RAY, GPUS_PER_WORKER, BATCH_SIZE, KV_MEMORY,
    CUDA_GRAPHS,
)
from hybridkv_cli.console import err, one_line_warnings, print_error, print_warning, quiet_libraries, status
from hybridkv_cli.errors import HybridKVError, UsageError, one_line
from hybridkv_cli.questions import split_args
from hybridkv_cli.signals import describe, exit_code, leave, signal_of, stop_on_signals

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Answer questions about videos and image sets with Qwen2.5-VL under a KV-cache budget.")
_state = {"debug": False}


def _limits(batch_size: int | None, kv_memory: str | None, cuda_graphs: bool, distributed: bool):
    """The decode limits ``--batch-size``, ``--kv-memory`` and ``--cuda-graphs`` give (a
    UsageError for a bad size, or for batching with Ray workers, which decode one input each)."""
    from hybridkv_cli.engine import Limits
    from hybridkv_cli.option_values import parse_size

    limits = Limits(batch_size, None if kv_memory is None else parse_size(kv_memory, "--kv-memory"), cuda_graphs)
    if limits.batched and distributed:
        flag = "--batch-size" if batch_size not in (None, 1) else "--kv-memory" if kv_memory else "--cuda-graphs"
        raise UsageError("batches on this device; with --workers or --ray each worker decodes one input at a time",
                         flag)
    return limits


def _method_options(values: dict) -> dict:
    """The method options among a command's parameters (None: not given)."""
    return {k: values[k] for k in METHOD_OPTIONS if k in values}


@app.command(help=ASK_HELP)
def ask(
    args: Optional[list[str]] = ASK_ARGS, model: Optional[str] = ASK_MODEL,
    method: Optional[str] = typer.Option(None, help="Compression method (see `hybridkv methods`) [default: "
                                         "hybridkv; a .hkv input: the file's]."),
    question_opt: Optional[list[str]] = QUESTION, questions_file: Optional[str] = QUESTIONS,
    budget: Optional[float] = BUDGET, window: Optional[int] = WINDOW, theta: Optional[float] = THETA,
    sparsity_topk: Optional[float] = TOPK, share: Optional[float] = SHARE, chunk_size: Optional[int] = CHUNK,
    sink_aware: Optional[bool] = SINK_AWARE, landmark: Optional[str] = LANDMARK, refresh: Optional[str] = REFRESH,
    refresh_rate: Optional[float] = REFRESH_RATE, refresh_period: Optional[int] = REFRESH_PERIOD,
    refresh_slots: Optional[int] = REFRESH_SLOTS, sinks: Optional[int] = SINKS, page_size: Optional[int] = PAGE_SIZE,
    head_scores: Optional[str] = HEAD_SCORES, route: Optional[str] = ROUTE, frames: int = FRAMES,
    fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(128, min=1, help="Greedy decoding length limit."),
    defer_question: bool = DEFER, device: str = DEVICE, dtype: str = DTYPE, as_json: bool = JSON,
    each: bool = EACH, jsonl: bool = JSONL, output: Optional[Path] = OUTPUT, resume: bool = RESUME,
    quiet: bool = QUIET, debug: bool = DEBUG, context: Optional[str] = CONTEXT, workers: Optional[int] = WORKERS,
    ray: Optional[str] = RAY, gpus_per_worker: float = GPUS_PER_WORKER, batch_size: Optional[int] = BATCH_SIZE,
    kv_memory: Optional[str] = KV_MEMORY, cuda_graphs: bool = CUDA_GRAPHS,
):
    given = _method_options(locals())  # first: the parameters only
    from hybridkv_cli.batch import run_batch
    from hybridkv_cli.inputs import Item, plan_inputs, read_context
    from hybridkv_cli.session import AskOptions, Session

    from hybridkv_cli.multi_run import plan_questions, resolve_cache_inputs

    _state["debug"] = debug
    asked = plan_questions(question_opt, questions_file)
    if asked is None:
        paths, question = split_args(args, context)
        if "\n" not in question and len(question) < 4096 and os.path.exists(question):
            print_warning(f"the question '{question}' is an existing path; the question comes last (MEDIA... QUESTION)")
    else:
        paths, question = list(args or []) if context is None else [], None
        if context is not None and args:
            raise UsageError("with --context and --question/--questions give no arguments", "arguments")
    if context is not None and (each or (output is not None and asked is None) or workers or ray):
        raise UsageError("--context is one text input; --each, --output (without -Q/--questions) and --workers "
                         "take media inputs", "--context")
    model, dtype, caches = resolve_cache_inputs(paths, model, dtype)
    multi = asked is not None or caches  # one compression (or a .hkv file), one record per question
    limits = _limits(batch_size, kv_memory, cuda_graphs, workers or ray)
    options = AskOptions(
        model=model, device=device, dtype=dtype, method=method or "hybridkv", method_given=method is not None,
        frames=frames, fps=fps, max_pixels=max_pixels, max_new_tokens=max_new_tokens,
        defer_question=defer_question or multi,
        method_options=given,
    )
    if multi:
        from hybridkv_cli.multi_run import ask_questions

        return ask_questions(Session(options, stage=status(quiet)), paths, asked or [(question, ())],
                             context=context, each=each, caches=caches, as_json=as_json, jsonl=jsonl,
                             output=output, resume=resume, quiet=quiet, debug=debug, workers=workers, address=ray,
                             gpus_per_worker=gpus_per_worker, limits=limits)
    session = Session(options, stage=status(quiet))  # refuses a bad method or option before any input is read
    batch = each or "-" in paths or jsonl or output is not None or workers or ray
    if as_json and jsonl:
        raise UsageError("--json and --jsonl exclude each other (--jsonl: one line per input)", "--json")
    if as_json and batch:
        raise UsageError("--json prints one object for one input; use --jsonl with --each, - or --output", "--json")
    if resume and output is None:
        raise UsageError("--resume needs --output FILE (the file to resume)", "--resume")

    if not batch or context is not None:  # one input: errors are raised, the report is rendered
        text = read_context(context) if context is not None else None
        try:
            result = session.answer(Item(tuple(paths)), question, context=text, limits=limits)
        except UsageError as e:
            if len(paths) > 1 and "one video per prompt" in e.reason:
                e.reason += "; add --each to ask the question about each file separately"
            raise
        except KeyboardInterrupt as e:
            return _stopped(e)
        if as_json or jsonl:
            print(json.dumps(result), flush=True)
        else:
            from hybridkv_cli.report import render

            render(result, Console())
        return 0

    if "-" in paths and sys.stdin is not None and sys.stdin.isatty() and not quiet:
        err.print("reading media paths from stdin, one per line (end with Ctrl-D) ...")
    items = plan_inputs(paths, each=each, stdin=sys.stdin)
    if not items:
        print_warning("no input paths on stdin; nothing to do")
        return 0
    kw = dict(console=err, jsonl=sys.stdout if jsonl else None, human=Console() if not jsonl and output is None
              else None, output=output, resume=resume, quiet=quiet, debug=debug)
    from hybridkv_cli.distributed import run_distributed  # imports Ray only when it runs
    summary = (run_distributed(items, question, options, workers=workers, address=ray, gpus_per_worker=gpus_per_worker,
                               **kw) if workers or ray else run_batch(items, question, session, limits=limits, **kw))
    return summary.exit_code


@app.command()
def profile(
    args: list[str] = ARGS, model: str = MODEL,
    budget: float = typer.Option(0.1, help="The budget whose heads and answer are shown, in (0, 1]."),
    window: Optional[int] = WINDOW, theta: Optional[float] = THETA, sparsity_topk: Optional[float] = TOPK,
    share: Optional[float] = SHARE, chunk_size: Optional[int] = CHUNK,
    sink_aware: Optional[bool] = SINK_AWARE, landmark: Optional[str] = LANDMARK, refresh: Optional[str] = REFRESH,
    refresh_rate: Optional[float] = REFRESH_RATE, refresh_period: Optional[int] = REFRESH_PERIOD,
    refresh_slots: Optional[int] = REFRESH_SLOTS,
    budgets: str = typer.Option("0.05,0.1,0.2,0.4,1.0", help="Comma-separated budgets to sweep."),
    out: Optional[Path] = typer.Option(None, help="Directory for the heatmap PNG (and profile.json)."),
    frames: int = FRAMES, fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(32, min=1, help="Tokens generated per sweep run."),
    device: str = DEVICE, dtype: str = DTYPE, as_json: bool = JSON, quiet: bool = QUIET, debug: bool = DEBUG,
    context: Optional[str] = CONTEXT,
):
    """Per-head sparsity and classes, the budget allocation, and a budget sweep with fidelity."""
    given = _method_options(locals())  # first: the parameters only
    from hybridkv_cli.bench import parse_budgets
    from hybridkv_cli.inputs import Item, read_context
    from hybridkv_cli.profile import profile as run_profile
    from hybridkv_cli.report import render_profile, save_heatmap
    from hybridkv_cli.session import AskOptions, Session

    _state["debug"] = debug
    sweep = tuple(parse_budgets(budgets))
    # The session's policy is the profiled budget's; building it refuses bad values before the model loads.
    session = Session(AskOptions(model=model, device=device, dtype=dtype, method="hybridkv", method_options=given,
                                 frames=frames, fps=fps, max_pixels=max_pixels, max_new_tokens=max_new_tokens),
                      stage=status(quiet))
    paths, question = split_args(args, context)
    media = session.load_media(paths) if paths else None  # cheap checks first, then the model
    text = read_context(context) if context is not None else None
    prepared = session.prepare(media, question, context=text, source=Item(tuple(paths)).key if paths else None)
    with (nullcontext() if quiet else err.status("profiling ...")) as spinner:
        result = run_profile(session, prepared, budgets=sweep,
                             on_run=lambda label: spinner and spinner.update(f"profiling: {label} ..."))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        save_heatmap(result["heads"], out / "heads.png")
        (out / "profile.json").write_text(json.dumps(result, indent=1))
        err.print(f"wrote {out / 'heads.png'} and {out / 'profile.json'}")
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        render_profile(result, Console())


@app.command(help=BENCH_HELP)
def bench(
    args: Optional[list[str]] = typer.Argument(None, metavar="MEDIA... QUESTION",
                                               help="One input: a video, image files or a directory, then the question."),
    tasks: Optional[Path] = typer.Option(None, "--tasks", metavar="FILE.jsonl", help="Inputs, one JSON object a line."),
    answer: Optional[list[str]] = typer.Option(None, metavar="TEXT",
                                               help="Expected answer of MEDIA... QUESTION (repeat: any counts)."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated methods (default: every one but full, "
                                          "which always runs, and route, which needs --route)."),
    budgets: str = typer.Option("0.05,0.1,0.2", help="Comma-separated budgets."),
    model: str = MODEL, window: Optional[int] = WINDOW, theta: Optional[float] = THETA,
    sparsity_topk: Optional[float] = TOPK, share: Optional[float] = SHARE, chunk_size: Optional[int] = CHUNK,
    sink_aware: Optional[bool] = SINK_AWARE, landmark: Optional[str] = LANDMARK, refresh: Optional[str] = REFRESH,
    refresh_rate: Optional[float] = REFRESH_RATE, refresh_period: Optional[int] = REFRESH_PERIOD,
    refresh_slots: Optional[int] = REFRESH_SLOTS, route: Optional[str] = ROUTE, defer_question: bool = DEFER,
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
):
    given = _method_options(locals())  # first: the parameters only
    from hybridkv_cli.bench import Task, method_options, parse_budgets, parse_methods, read_tasks, run_bench
    from hybridkv_cli.bench_report import render_bench, save
    from hybridkv_cli.inputs import Item
    from hybridkv_cli.session import AskOptions, Session

    _state["debug"] = debug
    names, sweep = parse_methods(methods), parse_budgets(budgets)
    limits = _limits(batch_size, kv_memory, cuda_graphs, workers or ray)
    options = given
    method_options(names, options)  # refuses what no method takes before anything loads
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
    kw = dict(console=err, quiet=quiet, debug=debug, per_video=per_video, **options)
    from hybridkv_cli.distributed import run_bench_distributed  # imports Ray only when it runs
    result = (run_bench_distributed(session.options, inputs, names, sweep, workers=workers, address=ray,
                                    gpus_per_worker=gpus_per_worker, **kw) if workers or ray
              else run_bench(session, inputs, names, sweep, limits=limits, **kw))
    if out is not None:
        err.print(f"wrote {', '.join(str(p) for p in save(result, out))}", highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        render_bench(result, Console())
    return 1 if any(row["errors"] for row in result["aggregates"]) else 0


@app.command(help=COMPRESS_HELP)
def compress(
    args: list[str] = typer.Argument(..., metavar="MEDIA...", help="A video, image files or a directory."),
    output: Path = typer.Option(..., "--output", "-o", metavar="FILE.hkv|DIR", help="The cache file (--each or "
                                "several inputs: a folder)."),
    model: str = MODEL,
    method: str = typer.Option("hybridkv", help="Compression method (see `hybridkv methods`)."),
    budget: Optional[float] = BUDGET, frames: int = FRAMES, fps: Optional[float] = FPS,
    max_pixels: Optional[int] = MAX_PIXELS, device: str = DEVICE, dtype: str = DTYPE,
    window: Optional[int] = WINDOW, theta: Optional[float] = THETA, sparsity_topk: Optional[float] = TOPK,
    share: Optional[float] = SHARE, chunk_size: Optional[int] = CHUNK, sink_aware: Optional[bool] = SINK_AWARE,
    landmark: Optional[str] = LANDMARK, refresh: Optional[str] = REFRESH, refresh_rate: Optional[float] = REFRESH_RATE,
    refresh_period: Optional[int] = REFRESH_PERIOD, refresh_slots: Optional[int] = REFRESH_SLOTS,
    sinks: Optional[int] = SINKS, page_size: Optional[int] = PAGE_SIZE, head_scores: Optional[str] = HEAD_SCORES,
    route: Optional[str] = ROUTE,
    each: bool = EACH, jsonl: bool = typer.Option(False, "--jsonl", help="One JSON line per input on stdout "
                                                  "(its cache file and sizes, or its error)."),
    resume: bool = typer.Option(False, "--resume", help="Skip inputs whose cache file already holds this "
                                "cache (another model, method or options: compressed again)."),
    quiet: bool = QUIET, debug: bool = DEBUG,
):
    given = _method_options(locals())  # first: the parameters only
    from hybridkv_cli.inputs import plan_inputs
    from hybridkv_cli.multi_run import run_compress
    from hybridkv_cli.session import AskOptions, Session

    _state["debug"] = debug
    options = AskOptions(
        model=model, device=device, dtype=dtype, method=method, frames=frames, fps=fps, max_pixels=max_pixels,
        defer_question=True,
        method_options=given,
    )
    session = Session(options, stage=status(quiet))
    items = plan_inputs(list(args), each=each, stdin=sys.stdin)
    if not items:
        print_warning("no inputs; nothing to do")
        return 0
    return run_compress(session, items, output, each=each, resume=resume, console=err, quiet=quiet, debug=debug,
                        jsonl=sys.stdout if jsonl else None)


@app.command()
def route(
    tasks: Path = typer.Option(..., "--tasks", metavar="DEV.jsonl", help="Dev tasks (bench's format) to profile on."),
    output: Path = typer.Option(..., "--output", "-o", metavar="ROUTE.json", help="The route file to write; the "
                                "profile goes beside it (ROUTE.profile.json)."),
    model: str = MODEL, budget: float = typer.Option(0.1, help="The budget the route is built for."),
    methods: str = typer.Option("hybridkv,snapkv,rcr,streamingllm", help="Candidate methods, in order of "
                                "preference on ties."),
    frames: int = FRAMES, fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(16, min=1, help="Tokens generated per profile run."),
    defer_question: bool = DEFER, device: str = DEVICE, dtype: str = DTYPE, quiet: bool = QUIET, debug: bool = DEBUG,
):
    """Build a route for `--method route`: per layer, the method that loses least compressed alone."""
    from hybridkv_cli.bench import parse_methods, read_tasks
    from hybridkv_cli.routing import build_route
    from hybridkv_cli.session import AskOptions, Session

    _state["debug"] = debug
    candidates = [m for m in parse_methods(methods) if m != "route"]
    inputs = read_tasks(tasks)
    session = Session(AskOptions(model=model, device=device, dtype=dtype, method=None, frames=frames, fps=fps,
                                 max_pixels=max_pixels, max_new_tokens=max_new_tokens,
                                 defer_question=defer_question), stage=status(quiet))
    with (nullcontext() if quiet else err.status("profiling layers ...")) as spinner:
        built = build_route(session, inputs, candidates, budget, output,
                            on_run=lambda label: spinner and spinner.update(f"profiling: {label} ..."))
    err.print(f"wrote {output} and its profile: {', '.join(built['layers'])}", highlight=False, soft_wrap=True)


@app.command()
def methods():
    """List the compression methods."""
    from hybridkv_cli.compression import METHODS

    for name, cls in sorted(METHODS.items()):
        print(f"{name:14s} {(cls.__doc__ or '').strip().splitlines()[0]}")


def run(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: sys.argv) and return the exit status: 0 ok, 1 runtime
    failure, 2 usage error, 130 interrupted (143 SIGTERM, 129 SIGHUP). Every error is one line on
    stderr (``--debug``: the traceback); libraries' warnings and log lines only show with ``--debug``."""
    try:  # typer >= 0.25 runs on a vendored click: its exceptions are not `click`'s
        from typer import _click as click
    except ImportError:  # pragma: no cover - older typer on the real click
        import click

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _state["debug"] = False
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)  # known before typer parses: libraries log early
    with one_line_warnings(), quiet_libraries(debug), stop_on_signals():
        try:
            code = app(args=argv, prog_name="hybridkv", standalone_mode=False)
        except HybridKVError as e:
            if _state["debug"]:
                raise
            print_error(str(e))
            return e.exit_code
        except (KeyboardInterrupt, typer.Abort) as e:
            return _stopped(e)
        except click.exceptions.NoArgsIsHelpError as e:
            e.show()
            return 2
        except click.exceptions.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            print_error(one_line(e.format_message(), limit=None) + where)
            return e.exit_code
        except click.exceptions.ClickException as e:
            print_error(one_line(e.format_message(), limit=None))
            return e.exit_code
        except BrokenPipeError:  # stdout closed early (e.g. `| head -1`): stop quietly
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            return 1
        except Exception as e:  # anything unexpected: still one line unless --debug
            if _state["debug"]:
                raise
            print_error(f"{type(e).__name__}: {one_line(e, limit=None)} (run with --debug for the traceback)")
            return 1
    return code if isinstance(code, int) else 0


def _stopped(e: BaseException) -> int:
    """Ctrl-C, SIGTERM or SIGHUP outside a batch: one line, exit 128 + the signal number."""
    signum = signal_of(e)
    err.print(describe(signum), highlight=False)
    return exit_code(signum)


def main() -> None:
    """Console entry point (a stopped run leaves at once: :func:`hybridkv_cli.signals.leave`)."""
    leave(run())


if __name__ == "__main__":
    main()
