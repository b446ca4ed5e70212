"""The prefixes of requests that missed the cache, made beside the decoding, in two stages.

A request whose compressed prefix is not ready comes here from the decode loop: the first for its
media *makes* the prefix, the next ones for the same media wait beside it, off both queues, and go
back with it the moment it is made (one prefill per media however many ask at once, and the misses
of other media never hold them up). The *media* thread decodes a maker's media and builds its
prompt (PyAV, the processor: work of the CPU, outside the model); the *prefill* thread finds the
prefix kept meanwhile, copies a parked one back to the device (``prefix_cache_tier: "host"``),
reads its file (``"disk"``), or runs the vision encoder, the prefill and the compression on the
prompt the media thread built. So while one video is prefilled the next is already decoded. Every
request goes back to the worker's queue with its prefix or the error that stopped it.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch

from hybridkv_cli.io.errors import HybridKVError
from hybridkv_cli.runs.session import TEMPLATE_QUESTION, Session

#: prompts built ahead of the prefill (each holds its media's pixels: the bound keeps them few)
PROMPTS_AHEAD = 2


class Prefiller:
    """The two threads (see the module docstring); ``done(ticket)`` hands a request back."""

    def __init__(self, session: Session, cache, store, metrics, done: Callable, stopping: threading.Event):
        self.session, self.cache, self.store, self.metrics, self.done = session, cache, store, metrics, done
        self._stopping = stopping
        self.misses: queue.Queue = queue.Queue()  # makers, from the decode loop
        self.prompts: queue.Queue = queue.Queue(PROMPTS_AHEAD)  # prompts built, for the prefill thread
        self._waiters: dict[str, list] = {}  # keys whose prefix a request is making -> the requests waiting for it
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._load, name="hybridkv-media", daemon=True),
                         threading.Thread(target=self._prefill, name="hybridkv-prefill", daemon=True)]

    @property
    def waiting(self) -> int:
        with self._lock:
            waiters = sum(map(len, self._waiters.values()))
        return self.misses.qsize() + self.prompts.qsize() + waiters

    def submit(self, ticket) -> None:
        """A request whose prefix is not ready: it makes the prefix, or waits for the request that does."""
        with self._lock:
            if ticket.key in self._waiters:
                self._waiters[ticket.key].append(ticket)
                return
            ticket.waiters = self._waiters[ticket.key] = []
        self.misses.put(ticket)

    def left(self) -> list:
        """The requests still here once the threads have stopped (the worker answers them as it stops)."""
        left = drained(self.misses) + drained(self.prompts)
        with self._lock:
            for waiters in self._waiters.values():
                left += waiters
            self._waiters.clear()
        return left

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float | None = None) -> None:
        for thread in self._threads:
            thread.join(timeout)

    def _next(self, source: queue.Queue):
        """The next request of ``source`` still wanted, by its client or by requests waiting for
        the prefix it makes (None: none within half a second)."""
        try:
            ticket = source.get(timeout=0.5)
        except queue.Empty:
            return None
        if not ticket.cancelled:
            return ticket
        with self._lock:  # its client left while it waited
            if ticket.waiters:
                return ticket
            del self._waiters[ticket.key]
        self.metrics.cancel()
        return None

    def _load(self) -> None:
        """The media thread: each maker's prompt built, unless its prefix is kept (in memory, parked
        or in a file: made or written since the worker looked)."""
        while not self._stopping.is_set():
            ticket = self._next(self.misses)
            if ticket is None:
                continue
            kept = self.cache.get(ticket.key, count=False) is not None or (
                self.store is not None and self.store.path(ticket.key).is_file())
            if not kept:
                try:
                    ticket.prepared = self._prepare(ticket)
                except Exception as e:  # its answer is this error (the prefill thread hands it back)
                    ticket.failure = e
                ticket.refs = []  # decoded: the bytes can go
            self._hand_on(ticket)

    def _hand_on(self, ticket) -> None:
        """``ticket`` to the prefill thread once it has room (stopping: back with the misses, which
        the worker answers as it stops)."""
        while not self._stopping.is_set():
            try:
                self.prompts.put(ticket, timeout=0.5)
                return
            except queue.Full:
                continue
        self.misses.put(ticket)

    def _prefill(self) -> None:
        """The prefill thread: each request's prefix found, copied back, read or made (once)."""
        with torch.inference_mode():
            while not self._stopping.is_set():
                ticket = self._next(self.prompts)
                if ticket is not None:
                    try:
                        self._make(ticket)
                    finally:  # the requests waiting for it are never left behind
                        ticket.prepared = None
                        self.done(ticket)
                        self._release(ticket)

    def _release(self, maker) -> None:
        """The requests that waited for ``maker``'s prefix, back with it (or with its error)."""
        with self._lock:
            del self._waiters[maker.key]
        for ticket in maker.waiters:
            ticket.prefix, ticket.failure, ticket.tier = maker.prefix, maker.failure, maker.tier
            ticket.cache_hit = maker.failure is None
            if ticket.cache_hit:
                self.cache.count(hit=True)
            self.done(ticket)
        maker.waiters = None

    def _make(self, ticket) -> None:
        if ticket.failure is not None:
            return
        ticket.prefix = self.cache.get(ticket.key, count=False)
        if ticket.prefix is not None and ticket.prefix.parked:
            ticket.prefix, ticket.tier = self.cache.unparked(ticket.key, ticket.prefix), "host"
        if ticket.prefix is None and self.store is not None:
            ticket.prefix = self.store.load(ticket.key, ticket.policy, ticket.chat.system)
            if ticket.prefix is not None:
                ticket.tier = "disk"
                self.cache.put(ticket.key, ticket.prefix)
        ticket.cache_hit = ticket.prefix is not None
        self.cache.count(hit=ticket.cache_hit)
        if ticket.prefix is not None:
            return
        try:  # built by the media thread, or here when a prefix it counted on was not made or was evicted
            prepared = ticket.prepared or self._prepare(ticket)
            ticket.prefix = self.session.compress_prepared(prepared, ticket.policy)
        except Exception as e:  # its answer is this error (see Worker._job)
            ticket.failure = e
            return
        self.cache.put(ticket.key, ticket.prefix)
        if self.store is not None:  # written beside the decoding, not before the answer
            self.store.keep(ticket.key, ticket.prefix)

    def _prepare(self, ticket):
        """The request's media decoded and its prompt built (with the question template), as
        ``ask -Q`` builds it; errors name what the client sent, not temporary files."""
        chat, refs = ticket.chat, ticket.refs
        if chat.context is not None:
            return self.session.prepare(None, TEMPLATE_QUESTION, context=chat.context, system=chat.system)
        label = refs[0].label if len(refs) == 1 else f"{refs[0].label} + {len(refs) - 1} more"
        with tempfile.TemporaryDirectory(prefix="hybridkv-serve-") as folder:  # the media loader reads files
            paths = []
            for i, ref in enumerate(refs):
                paths.append(os.path.join(folder, f"{i:04d}{ref.suffix}"))
                with open(paths[-1], "wb") as f:
                    f.write(ref.data)
            try:
                media = self.session.load_media(paths)
            except HybridKVError as e:
                for path, ref in zip(paths, refs):
                    e.reason = e.reason.replace(path, ref.label)
                raise
        # named by content, not by the temporary files (gone now)
        media = dataclasses.replace(media, origin=label, sources=tuple(Path(f"sha256-{r.digest}") for r in refs))
        return self.session.prepare(media, TEMPLATE_QUESTION, source=label, system=chat.system)


def drained(waiting: queue.Queue) -> list:
    """Everything ``waiting`` holds now, taken out."""
    left = []
    while True:
        try:
            left.append(waiting.get_nowait())
        except queue.Empty:
            return left
