"""The body of ``POST /v1/chat/completions``, validated into a :class:`Chat`.

OpenAI's request fields are declared (strict types; an unknown field is refused, as OpenAI refuses
one), then read into what the engine answers: one user message whose image / video parts are the
media and whose text is the question. What the engine cannot do is refused with a 400 naming the
field, never silently ignored: sampling (only greedy decoding is served), several choices, log
probabilities, tools, other turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridkv_cli.serve.errors import ApiError, bad_request
from hybridkv_cli.serve.settings import ServeSettings


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
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None  # greedy decoding is deterministic: any seed gives the same answer
    user: str | None = None
    hybridkv: MethodChoice | None = None


@dataclass(frozen=True)
class Chat:
    """One request as the engine answers it."""

    question: str
    context: str | None  # a text-only request: the text the question is about
    media: tuple[tuple[str, str], ...]  # ("image" | "video", url) in order
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: tuple[str, ...]
    method: str | None
    budget: float | None


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
    _greedy_only(chat)
    question, context, media = _conversation(chat.messages, settings)
    stop = (chat.stop,) if isinstance(chat.stop, str) else tuple(chat.stop or ())
    if len(stop) > settings.max_stop or any(not s for s in stop):
        raise bad_request(f"stop: at most {settings.max_stop} non-empty strings", "stop")
    if chat.max_tokens is not None and chat.max_completion_tokens is not None and \
            chat.max_tokens != chat.max_completion_tokens:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_tokens")
    choice = chat.hybridkv or MethodChoice()
    return Chat(question=question, context=context, media=media, stream=chat.stream,
                include_usage=bool(chat.stream_options and chat.stream_options.include_usage),
                max_tokens=chat.max_tokens or chat.max_completion_tokens, stop=stop, method=choice.method,
                budget=choice.budget)


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


def _greedy_only(chat: ChatBody) -> None:
    """Only greedy decoding is served: a sampling parameter other than its greedy value is refused."""
    greedy = {"temperature": (chat.temperature, 0), "top_p": (chat.top_p, 1), "n": (chat.n, 1),
              "presence_penalty": (chat.presence_penalty, 0), "frequency_penalty": (chat.frequency_penalty, 0)}
    for name, (value, plain) in greedy.items():
        if value is not None and value != plain:
            raise bad_request(f"{name} {value:g} is not served: answers are greedy (give {plain} or leave it out)",
                              name, "unsupported_value")


def _conversation(messages: list[Message], settings: ServeSettings):
    """``(question, context, media)`` of the one user message; other turns are refused (the
    engine's prompt is one user turn: media, then the question)."""
    if len(messages) != 1 or messages[0].role != "user":
        roles = ", ".join(m.role for m in messages) or "none"
        raise bad_request(f"give exactly one user message (got: {roles}); system prompts and earlier turns are not "
                          "served: the prompt is the media and the question, as `hybridkv ask` builds it", "messages")
    content = messages[0].content
    parts = [TextPart(type="text", text=content)] if isinstance(content, str) else list(content or [])
    texts = [p.text for p in parts if isinstance(p, TextPart)]
    media = tuple(("image", p.image_url.url) if isinstance(p, ImagePart) else ("video", p.video_url.url)
                  for p in parts if not isinstance(p, TextPart))
    if any(kind == "video" for kind, _ in media) and len(media) > 1:
        raise bad_request("one video per request, and nothing else beside it (a video cannot be combined with other "
                          "media)", "messages[0].content")
    if len(media) > settings.max_media_parts:
        raise bad_request(f"{len(media)} media parts; at most {settings.max_media_parts}", "messages[0].content")
    context = None
    if not media:
        if len(texts) < 2:
            raise bad_request("give an image_url or video_url part, or (a text-only request) the text as the first "
                              "text part(s) and the question as the last", "messages[0].content")
        context, texts = "\n\n".join(texts[:-1]), texts[-1:]
    question = "\n".join(t.strip() for t in texts if t.strip())
    if not question:
        raise bad_request("the question (the message's text) is empty", "messages[0].content")
    return question, context, media
