"""stderr for people: one-line errors and warnings, a status spinner while a slow step runs, and the
count of frames read while a video is prefilled."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator

from rich.console import Console
from rich.markup import escape

from hybridkv_cli.io.errors import MediaWarning, one_line

err = Console(stderr=True)


def print_error(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)


def print_warning(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False, soft_wrap=True)


class Stages:
    """A session's stage callback: ``stages(message)`` shows a transient spinner on stderr while
    a slow step runs (nothing when quiet); :meth:`frames` turns the spinner's line into the count
    of frames read while a video is prefilled."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.current = None  # the spinner shown now

    @contextmanager
    def __call__(self, message: str) -> Iterator[None]:
        if self.quiet:
            yield
            return
        with err.status(escape(message)) as spinner:
            self.current = spinner
            try:
                yield
            finally:
                self.current = None

    def frames(self, read: int, total: int) -> None:
        if self.current is not None:
            self.current.update(f"reading frames {read}/{total} ({100 * read // max(total, 1)} %) ...")


def status(quiet: bool) -> Stages:
    """A stage callback for a session (:class:`Stages`)."""
    return Stages(quiet)


@contextmanager
def one_line_warnings(print_line: Callable[[str], None] = print_warning) -> Iterator[None]:
    """Show Python warnings (e.g. the media layer's skipped files) as ``warning: <message>``
    lines, every time, instead of the default two-line format."""
    with warnings.catch_warnings():
        # our own notices (MediaWarning, resume repairs) every time, not once per location
        warnings.filterwarnings("always", category=UserWarning, module=r"hybridkv_cli(\.|$)")

        def show(message, category, filename, lineno, file=None, line=None):
            print_line(one_line(message, limit=1000))

        warnings.showwarning = show
        yield


@contextmanager
def quiet_libraries(debug: bool = False) -> Iterator[None]:
    """Keep libraries' warnings and log lines (transformers, tokenizers, PyAV, Pillow, ...) off
    stderr while a command runs: the user gets our one-line errors, not "Token indices sequence
    length is longer than ..." above them. ``debug`` leaves everything on. Scoped: the logging
    and warning state in force before comes back afterwards (importing hybridkv changes nothing)."""
    if debug:
        yield
        return
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)  # every logger, including transformers' own stderr handler
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            # ours still show: notices about inputs (MediaWarning) and the CLI's own UserWarnings
            warnings.filterwarnings("always", category=MediaWarning)
            warnings.filterwarnings("always", category=UserWarning, module=r"hybridkv_cli(\.|$)")
            yield
    finally:
        logging.disable(previous)
