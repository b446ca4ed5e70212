"""Turn media + a question, or a text context + a question, into model inputs and token roles.

The chat template is rendered once per prompt, with a marker where the question goes; the
question is tokenised on its own and spliced in (so chat-template strings in it stay text).
"""

from __future__ import annotations

import numbers
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer

from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models import families
from hybridkv_cli.models.streamed_video import FramePixels, grouped_video_inputs, streamed_video_inputs

VISUAL_PAD_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<image>", "<video>")  # never a question stand-in
_MARKER = "\ue000"  # a private-use character: absent from any template, replaced after rendering

#: ``images_kwargs`` for images already resized to multiples of 28 (patch 14 x merge 2): no second
#: resize by the image processor.
IMAGE_KWARGS: dict[str, Any] = {"do_resize": False}


def video_kwargs(
    fps: float | Sequence[float] | None = None, num_frames: int | Sequence[int] | None = None
) -> dict[str, Any]:
    """``videos_kwargs`` for ``(T, 3, H, W)`` uint8 clips that media.py already sampled and sized.

    ``do_sample_frames=False`` keeps every frame given; ``do_resize=False`` keeps the size (the
    Qwen2-VL video processor would otherwise resize again and *upscale* small clips to its
    100k-pixel minimum, e.g. 112x112 -> 336x336); ``cap_pixels_per_frame=False`` silences a
    transformers 5.x deprecation warning.

    ``fps`` is the rate of the frames *given* (frames kept per second of source video, e.g. 64
    frames from a 32 s clip -> 2.0), one value per clip, with ``num_frames`` (T per clip). They
    become ``video_metadata``, from which the processor computes ``second_per_grid_ts``
    (= temporal_patch_size / fps, the temporal spacing of 3-D mRoPE). Without them transformers
    assumes 24 fps. (A bare ``fps=`` processor kwarg does *not* do this: it is a sampling rate,
    ignored when ``do_sample_frames=False``.)
    """
    kw: dict[str, Any] = {"do_sample_frames": False, "do_resize": False, "cap_pixels_per_frame": False}
    if fps is not None:
        fps_list = [float(fps)] if isinstance(fps, numbers.Real) else [float(f) for f in fps]
        if num_frames is None:
            raise ValueError("video_kwargs: pass num_frames together with fps")
        if isinstance(num_frames, numbers.Integral):
            frames = [int(num_frames)] * len(fps_list)
        else:
            frames = [int(n) for n in num_frames]
        if len(frames) != len(fps_list):
            raise ValueError("video_kwargs: one fps and one num_frames per clip")
        kw["video_metadata"] = [
            {"total_num_frames": n, "fps": f, "frames_indices": list(range(n)), "duration": n / f}
            for f, n in zip(fps_list, frames)
        ]
    return kw


@dataclass
class Prompt:
    """Processor output for one input, plus which prompt positions are visual tokens."""

    inputs: dict
    visual: torch.Tensor  # BoolTensor [N]
    role: str = "visual"  # what the non-text tokens are: "visual" (media) or "context" (a text prompt)
    system: str | None = None  # the system prompt it was rendered with (None: the template's default)

    @property
    def length(self) -> int:
        return self.visual.numel()

    @property
    def read_while_prefilling(self) -> bool:
        """Its pixels are decoded chunk by chunk as the prompt is read (a streamed video)."""
        return isinstance(self.inputs.get("pixel_values_videos"), FramePixels)

    @property
    def visual_tokens(self) -> int:
        return int(self.visual.sum())

    @property
    def text_tokens(self) -> int:
        return self.length - self.visual_tokens

    @property
    def question_start(self) -> int:
        """Where the tokens after the media (or text context) begin: the question and the
        chat-template tail, what a deferred question reads after compression."""
        roles = self.visual.nonzero()
        return int(roles.max()) + 1 if len(roles) else self.length


@dataclass
class QuestionTemplate:
    """The tokens around a question after a prompt's media: ``head`` (e.g. ``<|vision_end|>``) and
    ``tail`` (the end of the user turn and the assistant header), so a question about a
    compressed prefix is ``head + question + tail`` with no media at hand."""

    head: list[int]
    tail: list[int]

    @classmethod
    def of(cls, tokenizer, prompt: Prompt, question: str) -> "QuestionTemplate":
        """Read from ``prompt``, built for ``question``: where its question tokens sit after the media."""
        ids = prompt.inputs["input_ids"][0].tolist()
        cut = prompt.question_start
        q = question_ids(tokenizer, question.strip())
        for start in range(len(ids) - len(q), cut - 1, -1):
            if ids[start:start + len(q)] == q:
                return cls(ids[cut:start], ids[start + len(q):])
        raise RuntimeError("the question's tokens were not found in its prompt")

    def suffix(self, tokenizer, question: str, history: Sequence[tuple[str, str]] = (),
               turn: list[int] | None = None) -> list[int]:
        """The tokens read after the prefix: ``question``, or a conversation whose earlier turns
        (``history``: each a question and the answer it got) come first, each answer followed by
        ``turn`` (:func:`conversation_tokens`) -- as the chat template renders them."""
        ids = list(self.head)
        for asked, answered in history:
            ids += [*question_ids(tokenizer, asked), *self.tail, *question_ids(tokenizer, answered), *turn]
        return [*ids, *question_ids(tokenizer, question), *self.tail]


def conversation_tokens(processor, role: str) -> tuple[list[int], list[int]] | None:
    """``(tail, turn)`` of the chat template: the tokens from the end of a user's text to the
    assistant's answer, and from the end of an answer to the next user's text (Qwen:
    ``<|im_end|>\n<|im_start|>assistant\n`` and ``<|im_end|>\n<|im_start|>user\n``), rendered as
    the prompt of ``role`` is (a media prompt by the processor, a text prompt by the tokenizer).
    None when there is no template or it renders an earlier answer otherwise than right after
    that tail (a conversation then cannot follow a kept prefix)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    marks = ("\ue001", "\ue002", "\ue003")  # private-use characters, as _MARKER
    if role == "context":
        if not getattr(tokenizer, "chat_template", None):
            return None
        render, content = tokenizer.apply_chat_template, (lambda text: text)
    else:
        render, content = processor.apply_chat_template, (lambda text: [{"type": "text", "text": text}])
    messages = [{"role": who, "content": content(text)} for who, text in zip(("user", "assistant", "user"), marks)]
    try:
        rendered = render(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses earlier turns
        return None
    if any(rendered.count(m) != 1 for m in marks):
        return None
    rest = rendered.split(marks[0])[1]
    tail, rest = rest.split(marks[1])
    turn, end = rest.split(marks[2])
    if tail != end:
        return None
    ids = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []  # noqa: E731
    return ids(tail), ids(turn)


def chat_text(processor, media: MediaInput, text: str, system: str | None = None) -> str:
    """The chat template rendered for ``media`` + ``text`` (one visual placeholder per image/video),
    after a ``system`` prompt if one is given (:func:`checked_system` first)."""
    parts = [{"type": "video"}] if media.kind == "video" else [{"type": "image"} for _ in media.images]
    messages = [*_system_turn(system, [{"type": "text", "text": system}]),
                {"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    # Several images are labelled "Picture 1:", ... (Qwen's convention), so questions can name them.
    # (Only templates that know the flag get it: others, e.g. LLaVA-OneVision's, would warn.)
    extra = {"add_vision_id": len(parts) > 1} if "add_vision_id" in str(processor.chat_template or "") else {}
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


def checked_system(tokenizer, system: str | None) -> str | None:
    """A system prompt as the template renders it: refused (a :class:`UsageError`) when it holds a
    token of the chat template, which rendered would be read as structure (a new turn)."""
    if system is None:
        return None
    if any(token in system for token in tokenizer.get_added_vocab()):
        raise UsageError("the system prompt contains chat-template tokens", "--system")
    return system


def _system_turn(system: str | None, content) -> list[dict]:
    return [] if system is None else [{"role": "system", "content": content}]


def question_ids(tokenizer, question: str) -> list[int]:
    """The question's token ids as plain text: special-token strings in it (``<|im_start|>``,
    ``<|image_pad|>``, ...) are split into ordinary tokens, never read as structure.

    A fast tokenizer is asked through a private copy of its backend that always splits them
    (:func:`splitting_backend`): asking the tokenizer itself switches a flag on the backend it
    shares with every thread, so a prompt built meanwhile in another thread (a server's media
    thread) would have its own special tokens split, and this question would not."""
    backend = splitting_backend(tokenizer)
    if backend is None:  # a slow tokenizer splits per call, with no shared state
        return list(tokenizer(question, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    return backend.encode(question, add_special_tokens=False).ids


_SPLITTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SPLITTING_LOCK = threading.Lock()


def splitting_backend(tokenizer):
    """A fast ``tokenizer``'s backend copied once, with no truncation or padding, splitting
    special tokens (None for a slow tokenizer). The copy is read only: threads may share it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not hasattr(backend, "encode_special_tokens"):
        return None
    with _SPLITTING_LOCK:
        copy = _SPLITTING.get(tokenizer)
        if copy is None:
            copy = _SPLITTING[tokenizer] = Tokenizer.from_str(backend.to_str())
            copy.no_truncation()
            copy.no_padding()
            copy.encode_special_tokens = True
    return copy


def question_standin(tokenizer, rendered: str) -> str | None:
    """A single-token special token absent from ``rendered`` (the template rendered once, the
    question left out), used as the question's placeholder while the processor runs; None if none
    fits."""
    added = tokenizer.get_added_vocab()
    specials = set(getattr(tokenizer, "all_special_tokens", ()))
    preferred = ("<|vision_pad|>", "<|endoftext|>")
    candidates = [t for t in preferred if t in added] + sorted(t for t in added if t in specials)
    for token in candidates:
        if token in VISUAL_PAD_TOKENS or token in rendered:
            continue
        if len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1:
            return token
    return None


def build_prompt(processor, media: MediaInput, question: str, system: str | None = None) -> Prompt:
    """Render the chat template for ``media`` + ``question`` (after a ``system`` prompt, if given)
    and run the processor.

    The question is tokenised on its own as plain text (:func:`question_ids`) and spliced into
    the processed prompt where a one-token stand-in sat, so text such as ``<|im_start|>`` or
    ``<|image_pad|>`` in a question can neither open a chat turn nor change the number of visual
    tokens. For a question without such strings the result is token-for-token what rendering the
    question into the template would give (special tokens delimit text segments).
    """
    question = question.strip()
    if not question:
        raise UsageError("the question is empty", "QUESTION")
    tokenizer = processor.tokenizer
    rendered = chat_text(processor, media, _MARKER, checked_system(tokenizer, system))
    standin = question_standin(tokenizer, rendered)
    if standin is None:  # no spare special token (not the case for Qwen tokenizers)
        if any(t in question for t in tokenizer.get_added_vocab()):
            raise UsageError("the question contains chat-template tokens this tokenizer cannot escape", "QUESTION")
        standin = question
    text = rendered.replace(_MARKER, standin)
    if media.kind == "video":
        # Frames are already sampled and sized by the media layer; their rate sets Qwen's temporal
        # ids (Qwen2/2.5-VL) or frame timestamps (Qwen3-VL).
        height, width = media.size

        def kwargs_for(frames: int) -> dict:
            meta = video_kwargs(fps=media.sample_fps or 2.0, num_frames=frames)["video_metadata"]
            return families.media_kwargs(processor, "video", frames * height * width, meta)

        if media.stream is not None:  # frames decoded while the prompt is read
            inputs = streamed_video_inputs(processor, text, media.stream, kwargs_for)
        elif families.repeats_video_groups(processor):  # the same inputs, the pixels a few frames at a time
            inputs = grouped_video_inputs(processor, text, media.video, kwargs_for)
        else:
            inputs = processor(text=[text], videos=[media.video], videos_kwargs=kwargs_for(media.frames_used),
                               return_tensors="pt")
    else:
        images = list(media.images)
        kwargs = families.media_kwargs(processor, "image", max(im.size[0] * im.size[1] for im in images))
        # nested: one prompt with several images (LLaVA-OneVision reads this as its multi-image mode)
        inputs = processor(text=[text], images=[images], images_kwargs=kwargs, return_tensors="pt")
    inputs = dict(inputs)
    if standin is not question:
        inputs = _splice(inputs, tokenizer.convert_tokens_to_ids(standin), question_ids(tokenizer, question))
    ids = inputs["input_ids"][0]
    return Prompt(inputs=inputs, visual=torch.isin(ids, torch.tensor(families.visual_token_ids(processor))),
                  system=system)


def build_text_prompt(tokenizer, context: str, question: str, system: str | None = None) -> Prompt:
    """A text prompt: ``context``, a blank line, then ``question``, in one user turn of the chat
    template (no template: the bare text), after a ``system`` prompt if one is given.

    Roles: the context's tokens play the part visual tokens play in a media prompt (``visual``
    True); the question and the template are text. Context and question are tokenised as plain
    text (:func:`question_ids`) and placed where a marker sat in the rendered template, so neither
    can open a chat turn.
    """
    question, context = question.strip(), context.strip()
    if not question:
        raise UsageError("the question is empty", "QUESTION")
    if system is not None and not tokenizer.chat_template:
        raise UsageError("this model has no chat template to put a system prompt in", "--system")
    turn = [*_system_turn(checked_system(tokenizer, system), system), {"role": "user", "content": _MARKER}]
    rendered = (tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
                if tokenizer.chat_template else _MARKER)
    head, tail = rendered.split(_MARKER)
    template = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
    before = template(head)
    ctx = question_ids(tokenizer, context + "\n\n") if context else []
    ids = before + ctx + question_ids(tokenizer, question) + template(tail)
    visual = torch.zeros(len(ids), dtype=torch.bool)
    visual[len(before):len(before) + len(ctx)] = True
    input_ids = torch.tensor([ids])
    return Prompt(inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}, visual=visual,
                  role="context", system=system)


def _splice(inputs: dict, standin_id: int, ids: list[int]) -> dict:
    """Replace the one stand-in position by ``ids`` in every per-token tensor of ``inputs``
    (other per-token tensors repeat the stand-in's value: attention 1, text token type)."""
    input_ids = inputs["input_ids"]
    n = input_ids.shape[-1]
    where = (input_ids[0] == standin_id).nonzero().flatten()
    if where.numel() != 1:  # pragma: no cover - question_standin picked a token absent from the template
        raise RuntimeError(f"question placeholder found {where.numel()} times in the prompt")
    pos = int(where[0])
    out = {}
    for key, value in inputs.items():
        if torch.is_tensor(value) and value.ndim == 2 and value.shape == (1, n) and not value.is_floating_point():
            fill = (torch.tensor([ids], dtype=value.dtype) if key == "input_ids"
                    else value[:, pos:pos + 1].expand(1, len(ids)))
            value = torch.cat([value[:, :pos], fill, value[:, pos + 1:]], dim=1)
        out[key] = value
    return out
