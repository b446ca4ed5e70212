"""Starting or joining the Ray runtime for :mod:`hybridkv_cli.runs.distributed`, with every stop honoured.

``--ray ADDRESS`` is checked before Ray is imported, probed with a plain TCP connect (nothing
listening fails at once; Ray itself would retry for minutes) and joined within
:data:`JOIN_TIMEOUT_S` (``HYBRIDKV_RAY_TIMEOUT``); the join runs in a thread so the stop signals
still end the run, and Ray's native log lines are kept off stderr.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable

from hybridkv_cli.io import signals
from hybridkv_cli.io.errors import HybridKVError, UsageError, one_line


def start(ray, address, workers, num_cpus) -> bool:
    """Start (or join) the Ray runtime; True when this call connected (and so must shut it down)."""
    if ray.is_initialized():
        return False
    with _keep_signal_handlers():
        _connect(ray, address, workers, num_cpus)
    return True


@contextmanager
def _keep_signal_handlers():
    """Ray's core installs its own handlers for SIGTERM (and others), which abort the process: put
    ours (:mod:`hybridkv_cli.io.signals`, stop after the completed lines) back after it."""
    saved = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                try:
                    signal.signal(s, handler)
                except ValueError:  # pragma: no cover - not the main thread
                    pass


#: Seconds ``--ray ADDRESS`` may take to join the cluster before the run fails (docs/scale-out.md);
#: the environment variable HYBRIDKV_RAY_TIMEOUT sets another.
JOIN_TIMEOUT_S = 30.0


def join_timeout() -> float:
    try:
        value = float(os.environ.get("HYBRIDKV_RAY_TIMEOUT") or JOIN_TIMEOUT_S)
    except ValueError:
        return JOIN_TIMEOUT_S
    return value if 0 < value < float("inf") else JOIN_TIMEOUT_S


def gcs_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` or ``ray://host:port`` address; None for ``auto`` (Ray
    finds the local cluster itself); a usage error for anything else."""
    if address == "auto":
        return None
    host, sep, port = address.strip().removeprefix("ray://").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise UsageError(f"expected HOST:PORT (e.g. 10.0.0.5:6379), auto or ray://HOST:PORT, got {address!r}", "--ray")
    return host, int(port)


def within(seconds: float, step: Callable):
    """``step()`` run in a daemon thread, its result (or its exception); a TimeoutError after
    ``seconds``. The main thread keeps taking the stop signals meanwhile (a blocked call in a
    library, a name lookup, a connect, cannot hold the run past a stop)."""
    box: dict = {}

    def run():
        try:
            box["value"] = step()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="hybridkv-join")
    thread.start()
    deadline = time.monotonic() + seconds
    while thread.is_alive():
        signals.raise_if_stopped()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {seconds:g} s")
        thread.join(min(left, 0.1))
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _probe(host: str, port: int, seconds: float) -> None:
    """Fail at once where nothing listens at ``host:port`` (Ray itself would retry for minutes)."""
    def connect():
        socket.create_connection((host, port), timeout=seconds).close()

    within(seconds, connect)


def _cannot_join(reason: str, auth_hint: bool = False) -> HybridKVError:
    hint = ("; a cluster with token authentication (Ray's default) needs RAY_AUTH_MODE=token here too, see "
            "docs/scale-out.md") if auth_hint else ""
    return HybridKVError(f"cannot join the Ray cluster ({reason}){hint}", "--ray")


def _connect(ray, address, workers, num_cpus) -> None:
    kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    if not address:
        with _native_stderr_quiet():
            ray.init(num_cpus=num_cpus or max(os.cpu_count() or 1, workers or 1), **kwargs)
        return
    seconds, target = join_timeout(), gcs_address(address)
    try:
        if target is not None:
            _probe(*target, seconds)
        with _native_stderr_quiet():  # Ray's C++ core logs each failed try on file descriptor 2
            within(seconds, lambda: ray.init(address=address, **kwargs))
    except socket.gaierror as e:
        raise _cannot_join(f"unknown host {target[0]!r}: {e.strerror or e}") from None
    except ConnectionRefusedError:
        raise _cannot_join(f"nothing listens at {target[0]}:{target[1]}") from None
    except TimeoutError:
        raise _cannot_join(f"no answer within {seconds:g} s") from None
    except (ConnectionError, OSError, RuntimeError, ValueError) as e:
        raise _cannot_join(one_line(getattr(e, "strerror", None) or e, limit=200), auth_hint=True) from None


@contextmanager
def _native_stderr_quiet():
    """While Ray starts or joins, what native code writes on file descriptor 2 goes to the null
    device; ``sys.stderr`` (our one-line errors) keeps writing to the real stderr through a copy
    of the descriptor. Left so when a join is abandoned (its thread may still log); with
    ``--debug`` (the libraries' logging left on) nothing is redirected."""
    if logging.root.manager.disable < logging.CRITICAL or not _stderr_fd_ok():
        yield
        return
    saved = os.dup(2)
    stream = sys.stderr
    sys.stderr = io.TextIOWrapper(io.FileIO(os.dup(saved), "w"), encoding=getattr(stream, "encoding", None) or "utf-8",
                                  errors="backslashreplace", line_buffering=True)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    abandoned = False
    try:
        yield
    except (TimeoutError, KeyboardInterrupt):  # the join's thread may still be running
        abandoned = True
        raise
    finally:
        if not abandoned:
            sys.stderr.flush()
            sys.stderr = stream
            os.dup2(saved, 2)
        os.close(saved)


def _stderr_fd_ok() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # pytest's captured stderr has no descriptor
        return False
