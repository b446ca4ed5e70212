"""Small tensor helpers the torch paths share."""

from __future__ import annotations

import torch


def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors one after the other along dim 0; a single one as it is (a ``cat`` of one would copy it)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
