"""Command line: parse, call the library, render. Errors become one line and an exit code."""

from __future__ import annotations

import json
import os
import sys
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
JSON = typer.Option(False, "--json", help="Print one JSON object on stdout.")
DEBUG = typer.Option(False, help="Show tracebacks.")


def _prepare(args, model, device, dtype, frames, fps, max_pixels):
    """Validate the arguments, then load the media (cheap, first) and the model."""
    from hybridkv_cli.media import load_media
    from hybridkv_cli.models import load_model

    if len(args) < 2:
        raise UsageError("give one or more media files (or a directory) followed by the question", "arguments")
    paths, question = args[:-1], args[-1]
    if not question.strip():
        raise UsageError("the question is empty", "QUESTION")
    media = load_media(paths, frames=frames, fps=fps, max_pixels=max_pixels)
    with err.status(f"loading {model} ..."):
        loaded = load_model(model, device=device, dtype=dtype)
    return media, question, loaded


@app.command()
def ask(
    args: list[str] = ARGS, model: str = MODEL,
    method: str = typer.Option("hybridkv", help="Compression method (see `hybridkv methods`)."),
    budget: float = BUDGET, window: int = WINDOW, theta: float = THETA, sparsity_topk: float = TOPK,
    share: float = SHARE, chunk_size: int = CHUNK, frames: int = FRAMES, fps: Optional[float] = FPS,
    max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(128, min=1, help="Greedy decoding length limit."),
    device: str = DEVICE, dtype: str = DTYPE, as_json: bool = JSON, debug: bool = DEBUG,
):
    """Answer QUESTION about MEDIA, with latency, KV memory and head-classification reports."""
    from hybridkv_cli.api import ask as ask_one
    from hybridkv_cli.compression import make_policy
    from hybridkv_cli.report import render

    _state["debug"] = debug
    policy = make_policy(method, budget=budget, window=window, theta=theta, sparsity_topk=sparsity_topk,
                         share=share, chunk_size=chunk_size)
    media, question, loaded = _prepare(args, model, device, dtype, frames, fps, max_pixels)
    with err.status(f"answering ({policy.name}, budget {policy.budget:g}) ..."):
        result = ask_one(loaded, media, question, method=policy, max_new_tokens=max_new_tokens)
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        render(result, Console())


@app.command()
def profile(
    args: list[str] = ARGS, model: str = MODEL, budget: float = BUDGET, window: int = WINDOW,
    theta: float = THETA, sparsity_topk: float = TOPK, share: float = SHARE, chunk_size: int = CHUNK,
    budgets: str = typer.Option("0.05,0.1,0.2,0.4,1.0", help="Comma-separated budgets to sweep."),
    out: Optional[Path] = typer.Option(None, help="Directory for the heatmap PNG (and profile.json)."),
    frames: int = FRAMES, fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(32, min=1, help="Tokens generated per sweep run."),
    device: str = DEVICE, dtype: str = DTYPE, as_json: bool = JSON, debug: bool = DEBUG,
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
    media, question, loaded = _prepare(args, model, device, dtype, frames, fps, max_pixels)
    with err.status("profiling ...") as status:
        result = run_profile(
            loaded, media, question, budget=budget, budgets=sweep, max_new_tokens=max_new_tokens,
            on_run=lambda label: status.update(f"profiling: {label} ..."),
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


def main() -> None:
    """Console entry point: one-line errors, exit 2 for usage and 1 for runtime failures."""
    import click

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        code = app(standalone_mode=False)
    except HybridKVError as e:
        if _state["debug"]:
            raise
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        err.print("interrupted")
        sys.exit(130)
    except click.exceptions.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except Exception as e:  # anything unexpected: still one line unless --debug
        if _state["debug"]:
            raise
        err.print(f"[red]error:[/red] {type(e).__name__}: {escape(str(e))} (run with --debug for the traceback)",
                  highlight=False, soft_wrap=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
