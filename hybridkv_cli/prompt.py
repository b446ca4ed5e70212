"""Turn media + a question, or a text context + a question, into model inputs and token roles."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.errors import UsageError
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models import IMAGE_KWARGS, video_kwargs

VISUAL_PAD_TOKENS = ("<|image_pad|>", "<|video_pad|>")


@dataclass
class Prompt:
    """Processor output for one input, plus which prompt positions are visual tokens."""

    inputs: dict
    visual: torch.Tensor  # BoolTensor [N]

    @property
    def length(self) -> int:
        return self.visual.numel()

    @property
    def visual_tokens(self) -> int:
        return int(self.visual.sum())

    @property
    def text_tokens(self) -> int:
        return self.length - self.visual_tokens


def chat_text(processor, media: MediaInput, text: str) -> str:
    """The chat template rendered for ``media`` + ``text`` (one visual placeholder per image/video)."""
    parts = [{"type": "video"}] if media.kind == "video" else [{"type": "image"} for _ in media.images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    # Several images are labelled "Picture 1:", ... (Qwen's convention), so questions can name them.
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         add_vision_id=len(parts) > 1)


def question_ids(tokenizer, question: str) -> list[int]:
    """The question's token ids as plain text: special-token strings in it (``<|im_start|>``,
    ``<|image_pad|>``, ...) are split into ordinary tokens, never read as structure."""
    return list(tokenizer(question, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def question_standin(tokenizer, rendered: str) -> str | None:
    """A single-token special token absent from ``rendered`` (the template with an empty
    question), used as the question's placeholder while the processor runs; None if none fits."""
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


def build_prompt(processor, media: MediaInput, question: str) -> Prompt:
    """Render the chat template for ``media`` + ``question`` and run the processor.

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
    standin = question_standin(tokenizer, chat_text(processor, media, ""))
    if standin is None:  # no spare special token (not the case for Qwen tokenizers)
        if any(t in question for t in tokenizer.get_added_vocab()):
            raise UsageError("the question contains chat-template tokens this tokenizer cannot escape", "QUESTION")
        standin = question
    text = chat_text(processor, media, standin)
    if media.kind == "video":
        # Frames are already sampled and sized by the media layer; their rate sets Qwen's temporal ids.
        kwargs = video_kwargs(fps=media.sample_fps or 2.0, num_frames=media.frames_used)
        inputs = processor(text=[text], videos=[media.video], videos_kwargs=kwargs, return_tensors="pt")
    else:
        inputs = processor(text=[text], images=list(media.images), images_kwargs=IMAGE_KWARGS, return_tensors="pt")
    inputs = dict(inputs)
    if standin is not question:
        inputs = _splice(inputs, tokenizer.convert_tokens_to_ids(standin), question_ids(tokenizer, question))
    ids = inputs["input_ids"][0]
    pads = [tokenizer.convert_tokens_to_ids(t) for t in VISUAL_PAD_TOKENS]
    return Prompt(inputs=inputs, visual=torch.isin(ids, torch.tensor(pads)))


def build_text_prompt(tokenizer, context: str, question: str) -> Prompt:
    """A text prompt: ``context``, a blank line, then ``question``, in one user turn of the chat
    template (no template: the bare text).

    Roles: the context's tokens play the part visual tokens play in a media prompt (``visual``
    True); the question and the template are text. Context and question are tokenised as plain
    text (:func:`question_ids`) and placed where a marker sat in the rendered template, so neither
    can open a chat turn.
    """
    question, context = question.strip(), context.strip()
    if not question:
        raise UsageError("the question is empty", "QUESTION")
    marker = "\ue000"  # a private-use character: absent from any template
    turn = [{"role": "user", "content": marker}]
    rendered = (tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
                if tokenizer.chat_template else marker)
    head, tail = rendered.split(marker)
    template = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
    before = template(head)
    ctx = question_ids(tokenizer, context + "\n\n") if context else []
    ids = before + ctx + question_ids(tokenizer, question) + template(tail)
    visual = torch.zeros(len(ids), dtype=torch.bool)
    visual[len(before):len(before) + len(ctx)] = True
    input_ids = torch.tensor([ids])
    return Prompt(inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}, visual=visual)


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
