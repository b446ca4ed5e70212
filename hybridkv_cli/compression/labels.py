"""Label channels: which channels of a head's keys rank its tokens in the device index.

A channel moves the logits in proportion to ``|q_c|·|k_c|``, so a head's channels are weighed by
the mean ``|q_c|`` times the mean ``|k_c|`` over a prompt, and the heaviest are its labels
(Double Sparsity's offline channels). The weights come from calibration prose, written once per
model by ``hybridkv calibrate`` to a label file (``--index-file``), or, without one, from the
prompt being compressed (its own queries: no file needed, but a deferred question is not seen).

A label file is JSON: ``{"format": "hybridkv-labels", "version": 1, "model": NAME, "rows": N,
"weights": [[[one weight per channel] per KV head] per layer]}``, read as every user file is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridkv_cli.compression.base import Compressed, Policy, PrefillLayer
from hybridkv_cli.compression.store import RaggedStore
from hybridkv_cli.io.errors import UsageError

FORMAT = "hybridkv-labels"
VERSION = 1
FILE_FORMAT = '{"format": "hybridkv-labels", "version": 1, "weights": [[[per channel] per KV head] per layer]}'


def channel_weights(layer: PrefillLayer) -> torch.Tensor:
    """Each channel's weight in ``layer``'s prompt: mean ``|q_c|`` times mean ``|k_c|``, [H, d] fp32."""
    return layer.query.float().abs().mean(dim=(1, 2)) * layer.keys.float().abs().mean(dim=1)


def choose_labels(weights: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` heaviest channels of every head, ascending, int64 [H, count]."""
    return weights.topk(count, dim=1).indices.sort(dim=1).values


def load_label_file(path: str | Path) -> list[torch.Tensor]:
    """The per-layer channel weights [H, d] of a label file; a one-line UsageError naming the
    file when it is not one (missing, not a regular file, too large, not JSON, wrong shape)."""
    from hybridkv_cli.io.user_files import read_json

    source = str(path)
    data = read_json(path, "--index-file", FILE_FORMAT)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"is not a label file; expected {FILE_FORMAT}", source)
    if data.get("version") != VERSION:
        raise UsageError(f"is label file version {data.get('version')!r}; this hybridkv reads version {VERSION}",
                         source)
    layers = data.get("weights")
    if not isinstance(layers, list) or not layers:
        raise UsageError(f"has no weights; expected {FILE_FORMAT}", source)
    out = []
    for i, heads in enumerate(layers):
        ok = isinstance(heads, list) and heads and all(
            isinstance(row, list) and row and len(row) == len(heads[0])
            and all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                    for w in row) for row in heads)
        if not ok:
            raise UsageError(f"layer {i}: weights must be one list of finite non-negative numbers per KV head, "
                             "every head the same length", source)
        out.append(torch.tensor(heads, dtype=torch.float32))
    return out


def layer_labels(weights: list[torch.Tensor], layer: PrefillLayer, count: int, source: str) -> torch.Tensor:
    """Layer ``layer``'s labels from a label file's ``weights`` (checked against the model)."""
    if layer.index >= len(weights):
        raise UsageError(f"has weights for {len(weights)} layers, the model has more (layer {layer.index})", source)
    w = weights[layer.index]
    if tuple(w.shape) != (layer.num_heads, layer.keys.shape[-1]):
        raise UsageError(f"layer {layer.index} has weights for {w.shape[0]} heads of {w.shape[1]} channels, the "
                         f"model has {layer.num_heads} of {layer.keys.shape[-1]}", source)
    return choose_labels(w.to(layer.keys.device), count)


@dataclass
class ChannelCalibration(Policy):
    """Keeps the whole cache and adds up each layer's :func:`channel_weights` over the prompts it
    sees (``hybridkv calibrate``); :meth:`weights` is their mean."""

    budget: float = 1.0
    sums: dict = field(default_factory=dict)
    prompts: int = 0

    def compress(self, layer: PrefillLayer) -> Compressed:
        self.sums[layer.index] = self.sums.get(layer.index, 0) + channel_weights(layer).cpu()
        self.prompts += layer.index == 0
        keep = torch.ones(layer.keys.shape[:2], dtype=torch.bool, device=layer.keys.device)
        return Compressed(RaggedStore.build(layer.keys, layer.values, keep))

    def file(self, model: str) -> dict:
        """The label file's content."""
        weights = [[[float(f"{w:.4g}") for w in head] for head in (self.sums[i] / max(1, self.prompts)).tolist()]
                   for i in sorted(self.sums)]  # four digits: the ranking, not the values, matters
        return {"format": FORMAT, "version": VERSION, "model": model, "rows": self.prompts, "weights": weights}
