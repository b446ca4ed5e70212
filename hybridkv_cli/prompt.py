"""Turn media + a question into model inputs and token roles."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.errors import UsageError
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models import IMAGE_KWARGS, video_kwargs


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


def build_prompt(processor, media: MediaInput, question: str) -> Prompt:
    """Render the chat template for ``media`` + ``question`` and run the processor."""
    question = question.strip()
    if not question:
        raise UsageError("the question is empty", "QUESTION")
    parts = [{"type": "video"}] if media.kind == "video" else [{"type": "image"} for _ in media.images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if media.kind == "video":
        # Frames are already sampled and sized by the media layer; their rate sets Qwen's temporal ids.
        kwargs = video_kwargs(fps=media.sample_fps or 2.0, num_frames=media.frames_used)
        inputs = processor(text=[text], videos=[media.video], videos_kwargs=kwargs, return_tensors="pt")
    else:
        inputs = processor(text=[text], images=list(media.images), images_kwargs=IMAGE_KWARGS, return_tensors="pt")
    ids = inputs["input_ids"][0]
    tokenizer = processor.tokenizer
    pads = [tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")]
    return Prompt(inputs=dict(inputs), visual=torch.isin(ids, torch.tensor(pads)))
