"""What a server is allowed to do: the limits every request is held to, set once at start."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20


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
