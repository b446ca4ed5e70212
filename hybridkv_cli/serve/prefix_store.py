"""Compressed prefixes on disk (``--prefix-cache-dir``): the prefix cache's second tier, kept
across restarts.

Every prefix the server makes is also written, by a thread of its own (the prefill thread goes on
to the next request), as ``<key>.hkv`` in the folder -- the ``.hkv`` format of ``hybridkv
compress``, which names no code and is checked on load (format and library version, model, dtype,
checksum, the state against the model's geometry). A request whose prefix is not in memory looks
here before it prefills: a file is read only when it is a regular file (not a link) named by a key,
within the folder's cap, written with the request's method and options; a file that fails a check
is removed and the prefix made again. The folder is bounded by bytes: the least recently used
files (by their modification time, touched on each read) go first. One server uses a folder at a
time: it holds a lock on ``.lock`` in it while it runs (another is refused at start).
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import re
import stat
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from hybridkv_cli.engine import hkv
from hybridkv_cli.io.errors import UsageError

log = logging.getLogger("hybridkv.serve")

_NAME = re.compile(r"([0-9a-f]{64})" + re.escape(hkv.SUFFIX))
#: prefixes waiting to be written; beyond this the newest is not written (the disk is behind)
PENDING = 8


class PrefixStore:
    """A folder of ``.hkv`` prefixes bounded by bytes (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, capacity: int, loaded):
        self.folder, self.capacity, self.loaded = Path(folder), capacity, loaded
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self.bytes = 0
        self.reads = self.writes = self.refused = self.evictions = 0
        self._pending: queue.Queue = queue.Queue(PENDING)
        self._writer = threading.Thread(target=self._write_pending, name="hybridkv-prefix-store", daemon=True)
        try:
            self._lock_fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:  # a link or no write access
            raise UsageError(f"cannot lock {self.folder / '.lock'} ({e.strerror})", "--prefix-cache-dir") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise UsageError(f"{folder} is in use by another hybridkv serve (one server per folder)",
                             "--prefix-cache-dir") from None
        found = []
        for entry in os.scandir(self.folder):  # what an earlier run kept, oldest use first
            name = _NAME.fullmatch(entry.name)
            if name and entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                found.append((info.st_mtime, name.group(1), info.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self.bytes += size
        with self._lock:
            self._evict()

    def __len__(self) -> int:
        return len(self._sizes)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{hkv.SUFFIX}"

    # --- reads (the prefill thread) -------------------------------------------------------------
    def load(self, key: str, policy, system: str | None = None):
        """The prefix kept under ``key`` for ``policy`` and ``system`` prompt, or None (not kept, or
        refused and removed)."""
        with self._lock:
            if key not in self._sizes:
                return None
        path = self.path(key)
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_size > self.capacity:
                raise hkv.CacheFileError("not a regular file within --prefix-cache-dir-bytes", str(path))
            if not hkv.matches(hkv.read_header(path), self.loaded, policy, system):
                raise hkv.CacheFileError("written by another version, model, dtype, method, options or system "
                                         "prompt", str(path))
            prefix = hkv.load(path, self.loaded)
            os.utime(path)  # its use, for the next start's order
        except (hkv.CacheFileError, OSError) as e:
            reason = e.reason if isinstance(e, hkv.CacheFileError) else e.strerror or type(e).__name__
            log.warning("prefix cache file %s refused (%s); its prefix is made again", path.name, reason)
            with self._lock:
                self.refused += 1
                self._remove(key)
            return None
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
            self.reads += 1
        return prefix

    # --- writes (the store's thread) ------------------------------------------------------------
    def start(self) -> None:
        self._writer.start()

    def keep(self, key: str, prefix) -> None:
        """Write ``prefix`` under ``key`` soon (not when the writes are behind)."""
        try:
            self._pending.put_nowait((key, prefix))
        except queue.Full:
            log.warning("prefix cache: %d prefixes wait to be written; one is kept in memory only", PENDING)

    def stop(self, timeout: float) -> None:
        """Write what waits, then stop (at most ``timeout`` seconds) and let the folder go."""
        if self._writer.is_alive():
            self._pending.put(None)
            self._writer.join(timeout)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the lock goes with it
            self._lock_fd = None

    def _write_pending(self) -> None:
        with torch.inference_mode():
            while (item := self._pending.get()) is not None:
                key, prefix = item
                try:
                    size = hkv.save(self.path(key), prefix, self.loaded)
                except Exception as e:  # a full or read-only disk: the prefix stays in memory
                    log.warning("prefix cache: writing %s failed (%s)", self.path(key).name, e)
                    continue
                with self._lock:
                    self.bytes -= self._sizes.pop(key, 0)
                    self._sizes[key] = size
                    self.bytes += size
                    self.writes += 1
                    self._evict()

    def _evict(self) -> None:
        """The least recently used files out until the rest fit the cap (the lock held)."""
        while self._sizes and self.bytes > self.capacity:
            self._remove(next(iter(self._sizes)))
            self.evictions += 1

    def _remove(self, key: str) -> None:
        self.bytes -= self._sizes.pop(key, 0)
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("prefix cache: removing %s failed (%s)", self.path(key).name, e.strerror)
