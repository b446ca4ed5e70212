"""Command line: parse, call the library, render. Errors become one line and an exit code."""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from hybridkv_cli.errors import HybridKVError, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Answer questions about videos and image sets with Qwen2.5-VL under a KV-cache budget.")
err = Console(stderr=True)
_state = {"debug": False}

# Options shared by `ask` and `profile`, declared once.
ARGS = typer.Argument(..., metavar="MEDIA... QUESTION", help="A video, image files or a directory, then the question.")
MODEL = typer.Option("Qwen/Qwen2.5-VL-7B-Instruct", help="Hub id, local directory, or 'demo' (offline tiny model).")
BUDGET = typer.Option(0.1, help="Device-resident prompt KV as a share of the full cache, in (0, 1].")
WINDOW = typer.Option(32, help="Observation window: last prompt positions used for scoring, always kept.")
THETA = typer.Option(0.9, help="HybridKV θ: heads whose sparsity score is >= θ are static.")
TOPK = typer.Option(0.05, help="HybridKV p: the sparsity score is the attention mass on the top p·N tokens.")
SHARE = typer.Option(0.75, help="HybridKV r: a dynamic head's budget as a share of the average head budget.")
CHUNK = typer.Option(8, help="HybridKV: tokens per retrieval chunk.")
FRAMES = typer.Option(64, help="Frames sampled uniformly from a video.")
FPS = typer.Option(None, help="Sample frames at this rate instead of --frames.")
MAX_PIXELS = typer.Option(None, help="Max pixels per frame/image (resized by Qwen2.5-VL's rules).")
DEVICE = typer.Option("auto", help="auto | cuda | cpu")
DTYPE = typer.Option("auto", help="auto | bfloat16 | float16 | float32")
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout (one input only).")
DEBUG = typer.Option(False, help="Show tracebacks.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar or status spinners on stderr (errors and "
                     "warnings still show).")
# Options of runs over many inputs (see hybridkv_cli/pipeline.py).
EACH = typer.Option(False, "--each", help="Each media argument is its own input (a directory: each video/image "
                    "file in it, natural order), all with the same question and one model load.")
JSONL = typer.Option(False, "--jsonl", help="Print one JSON line per input on stdout as soon as it is done; a failed "
                     'input gives {"input": PATH, "error": {"type": ..., "message": ...}}.')
OUTPUT = typer.Option(None, "--output", "-o", metavar="FILE", help="Append the JSON lines to FILE (whole lines, "
                      "fsynced one by one).")
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
    "130 interrupted (completed lines are kept)."
)


def _clean_message(text: str) -> str:
    return " ".join(str(text).split())


def _status(quiet: bool):
    """A stage callback for pipeline.Runner: a transient spinner on stderr (none when quiet)."""
    return (lambda message: nullcontext()) if quiet else (lambda message: err.status(escape(message)))


def _prepare(args, model, device, dtype, frames, fps, max_pixels, quiet=False):
    """Validate the arguments, then load the media (cheap, first) and the model."""
    from hybridkv_cli.media import load_media
    from hybridkv_cli.models import load_model
    from hybridkv_cli.pipeline import clean_question

    if len(args) < 2:
        raise UsageError("give one or more media files (or a directory) followed by the question", "arguments")
    paths, question = args[:-1], clean_question(args[-1])
    media = load_media(paths, frames=frames, fps=fps, max_pixels=max_pixels)
    with _status(quiet)(f"loading {model} ..."):
        loaded = load_model(model, device=device, dtype=dtype)
    return media, question, loaded


@app.command(help=ASK_HELP)
def ask(
    args: list[str] = ARGS, model: str = MODEL,
    method: str = typer.Option("hybridkv", help="Compression method (see `hybridkv methods`)."),
    budget: float = BUDGET, window: int = WINDOW, theta: float = THETA, sparsity_topk: float = TOPK,
    share: float = SHARE, chunk_size: int = CHUNK, frames: int = FRAMES, fps: Optional[float] = FPS,
    max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(128, min=1, help="Greedy decoding length limit."),
    device: str = DEVICE, dtype: str = DTYPE, as_json: bool = JSON, each: bool = EACH, jsonl: bool = JSONL,
    output: Optional[Path] = OUTPUT, resume: bool = RESUME, quiet: bool = QUIET, debug: bool = DEBUG,
):
    from hybridkv_cli.pipeline import AskOptions, Item, Runner, clean_question, plan_inputs, run_batch

    _state["debug"] = debug
    if len(args) < 2:
        raise UsageError("give one or more media files (or a directory) followed by the question", "arguments")
    paths, question = list(args[:-1]), clean_question(args[-1])
    if "\n" not in question and len(question) < 4096 and os.path.exists(question):
        err.print(f"[yellow]warning:[/yellow] the question '{escape(question)}' is an existing path; the question "
                  "comes last (MEDIA... QUESTION)", highlight=False, soft_wrap=True)
    options = AskOptions(
        model=model, device=device, dtype=dtype, method=method, frames=frames, fps=fps, max_pixels=max_pixels,
        max_new_tokens=max_new_tokens, method_options=dict(budget=budget, window=window, theta=theta,
                                                           sparsity_topk=sparsity_topk, share=share,
                                                           chunk_size=chunk_size),
    )
    options.policy()  # validates --method, --budget, ... before any input is read
    batch = each or "-" in paths or jsonl or output is not None
    if as_json and jsonl:
        raise UsageError("--json and --jsonl exclude each other (--jsonl: one line per input)", "--json")
    if as_json and batch:
        raise UsageError("--json prints one object for one input; use --jsonl with --each, - or --output", "--json")
    if resume and output is None:
        raise UsageError("--resume needs --output FILE (the file to resume)", "--resume")

    if not batch:  # one input: errors are raised, the report is rendered
        runner = Runner(options, stage=_status(quiet))
        try:
            result = runner.answer(Item(tuple(paths)), question)
        except UsageError as e:
            if len(paths) > 1 and "one video per prompt" in e.reason:
                e.reason += "; add --each to ask the question about each file separately"
            raise
        except KeyboardInterrupt:
            err.print("interrupted")
            return 130
        if as_json:
            print(json.dumps(result), flush=True)
        else:
            from hybridkv_cli.report import render

            render(result, Console())
        return 0

    if "-" in paths and sys.stdin is not None and sys.stdin.isatty() and not quiet:
        err.print("reading media paths from stdin, one per line (end with Ctrl-D) ...")
    items = plan_inputs(paths, each=each, stdin=sys.stdin)
    if not items:
        err.print("[yellow]warning:[/yellow] no input paths on stdin; nothing to do", highlight=False)
        return 0
    summary = run_batch(items, question, Runner(options), console=err, jsonl=sys.stdout if jsonl else None,
                        human=Console() if not jsonl and output is None else None, output=output, resume=resume,
                        quiet=quiet, debug=debug)
    return summary.exit_code


@app.command()
def profile(
    args: list[str] = ARGS, model: str = MODEL, budget: float = BUDGET, window: int = WINDOW,
    theta: float = THETA, sparsity_topk: float = TOPK, share: float = SHARE, chunk_size: int = CHUNK,
    budgets: str = typer.Option("0.05,0.1,0.2,0.4,1.0", help="Comma-separated budgets to sweep."),
    out: Optional[Path] = typer.Option(None, help="Directory for the heatmap PNG (and profile.json)."),
    frames: int = FRAMES, fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(32, min=1, help="Tokens generated per sweep run."),
    device: str = DEVICE, dtype: str = DTYPE, as_json: bool = JSON, quiet: bool = QUIET, debug: bool = DEBUG,
):
    """Per-head sparsity and classes, the budget allocation, and a budget sweep with fidelity."""
    from hybridkv_cli.compression import make_policy
    from hybridkv_cli.profile import profile as run_profile
    from hybridkv_cli.report import render_profile, save_heatmap

    _state["debug"] = debug
    try:
        sweep = tuple(float(b) for b in budgets.split(",") if b.strip())
    except ValueError:
        raise UsageError(f"not a comma-separated list of numbers: '{budgets}'", "--budgets") from None
    for b in (*sweep, budget):
        make_policy("hybridkv", budget=b)  # validates the range
    media, question, loaded = _prepare(args, model, device, dtype, frames, fps, max_pixels, quiet)
    with (nullcontext() if quiet else err.status("profiling ...")) as status:
        result = run_profile(
            loaded, media, question, budget=budget, budgets=sweep, max_new_tokens=max_new_tokens,
            on_run=lambda label: status and status.update(f"profiling: {label} ..."),
            window=window, theta=theta, sparsity_topk=sparsity_topk, share=share, chunk_size=chunk_size,
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


@app.command()
def methods():
    """List the compression methods."""
    from hybridkv_cli.compression import METHODS

    for name, cls in sorted(METHODS.items()):
        print(f"{name:14s} {(cls.__doc__ or '').strip().splitlines()[0]}")


def _print_error(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)


def run(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: sys.argv) and return the exit status: 0 ok, 1 runtime
    failure, 2 usage error, 130 interrupted. Every error is one line on stderr (``--debug``:
    the traceback)."""
    try:  # typer >= 0.25 runs on a vendored click: its exceptions are not `click`'s
        from typer import _click as click
    except ImportError:  # pragma: no cover - older typer on the real click
        import click

    from hybridkv_cli.pipeline import one_line_warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _state["debug"] = False
    def warn(line: str) -> None:
        err.print(f"[yellow]warning:[/yellow] {escape(line)}", highlight=False, soft_wrap=True)

    with one_line_warnings(warn):
        try:
            code = app(args=argv, prog_name="hybridkv", standalone_mode=False)
        except HybridKVError as e:
            if _state["debug"]:
                raise
            _print_error(str(e))
            return e.exit_code
        except (KeyboardInterrupt, typer.Abort):
            err.print("interrupted")
            return 130
        except click.exceptions.NoArgsIsHelpError as e:
            e.show()
            return 2
        except click.exceptions.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            _print_error(_clean_message(e.format_message()) + where)
            return e.exit_code
        except click.exceptions.ClickException as e:
            _print_error(_clean_message(e.format_message()))
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
            _print_error(f"{type(e).__name__}: {_clean_message(e)} (run with --debug for the traceback)")
            return 1
    return code if isinstance(code, int) else 0


def main() -> None:
    """Console entry point."""
    sys.exit(run())


if __name__ == "__main__":
    main()
