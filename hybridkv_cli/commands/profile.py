"""``hybridkv profile``: how a model's heads behave on one input, and what each budget costs."""

from __future__ import annotations

import dataclasses
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer

from hybridkv_cli.commands.options import (ARGS, CONTEXT, DEBUG, DEVICE, DTYPE, FPS, FRAMES, HYBRIDKV_OPTIONS, JSON,
                                           MAX_PIXELS, MODEL, QUIET, method_options)
from hybridkv_cli.io.console import err, status
from hybridkv_cli.io.questions import split_args


@method_options(HYBRIDKV_OPTIONS)
def profile(
    args: list[str] = ARGS, model: str = MODEL,
    budget: float = typer.Option(0.1, help="The budget whose heads and answer are shown, in (0, 1]."),
    budgets: str = typer.Option("0.05,0.1,0.2,0.4,1.0", help="Comma-separated budgets to sweep."),
    out: Optional[Path] = typer.Option(None, help="Directory for the heatmap PNG (and profile.json)."),
    frames: int = FRAMES, fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(32, min=1, help="Tokens generated per sweep run."),
    device: str = DEVICE, dtype: str = DTYPE, as_json: bool = JSON, quiet: bool = QUIET, debug: bool = DEBUG,
    context: Optional[str] = CONTEXT, options=None,
):
    """Per-head sparsity and classes, the budget allocation, and a budget sweep with fidelity."""
    from rich.console import Console

    from hybridkv_cli.io.report import render_profile, save_heatmap
    from hybridkv_cli.runs.bench import parse_budgets
    from hybridkv_cli.runs.inputs import Item, read_context
    from hybridkv_cli.runs.profile import profile as run_profile
    from hybridkv_cli.runs.session import AskOptions, Session

    sweep = tuple(parse_budgets(budgets))
    # The session's policy is the profiled budget's; building it refuses bad values before the model loads.
    session = Session(AskOptions(model=model, device=device, dtype=dtype, method="hybridkv",
                                 method_options=dataclasses.replace(options, budget=budget), frames=frames, fps=fps,
                                 max_pixels=max_pixels, max_new_tokens=max_new_tokens), stage=status(quiet))
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
