"""The body of ``POST /v1/chat/completions``, validated into a :class:`Chat`.

OpenAI's request fields are declared (strict types; an unknown field is refused, as OpenAI refuses
one), then read into what the engine answers: a conversation whose first user message holds the
media (its image / video parts) and the first question, then, as a chat goes on, the assistant's
answers and the user's next questions as text; the last message is the question answered. What
the engine cannot do is refused with a 400 naming the field, never silently ignored: tools,
media after the first message. ``presence_penalty`` / ``frequency_penalty`` lower the tokens an
answer has generated (greedy or sampled). ``n`` answers (at most :data:`MAX_CHOICES`) each decode a
copy of the one kept prefix; sampled, answer ``i`` draws with the seed + ``i``. ``logprobs`` / ``top_logprobs`` give each
answer token's log probability and its best alternatives. ``temperature`` above 0
samples (with ``top_p``), from ``seed`` or a seed drawn for the request; left out, it is 0: greedy,
as the CLI answers. A system (or developer) message may come first: it is rendered before the media, so it
is part of the kept prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridkv_cli.engine.sampling import MAX_PENALTY, MAX_TEMPERATURE, Sampling
from hybridkv_cli.serve.errors import ApiError, bad_request
from hybridkv_cli.serve.settings import ServeSettings

#: most answers one request may ask for (``n``): each decodes its own copy of the kept prefix
MAX_CHOICES = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class UrlRef(_Strict):
    url: str
    detail: str | None = None  # OpenAI's image detail hint: accepted, frames are sized by the server


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: UrlRef


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: UrlRef


Part = Annotated[Union[TextPart, ImagePart, VideoPart], Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Part], None] = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class MethodChoice(_Strict):
    method: str | None = None
    budget: float | None = None


class ChatBody(_Strict):
    model: str
    messages: list[Message]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stop: Union[str, list[str], None] = None
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    seed: int | None = Field(default=None, ge=-2**63, lt=2**64)  # a sampled answer's draws (greedy: no effect)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    user: str | None = None
    hybridkv: MethodChoice | None = None


@dataclass(frozen=True)
class Chat:
    """One request as the engine answers it."""

    question: str
    context: str | None  # a text-only request: the text the question is about
    history: tuple[tuple[str, str], ...]  # the conversation's earlier turns: (question, answer) each
    system: str | None  # the system prompt, before the media (None: the template's default)
    media: tuple[tuple[str, str], ...]  # ("image" | "video", url) in order
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: tuple[str, ...]
    method: str | None
    budget: float | None
    sampling: Sampling | None = None  # how its tokens are drawn (greedy at temperature 0; None: the server's)
    logprobs: int | None = None  # the answer tokens' log probabilities with this many alternatives (None: none)
    choices: int = 1  # answers to give (OpenAI's n), each over its own copy of the one kept prefix


def parse_chat(body, settings: ServeSettings) -> Chat:
    """``body`` (parsed JSON) as a :class:`Chat`, or an :class:`ApiError` (400; 404 for another model)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > settings.max_messages:
        raise bad_request(f"{len(messages)} messages; this server takes at most {settings.max_messages}", "messages")
    try:
        chat = ChatBody.model_validate(body)
    except ValidationError as e:
        raise _refusal(e) from None
    if chat.model != settings.model_id:
        raise ApiError(404, f"the model '{chat.model}' does not exist; this server serves '{settings.model_id}'",
                       param="model", code="model_not_found")
    system, first = _system(chat.messages)
    question, context, media, history = _conversation(chat.messages[first:], settings, first)
    stop = (chat.stop,) if isinstance(chat.stop, str) else tuple(chat.stop or ())
    if len(stop) > settings.max_stop or any(not s for s in stop):
        raise bad_request(f"stop: at most {settings.max_stop} non-empty strings", "stop")
    if chat.top_logprobs is not None and not chat.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if chat.max_tokens is not None and chat.max_completion_tokens is not None and \
            chat.max_tokens != chat.max_completion_tokens:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_tokens")
    choice = chat.hybridkv or MethodChoice()
    return Chat(question=question, context=context, history=history, system=system, media=media, stream=chat.stream,
                include_usage=bool(chat.stream_options and chat.stream_options.include_usage),
                max_tokens=chat.max_tokens or chat.max_completion_tokens, stop=stop, method=choice.method,
                budget=choice.budget,
                sampling=Sampling.of(chat.temperature or 0.0, 1.0 if chat.top_p is None else chat.top_p, chat.seed,
                                     chat.presence_penalty or 0.0, chat.frequency_penalty or 0.0),
                logprobs=(chat.top_logprobs or 0) if chat.logprobs else None, choices=chat.n or 1)


_BRANCHES = {"str", "int", "float", "bool", "none"}  # how pydantic names the branches of a union in a location
_TAGS = {"text", "image_url", "video_url"}  # the content parts' tags


def _refusal(error: ValidationError) -> ApiError:
    """The most specific problem of ``error`` (the deepest field: a union's other branches are
    less telling) as one line naming the field, e.g. ``messages[0].content[1].type``."""
    problem = max(error.errors(include_url=False), key=lambda e: len(e["loc"]))
    where, previous = "", None
    for part in problem["loc"]:
        if isinstance(part, int):
            where += f"[{part}]"
        elif isinstance(previous, int) and part in _TAGS:
            pass  # the tag of a content part, not a field
        elif part not in _BRANCHES and "[" not in part and not part[:1].isupper():
            where += f".{part}" if where else part
        previous = part
    if problem["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {where}", where, "unknown_parameter")
    return bad_request(f"{where}: {problem['msg']}", where or None)


def _system(messages: list[Message]) -> tuple[str | None, int]:
    """The system prompt (a first ``system`` or ``developer`` message, its text parts joined by line
    breaks) and where the conversation after it starts."""
    if not messages or messages[0].role not in ("system", "developer"):
        return None, 0
    parts = _parts(messages[0])
    if any(not isinstance(p, TextPart) for p in parts):
        raise bad_request("a system message is text", "messages[0].content")
    return "\n".join(p.text for p in parts), 1


def _conversation(messages: list[Message], settings: ServeSettings, first: int = 0):
    """``(question, context, media, history)``: the first user message's media (and, with none,
    its text context), the last message's question, and the turns between as (question, answer)
    pairs. Turns alternate user, assistant, ..., user; only the first message has media (its
    compressed prefix is what a conversation about it keeps). ``first``: the index of ``messages[0]``
    in the request (after a system message), for the fields errors name."""
    for i, m in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if m.role != expected or (i == len(messages) - 1 and m.role != "user"):
            roles = ", ".join(m.role for m in messages) or "none"
            raise bad_request(f"after an optional system message, turns alternate user, assistant, ..., user, the "
                              f"media in the first (got: {roles})", "messages")
    if not messages:
        raise bad_request("give a user message", "messages")
    where = lambda i: f"messages[{first + i}].content"  # noqa: E731
    parts = [_parts(m) for m in messages]
    media = tuple(("image", p.image_url.url) if isinstance(p, ImagePart) else ("video", p.video_url.url)
                  for p in parts[0] if not isinstance(p, TextPart))
    if any(kind == "video" for kind, _ in media) and len(media) > 1:
        raise bad_request("one video per request, and nothing else beside it (a video cannot be combined with other "
                          "media)", where(0))
    if len(media) > settings.max_media_parts:
        raise bad_request(f"{len(media)} media parts; at most {settings.max_media_parts}", where(0))
    for i, later in enumerate(parts[1:], 1):
        if any(not isinstance(p, TextPart) for p in later):
            raise bad_request("media only in the first user message (a conversation is about its media; ask about "
                              "other media in a new conversation)", where(i))
    texts = [[p.text for p in message if isinstance(p, TextPart)] for message in parts]
    context = None
    if not media:
        if len(texts[0]) < 2:
            raise bad_request("give an image_url or video_url part, or (a text-only request) the text as the first "
                              "text part(s) and the question as the last", where(0))
        context, texts[0] = "\n\n".join(texts[0][:-1]), texts[0][-1:]
    said = ["\n".join(t.strip() for t in message if t.strip()) for message in texts]
    for i in range(0, len(said), 2):
        if not said[i]:
            raise bad_request("the question (the message's text) is empty", where(i))
    history = tuple(zip(said[0:-1:2], said[1:-1:2]))
    return said[-1], context, media, history


def _parts(message: Message) -> list:
    """A message's content as parts (a string is one text part); no content is refused."""
    if message.content is None:
        raise bad_request(f"a message ({message.role}) without content (tool calls are not served)", "messages")
    return [TextPart(type="text", text=message.content)] if isinstance(message.content, str) else list(message.content)
