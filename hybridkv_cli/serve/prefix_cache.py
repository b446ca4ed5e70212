"""Compressed prefixes kept between requests: a later question about the same media skips its
decoding, the vision encoder, the prefill and the compression.

The key is a SHA-256 over everything a prefix depends on -- the model, the method and its options,
how media is sampled and sized, each media's kind and bytes, the system prompt, and (a text
prompt) the text before the question -- so equal keys are equal prefixes. The value is the engine's shared
:class:`~hybridkv_cli.engine.Prefix`; every question decodes a copy of it (``Prefix.take``), so
nothing of one answer reaches the next. Entries are evicted least recently used first, to keep
their device + host bytes within the cap; a prefix larger than the cap is not kept.

Two tiers in that memory: the device holds at most ``device_capacity`` bytes of kept prefixes
(beside the decoding answers' KV); beyond it the least recently used are *parked*
(:meth:`~hybridkv_cli.engine.Prefix.park`: their device state copied to pinned host memory, the
device's freed), and a hit on a parked prefix has it copied back (:meth:`unparked`) -- a copy over
the host link, not a prefill.

The worker thread gets; the prefill thread gets, puts and unparks (one thread: one copy at a
time); request threads read the metrics. One lock guards the entries and the counts; the copies
run outside it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict


def prefix_key(model: str, method: str, options: dict, sampling: dict, media_digests: list[tuple[str, str]],
               context: str | None, system: str | None = None) -> str:
    """The content hash of a prefix (see the module docstring)."""
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest() if text is not None else None  # noqa: E731
    what = {"model": model, "method": method, "options": options, "sampling": sampling, "media": media_digests,
            "context": digest(context), "system": digest(system)}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def prefix_bytes(prefix) -> int:
    return int(prefix.device_bytes) + int(prefix.host_bytes)


def on_device(prefix) -> int:
    """The bytes ``prefix`` holds on the device now (none once parked)."""
    return 0 if prefix.parked else int(prefix.device_bytes)


class PrefixCache:
    """An LRU of prefixes bounded by their bytes, the device's share of them by ``device_capacity``
    (see the module docstring)."""

    def __init__(self, capacity: int, device_capacity: int | None = None):
        self.capacity = capacity
        self.device_capacity = capacity if device_capacity is None else device_capacity
        self._entries: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
        self.parks = self.unparks = 0  # prefixes moved to host memory, and copied back for a hit
        self.bytes = self.device_bytes = 0

    def get(self, key: str, count: bool = True):
        """The prefix of ``key`` (now the most recently used), or None; counted as a hit or a miss
        (``count``; else the caller counts the request once it knows, :meth:`count`)."""
        with self._lock:
            prefix = self._entries.get(key)
            if prefix is not None:
                self._entries.move_to_end(key)
        if count:
            self.count(hit=prefix is not None)
        return prefix

    def count(self, hit: bool) -> None:
        """One request's lookup: a hit, or a miss (its prefix made for it)."""
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def put(self, key: str, prefix) -> bool:
        """Keep ``prefix`` under ``key``, evicting the least recently used to make room and parking
        the least recently used beyond the device's share; False when it alone is over the
        capacity (not kept)."""
        size = prefix_bytes(prefix)
        if size > self.capacity:
            return False
        with self._lock:
            if key in self._entries:
                self._drop(key)
            while self._entries and self.bytes + size > self.capacity:
                self._drop(next(iter(self._entries)))
                self.evictions += 1
            self._entries[key] = prefix
            self.bytes += size
            self.device_bytes += on_device(prefix)
        self._park_beyond_share()
        return True

    def unparked(self, key: str, parked):
        """``parked`` (the entry of ``key``) copied back to the device and kept so: the prefix a
        hit on it decodes from."""
        prefix = parked.unpark()
        with self._lock:
            self.unparks += 1
            if self._entries.get(key) is parked:
                self._entries[key] = prefix
                self.device_bytes += on_device(prefix)
        self._park_beyond_share()
        return prefix

    def _park_beyond_share(self) -> None:
        """Park the least recently used prefixes until the device holds at most its share (each
        copy outside the lock; an entry replaced meanwhile is left as it is)."""
        while True:
            with self._lock:
                if self.device_bytes <= self.device_capacity:
                    return
                key, prefix = next((k, p) for k, p in self._entries.items() if not p.parked)
                self.device_bytes -= on_device(prefix)  # claimed: no other thread parks it too
            parked = prefix.park()
            with self._lock:
                if self._entries.get(key) is prefix:
                    self._entries[key] = parked
                    self.parks += 1
                else:  # evicted or replaced meanwhile, and counted off again then: count it back
                    self.device_bytes += on_device(prefix)

    def _drop(self, key: str) -> None:
        prefix = self._entries.pop(key)
        self.bytes -= prefix_bytes(prefix)
        self.device_bytes -= on_device(prefix)

    def __len__(self) -> int:
        return len(self._entries)
