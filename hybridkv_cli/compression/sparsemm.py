"""``sparsemm``: head budgets from visual head scores, SnapKV selection per head (Wang et al., 2025).

SparseMM's official scores come from an offline OCR-grounding procedure run once per model. Here
they are read from a JSON file (``head_scores``) or, without one, computed on the fly from the
current prompt: the window attention mass of each KV head on visual positions (text-to-visual
attention of the question and template tail). ``summary()`` says which was used, and its
``per_layer.scores`` is already in the file format, so a score file can be written from it
(e.g. averaged over a calibration set).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridkv_cli.compression.base import Compressed, Policy, PrefillLayer
from hybridkv_cli.compression.budget import Budget
from hybridkv_cli.compression.registry import register
from hybridkv_cli.compression.scoring import proportional_split, snap_keep, window_attention
from hybridkv_cli.compression.store import RaggedStore
from hybridkv_cli.io.errors import UsageError

FILE_FORMAT = '{"scores": [[one number per KV head] per layer]}'


def load_head_scores(path: str | Path) -> list[list[float]]:
    """Read and validate a head-score file: ``{"scores": [[per KV head] per layer]}``.

    Scores must be finite and non-negative, with the same number of heads in every layer, and
    each layer's sum finite (they are normalised per layer). The file is read as every user text
    file is (:mod:`hybridkv_cli.io.user_files`: a regular file, at most 16 MiB).

    Raises
    ------
    UsageError
        Missing, unreadable or not a regular file, not JSON, or not that shape.
    """
    from hybridkv_cli.io.user_files import read_json

    source = str(path)
    data = read_json(path, "--head-scores", FILE_FORMAT)
    scores = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(scores, list) or not scores or not all(isinstance(row, list) and row for row in scores):
        raise UsageError(f"expected {FILE_FORMAT}", source)
    out = []
    for i, row in enumerate(scores):
        try:
            if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in row):
                raise TypeError
            values = [float(s) for s in row]  # OverflowError: an integer beyond a float
        except (TypeError, ValueError, OverflowError):
            values = [math.nan]
        if not all(math.isfinite(s) and s >= 0 for s in values):
            raise UsageError(f"layer {i}: scores must be finite non-negative numbers", source)
        if len(row) != len(scores[0]):
            raise UsageError(f"layer {i} has {len(row)} scores, layer 0 has {len(scores[0])}", source)
        if not math.isfinite(sum(values)):  # normalised per layer: the sum must be a number
            raise UsageError(f"layer {i}: the scores' sum overflows; scale them down", source)
        out.append(values)
    return out


def visual_scores(attn: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
    """On-the-fly visual head score: each head's window attention mass on visual positions, [H]."""
    return attn[:, visual].sum(dim=1)


def head_budgets(scores: torch.Tensor, budget: Budget, min_share: float) -> torch.Tensor:
    """SparseMM allocation of one layer's ``round(b·N·H)`` entries (``budget.pool``).

    Every head gets ``min = min_share·b·N`` (rounded down), and the remainder is distributed
    proportionally to the normalised scores: ``cap = min + score·remain``. No head exceeds N; what
    a head cannot hold goes to the others (so at ``b = 1`` every head keeps everything).
    """
    floor = min(budget.length, int(min_share * budget.per_head))
    room = torch.full((budget.heads,), budget.length - floor, dtype=torch.long, device=scores.device)
    return floor + proportional_split(budget.pool - budget.heads * floor, scores, room)


@register("sparsemm")
@dataclass
class SparseMM(Policy):
    """SparseMM: per-head budgets from visual head scores (min + score·remain), SnapKV per head.

    Parameters
    ----------
    head_scores : str, optional
        JSON file ``{"scores": [[per KV head] per layer]}`` (the official offline scores). Without
        it, scores are computed on the fly from the current prompt (window attention on visual
        tokens), which the summary reports.
    min_share : float
        Every head's floor, as a share of the average head budget ``b·N``.
    """

    window: int = 32
    head_scores: str | None = None
    min_share: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        self._file_scores = load_head_scores(self.head_scores) if self.head_scores else None

    def _layer_scores(self, layer: PrefillLayer, attn: torch.Tensor) -> torch.Tensor:
        if self._file_scores is None:
            return visual_scores(attn, layer.visual)
        if layer.index >= len(self._file_scores):
            raise UsageError(
                f"has scores for {len(self._file_scores)} layers, the model has more (layer {layer.index})",
                self.head_scores,
            )
        row = self._file_scores[layer.index]
        if len(row) != layer.num_heads:
            raise UsageError(
                f"layer {layer.index} has {len(row)} scores, the model has {layer.num_heads} KV heads",
                self.head_scores,
            )
        return torch.tensor(row, dtype=torch.float64, device=attn.device)

    def compress(self, layer: PrefillLayer) -> Compressed:
        attn, pooled, window = window_attention(layer, self.window)
        scores = self._layer_scores(layer, attn)
        counts = head_budgets(scores, Budget.of(self.budget, layer), self.min_share)
        store = RaggedStore.build(layer.keys, layer.values, snap_keep(pooled, window, counts))
        return Compressed(store, (scores.tolist(), counts.tolist()))

    def summary(self, records: list[tuple[list[float], list[int]]]) -> dict:
        return {
            "head_scores": (
                f"file {self.head_scores}" if self.head_scores
                else "on the fly: window attention mass on visual tokens of this prompt "
                     "(not the official offline OCR-grounding scores)"
            ),
            "per_layer": {
                "scores": [[round(s, 6) for s in scores] for scores, _ in records],
                "entries": [entries for _, entries in records],
            },
        }
