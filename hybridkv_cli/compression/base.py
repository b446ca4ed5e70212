"""What every compression method sees at prefill and what it hands back for decoding."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from hybridkv_cli.errors import UsageError


@dataclass
class PrefillLayer:
    """One text layer right after its prefill attention (batch size 1).

    Attributes
    ----------
    index : int
        Layer number.
    num_layers : int
        Layers of the model (a method carrying budget across layers knows which one is last).
    query : Tensor [H_kv, G, N, d]
        Post-RoPE prompt queries, grouped by the KV head they read (HF ``repeat_kv`` order).
    keys, values : Tensor [H_kv, N, d]
        The full prompt KV of the layer (post-RoPE keys).
    visual : BoolTensor [N]
        Token roles: True for visual (image/video pad) tokens, False for text. For text
        prompts True marks the context and False the question and chat template.
    scale : float
        Softmax scale of the attention.
    run : dict
        Scratch space shared by the layers of one generation (e.g. a refresh controller whose
        threshold all layers update); a fresh dict per generation.
    """

    index: int
    num_layers: int
    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    visual: torch.Tensor
    scale: float
    run: dict = dataclasses.field(default_factory=dict)

    @property
    def num_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def window_query(self, window: int) -> torch.Tensor:
        """Queries of the last ``window`` prompt positions, [H_kv, G, w, d]."""
        return self.query[:, :, -window:]


class LayerKV(Protocol):
    """A compressed layer as decoding uses it."""

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor: ...
    def append(self, key: torch.Tensor, value: torch.Tensor) -> None: ...
    def device_bytes(self) -> int: ...
    def host_bytes(self) -> int: ...
    def transferred_bytes(self) -> int: ...


@dataclass
class Policy:
    """Base of every method: how a layer's prompt KV becomes what decoding reads.

    Parameters
    ----------
    budget : float
        Device-resident prompt KV per layer as a share of the full cache, in (0, 1].
    window : int
        Observation window: the last ``window`` prompt positions (question + template tail).
    """

    name: ClassVar[str] = ""
    budget: float = 1.0
    window: int = 32

    def compress(self, layer: PrefillLayer) -> LayerKV:
        raise NotImplementedError

    def summary(self) -> dict | None:
        """Head-level report (classes, budgets), or None for methods without one."""
        return None

    @classmethod
    def options(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def check_choice(option: str, value: str, choices) -> None:
    """Refuse an option value that is not one of ``choices`` (a usage error naming the flag)."""
    if value not in choices:
        raise UsageError(f"{option} must be one of {', '.join(choices)}, got '{value}'", "--" + option.replace("_", "-"))
