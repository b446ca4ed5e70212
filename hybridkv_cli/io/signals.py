"""Stop signals: SIGTERM and SIGHUP (kill, timeout, systemd, Slurm, Ray, a closed terminal) end a
run the way Ctrl-C does, as a :class:`KeyboardInterrupt`, so every completed line is kept and
the exit status is 128 + the signal number (130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

#: The signals a run stops on (SIGHUP does not exist on Windows), and the exit codes they give.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
STOP_EXIT_CODES = frozenset(128 + int(s) for s in STOP_SIGNALS)


class Terminated(KeyboardInterrupt):
    """A stop signal other than SIGINT: a KeyboardInterrupt, so every Ctrl-C path handles it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def interrupt_for(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def signal_of(exc: BaseException | None) -> int:
    """The signal behind an interruption (a KeyboardInterrupt, or click's Abort raised from one)."""
    while exc is not None:
        if isinstance(exc, Terminated):
            return exc.signum
        if isinstance(exc, KeyboardInterrupt):
            return int(signal.SIGINT)
        exc = exc.__cause__ or exc.__context__
    return int(signal.SIGINT)


def exit_code(signum: int) -> int:
    return 128 + int(signum)


def describe(signum: int) -> str:
    """``interrupted`` for Ctrl-C, ``stopped by SIGTERM`` for the others."""
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install(handler, signals) -> dict:
    """Set ``handler`` for ``signals``; the handlers they had (to give back with :func:`_restore`)."""
    previous = {}
    for signum in signals:
        try:
            previous[signum] = signal.signal(signum, handler)
        except (ValueError, OSError):  # pragma: no cover - not settable here
            pass
    return previous


def _restore(previous: dict) -> None:
    for signum, handler in previous.items():
        if handler is not None:  # None: a handler set from C, which Python cannot reinstall
            signal.signal(signum, handler)


# The stop signals received inside stop_on_signals(). A handler's exception can be swallowed
# (raised inside a destructor, Python prints "Exception ignored" and goes on), so loops over
# inputs also ask raise_if_stopped() between inputs.
_received: list[int] = []


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs, Ctrl-C raises KeyboardInterrupt and SIGTERM / SIGHUP raise
    :class:`Terminated`, and each is remembered for :func:`raise_if_stopped` (the previous handlers
    come back afterwards: nothing is installed at import)."""
    _received.clear()
    previous = _install(_raise, STOP_SIGNALS) if _main_thread() else {}
    hook = sys.unraisablehook
    sys.unraisablehook = _quiet_stops(hook)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        _restore(previous)
        _received.clear()


def _quiet_stops(hook):
    """An unraisable-exception hook that drops our own stop raised inside a destructor (e.g.
    decord's ``VideoReader.__del__``): Python would print its traceback, yet the stop is
    remembered and ends the run cleanly (:func:`raise_if_stopped`)."""

    def quiet(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            hook(unraisable)

    return quiet


def _raise(signum, frame):
    _received.append(int(signum))
    raise interrupt_for(signum)


def raise_if_stopped() -> None:
    """Raise the interruption of a stop signal received earlier in this run, if one was (its
    handler's own exception may have been swallowed)."""
    if _received:
        raise interrupt_for(_received[0])


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold the stop signals until the block is done (a record line is written whole or not at
    all), then raise the first one that came. Nested blocks are held by the outermost one."""
    if not _main_thread() or _holding:
        yield
        return
    caught: list[int] = []
    previous = _install(lambda s, f: caught.append(s), STOP_SIGNALS)
    _holding.append(True)
    try:
        yield
    finally:
        _holding.pop()
        _restore(previous)
        if caught:
            raise interrupt_for(caught[0])


_holding: list[bool] = []  # non-empty while a deferred_signals() block holds the signals


def leave(code: int) -> None:
    """End the process with ``code``. A run ended by a stop signal leaves at once once stdout and
    stderr are flushed (its output files are closed, each line was fsynced when written): tearing
    down torch and a model can take seconds on a loaded machine, and a stop ends the process
    within 5 s."""
    if code in STOP_EXIT_CODES:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)
