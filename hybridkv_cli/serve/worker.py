"""The decode loop of the server: requests in, answers out.

Requests wait in a bounded queue (full: 503 with Retry-After). The worker thread runs the engine's
one decode loop (:func:`hybridkv_cli.engine.decode`) over that queue as a live source: while
requests are decoding it admits whatever is waiting, up to ``--max-batch`` members (and
``--kv-memory``), and they decode together in one batch step (continuous batching); when nothing
decodes it sleeps on the queue. A request whose compressed prefix is in the
:class:`~.prefix_cache.PrefixCache` becomes a job at once; one whose prefix is not goes to the
:class:`~.prefiller.Prefiller`, whose threads decode its media and make its prefix (or copy a
parked one back to the device, or read its file) beside the decoding, and put the request back
in the queue; requests for the same uncached media prefill it once. A request's question is
then its job's suffix, read through a copy of that prefix -- exactly what ``hybridkv ask MEDIA
-Q QUESTION`` does, so the answers are the same. (The decode loop and the prefill share the
model: the decode loop passes its positions, so the prefill's own mRoPE state is the prefill's.)

After every batch step the worker hands each streaming request its new text and stops members
whose client has gone or whose stop string appeared (their KV freed at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass, field

from hybridkv_cli.compression import MethodOptions, Policy
from hybridkv_cli.compression.cache import policy_attention
from hybridkv_cli.engine import Job, Limits, decode
from hybridkv_cli.engine.admission import Admission
from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.models.prompt import checked_system
from hybridkv_cli.runs.guards import failure
from hybridkv_cli.runs.requests import Request
from hybridkv_cli.runs.session import Session
from hybridkv_cli.serve.answer_text import AnswerText
from hybridkv_cli.serve.errors import ApiError, bad_request, from_error
from hybridkv_cli.serve.media_refs import MediaRef
from hybridkv_cli.serve.metrics import Metrics
from hybridkv_cli.serve.prefix_cache import PrefixCache, prefix_key
from hybridkv_cli.serve.prefiller import Prefiller, drained
from hybridkv_cli.serve.prefix_store import PrefixStore
from hybridkv_cli.serve.response_info import covering, hybridkv_info, logprobs, usage
from hybridkv_cli.serve.schema import Chat
from hybridkv_cli.serve.settings import ServeSettings

log = logging.getLogger("hybridkv.serve")


@dataclass(eq=False)
class Ticket:
    """One request on its way through the worker; events go back to the request's event loop:
    ``("delta", (index, text, logprobs))`` of its answers (``n`` of them, OpenAI's choices), ``("end",
    (index, result))`` as each but the last ends, then ``("done", summary)`` or ``("error",
    ApiError)``."""

    chat: Chat
    refs: list[MediaRef]
    policy: Policy
    key: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client went away: dropped at the next step
    cache_hit: bool | None = None
    tier: str = "memory"  # where a hit found its prefix: ready ("memory"), parked ("host"), a file ("disk")
    prefix: object = None  # its compressed prefix, once the prefill thread made it (or found it made)
    prepared: object = None  # its prompt, built by the media thread for the prefill thread
    failure: BaseException | None = None  # why its prefix could not be made
    waiters: list | None = None  # requests for the same media waiting for the prefix this one makes
    results: list = field(default_factory=list)  # each answer's result as it ends (None: decoding)
    failed: bool = False  # an answer failed: the request's error is sent, its other answers stop

    @property
    def stopped(self) -> bool:
        return self.cancelled or self.failed

    def send(self, kind: str, data) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, data))
        except RuntimeError:  # the request's loop is closed: nobody is listening
            self.cancelled = True


@dataclass(eq=False)
class Answer:
    """Answer ``index`` of a ticket's ``n``: the tag of its decode job."""

    ticket: Ticket
    index: int
    text: AnswerText
    given: int = 0  # its tokens whose log probabilities went out with the text streamed so far


class Worker:
    """The model's owner (see the module docstring)."""

    def __init__(self, session: Session, settings: ServeSettings, limits: Limits, metrics: Metrics):
        self.session, self.settings, self.limits, self.metrics = session, settings, limits, metrics
        self.cache = PrefixCache(settings.prefix_cache_bytes, settings.prefix_cache_device_bytes)
        self.store = None if settings.prefix_cache_dir is None else PrefixStore(
            settings.prefix_cache_dir, settings.prefix_cache_dir_bytes, session.model())
        self.queue: queue.Queue = queue.Queue()  # requests for the decode loop (bounded by submit)
        self.admission = Admission(limits)  # the engine's: who waits, made, for room in the batch
        self.active = 0  # jobs taken from the queue whose outcome has not come yet
        self.inflight: set[Ticket] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridkv-worker", daemon=True)
        self.prefiller = Prefiller(session, self.cache, self.store, metrics, self.queue.put, self._stopping)
        generation = session.model().model.generation_config.eos_token_id
        self.eos = set() if generation is None else {generation} if isinstance(generation, int) else set(generation)

    # --- the request side -------------------------------------------------------------------
    def policy(self, method: str | None, budget: float | None) -> Policy:
        """The policy of a request's ``hybridkv`` choice: the server's method and options, the
        request's method (then with none of the server's other options) and budget; refused with
        the CLI's own checks."""
        o = self.session.options
        name = method or o.method
        options = o.method_options if name == o.method else MethodOptions()
        if budget is not None:
            options = dataclasses.replace(options, budget=budget)
        try:
            return options.policy(name)
        except UsageError as e:  # named by its flag (--budget): the request's field is hybridkv.budget
            field_name = (e.source or "").lstrip("-").replace("-", "_")
            raise bad_request(e.reason, f"hybridkv.{field_name}" if field_name else "hybridkv") from None

    def ticket(self, chat: Chat, refs: list[MediaRef], loop) -> Ticket:
        """A request made ready for the queue: its policy and its prefix's key. A ``max_tokens``
        that alone fills the model's context is refused here, before its media is decoded (one
        that does not fit beside the prompt is refused when the prompt's length is known)."""
        limit = self.session.model().context_limit
        if chat.max_tokens and limit and chat.max_tokens >= limit:
            raise bad_request(f"max_tokens {chat.max_tokens} does not fit the model's context of {limit} tokens",
                              "max_tokens", "context_length_exceeded")
        policy = self.policy(chat.method, chat.budget)
        try:
            checked_system(self.session.model().tokenizer, chat.system)
        except UsageError as e:
            raise bad_request(e.reason, "messages[0].content") from None
        o = self.session.options
        options = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
        key = prefix_key(o.model, policy.name, options, {"frames": o.frames, "fps": o.fps, "max_pixels": o.max_pixels,
                                                         "dtype": o.dtype, "device": o.device},
                         [(r.kind, r.digest) for r in refs], chat.context, chat.system)
        return Ticket(chat, refs, policy, key, loop)

    def submit(self, ticket: Ticket) -> None:
        if not self.alive:
            raise ApiError(503, "the server is stopping", type="server_error", code="unavailable")
        if self.waiting >= self.settings.queue_size:
            raise ApiError(503, f"the server is busy ({self.settings.queue_size} requests waiting); retry later",
                           type="server_error", code="queue_full", headers={"Retry-After": "1"})
        self.queue.put_nowait(ticket)

    @property
    def waiting(self) -> int:
        """Requests waiting: for the decode loop, for their prefill, and made but not yet admitted
        to the batch (--kv-memory)."""
        return self.queue.qsize() + self.prefiller.waiting + len(self.admission.waiting)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def start(self) -> None:
        self._thread.start()
        self.prefiller.start()
        if self.store is not None:
            self.store.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self.prefiller.join(timeout)
        self._thread.join(timeout)
        if self.store is not None:  # the prefixes made last are written before the process ends
            self.store.stop(timeout)

    # --- the worker thread --------------------------------------------------------------------
    def _run(self) -> None:
        model = lambda: self.session.model().model
        with policy_attention(model()):  # held while serving: no step, question pass or prefill switches the model
            self._serve(model)
            self.prefiller.join()  # its last request is back in the queue
        for ticket in list(self.inflight) + drained(self.queue) + self.prefiller.left():
            ticket.send("error", ApiError(503, "the server is stopping", type="server_error", code="unavailable"))

    def _serve(self, model) -> None:
        while not self._stopping.is_set():
            try:
                for outcome in decode(model, self._source(), max_new_tokens=self.session.options.max_new_tokens,
                                      limits=self.limits, watch=self._watch, admission=self.admission):
                    self.active -= 1
                    try:
                        self._finish(outcome)
                    except Exception:  # this answer's record or text failed: its request alone gets a 500
                        log.exception("answering a request failed")
                        self._fail(outcome.job.tag.ticket, from_error(RuntimeError()))
            except Exception:  # a bug in the loop: fail what was in flight and go on serving
                log.exception("the decode loop failed; its requests get a 500")
                for ticket in self.inflight:
                    ticket.send("error", from_error(RuntimeError()))
                self.inflight.clear()
                self.admission.waiting.clear()
                self.active = 0

    def _source(self):
        """The decode loop's jobs: whatever is waiting, None when nothing is (a step goes on), and
        a blocking wait when nothing decodes."""
        while not self._stopping.is_set():
            try:
                ticket = self.queue.get(timeout=0.5) if self.active == 0 else self.queue.get_nowait()
            except queue.Empty:
                if self.active:
                    yield None
                continue
            if ticket.cancelled:  # its client left while it waited
                self.metrics.cancel()
                continue
            if ticket.prefix is None and ticket.failure is None:
                ticket.prefix = self.cache.get(ticket.key, count=False)
                if ticket.prefix is None or ticket.prefix.parked:  # made or copied back beside the decoding
                    ticket.prefix = None
                    self.prefiller.submit(ticket)
                    continue
                self.cache.count(hit=True)
                ticket.cache_hit = True
            self.active += ticket.chat.choices
            self.inflight.add(ticket)
            ticket.results = [None] * ticket.chat.choices
            for index in range(ticket.chat.choices):  # each a job over its own copy of the one prefix
                answer = Answer(ticket, index, AnswerText(self._decode, ticket.chat.stop))
                yield answer, lambda answer=answer: self._job(answer)

    def _job(self, answer: Answer) -> Job:
        ticket = answer.ticket
        chat = ticket.chat
        if ticket.failure is not None:
            raise ticket.failure
        prefix = ticket.prefix
        ticket.refs = []  # decoded: the bytes can go
        sampling = chat.sampling.nth(answer.index) if chat.sampling else None
        request = Request(ticket, (chat.question,), prefix=prefix, max_new_tokens=chat.max_tokens, label="request",
                          history=chat.history, sampling=sampling, logprobs=chat.logprobs)
        return self.session.question_job(prefix, request, 0, tag=answer)

    def _decode(self, ids: list[int]) -> str:
        return self.session.model().tokenizer.decode(ids, skip_special_tokens=True)

    def _watch(self, members) -> list:
        """After a step: new text to streaming clients; the members to stop (client gone, stop string)."""
        stop = []
        for m in members:
            answer = m.job.tag
            ticket = answer.ticket
            if ticket.stopped:
                stop.append(m)
                if ticket.cancelled:
                    self.metrics.cancel()
            elif ticket.chat.stream or ticket.chat.stop:
                delta = answer.text.update(m.tokens)
                if delta and ticket.chat.stream:
                    ticket.send("delta", (answer.index, delta, self._given(answer, m.tokens, m.logprobs)))
                if answer.text.stopped:
                    stop.append(m)
        self.metrics.decoding(len(members) - len(stop), sum(m.bytes for m in members if m not in stop))
        return stop

    def _finish(self, outcome) -> None:
        answer: Answer = outcome.job.tag
        ticket = answer.ticket
        if self.active == 0:
            self.metrics.decoding(0, 0)
        if ticket.stopped:  # stopped early: its tokens still count as generated
            if outcome.generation is not None:
                self.metrics.answered(0, len(outcome.generation.tokens))
            self._ended(ticket, answer.index)
            return
        if outcome.error is not None:
            error = from_error(failure("request", outcome.error))
            if error.status == 500:  # not one of the package's one-line errors: the log keeps its traceback
                log.error("request failed", exc_info=outcome.error)
            self._fail(ticket, error)
            return
        job, run = outcome.job, outcome.generation
        prefix = job.prefix
        # as ask -Q makes it; the response's hybridkv field is answer 0's (the others' would be dropped)
        record = self.session.record(outcome) if answer.index == 0 else None
        text = answer.text
        delta = text.finish(run.tokens)
        limit = job.max_new_tokens or self.session.options.max_new_tokens
        ended = bool(run.tokens) and run.tokens[-1] in self.eos
        reason = "length" if not text.stopped and not ended and len(run.tokens) >= limit else "stop"
        prompt_tokens = prefix.seen + len(job.suffix)
        self.metrics.answered(0 if answer.index else prompt_tokens, len(run.tokens))
        probs = self._given(answer, run.tokens, run.logprobs, final=True)
        ticket.results[answer.index] = {"text": text.sent, "delta": delta, "finish_reason": reason, "logprobs": probs,
                                        "tokens": len(run.tokens), "record": record}
        if not self._ended(ticket, answer.index):
            ticket.send("end", (answer.index, ticket.results[answer.index]))
            return
        first = ticket.results[0]["record"]
        ticket.send("done", {"choices": ticket.results, "last": answer.index,
                             "usage": usage(prompt_tokens, sum(r["tokens"] for r in ticket.results),
                                            prefix.seen if ticket.cache_hit else 0),
                             "hybridkv": hybridkv_info(first, ticket.cache_hit, ticket.tier, prefix.prefill_s)})

    def _given(self, answer: Answer, tokens: list[int], entries: list | None, final: bool = False) -> dict | None:
        """The log probabilities (``entries``, None: not asked for) of ``answer``'s tokens that
        its text given out so far covers and that have not gone out yet, counted as given (None
        when there are none, but at the ``final`` text)."""
        if entries is None:
            return None
        tokenizer = self.session.model().tokenizer
        start, answer.given = answer.given, covering(tokenizer, tokens, answer.text.sent, answer.given)
        if start == answer.given and not final:
            return None
        return logprobs(tokenizer, tokens[start:answer.given], entries[start:answer.given])

    def _ended(self, ticket: Ticket, index: int) -> bool:
        """Answer ``index`` of ``ticket`` has ended; whether it was the last (the ticket leaves)."""
        if ticket.results[index] is None:
            ticket.results[index] = {}
        if any(r is None for r in ticket.results):
            return False
        self.inflight.discard(ticket)
        return True

    def _fail(self, ticket: Ticket, error: ApiError) -> None:
        """``ticket``'s error, sent once; its other answers stop at the next step."""
        if not ticket.failed:
            ticket.failed = True
            ticket.send("error", error)
        self.inflight.discard(ticket)
