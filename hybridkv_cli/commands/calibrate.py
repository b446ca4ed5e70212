"""``hybridkv calibrate``: write a model's label file (the label channels of ``--landmark labels``)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer

from hybridkv_cli.commands.options import DEBUG, DEVICE, DTYPE, FPS, FRAMES, MAX_PIXELS, MODEL, QUIET
from hybridkv_cli.io.console import err, status


def calibrate(
    tasks: Path = typer.Option(..., "--tasks", metavar="DEV.jsonl", help="Dev tasks (bench's format) whose prompts "
                               "weigh the channels."),
    output: Path = typer.Option(..., "--output", "-o", metavar="LABELS.json", help="The label file to write."),
    rows: Optional[int] = typer.Option(None, min=1, help="Use the first N tasks [default: all]."),
    model: str = MODEL, frames: int = FRAMES, fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    device: str = DEVICE, dtype: str = DTYPE, quiet: bool = QUIET, debug: bool = DEBUG,
):
    """Weigh each head's key channels on dev prompts and write the model's label file, read by
    `--landmark labels --index-file FILE` (docs/quality.md)."""
    from hybridkv_cli.io.user_files import check_output
    from hybridkv_cli.runs.bench import read_tasks
    from hybridkv_cli.runs.calibrate import calibrate as write_labels
    from hybridkv_cli.runs.session import AskOptions, Session

    check_output(output, "--output")
    inputs = read_tasks(tasks)[:rows]
    session = Session(AskOptions(model=model, device=device, dtype=dtype, method=None, frames=frames, fps=fps,
                                 max_pixels=max_pixels, max_new_tokens=1), stage=status(quiet))
    with (nullcontext() if quiet else err.status("calibrating ...")) as spinner:
        content = write_labels(session, inputs, output, on_run=lambda label: spinner and spinner.update(
            f"calibrating: {label} ..."))
    err.print(f"wrote {output}: label weights of {len(content['weights'])} layers from {content['rows']} prompts",
              highlight=False, soft_wrap=True)
