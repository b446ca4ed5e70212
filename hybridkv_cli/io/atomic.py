"""Writing a file whole or not at all: a reader never sees half of it, a killed run leaves no
half-written file behind (its temporary file is removed by the next save)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Callable


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> int:
    """Call ``write(tmp)`` on a temporary file beside ``path``, sync it and rename it over ``path``
    with the permissions a plain ``open()`` would give; returns the file's size in bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what a plain open() would give
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _remove_stale_temps(path: Path) -> None:
    """Remove the temporary files of saves to ``path`` whose process is gone (a killed run)."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.\w+\.tmp")
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        m = pattern.fullmatch(tmp.name)
        if m and not _alive(int(m.group(1))) and tmp.is_file() and not tmp.is_symlink():
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid < 2**31
    return True
