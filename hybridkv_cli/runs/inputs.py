"""The inputs of a run: media arguments -> :class:`Item` s (one prompt each), stdin path lists, text contexts.

* all media arguments as one input (an image set), or each its own (``--each``; a directory
  expands to the media files in it, natural order), or one path per line from stdin (``-``);
* ``--context FILE``: the text a text prompt asks about.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TextIO

from hybridkv_cli.io.errors import HybridKVError, MediaError, UsageError


@dataclass(frozen=True)
class Item:
    """One prompt's media: the paths as the user gave them. ``error`` marks an input known to be
    bad before loading (e.g. a directory with no media files under ``--each``)."""

    paths: tuple[str, ...]
    error: HybridKVError | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        """The ``input`` of an error record, and the ``input.label`` of a success record for the
        same input (a path as given; an image set of several files: ``first + N more``)."""
        from hybridkv_cli.media.paths import set_label  # the media package imports torch: on first use

        return set_label(self.paths) if self.paths else "text"  # no paths: a text prompt (--context), so labelled


def read_context(path: str, stdin: TextIO | None = None) -> str:
    """The text of a ``--context`` file (``-``: all of ``stdin``), as UTF-8; a byte-order mark
    (Notepad writes one) is dropped, and any line ending reads as ``\n``. The file is read as
    every user text file is (:mod:`hybridkv_cli.io.user_files`: a regular file, at most 16 MiB; it
    may be empty: the prompt is then the question alone); a
    bad one is a :class:`MediaError` (exit 1: the input, not the command line, is at fault)."""
    from hybridkv_cli.io.user_files import read_stream, read_text

    if path == "-":
        text = read_stream(stdin, "--context", error=MediaError, empty_ok=True)
    else:
        text = read_text(path, "--context", error=MediaError, empty_ok=True)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_paths(stream: TextIO) -> list[str]:
    """One path per line (read to the end of input). Only the line ending is removed, so names
    with spaces work; blank lines are ignored; bytes that are not UTF-8 survive (surrogateescape)."""
    raw = getattr(stream, "buffer", None)
    if raw is not None:
        lines = [os.fsdecode(b) for b in raw.read().split(b"\n")]
    else:
        lines = stream.read().split("\n")
    if lines and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]
    return [line[:-1] if line.endswith("\r") else line for line in lines if line.strip()]


def plan_inputs(paths: list[str], *, each: bool, stdin: TextIO | None = None) -> list[Item]:
    """The inputs of a run (see the module docstring). ``-`` must be the only media argument."""
    if "-" in paths:
        if len(paths) > 1:
            raise UsageError("'-' (read paths from stdin) cannot be combined with other media arguments", "MEDIA")
        if stdin is None:
            raise UsageError("no stdin to read paths from", "MEDIA")
        return [it for p in read_paths(stdin) for it in (_expand_one(p) if each else [Item((p,))])]
    if not paths:
        raise UsageError("give one or more media files (or a directory) followed by the question", "arguments")
    if not each:
        return [Item(tuple(paths))]
    return [it for p in paths for it in _expand_one(p)]


def _expand_one(path: str) -> list[Item]:
    """``--each`` over one argument: a directory's media files, each an input; else the path."""
    if not (path and os.path.isdir(path)):
        return [Item((path,))]
    from hybridkv_cli.media import media_in_directory

    try:
        return [Item((p,)) for p in media_in_directory(path)]
    except MediaError as e:
        return [Item((path,), e)]
