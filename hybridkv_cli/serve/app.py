"""The routes: ``POST /v1/chat/completions`` (JSON or server-sent events), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``.

Every error is OpenAI's JSON shape with its status (:mod:`.errors`); nothing a handler raises
reaches a client as a traceback. The key (``--api-key``) is compared in constant time. A body is
read up to ``--max-body-bytes`` (413 beyond, told by its Content-Length before it is read) and
within ``--body-timeout`` seconds (408 after: a client that sends slowly holds nothing longer), then
parsed, validated and its media resolved (in a thread for a body over 256 KiB); the request then
waits for the worker's events, and a client that disconnects is cancelled. A stream's first chunk
carries the assistant's role with the first text.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from hybridkv_cli.serve.errors import ApiError, bad_request
from hybridkv_cli.serve.media_refs import resolve_all
from hybridkv_cli.serve.metrics import Metrics
from hybridkv_cli.serve.schema import parse_chat
from hybridkv_cli.serve.settings import ServeSettings
from hybridkv_cli.serve.worker import Ticket, Worker

#: a body up to this size is parsed, decoded and hashed on the event loop (well under a
#: millisecond: less than the hop to a thread); a larger one in a thread, not to stall the loop
INLINE_BODY_BYTES = 256 * 1024


def create_app(worker: Worker, settings: ServeSettings, metrics: Metrics) -> FastAPI:
    """The server's app around a worker (started with the app, stopped with it)."""

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await run_in_threadpool(worker.stop)

    app = FastAPI(title="hybridkv", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    started = int(time.time())

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        message = (f"no route {request.method} {request.url.path}" if error.status_code == 404 else
                   f"{request.method} is not allowed on {request.url.path}" if error.status_code == 405 else
                   str(error.detail))
        return error_response(ApiError(error.status_code, message, code="not_found" if error.status_code == 404
                                       else None, headers=dict(error.headers or {})))

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return error_response(ApiError(500, "internal server error (see the server's log)", type="server_error"))

    @app.get("/health")
    async def health():
        if not worker.alive:
            return error_response(ApiError(503, "the worker is not running", type="server_error"))
        return {"status": "ok", "model": settings.model_id, "queued": worker.waiting,
                "decoding": metrics.members}

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorize(request)
        return PlainTextResponse(metrics.render(worker.cache, worker.store, worker.waiting),
                                 media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": settings.model_id, "object": "model", "created": started, "owned_by": "hybridkv"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        authorize(request)
        if model != settings.model_id:
            raise ApiError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        status, gone = 500, None
        try:
            authorize(request)
            try:
                async with asyncio.timeout(settings.body_timeout_s):
                    body = await read_body(request, settings.max_body_bytes)
            except TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {settings.body_timeout_s:g} s "
                               "(--body-timeout)", code="request_timeout") from None
            loop = asyncio.get_running_loop()
            ticket = (make_ticket(body, loop) if len(body) <= INLINE_BODY_BYTES else
                      await run_in_threadpool(lambda: make_ticket(body, loop)))
            worker.submit(ticket)
            gone = asyncio.ensure_future(disconnected(request))
            first = await next_event(ticket, gone)
            if first is None:  # the client left before anything was answered
                status = 499
                return Response(status_code=499)
            if first[0] == "error":
                raise first[1]
            # a stream's response watches its client itself (and ends the stream when it leaves)
            response = streamed(ticket, first) if ticket.chat.stream else await completed(ticket, first, gone)
            status = response.status_code
            return response
        except ApiError as e:
            status = e.status
            return error_response(e)
        finally:
            if gone is not None:
                gone.cancel()
            metrics.request(status)

    def make_ticket(body: bytes, loop) -> Ticket:
        try:
            parsed = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise bad_request(f"the body is not valid JSON ({type(e).__name__})", code="invalid_json") from None
        chat = parse_chat(parsed, settings)
        return worker.ticket(chat, resolve_all(chat.media, settings), loop)

    async def completed(ticket: Ticket, event, gone: asyncio.Future) -> Response:
        while event is not None and event[0] in ("delta", "end"):
            event = await next_event(ticket, gone)
        if event is None:
            return Response(status_code=499)
        kind, data = event
        if kind == "error":
            raise data
        choices = [{"index": i, "message": {"role": "assistant", "content": r["text"], "refusal": None},
                    "finish_reason": r["finish_reason"], "logprobs": r["logprobs"]} for i, r in enumerate(data["choices"])]
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                             "created": int(time.time()), "model": settings.model_id, "choices": choices,
                             "usage": data["usage"], "hybridkv": data["hybridkv"]})

    def streamed(ticket: Ticket, first) -> StreamingResponse:
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int | None, delta: dict, reason: str | None = None, logprobs: dict | None = None,
                  **extra) -> str:
            choices = [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}] \
                if index is not None else []
            body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": settings.model_id,
                    "choices": choices, **extra}
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            started = set()  # the answers whose first chunk (with the role) has gone

            def text(index: int, content: str, logprobs: dict | None = None) -> str:
                role = {} if index in started else {"role": "assistant"}
                started.add(index)
                return chunk(index, {**role, "content": content}, None, logprobs)

            def ending(index: int, result: dict, **extra):
                if result["delta"] or index not in started:
                    yield text(index, result["delta"])
                # the log probabilities of its tokens after the text streamed so far, on the chunk that ends it
                yield chunk(index, {}, result["finish_reason"], result["logprobs"], **extra)

            try:
                kind, data = first
                while True:
                    if kind == "delta":
                        yield text(*data)
                    elif kind == "end":
                        for part in ending(*data):
                            yield part
                    elif kind == "done":
                        last = data["last"]
                        for part in ending(last, data["choices"][last], hybridkv=data["hybridkv"]):
                            yield part
                        if ticket.chat.include_usage:
                            yield chunk(None, {}, usage=data["usage"])
                        break
                    else:  # an error after the response began: the stream's last event says so
                        yield f"data: {json.dumps(data.body())}\n\n"
                        break
                    kind, data = await ticket.events.get()
                yield "data: [DONE]\n\n"
            finally:  # done, or the client went away (the stream is cancelled): stop decoding it
                ticket.cancelled = True

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes (413: refused from its Content-Length, or when it grows past it)."""
    too_large = ApiError(413, f"the request body is over the server's limit of {limit} bytes (--max-body-bytes)",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_large if declared.isdigit() else bad_request("bad Content-Length header")
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        chunks.append(part)
    return b"".join(chunks)


async def disconnected(request: Request) -> None:
    """Returns when the client of ``request`` (its body read) disconnects: the server's next
    message on the connection is then ``http.disconnect``. One wait a request, not a poll."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except OSError:  # the connection failed some other way: gone all the same
        return


async def next_event(ticket: Ticket, gone: asyncio.Future):
    """The ticket's next event, or None (the ticket cancelled) when its client disconnects first
    (``gone``: :func:`disconnected` of its request)."""
    getter = asyncio.ensure_future(ticket.events.get())
    try:
        await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        ticket.cancelled = True
        return None
    finally:
        if not getter.done():
            getter.cancel()
