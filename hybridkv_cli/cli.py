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

from hybridkv_cli.console import err, one_line_warnings, print_error, print_warning, quiet_libraries, status
from hybridkv_cli.errors import HybridKVError, UsageError, one_line
from hybridkv_cli.signals import describe, exit_code, signal_of, stop_on_signals

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Answer questions about videos and image sets with Qwen2.5-VL under a KV-cache budget.")
_state = {"debug": False}

# Options shared by `ask` and `profile`, declared once.
ARGS = typer.Argument(..., metavar="MEDIA... QUESTION", help="A video, image files or a directory, then the question "
                      "(with --context: the question only).")
MODEL = typer.Option("Qwen/Qwen2.5-VL-7B-Instruct", help="Hub id, local directory, 'demo' (offline tiny video-QA "
                     "model), 'demo-random', 'smollm2' or a .gguf file (text models).")
CONTEXT = typer.Option(None, "--context", metavar="FILE", help="Ask about the text in FILE instead of media "
                       "(a text prompt: its tokens take the visual tokens' role); - reads stdin.")
BUDGET = typer.Option(None, help="Device-resident prompt KV as a share of the full cache, in (0, 1] [default: 0.1; "
                      "full: always 1].")
WINDOW = typer.Option(None, min=1, help="Methods that score with the last prompt queries (hybridkv, rcr, snapkv, "
                      "madakv, sparsemm): observation window, always kept [default: 32].")
THETA = typer.Option(None, help="HybridKV θ: heads whose sparsity score is >= θ are static [default: 0.9].")
TOPK = typer.Option(None, help="HybridKV p: the sparsity score is the attention mass on the top p·N tokens "
                    "[default: 0.05].")
SHARE = typer.Option(None, help="HybridKV r: a dynamic head's budget as a share of the average head budget "
                     "[default: 0.75].")
CHUNK = typer.Option(None, min=1, help="HybridKV: tokens per retrieval chunk [default: 16].")
SINK_AWARE = typer.Option(None, "--sink-aware/--no-sink-aware", help="HybridKV: score heads without the first 4 "
                          "tokens (attention sinks) [default: the method's].")
LANDMARK = typer.Option(None, help="HybridKV: how dynamic heads rank chunks: mean | minmax | detector "
                        "[default: the method's].")
REFRESH = typer.Option(None, help="hybridkv (static heads) / rcr: refresh while decoding: rcr | periodic | none "
                       "[default: the method's].")
REFRESH_RATE = typer.Option(None, min=0.0, max=1.0, help="rcr refresh: target share of layer-steps that "
                            "re-select [default: 0.4].")
REFRESH_PERIOD = typer.Option(None, min=1, help="periodic refresh: every T-th decode step [default: 3].")
REFRESH_SLOTS = typer.Option(None, min=1, help="refresh: most entries per head that a refresh re-selects (c); the "
                             "rest keep the prefill's best [default: 256].")
SINKS = typer.Option(None, min=0, help="streamingllm: attention-sink tokens kept at the start [default: 4].")
PAGE_SIZE = typer.Option(None, min=1, help="quest: tokens per page [default: 8].")
HEAD_SCORES = typer.Option(None, metavar="FILE", help='sparsemm: JSON {"scores": [[per KV head] per layer]} '
                           "(offline head scores) instead of scores computed from the prompt.")
FRAMES = typer.Option(64, help="Frames sampled uniformly from a video.")
FPS = typer.Option(None, help="Sample frames at this rate instead of --frames.")
DEFER = typer.Option(False, "--defer-question", help="Compress the cache before the question is read; the "
                     "question then goes through the compressed cache (as a later question about an "
                     "already-compressed video would).")
MAX_PIXELS = typer.Option(None, help="Max pixels per frame/image (resized by Qwen2.5-VL's rules).")
DEVICE = typer.Option("auto", help="auto | cuda | cpu")
DTYPE = typer.Option("auto", help="auto | bfloat16 | float16 | float32")
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout (one input only).")
DEBUG = typer.Option(False, help="Show tracebacks.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar or status spinners on stderr (errors and "
                     "warnings still show).")
# Options of runs over many inputs (see hybridkv_cli/batch.py).
EACH = typer.Option(False, "--each", help="Each media argument is its own input (a directory: each video/image "
                    "file in it, natural order), all with the same question and one model load.")
JSONL = typer.Option(False, "--jsonl", help="Print one JSON line per input on stdout as soon as it is done; a failed "
                     'input gives {"input": PATH, "error": {"type": ..., "message": ...}}.')
OUTPUT = typer.Option(None, "--output", "-o", metavar="FILE", help="Append the JSON lines to FILE (whole lines, "
                      "fsynced one by one).")
ASK_MODEL = typer.Option(None, help="Hub id, local directory, 'demo' (offline tiny video-QA model), 'demo-random', "
                         "'smollm2' or a .gguf file (text models) [default: Qwen/Qwen2.5-VL-7B-Instruct; .hkv "
                         "inputs: the file's model].")
QUESTION = typer.Option(None, "--question", "-Q", metavar="TEXT", help="A question (repeat for several): the "
                        "arguments are then all media; the media is compressed once and every question answered "
                        "from that compressed cache (as --defer-question does), one record each.")
QUESTIONS = typer.Option(None, "--questions", metavar="FILE", help="Questions, one per line, or JSON lines "
                         '{"question": ..., "answer"?: ...} (an answer adds "expected" and "correct" to the record); '
                         "asked like repeated --question.")
RESUME = typer.Option(False, "--resume", help="With --output: skip inputs already answered in FILE (failed ones "
                      "are retried).")

ASK_HELP = (
    "Answer QUESTION about MEDIA, with latency, KV memory and head-classification reports.\n\n"
    "MEDIA is a video, one or more image files (one image set), or a directory of images (one image set). "
    "With --each every media argument is its own input (a directory: every video and image in it); with - the "
    "paths are read from stdin, one per line (blank lines ignored), each its own input. The model is loaded once "
    "for all inputs.\n\n"
    "Output on stdout: a human report per input; --json: one JSON object (one input only); --jsonl: one JSON "
    'line per input, a failed input as {"input": PATH, "error": {"type": ..., "message": ...}}. --output FILE '
    "appends the same lines to FILE (stdout then stays empty unless --jsonl); --resume skips the inputs FILE "
    "already answered (failed ones are retried). Progress, warnings and errors go to stderr.\n\n"
    "Exit status: 0 every input answered; 1 an input failed (the others still ran) or the model did not load; "
    "2 bad command line; "
    "130 interrupted by Ctrl-C, 143 by SIGTERM, 129 by SIGHUP (completed lines are kept)."
)


def _split_args(args: list[str] | None, context: str | None,
                alternative: str = "(or --context FILE and the question)") -> tuple[list[str], str]:
    """(media paths, question) from MEDIA... QUESTION; with --context only the question.
    ``alternative`` names the other way to give an input, in the error."""
    from hybridkv_cli.questions import clean_question

    args = args or []
    if context is not None:
        if len(args) != 1:
            raise UsageError("with --context give only the question (the context replaces the media)", "arguments")
        return [], clean_question(args[0])
    if len(args) < 2:
        raise UsageError(f"give one or more media files (or a directory) followed by the question {alternative}",
                         "arguments")
    return list(args[:-1]), clean_question(args[-1])


@app.command(help=ASK_HELP)
def ask(
    args: list[str] = ARGS, model: Optional[str] = ASK_MODEL,
    method: Optional[str] = typer.Option(None, help="Compression method (see `hybridkv methods`) [default: "
                                         "hybridkv; a .hkv input: the file's]."),
    question_opt: Optional[list[str]] = QUESTION, questions_file: Optional[str] = QUESTIONS,
    budget: Optional[float] = BUDGET, window: Optional[int] = WINDOW, theta: Optional[float] = THETA,
    sparsity_topk: Optional[float] = TOPK, share: Optional[float] = SHARE, chunk_size: Optional[int] = CHUNK,
    sink_aware: Optional[bool] = SINK_AWARE, landmark: Optional[str] = LANDMARK, refresh: Optional[str] = REFRESH,
    refresh_rate: Optional[float] = REFRESH_RATE, refresh_period: Optional[int] = REFRESH_PERIOD,
    refresh_slots: Optional[int] = REFRESH_SLOTS,
    sinks: Optional[int] = SINKS, page_size: Optional[int] = PAGE_SIZE,
    head_scores: Optional[str] = HEAD_SCORES, frames: int = FRAMES, fps: Optional[float] = FPS,
    max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(128, min=1, help="Greedy decoding length limit."),
    defer_question: bool = DEFER, device: str = DEVICE, dtype: str = DTYPE, as_json: bool = JSON,
    each: bool = EACH, jsonl: bool = JSONL,
    output: Optional[Path] = OUTPUT, resume: bool = RESUME, quiet: bool = QUIET, debug: bool = DEBUG,
    context: Optional[str] = CONTEXT,
):
    from hybridkv_cli.batch import run_batch
    from hybridkv_cli.inputs import Item, plan_inputs, read_context
    from hybridkv_cli.session import AskOptions, Session

    from hybridkv_cli.multi_run import plan_questions, resolve_cache_inputs

    _state["debug"] = debug
    asked = plan_questions(question_opt, questions_file)
    if asked is None:
        paths, question = _split_args(args, context)
        if "\n" not in question and len(question) < 4096 and os.path.exists(question):
            print_warning(f"the question '{question}' is an existing path; the question comes last (MEDIA... QUESTION)")
    else:
        paths, question = list(args or []) if context is None else [], None
        if context is not None and args:
            raise UsageError("with --context and --question/--questions give no arguments", "arguments")
    if context is not None and (each or output is not None):
        raise UsageError("--context is one text input; --each and --output take media inputs", "--context")
    model, dtype, caches = resolve_cache_inputs(paths, model, dtype)
    if asked is not None or caches:  # one compression (or a .hkv file), one record per question
        from hybridkv_cli.multi_run import ask_questions

        options = AskOptions(
            model=model, device=device, dtype=dtype, method=method or "hybridkv", method_given=method is not None,
            frames=frames, fps=fps, max_pixels=max_pixels, max_new_tokens=max_new_tokens, defer_question=True,
            method_options=dict(budget=budget, window=window, theta=theta, sparsity_topk=sparsity_topk, share=share,
                                chunk_size=chunk_size, sink_aware=sink_aware, landmark=landmark, refresh=refresh,
                                refresh_rate=refresh_rate, refresh_period=refresh_period,
                                refresh_slots=refresh_slots, sinks=sinks, page_size=page_size,
                                head_scores=head_scores))
        return ask_questions(Session(options, stage=status(quiet)), paths, asked or [(question, ())],
                             context=context, each=each, caches=caches, as_json=as_json, jsonl=jsonl,
                             output=output, resume=resume, quiet=quiet, debug=debug)
    method = method or "hybridkv"
    options = AskOptions(
        model=model, device=device, dtype=dtype, method=method, frames=frames, fps=fps, max_pixels=max_pixels,
        max_new_tokens=max_new_tokens, defer_question=defer_question,
        method_options=dict(budget=budget, window=window, theta=theta, sparsity_topk=sparsity_topk, share=share,
                            chunk_size=chunk_size, sink_aware=sink_aware, landmark=landmark, refresh=refresh,
                            refresh_rate=refresh_rate, refresh_period=refresh_period, refresh_slots=refresh_slots,
                            sinks=sinks, page_size=page_size, head_scores=head_scores),
    )
    session = Session(options, stage=status(quiet))  # refuses a bad method or option before any input is read
    batch = each or "-" in paths or jsonl or output is not None
    if as_json and jsonl:
        raise UsageError("--json and --jsonl exclude each other (--jsonl: one line per input)", "--json")
    if as_json and batch:
        raise UsageError("--json prints one object for one input; use --jsonl with --each, - or --output", "--json")
    if resume and output is None:
        raise UsageError("--resume needs --output FILE (the file to resume)", "--resume")

    if not batch or context is not None:  # one input: errors are raised, the report is rendered
        text = read_context(context) if context is not None else None
        try:
            result = session.answer(Item(tuple(paths)), question, context=text)
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
    summary = run_batch(items, question, session, console=err, jsonl=sys.stdout if jsonl else None,
                        human=Console() if not jsonl and output is None else None, output=output, resume=resume,
                        quiet=quiet, debug=debug)
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
    from hybridkv_cli.bench import parse_budgets
    from hybridkv_cli.compression import make_policy
    from hybridkv_cli.inputs import Item, read_context
    from hybridkv_cli.profile import profile as run_profile
    from hybridkv_cli.report import render_profile, save_heatmap
    from hybridkv_cli.session import AskOptions, Session

    _state["debug"] = debug
    sweep = tuple(parse_budgets(budgets))
    options = dict(window=window, theta=theta, sparsity_topk=sparsity_topk, share=share, chunk_size=chunk_size,
                   sink_aware=sink_aware, landmark=landmark, refresh=refresh, refresh_rate=refresh_rate,
                   refresh_period=refresh_period, refresh_slots=refresh_slots)
    make_policy("hybridkv", budget=budget, **options)  # refuses bad values before the model loads
    paths, question = _split_args(args, context)
    session = Session(AskOptions(model=model, device=device, dtype=dtype, frames=frames, fps=fps,
                                 max_pixels=max_pixels, max_new_tokens=max_new_tokens), stage=status(quiet))
    media = session.load_media(paths) if paths else None  # cheap checks first, then the model
    text = read_context(context) if context is not None else None
    prepared = session.prepare(media, question, context=text, source=Item(tuple(paths)).key if paths else None)
    with (nullcontext() if quiet else err.status("profiling ...")) as spinner:
        result = run_profile(
            session, prepared, budget=budget, budgets=sweep,
            on_run=lambda label: spinner and spinner.update(f"profiling: {label} ..."), **options,
        )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        save_heatmap(result["heads"], out / "heads.png")
        (out / "profile.json").write_text(json.dumps(result, indent=1))
        err.print(f"wrote {out / 'heads.png'} and {out / 'profile.json'}")
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        render_profile(result, Console())


BENCH_HELP = (
    "Compare compression methods × budgets on MEDIA... QUESTION (one input) or on --tasks FILE.jsonl.\n\n"
    "Every input runs once with the full cache (the reference) and once per method and budget, greedy, the same "
    "--max-new-tokens for all. Per method and budget: accuracy (the expected answer occurs in the output), "
    "fidelity (ROUGE-L F1 vs the full-cache output), device KV ratio, ms/token and host->device traffic per step. "
    'Task rows: {"id"?, "question", "answer"?, "context"? | "media"?}: the answer a string or a list of them, '
    "the media a path or a list of paths (relative to the file). See docs/bench.md.\n\n"
    "Exit status: 0 every run completed; 1 a run failed (the others still ran); 2 bad command line or task file."
)


@app.command(help=BENCH_HELP)
def bench(
    args: Optional[list[str]] = typer.Argument(None, metavar="MEDIA... QUESTION",
                                               help="One input: a video, image files or a directory, then the question."),
    tasks: Optional[Path] = typer.Option(None, "--tasks", metavar="FILE.jsonl", help="Inputs, one JSON object a line."),
    answer: Optional[list[str]] = typer.Option(None, metavar="TEXT",
                                               help="Expected answer of MEDIA... QUESTION (repeat: any counts)."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated methods (default: every one but full, "
                                          "which always runs)."),
    budgets: str = typer.Option("0.05,0.1,0.2", help="Comma-separated budgets."),
    model: str = MODEL, window: Optional[int] = WINDOW, theta: Optional[float] = THETA,
    sparsity_topk: Optional[float] = TOPK, share: Optional[float] = SHARE, chunk_size: Optional[int] = CHUNK,
    sink_aware: Optional[bool] = SINK_AWARE, landmark: Optional[str] = LANDMARK, refresh: Optional[str] = REFRESH,
    refresh_rate: Optional[float] = REFRESH_RATE, refresh_period: Optional[int] = REFRESH_PERIOD,
    refresh_slots: Optional[int] = REFRESH_SLOTS,
    frames: int = FRAMES, fps: Optional[float] = FPS,
    max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(32, min=1, help="Tokens generated per run (greedy)."),
    defer_question: bool = DEFER,
    per_video: bool = typer.Option(False, "--per-video", help="Questions about the same media share one "
                                   "compression per method and budget (each answered from a copy of it, as a "
                                   "deferred question: the answers of --defer-question, in less time)."),
    out: Optional[Path] = typer.Option(None, help="Directory for bench.csv, bench.json and bench.png."),
    device: str = DEVICE, dtype: str = DTYPE,
    as_json: bool = typer.Option(False, "--json", help="Print the JSON (config, aggregates, items), not the table."),
    quiet: bool = QUIET, debug: bool = DEBUG,
):
    from hybridkv_cli.bench import Task, method_options, parse_budgets, parse_methods, read_tasks, run_bench
    from hybridkv_cli.bench_report import render_bench, save
    from hybridkv_cli.inputs import Item
    from hybridkv_cli.session import AskOptions, Session

    _state["debug"] = debug
    names, sweep = parse_methods(methods), parse_budgets(budgets)
    options = dict(window=window, theta=theta, sparsity_topk=sparsity_topk, share=share, chunk_size=chunk_size,
                   sink_aware=sink_aware, landmark=landmark, refresh=refresh, refresh_rate=refresh_rate,
                   refresh_period=refresh_period, refresh_slots=refresh_slots)
    method_options(names, options)  # refuses what no method takes before anything loads
    if tasks is not None:
        if args or answer:
            raise UsageError("give either --tasks FILE or MEDIA... QUESTION [--answer A], not both", "--tasks")
        inputs = read_tasks(tasks)
    else:
        paths, question = _split_args(args, None, alternative="(or --tasks FILE)")
        inputs = [Task(Item(tuple(paths)).key, question, tuple(answer or ()), media=tuple(paths))]
    session = Session(AskOptions(model=model, device=device, dtype=dtype, frames=frames, fps=fps,
                                 max_pixels=max_pixels, max_new_tokens=max_new_tokens,
                                 defer_question=defer_question), stage=status(quiet))
    session.model()
    result = run_bench(session, inputs, names, sweep, console=err, quiet=quiet, debug=debug, per_video=per_video,
                       **options)
    if out is not None:
        err.print(f"wrote {', '.join(str(p) for p in save(result, out))}", highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        render_bench(result, Console())
    return 1 if any(row["errors"] for row in result["aggregates"]) else 0


COMPRESS_HELP = (
    "Prefill and compress MEDIA once (no question) and save the compressed cache to a .hkv file, to be asked "
    "later with `hybridkv ask FILE.hkv QUESTION` (or many questions: -Q, --questions) without decoding or "
    "encoding the media again.\n\n"
    "MEDIA is a video, image files (one image set) or a directory of images; with --each every argument is its "
    "own input (a directory: every video and image in it) and -o names a folder that gets NAME.hkv per input. "
    "--resume skips inputs whose cache file already exists. The file (safetensors, written atomically) holds the "
    "method and its options and the model it was made with; `ask` refuses it with another model, dtype, method "
    "or hybridkv version.\n\n"
    "Exit status: 0 every input compressed; 1 an input failed (the others still ran); 2 bad command line."
)


@app.command(help=COMPRESS_HELP)
def compress(
    args: list[str] = typer.Argument(..., metavar="MEDIA...", help="A video, image files or a directory."),
    output: Path = typer.Option(..., "--output", "-o", metavar="FILE.hkv|DIR", help="The cache file (--each or "
                                "several inputs: a folder)."),
    model: str = MODEL,
    method: str = typer.Option("hybridkv", help="Compression method (see `hybridkv methods`)."),
    budget: Optional[float] = BUDGET, window: Optional[int] = WINDOW, theta: Optional[float] = THETA,
    sparsity_topk: Optional[float] = TOPK, share: Optional[float] = SHARE, chunk_size: Optional[int] = CHUNK,
    sink_aware: Optional[bool] = SINK_AWARE, landmark: Optional[str] = LANDMARK, refresh: Optional[str] = REFRESH,
    refresh_rate: Optional[float] = REFRESH_RATE, refresh_period: Optional[int] = REFRESH_PERIOD,
    refresh_slots: Optional[int] = REFRESH_SLOTS,
    sinks: Optional[int] = SINKS, page_size: Optional[int] = PAGE_SIZE,
    head_scores: Optional[str] = HEAD_SCORES, frames: int = FRAMES, fps: Optional[float] = FPS,
    max_pixels: Optional[int] = MAX_PIXELS, device: str = DEVICE, dtype: str = DTYPE,
    each: bool = EACH, jsonl: bool = typer.Option(False, "--jsonl", help="One JSON line per input on stdout "
                                                  "(its cache file and sizes, or its error)."),
    resume: bool = typer.Option(False, "--resume", help="Skip inputs whose cache file already exists."),
    quiet: bool = QUIET, debug: bool = DEBUG,
):
    from hybridkv_cli.inputs import plan_inputs
    from hybridkv_cli.multi_run import run_compress
    from hybridkv_cli.session import AskOptions, Session

    _state["debug"] = debug
    options = AskOptions(
        model=model, device=device, dtype=dtype, method=method, frames=frames, fps=fps, max_pixels=max_pixels,
        defer_question=True,
        method_options=dict(budget=budget, window=window, theta=theta, sparsity_topk=sparsity_topk, share=share,
                            chunk_size=chunk_size, sink_aware=sink_aware, landmark=landmark, refresh=refresh,
                            refresh_rate=refresh_rate, refresh_period=refresh_period, refresh_slots=refresh_slots,
                            sinks=sinks, page_size=page_size, head_scores=head_scores),
    )
    session = Session(options, stage=status(quiet))
    items = plan_inputs(list(args), each=each, stdin=sys.stdin)
    if not items:
        print_warning("no inputs; nothing to do")
        return 0
    return run_compress(session, items, output, each=each, resume=resume, console=err, quiet=quiet, debug=debug,
                        jsonl=sys.stdout if jsonl else None)


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
    """Console entry point."""
    sys.exit(run())


if __name__ == "__main__":
    main()
