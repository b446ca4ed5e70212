"""``hybridkv serve``: an OpenAI-compatible HTTP server whose compressed prefixes outlive the
request (docs/serve.md)."""

from __future__ import annotations

import gc
from typing import Optional

import typer

from hybridkv_cli.commands.options import (ALL_OPTIONS, DEBUG, DEVICE, DTYPE, FPS, FRAMES, KV_MEMORY, MAX_PIXELS,
                                           QUIET, method_options, parse_size)
from hybridkv_cli.io.console import err, print_warning
from hybridkv_cli.io.errors import UsageError

SERVE_HELP = (
    "Serve MODEL over HTTP with OpenAI's chat completions API (POST /v1/chat/completions, GET /v1/models, "
    "GET /health, GET /metrics).\n\n"
    "A request is a user message: image_url / video_url parts (data: URLs; local files only under "
    "--allowed-media-dir; remote URLs are refused) and the question as text; a conversation goes on with the "
    "answers and further questions as text. The media is compressed once and kept (--prefix-cache-bytes, "
    "--prefix-cache-dir): a later question about the same media skips its decoding and prefill. Answers "
    "are greedy and equal `hybridkv ask MEDIA -Q QUESTION`'s. Requests decode together (--max-batch, "
    "--kv-memory). Per request: \"hybridkv\": {\"method\": ..., \"budget\": ...}. Needs the serve extra: "
    "pip install -e \".\\[serve]\". See docs/serve.md."
)


@method_options(ALL_OPTIONS)
def serve(
    model: str = typer.Option("Qwen/Qwen2.5-VL-7B-Instruct", help="Hub id, local directory, 'demo', 'smollm2', ... "
                              "(as for ask); clients name it as \"model\"."),
    served_model_name: Optional[str] = typer.Option(None, metavar="NAME", help="The name clients pass as \"model\" "
                                                    "(as vLLM's flag) [default: the --model given]."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (another than localhost: give --api-key)."),
    port: int = typer.Option(8000, min=1, max=65535, help="Port to listen on."),
    method: str = typer.Option("hybridkv", help="Compression method (see `hybridkv methods`); a request may choose "
                               "another."),
    frames: int = FRAMES, fps: Optional[float] = FPS, max_pixels: Optional[int] = MAX_PIXELS,
    max_new_tokens: int = typer.Option(128, min=1, help="Tokens a request generates when it gives no max_tokens "
                                       "(requests may ask up to the model's context)."),
    device: str = DEVICE, dtype: str = DTYPE,
    max_batch: int = typer.Option(16, min=1, max=1024, help="Requests decoded together (with --kv-memory: at "
                                  "most this many, as many as fit)."),
    kv_memory: Optional[str] = KV_MEMORY,
    queue_size: int = typer.Option(64, min=1, help="Requests waiting for the model; beyond: 503 with Retry-After."),
    allowed_media_dir: Optional[str] = typer.Option(None, metavar="DIR", help="Serve local media files (plain paths "
                                                    "or file:// URLs) under DIR only [default: none]."),
    api_key: Optional[str] = typer.Option(None, envvar="HYBRIDKV_API_KEY", help="Require 'Authorization: Bearer "
                                          "KEY' (also from $HYBRIDKV_API_KEY)."),
    prefix_cache_bytes: str = typer.Option("1GiB", metavar="SIZE", help="Compressed prefixes kept (device + host "
                                           "bytes), least recently used evicted first."),
    prefix_cache_device_bytes: str = typer.Option("256MiB", metavar="SIZE", help="Of those, the most on the "
                                                  "device; beyond it the least recently used move to host memory "
                                                  "and are copied back on their next question."),
    prefix_cache_dir: Optional[str] = typer.Option(None, metavar="DIR", help="Also write every compressed prefix "
                                                   "to DIR as a .hkv file, read back after an eviction or a restart "
                                                   "(created if missing) [default: memory only]."),
    prefix_cache_dir_bytes: str = typer.Option("16GiB", metavar="SIZE", help="Bytes of the files kept in "
                                               "--prefix-cache-dir, least recently used removed first."),
    max_body_bytes: str = typer.Option("64MiB", metavar="SIZE", help="Largest request body (413 beyond)."),
    body_timeout: float = typer.Option(120.0, min=0.001, metavar="SECONDS", help="Time a request body may take to "
                                       "arrive (408 after)."),
    max_media_bytes: str = typer.Option("256MiB", metavar="SIZE", help="Media bytes of one request, decoded."),
    max_messages: int = typer.Option(64, min=1, help="Messages of one request."),
    warm: bool = typer.Option(True, "--warm-up/--no-warm-up", help="Before the port opens, answer one small "
                                 "request about a clip made here, so that the first client's request does not pay "
                                 "the one-time set-up (the video library's, the processor's, the kernels')."),
    threads: Optional[int] = typer.Option(None, min=1, help="Torch intra-op threads of each of the server's "
                                          "three computing threads (decoding, prefill, media) [default: "
                                          "$OMP_NUM_THREADS if set, else the cores / 3, at least 1]."),
    quiet: bool = QUIET, debug: bool = DEBUG, options=None,
):
    import logging
    import os

    import torch

    from hybridkv_cli.engine import Limits
    from hybridkv_cli.runs.session import AskOptions, Session
    from hybridkv_cli.serve.settings import ServeSettings, intra_op_threads, usable_cores

    if allowed_media_dir is not None and not os.path.isdir(allowed_media_dir):
        raise UsageError("not a directory", "--allowed-media-dir")
    if prefix_cache_dir is not None:
        if os.path.lexists(prefix_cache_dir) and not os.path.isdir(prefix_cache_dir):
            raise UsageError("not a directory", "--prefix-cache-dir")
        try:
            os.makedirs(prefix_cache_dir, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot make the folder ({e.strerror})", "--prefix-cache-dir") from None
        if not os.access(prefix_cache_dir, os.R_OK | os.W_OK | os.X_OK):
            raise UsageError("not a folder this process can read and write", "--prefix-cache-dir")
    if served_model_name is not None and not served_model_name.strip():
        raise UsageError("the name is empty", "--served-model-name")
    if api_key is not None and not api_key.strip():
        raise UsageError("the key is empty", "--api-key")
    settings = ServeSettings(
        model_id=model if served_model_name is None else served_model_name, allowed_media_dir=allowed_media_dir,
        api_key=api_key,
        max_body_bytes=parse_size(max_body_bytes, "--max-body-bytes"), body_timeout_s=body_timeout,
        max_media_bytes=parse_size(max_media_bytes, "--max-media-bytes"), max_messages=max_messages,
        max_batch=max_batch, queue_size=queue_size,
        prefix_cache_bytes=parse_size(prefix_cache_bytes, "--prefix-cache-bytes"),
        prefix_cache_device_bytes=parse_size(prefix_cache_device_bytes, "--prefix-cache-device-bytes"),
        prefix_cache_dir=prefix_cache_dir,
        prefix_cache_dir_bytes=parse_size(prefix_cache_dir_bytes, "--prefix-cache-dir-bytes"))
    chosen = intra_op_threads(threads, usable_cores(), bool(os.environ.get("OMP_NUM_THREADS")))
    if chosen is not None:  # this process is the server's: the setting is its own
        torch.set_num_threads(chosen)
    limits = Limits(batch_size=max_batch, kv_memory=None if kv_memory is None else parse_size(kv_memory,
                                                                                              "--kv-memory"))
    try:
        import uvicorn

        from hybridkv_cli.serve.app import create_app
        from hybridkv_cli.serve.metrics import Metrics
        from hybridkv_cli.serve.warmup import warm_up
        from hybridkv_cli.serve.worker import Worker
    except ImportError as e:
        raise UsageError(f"needs the serve extra ({e.name} is missing): pip install -e \".[serve]\"",
                         "serve") from None
    session = Session(AskOptions(model=model, device=device, dtype=dtype, method=method, method_options=options,
                                 frames=frames, fps=fps, max_pixels=max_pixels, max_new_tokens=max_new_tokens,
                                 defer_question=True))  # refuses a bad method or option before the model loads
    session.model()  # loaded before the port opens: the first request does not wait for it
    # The CLI keeps libraries' log lines off stderr; a server's log is where its requests and the
    # tracebacks of its 500s go (uvicorn's level: --quiet warnings only, --debug everything).
    logging.disable(logging.NOTSET)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print_warning(f"listening on {host} without --api-key: anyone who can reach it can use the model")
    metrics = Metrics()
    worker = Worker(session, settings, limits, metrics)
    warmed = ""
    if warm:
        try:
            warmed = f"; warmed up in {warm_up(session, worker.policy(None, None)):.1f} s"
        except Exception as e:  # it still serves: a request that fails the same way gets its own error
            print_warning(f"the warm-up request failed ({e}); the first request pays the one-time set-up")
    app = create_app(worker, settings, metrics)
    # What start-up made (the model, the libraries, the warm-up: ~0.5M objects, all kept) leaves the
    # collector's scans: a full collection, which stops every thread, then takes ~5 ms, not ~190.
    gc.collect()
    gc.freeze()
    if not quiet:
        team = torch.get_num_threads()
        err.print(f"serving {model} as '{settings.model_id}' on http://{host}:{port}/v1 (max batch {max_batch}, "
                  f"{team} torch thread{'s' if team > 1 else ''} per computing thread{warmed}; Ctrl-C stops)",
                  highlight=False)
    # a stop waits at most 10 s for open streams before closing them
    uvicorn.run(app, host=host, port=port, log_level="debug" if debug else "warning" if quiet else "info",
                access_log=not quiet, timeout_graceful_shutdown=10)
    return 0
