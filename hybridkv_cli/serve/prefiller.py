"""The prefixes of requests that missed the cache, made beside the decoding, in two stages.

A request whose compressed prefix is not ready comes here from the decode loop. The *media* thread
decodes its media and builds its prompt (PyAV, the processor: work of the CPU, outside the model);
the *prefill* thread finds the prefix kept meanwhile, copies a parked one back to the device
(``prefix_cache_tier: "host"``), reads its file (``"disk"``), or runs the vision encoder, the
prefill and the compression on the prompt the media thread built. So while one video is prefilled
the next is already decoded. A request for media whose prompt the media thread has built and whose
prefix is not made yet is not decoded again: it waits behind it and finds the prefix made (one
prefill per media however many ask at once). The request then goes back to the worker's queue, with
its prefix or the error that stopped it.
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
        self.misses: queue.Queue = queue.Queue()  # from the decode loop
        self.prompts: queue.Queue = queue.Queue(PROMPTS_AHEAD)  # prompts built, for the prefill thread
        self._building: set[str] = set()  # keys whose prompt is built and whose prefix is not made yet
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._load, name="hybridkv-media", daemon=True),
                         threading.Thread(target=self._prefill, name="hybridkv-prefill", daemon=True)]

    @property
    def waiting(self) -> int:
        return self.misses.qsize() + self.prompts.qsize()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float | None = None) -> None:
        for thread in self._threads:
            thread.join(timeout)

    def _next(self, source: queue.Queue):
        """The next request of ``source`` still wanted (None: none within half a second)."""
        try:
            ticket = source.get(timeout=0.5)
        except queue.Empty:
            return None
        if ticket.cancelled:  # its client left while it waited
            self.metrics.cancel()
            return None
        return ticket

    def _load(self) -> None:
        """The media thread: each miss's prompt built, unless its prefix is kept (in memory or in
        a file) or another request's prompt for the same media is on its way to the prefill."""
        while not self._stopping.is_set():
            ticket = self._next(self.misses)
            if ticket is None:
                continue
            kept = self.cache.get(ticket.key, count=False) is not None or (
                self.store is not None and self.store.path(ticket.key).is_file())
            with self._lock:
                wanted = not kept and ticket.key not in self._building
                if wanted:
                    self._building.add(ticket.key)
            if wanted:
                try:
                    ticket.prepared = self._prepare(ticket)
                except Exception as e:  # its answer is this error (the prefill thread hands it back)
                    ticket.failure = e
                    with self._lock:
                        self._building.discard(ticket.key)
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
                    finally:
                        if ticket.prepared is not None:
                            with self._lock:
                                self._building.discard(ticket.key)
                            ticket.prepared = None
                    self.done(ticket)

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
