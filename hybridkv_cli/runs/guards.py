"""What a run checks around a generation: the prompt fits the model's context, a very large
prompt is warned about, and running out of memory becomes a one-line error."""

from __future__ import annotations

import gc
import re
import warnings

import torch

from hybridkv_cli.io.errors import ContextLengthError, MediaWarning, OutOfMemoryError, UsageError
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models.prompt import Prompt
from hybridkv_cli.models.streamed_video import DECODE_FRAMES


def failure(source: str, error: BaseException) -> BaseException:
    """A generation's error as the one-line error it is reported as (running out of memory
    named as such)."""
    if not is_oom(error):
        return error
    where = "device" if isinstance(error, torch.OutOfMemoryError) else "host"
    m = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]?i?B)", str(error))
    detail = f" (tried to allocate {m.group(1)})" if m else ""
    free_memory()
    return OutOfMemoryError(f"out of {where} memory{detail}; try a lower --budget, fewer --frames or a lower "
                            "--max-pixels", source)


def guarded(source: str, step, *args, **kwargs):
    """``step(*args, **kwargs)``, with running out of memory turned into :class:`OutOfMemoryError`."""
    failed = None
    try:
        return step(*args, **kwargs)
    except Exception as e:
        if not is_oom(e):
            raise
        # only its kind and message: the failed step's frames must go so its memory can be freed
        failed = (torch.OutOfMemoryError if isinstance(e, torch.OutOfMemoryError) else MemoryError)(str(e))
    raise failure(source, failed)


def check_new_tokens(max_new_tokens: int, limit: int | None) -> None:
    """``--max-new-tokens`` alone must leave room in the model's context (a usage error naming it)."""
    if limit and max_new_tokens >= limit:
        raise UsageError(f"{max_new_tokens} new tokens do not fit the model's context of {limit} tokens",
                         "--max-new-tokens")


def check_length(prompt: Prompt, limit: int | None, max_new_tokens: int, source: str) -> None:
    """Raise when the built prompt + ``max_new_tokens`` exceed the model's context ``limit``: a
    :class:`UsageError` when the question alone does, else :class:`ContextLengthError`."""
    if not limit:
        return
    check_new_tokens(max_new_tokens, limit)
    bulk, text = prompt.visual_tokens, prompt.text_tokens
    if text + max_new_tokens > limit:
        raise UsageError(f"the question is too long: {text} text tokens + {max_new_tokens} new tokens exceed the "
                         f"model's context of {limit} tokens", "QUESTION")
    if bulk + text + max_new_tokens > limit:
        fix = ("shorten the context" if prompt.role == "context"
               else "use fewer --frames (or --max-frames, a lower --fps), a lower --max-pixels")
        raise ContextLengthError(
            f"the prompt needs {bulk + text} tokens ({bulk} {prompt.role} + {text} text) + {max_new_tokens} new, "
            f"more than the model's context of {limit} tokens; {fix}, or a lower --max-new-tokens", source)


#: A prompt above either limit gets a warning: it may be far bigger than meant.
LARGE_SET_IMAGES = 256
LARGE_PROMPT_TOKENS = 16384


def warn_if_large(media: MediaInput, tokens: int) -> None:
    """One warning line when ``media`` is an image set of more than 256 images or its built prompt
    holds more than 16k visual ``tokens`` (a folder of 2000 thumbnails is one 8000-token prompt
    unless --each is given), naming the flags that make it smaller."""
    images = len(media.images) if media.kind == "images" else 0
    if images <= LARGE_SET_IMAGES and tokens <= LARGE_PROMPT_TOKENS:
        return
    if media.kind == "images":
        what = f"one image set of {images} images, {tokens} visual tokens"
        fix = "--each asks about every image separately, a lower --max-pixels makes each image smaller"
    else:  # --each splits only a set of files: a video is smaller with fewer frames or pixels
        what, fix = f"{tokens} visual tokens", "fewer --frames or a lower --max-pixels makes it smaller"
    warnings.warn(f"{media.label}: {what} in one prompt; {fix}", MediaWarning, stacklevel=3)


def host_memory_available() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_stream_memory(media: MediaInput, prompt, loaded, source: str) -> None:
    """Refuse (this input, exit 1), before any frame is decoded, a streamed video whose KV the host
    cannot hold: a streamed prefill keeps every layer's prompt KV in host memory until it is
    compressed."""
    if media.stream is None:
        return
    itemsize = torch.empty(0, dtype=loaded.model.dtype).element_size()
    need = 2 * prompt.length * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * itemsize
    need += media.stream.memory(DECODE_FRAMES).chunk
    have = host_memory_available()
    if have is not None and need > have:
        raise OutOfMemoryError(f"{media.frames_used} frames need {need / 2**30:.1f} GiB of host memory for "
                         f"their KV while prefilling, {have / 2**30:.1f} GiB is available; a lower --max-frames, "
                         "--fps or --max-pixels makes it smaller", source)


def is_oom(e: BaseException) -> bool:
    """torch's device OOM, Python's MemoryError, or torch's CPU allocator failing."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and re.search(r"can't allocate memory|not enough memory", str(e)) is not None)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
