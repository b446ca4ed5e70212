"""Progress over a run's inputs on stderr: a bar with ETA on a terminal, a line per input in logs."""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from typing import ContextManager


def clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Progress over inputs on ``console`` (stderr): a rich progress bar with ETA on a terminal,
    one plain line per finished input otherwise (logs); nothing when ``quiet``."""

    def __init__(self, console, total: int, *, quiet: bool = False):
        self.console, self.total, self.quiet = console, total, quiet
        self.done = 0
        self.start = time.perf_counter()
        self._bar = None
        self._task = None
        self._key = ""

    def __enter__(self):
        if not self.quiet and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn
            from rich.progress import Progress as Bar
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = Bar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
                            redirect_stdout=sys.stdout.isatty(), redirect_stderr=False)
            self._bar.__enter__()
            self._task = self._bar.add_task("", total=self.total)
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False

    def begin(self, key: str) -> None:
        """Input ``key`` starts."""
        self._key = key
        if self._bar is not None:
            self._bar.update(self._task, description=self._short(key))

    def stage(self, message: str) -> ContextManager:
        """Show ``message`` beside the current input while a slow step runs."""
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self._short(self._key)}: {message}")
        return nullcontext()

    def finish(self, key: str, ok: bool, seconds: float) -> None:
        """Input ``key`` is done (``ok``: answered) after ``seconds``."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=self._short(key))
        elif not self.quiet:
            left = self.total - self.done
            eta = (time.perf_counter() - self.start) / self.done * left
            self.console.print(f"[{self.done}/{self.total}] {'ok' if ok else 'failed'}: {key} "
                               f"({seconds:.1f} s{f', ETA {clock(eta)}' if left else ''})",
                               markup=False, highlight=False, soft_wrap=True)

    @staticmethod
    def _short(text: str, width: int = 40) -> str:
        from rich.markup import escape

        return escape(text if len(text) <= width else "…" + text[-(width - 1):])
