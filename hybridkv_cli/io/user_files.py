"""Text files a user names (questions, route, head scores, tasks, a text context), read the way
media are: the path is checked before it is opened (a regular file only: a FIFO, a device, a
socket or a directory is refused without being opened, so nothing blocks), the file is read up
to a size limit, and it must be UTF-8 text. Every failure is one line naming the file and the
option it was given to.

The limits (bytes; see docs/pipelines.md) are far above what the files hold in practice and
keep a wrong path (``/dev/zero``, a disk image, a video) from filling the memory:

========================  ==========
``--questions``           64 MiB
``--tasks``               64 MiB
``--context``             16 MiB
``--head-scores``         16 MiB
``--route``               1 MiB
========================  ==========
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import TextIO

from hybridkv_cli.io.errors import HybridKVError, UsageError

MiB = 2**20
LIMITS = {"--questions": 64 * MiB, "--tasks": 64 * MiB, "--context": 16 * MiB, "--head-scores": 16 * MiB,
          "--route": 1 * MiB}

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str | None:
    """What a non-regular file is (None: a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def stat_checked(path: str | os.PathLike, error: type[HybridKVError] = UsageError, shown: str | None = None
                 ) -> os.stat_result:
    """``stat()`` of ``path`` following symbolic links, every failure one line (``error``): no such
    file, a dangling or looping link, permission denied. The file is not opened."""
    shown = os.fspath(path) if shown is None else shown
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise error("no such file or directory", shown) from None
    except PermissionError:
        raise error("permission denied", shown) from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise error(f"cannot access: {getattr(e, 'strerror', None) or e}", shown) from None
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise error(f"dangling symbolic link (target '{target}' does not exist)", shown) from None
        except PermissionError:
            raise error("permission denied", shown) from None
        except OSError as e:  # a symlink loop
            raise error(f"cannot follow symbolic link: {e.strerror or e}", shown) from None
    return st


def human(size: int) -> str:
    return f"{size / MiB:.0f} MiB" if size >= MiB else f"{size} bytes"


def read_bytes(path: str | os.PathLike, flag: str, limit: int | None = None,
               error: type[HybridKVError] = UsageError) -> bytes:
    """The bytes of the regular file ``path`` given to ``flag`` (at most ``limit``, default the
    flag's :data:`LIMITS`); a one-line ``error`` naming the file otherwise."""
    shown = os.fspath(path)
    if not shown:
        raise error("empty file name", flag)
    limit = LIMITS.get(flag, 16 * MiB) if limit is None else limit
    st = stat_checked(path, error, shown)
    if (kind := kind_of(st.st_mode)) is not None:
        raise error(f"is {kind}, not a text file ({flag} reads a regular file)", shown)
    too_big = f"larger than the {human(limit)} a {flag} file may hold"
    if st.st_size > limit:
        raise error(too_big, shown)
    try:  # O_NONBLOCK: a FIFO swapped in after the check still cannot block the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except PermissionError:
        raise error("permission denied (the file is not readable)", shown) from None
    except OSError as e:
        raise error(f"cannot open: {e.strerror or e}", shown) from None
    try:
        if (kind := kind_of(os.fstat(fd).st_mode)) is not None:
            raise error(f"is {kind}, not a text file ({flag} reads a regular file)", shown)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 4 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise error(f"cannot read: {e.strerror or e}", shown) from None
    finally:
        os.close(fd)
    if size > limit:  # a file that grew, or one whose size the kernel does not report (/proc)
        raise error(too_big, shown)
    return b"".join(chunks)


def decode(data: bytes, shown: str, flag: str, error: type[HybridKVError] = UsageError,
           empty_ok: bool = False) -> str:
    """``data`` as UTF-8 text, a byte-order mark dropped; binary (NUL bytes) or non-UTF-8 data is a
    one-line ``error``, and so is empty data unless ``empty_ok`` (a ``--context`` may be empty:
    the prompt is then the question alone)."""
    if not empty_ok and not data.strip():
        raise error("empty file" if not data else "the file holds only white space", shown)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"not UTF-8 text (byte {e.start}); {flag} reads a UTF-8 text file", shown) from None
    if "\x00" in text:
        raise error(f"not a text file (it holds NUL bytes); {flag} reads a UTF-8 text file", shown)
    return text


def read_text(path: str | os.PathLike, flag: str, limit: int | None = None,
              error: type[HybridKVError] = UsageError, empty_ok: bool = False) -> str:
    """The UTF-8 text of ``path`` given to ``flag``: a regular file (checked before opening),
    at most ``limit`` bytes (default: the flag's :data:`LIMITS`), not binary, not empty unless ``empty_ok``."""
    return decode(read_bytes(path, flag, limit, error), os.fspath(path), flag, error, empty_ok)


def read_stream(stream: TextIO | None, flag: str, limit: int | None = None,
                error: type[HybridKVError] = UsageError, empty_ok: bool = False) -> str:
    """All of ``stream`` (``-``: standard input) as text, at most ``limit`` bytes, like :func:`read_text`."""
    limit = LIMITS.get(flag, 16 * MiB) if limit is None else limit
    stream = stream or sys.stdin
    raw = getattr(stream, "buffer", None)
    if raw is not None:
        data = raw.read(limit + 1)
    else:
        text = stream.read(limit + 1)
        data = text.encode("utf-8", "surrogatepass")
    if len(data) > limit:
        raise error(f"larger than the {human(limit)} a {flag} file may hold", "stdin")
    return decode(data, "stdin", flag, error, empty_ok)


def loads(text: str):
    """``json.loads`` whose every failure (bad syntax, a number of 5000 digits, nesting deep enough
    to exhaust the stack) is a ValueError with a short reason."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise ValueError(" ".join(str(e).split())[:120]) from None


def read_json(path: str | os.PathLike, flag: str, expected: str, limit: int | None = None,
              error: type[HybridKVError] = UsageError):
    """The JSON value of the text file ``path`` (see :func:`read_text`); not JSON is a one-line
    ``error`` saying what was ``expected``."""
    text = read_text(path, flag, limit, error)
    try:
        return loads(text)
    except ValueError as e:
        raise error(f"not JSON ({e}); expected {expected}", os.fspath(path)) from None


def check_output(path: str | os.PathLike, flag: str, folder: bool = False) -> None:
    """Refuse an output path that exists and is not a regular file (a directory too, unless
    ``folder``): writing to a FIFO would block, to a device would write nowhere a user can
    read back. A path that does not exist yet passes."""
    shown = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return  # not there yet (or not reachable: the write says why)
    kind = kind_of(mode)
    if kind is None or (folder and stat.S_ISDIR(mode)):
        return
    raise UsageError(f"is {kind}; {flag} writes a regular file{' or into a folder' if folder else ''}", shown)
