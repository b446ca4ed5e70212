"""What a server is allowed to do: the limits every request is held to, set once at start."""

from __future__ import annotations

import os
from dataclasses import dataclass

MiB = 2**20

#: the server's threads that run torch operations at once: the decode loop, the prefill, the media decoding
COMPUTING_THREADS = 3


@dataclass(frozen=True)
class ServeSettings:
    """The server's limits (``hybridkv serve`` flags; docs/serve.md)."""

    model_id: str  # the name clients pass as "model" (--served-model-name, else the --model given)
    allowed_media_dir: str | None = None  # local media only under this directory (None: no local files)
    api_key: str | None = None  # required as "Authorization: Bearer KEY" (None: no key)
    max_body_bytes: int = 64 * MiB  # a request body beyond this: 413
    body_timeout_s: float = 120.0  # a body not all here by then: 408 (a client sending slowly holds nothing longer)
    max_media_bytes: int = 256 * MiB  # the media of one request, decoded, together
    max_messages: int = 64
    max_media_parts: int = 256  # images of one image set (runs/guards.py warns beyond 256 too)
    max_stop: int = 4  # stop strings of one request (OpenAI's limit)
    max_batch: int = 16  # requests decoded together
    queue_size: int = 64  # requests waiting for the worker; beyond: 503 with Retry-After
    prefix_cache_bytes: int = 1024 * MiB  # compressed prefixes kept (device + host bytes)
    prefix_cache_device_bytes: int = 256 * MiB  # of those, on the device (beyond: parked in host memory)
    prefix_cache_dir: str | None = None  # and written here as .hkv files, kept across restarts (None: memory only)
    prefix_cache_dir_bytes: int = 16 * 1024 * MiB  # the files' bytes in that folder


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the system tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def intra_op_threads(requested: int | None, cores: int, env_set: bool) -> int | None:
    """Torch's intra-op threads for a server: ``requested`` (--threads); else None when
    ``$OMP_NUM_THREADS`` is set (torch has read it); else the ``cores`` shared out among the
    :data:`COMPUTING_THREADS`, at least one each. Each of them runs its operations on a team of
    that many threads, so more would outnumber the cores and every small operation would wait
    for a thread that is not running (on 2 cores, 2 threads a team: ~0.6x the answers/s of 1)."""
    if requested is not None:
        return requested
    return None if env_set else max(1, cores // COMPUTING_THREADS)
