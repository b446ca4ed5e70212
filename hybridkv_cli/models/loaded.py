"""A loaded model and the device / dtype it runs on: the leaf every other module builds on.

Nothing here loads anything: :mod:`hybridkv_cli.models.registry` turns a model name into a
:class:`LoadedModel`, through the loader registered for that name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from hybridkv_cli.io.errors import UsageError

__all__ = ["LoadedModel", "resolve_device", "resolve_dtype"]


@dataclass
class LoadedModel:
    """A model ready for inference with its processor.

    Attributes
    ----------
    model
        A multimodal model of one of :data:`hybridkv_cli.models.families.FAMILIES` (Qwen2-VL, Qwen2.5-VL,
        Qwen3-VL, LLaVA-OneVision), or a text-only decoder LM (Llama / Qwen2 families), in eval mode.
    processor
        Its multimodal processor, or its tokenizer for a text model.
    name : str
        The name it was loaded by (``--model``).
    device, dtype
        Where and in which precision it runs.
    random_weights : bool
        Its weights are random (``demo-random[:FAMILY]``): answers are noise.
    """

    model: Any
    processor: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    random_weights: bool = False

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def multimodal(self) -> bool:
        """Whether the model takes images and videos (else: text prompts only)."""
        return hasattr(self.processor, "image_processor")

    def refuse_media(self, source: str | None) -> None:
        """Raise a :class:`UsageError` naming ``source`` when this model takes text only."""
        if not self.multimodal:
            raise UsageError(f"{self.name} is a text model: it takes a text context (--context FILE or a task's "
                             "'context'), not media", source)

    @property
    def text_config(self):
        """The text (language model) config: layers, heads, hidden size."""
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(self.text_config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        # Read off the attention itself: Qwen2.5-VL's text attention uses hidden_size // heads
        # whatever config.head_dim says, Llama uses config.head_dim.
        return int(self.model.get_decoder().layers[0].self_attn.head_dim)

    @cached_property
    def language_weight_bytes(self) -> int:
        """Bytes of every parameter outside the vision tower: what a decode step reads once
        (counted once per model: a record on CUDA prices each answer's step with it)."""
        return sum(p.numel() * p.element_size() for name, p in self.model.named_parameters()
                   if "visual" not in name and "vision" not in name)

    @property
    def context_limit(self) -> int | None:
        """The text model's context window in tokens (None: not stated)."""
        return getattr(self.text_config, "max_position_embeddings", None) or None


_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when CUDA is available, else ``cpu``. ``cuda[:N]`` needs CUDA."""
    if isinstance(device, torch.device):
        device = str(device)
    text = (device or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)", source="--device") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise UsageError(f"unsupported device {device!r} (use auto, cpu, cuda or cuda:N)", source="--device")
    if not torch.cuda.is_available():
        raise UsageError(f"{device!r} requested but CUDA is not available here (use --device cpu)", source="--device")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(
            f"{device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist", source="--device"
        )
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 on CPU; else one of bfloat16 | float16 | float32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise UsageError(f"unsupported dtype {dtype} (use bfloat16, float16 or float32)", source="--dtype")
        return dtype
    text = (dtype or "auto").strip().lower().removeprefix("torch.")
    if text == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if text not in _DTYPES:
        raise UsageError(f"unknown dtype {dtype!r} (use auto, bfloat16, float16 or float32)", source="--dtype")
    return _DTYPES[text]
