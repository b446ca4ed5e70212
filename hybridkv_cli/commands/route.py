"""``hybridkv route``: build a route (a compression method per layer) from dev tasks."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer

from hybridkv_cli.commands.options import DEBUG, DEFER, DEVICE, DTYPE, FPS, FRAMES, MAX_PIXELS, MODEL, QUIET
from hybridkv_cli.io.console import err, status


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
    from hybridkv_cli.runs.bench import parse_methods, read_tasks
    from hybridkv_cli.runs.routing import build_route
    from hybridkv_cli.runs.session import AskOptions, Session

    candidates = [m for m in parse_methods(methods) if m != "route"]
    inputs = read_tasks(tasks)
    session = Session(AskOptions(model=model, device=device, dtype=dtype, method=None, frames=frames, fps=fps,
                                 max_pixels=max_pixels, max_new_tokens=max_new_tokens,
                                 defer_question=defer_question), stage=status(quiet))
    with (nullcontext() if quiet else err.status("profiling layers ...")) as spinner:
        built = build_route(session, inputs, candidates, budget, output,
                            on_run=lambda label: spinner and spinner.update(f"profiling: {label} ..."))
    err.print(f"wrote {output} and its profile: {', '.join(built['layers'])}", highlight=False, soft_wrap=True)
