"""The JSON-lines output file: whole lines only, fsynced one by one, Ctrl-C / SIGTERM / SIGHUP held while a
line is written."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from hybridkv_cli.io.errors import HybridKVError, MediaWarning
from hybridkv_cli.io.signals import deferred_signals


def record_key(record) -> str | None:
    """The input a JSONL line answered (None for error records and foreign lines)."""
    if not isinstance(record, dict) or "error" in record:
        return None
    inp = record.get("input")
    return inp.get("label") if isinstance(inp, dict) and isinstance(inp.get("label"), str) else None


class JsonlFile:
    """An append-only JSON-lines file: whole lines, each flushed and fsynced, so a crash never
    leaves half a line behind; a half last line left by an earlier crash (kill -9, full disk)
    is removed, with a warning, when the file is opened."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd: int | None = None

    def done(self) -> set[str]:
        """Inputs answered successfully in the file (error records do not count: they are retried)."""
        keys: set[str] = set()
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return keys
        except OSError as e:
            raise HybridKVError(f"cannot read: {e.strerror or e}", str(self.path)) from None
        bad = 0
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                key = record_key(json.loads(line))
            except ValueError:
                bad += i < len(lines) - 1  # a half last line (no newline) is repaired by open()
                continue
            if key is not None:
                keys.add(key)
        if bad:
            warnings.warn(f"{self.path}: ignored {bad} unreadable line{'s' if bad > 1 else ''}", MediaWarning,
                          stacklevel=2)
        return keys

    def open(self) -> None:
        from hybridkv_cli.io.user_files import check_output

        shown = str(self.path)
        check_output(self.path, "--output")  # a FIFO would block the open, a device swallow the records
        try:
            self._repair_tail()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except IsADirectoryError:
            raise HybridKVError("is a directory, expected a file", shown) from None
        except OSError as e:
            raise HybridKVError(f"cannot write: {e.strerror or e}", shown) from None

    def _repair_tail(self) -> None:
        try:
            f = open(self.path, "rb+")
        except FileNotFoundError:
            return
        with f:
            end = f.seek(0, os.SEEK_END)
            if end == 0:
                return
            f.seek(end - 1)
            if f.read(1) == b"\n":
                return
            pos, tail = end, b""
            while pos > 0 and b"\n" not in tail:  # read backwards to the last newline
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                tail = f.read(step) + tail
            cut = pos + tail.rfind(b"\n") + 1  # 0 when the file is one half line
            try:
                json.loads(tail[tail.rfind(b"\n") + 1:])
                complete = True
            except ValueError:
                complete = False
            if complete:  # a whole record without its newline: keep it
                f.write(b"\n")
            else:
                f.truncate(cut)
                warnings.warn(f"{self.path}: removed an incomplete last line ({end - cut} bytes) left by an "
                              "interrupted run", MediaWarning, stacklevel=3)
            f.flush()
            os.fsync(f.fileno())

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        try:
            with deferred_signals():
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                os.fsync(self._fd)
        except OSError as e:
            raise HybridKVError(f"cannot write: {e.strerror or e}", str(self.path)) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
