"""A server's first request as fast as its next: one small request through the whole path
before the port opens.

The first video a process decodes, the first prompt its processor builds, the first prefill and
compression and the first question read pay costs paid once (the video library's and its
codec's set-up, the processor's lazy state, first allocations; on CUDA the libraries' handles and
the Triton kernels' compilation, seconds where its cache is cold). The server pays them at
startup with a clip it makes itself (:data:`FRAMES` gray frames of :data:`SIDE` pixels; a text
model: a short text), through the calls a request makes (media loader, prompt, prefill +
compression with the server's policy, question read, decoding) and keeps nothing of it: no
prefix cached, no request counted.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from hybridkv_cli.compression import Policy
from hybridkv_cli.engine import decode
from hybridkv_cli.runs.requests import Prepared, Request
from hybridkv_cli.runs.session import TEMPLATE_QUESTION, Session

FRAMES, SIDE = 64, 56  # the default --frames, at the fewest pixels a frame patch takes
QUESTION, NEW_TOKENS = "What is shown?", 2  # a question read, then a batch step
CONTEXT = "A gray square is shown for sixteen seconds."  # a text model's prompt


def warm_up(session: Session, policy: Policy) -> float:
    """Run one request about a clip made here (a text model: :data:`CONTEXT`) through ``session``
    with ``policy``; the seconds it took. Raises what the request would (the caller says so and
    serves anyway)."""
    start = time.perf_counter()
    prefix = session.compress_prepared(prompt(session), policy)
    job = session.question_job(prefix, Request(None, (QUESTION,), prefix=prefix, max_new_tokens=NEW_TOKENS), 0)
    for outcome in decode(lambda: session.model().model, [(None, lambda: job)], max_new_tokens=NEW_TOKENS):
        if outcome.error is not None:
            raise outcome.error
    return time.perf_counter() - start


def prompt(session: Session) -> Prepared:
    """The warm-up's prompt: about a clip written here, or for a text model about :data:`CONTEXT`."""
    if not session.model().multimodal:
        return session.prepare(None, TEMPLATE_QUESTION, context=CONTEXT, source="warm-up")
    with tempfile.TemporaryDirectory(prefix="hybridkv-warm-up-") as folder:
        path = os.path.join(folder, "warm-up.mp4")
        write_clip(path)
        media = session.load_media([path])
    return session.prepare(media, TEMPLATE_QUESTION, source="warm-up")


def write_clip(path: str) -> None:
    """:data:`FRAMES` gray frames as an MPEG-4 video (an encoder every build of the video library has)."""
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream("mpeg4", rate=FRAMES)
        stream.width = stream.height = SIDE
        stream.pix_fmt = "yuv420p"
        gray = av.VideoFrame.from_ndarray(np.full((SIDE, SIDE, 3), 128, dtype=np.uint8), format="rgb24")
        for _ in range(FRAMES):
            for packet in stream.encode(gray):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
