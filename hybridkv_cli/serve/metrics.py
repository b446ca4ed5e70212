"""The server's counters, and ``GET /metrics`` in Prometheus' text format (version 0.0.4)."""

from __future__ import annotations

import gc
import threading
import time
from collections import Counter, deque

#: tokens/s is measured over the last minute of finished answers
RATE_WINDOW_S = 60.0


class Metrics:
    """Counters updated by the request threads and the worker (one lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # HTTP status -> chat completion requests answered with it
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.kv_device_bytes = 0  # the decoding members' device KV (the worker's last step)
        self.kv_device_peak = 0  # the most of it at any step so far (under --kv-memory: never above it)
        self.members = 0
        self.cancelled = 0  # requests dropped because their client went away
        self._recent: deque = deque()  # (finished at, tokens)

    def request(self, status: int) -> None:
        with self._lock:
            self.requests[status] += 1

    def answered(self, prompt_tokens: int, tokens: int) -> None:
        at = time.monotonic()
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += tokens
            self._recent.append((at, tokens))

    def cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def decoding(self, members: int, device_bytes: int) -> None:
        with self._lock:
            self.members, self.kv_device_bytes = members, device_bytes
            self.kv_device_peak = max(self.kv_device_peak, device_bytes)

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(t for _, t in self._recent) / RATE_WINDOW_S

    def render(self, cache, store, queued: int) -> str:
        """Every metric as Prometheus text; ``cache``: the prefix cache, ``store``: its folder (or
        None), ``queued``: requests waiting."""
        rate = self.tokens_per_s()
        with self._lock:
            rows = [("hybridkv_requests_total", "counter", "chat completion requests by HTTP status",
                     [(f'{{status="{s}"}}', n) for s, n in sorted(self.requests.items())] or [("", 0)]),
                    ("hybridkv_generated_tokens_total", "counter", "tokens generated", [("", self.generated_tokens)]),
                    ("hybridkv_prompt_tokens_total", "counter", "prompt tokens of answered requests",
                     [("", self.prompt_tokens)]),
                    ("hybridkv_tokens_per_second", "gauge", f"tokens generated per second over the last "
                     f"{RATE_WINDOW_S:g} s", [("", round(rate, 3))]),
                    ("hybridkv_cancelled_total", "counter", "requests dropped because their client went away",
                     [("", self.cancelled)]),
                    ("hybridkv_prefix_cache_hits_total", "counter", "requests whose compressed prefix was cached",
                     [("", cache.hits)]),
                    ("hybridkv_prefix_cache_misses_total", "counter", "requests that prefilled their prefix",
                     [("", cache.misses)]),
                    ("hybridkv_prefix_cache_evictions_total", "counter", "prefixes evicted for room",
                     [("", cache.evictions)]),
                    ("hybridkv_prefix_cache_parks_total", "counter", "kept prefixes moved to host memory for the "
                     "device's room (--prefix-cache-device-bytes)", [("", cache.parks)]),
                    ("hybridkv_prefix_cache_host_hits_total", "counter", "requests whose prefix was copied back from "
                     "host memory", [("", cache.unparks)]),
                    ("hybridkv_prefix_cache_entries", "gauge", "compressed prefixes kept", [("", len(cache))]),
                    ("hybridkv_prefix_cache_bytes", "gauge", "device + host bytes of the kept prefixes",
                     [("", cache.bytes)]),
                    ("hybridkv_prefix_cache_device_bytes", "gauge", "device bytes of the kept prefixes",
                     [("", cache.device_bytes)]),
                    *([] if store is None else [
                        ("hybridkv_prefix_cache_disk_hits_total", "counter", "requests whose prefix was read from "
                         "--prefix-cache-dir", [("", store.reads)]),
                        ("hybridkv_prefix_cache_disk_writes_total", "counter", "prefixes written to --prefix-cache-dir",
                         [("", store.writes)]),
                        ("hybridkv_prefix_cache_disk_refused_total", "counter", "files in --prefix-cache-dir that "
                         "failed a check (removed)", [("", store.refused)]),
                        ("hybridkv_prefix_cache_disk_evictions_total", "counter", "files removed for room",
                         [("", store.evictions)]),
                        ("hybridkv_prefix_cache_disk_entries", "gauge", "prefixes in --prefix-cache-dir",
                         [("", len(store))]),
                        ("hybridkv_prefix_cache_disk_bytes", "gauge", "bytes of the files in --prefix-cache-dir",
                         [("", store.bytes)])]),
                    ("hybridkv_kv_device_bytes", "gauge", "device KV bytes in use: kept prefixes + decoding answers",
                     [("", cache.device_bytes + self.kv_device_bytes)]),
                    ("hybridkv_decoding_kv_device_bytes_peak", "gauge", "most device KV bytes of the decoding "
                     "answers at once so far (under --kv-memory, at most that)", [("", self.kv_device_peak)]),
                    ("hybridkv_decoding_requests", "gauge", "requests decoding now", [("", self.members)]),
                    ("hybridkv_queue_length", "gauge", "requests waiting for the worker", [("", queued)])]
        lines = []
        for name, kind, help_text, samples in rows + collector_rows():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{labels} {value}" for labels, value in samples]
        return "\n".join(lines) + "\n"


def collector_rows() -> list[tuple]:
    """The Python garbage collector's counts, under the names Prometheus' Python client gives them,
    and the objects frozen out of its scans at start-up."""
    stats = gc.get_stats()
    counts = [(f"python_gc_{name}_total", "counter", f"{what} in each generation",
               [(f'{{generation="{g}"}}', s[key]) for g, s in enumerate(stats)])
              for name, key, what in (("collections", "collections", "collections"),
                                      ("objects_collected", "collected", "objects collected"),
                                      ("objects_uncollectable", "uncollectable", "uncollectable objects found"))]
    frozen = ("hybridkv_gc_frozen_objects", "gauge", "objects made at start-up that the collector no longer scans",
              [("", gc.get_freeze_count())])
    return counts + [frozen]
