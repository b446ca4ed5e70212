"""``hybridkv compress``: media prefilled and compressed once, saved as ``.hkv`` files."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from hybridkv_cli.commands.options import (ALL_OPTIONS, DEBUG, DEVICE, DTYPE, EACH, FPS, FRAMES, MAX_FRAMES,
                                           MAX_PIXELS, MODEL, QUIET, STREAM, STREAM_CHUNK, STREAM_KV_TOKENS,
                                           STREAM_WINDOW, SYSTEM, max_frames_arg, method_options, streaming)
from hybridkv_cli.io.console import err, print_warning, status


@method_options(ALL_OPTIONS)
def compress(
    args: list[str] = typer.Argument(..., metavar="MEDIA...", help="A video, image files or a directory."),
    output: Path = typer.Option(..., "--output", "-o", metavar="FILE.hkv|DIR", help="The cache file (--each or "
                                "several inputs: a folder)."),
    model: str = MODEL,
    method: str = typer.Option("hybridkv", help="Compression method (see `hybridkv methods`)."),
    frames: int = FRAMES, fps: float | None = FPS, max_pixels: int | None = MAX_PIXELS, device: str = DEVICE,
    dtype: str = DTYPE, each: bool = EACH,
    jsonl: bool = typer.Option(False, "--jsonl", help="One JSON line per input on stdout (its cache file and "
                               "sizes, or its error)."),
    resume: bool = typer.Option(False, "--resume", help="Skip inputs whose cache file already holds this "
                                "cache (another model, method, options or --system: compressed again)."),
    max_frames: Optional[str] = MAX_FRAMES, stream: str = STREAM, stream_chunk: int = STREAM_CHUNK,
    stream_window: int = STREAM_WINDOW, stream_kv_tokens: Optional[int] = STREAM_KV_TOKENS,
    system: Optional[str] = SYSTEM, quiet: bool = QUIET, debug: bool = DEBUG, options=None,
):
    from hybridkv_cli.runs.inputs import plan_inputs
    from hybridkv_cli.runs.multi_run import run_compress
    from hybridkv_cli.runs.session import AskOptions, Session

    streams, stages = streaming(stream, stream_chunk, stream_window, stream_kv_tokens), status(quiet)
    session = Session(AskOptions(model=model, device=device, dtype=dtype, method=method, method_options=options,
                                 frames=frames, fps=fps, max_pixels=max_pixels, defer_question=True, streaming=streams,
                                 max_frames=max_frames_arg(max_frames, fps, max_pixels, streams), system=system),
                      stage=stages, progress=stages.frames)
    items = plan_inputs(list(args), each=each, stdin=sys.stdin)
    if not items:
        print_warning("no inputs; nothing to do")
        return 0
    return run_compress(session, items, output, each=each, resume=resume, console=err, quiet=quiet, debug=debug,
                        jsonl=sys.stdout if jsonl else None)
