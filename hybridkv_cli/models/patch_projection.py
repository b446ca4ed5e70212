"""The vision patch embedding as the matrix product it is.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL embed each patch of 2 frames x 14 x 14 pixels with an
``nn.Conv3d`` whose kernel equals its stride: the patches do not overlap, so the convolution is
one matrix product of the flattened patches with the flattened kernel. Convolution backends
handle that degenerate shape badly: on the CPU it costs ~5x the product (14 ms of the demo
model's 64 ms compression of a 64-frame video, against ~2.5 ms), and on some GPU / cuDNN /
dtype combinations it is orders of magnitude slower (transformers issue 45750; transformers
offers the same replacement as an opt-in fusion). Every model :func:`load_model
<hybridkv_cli.models.registry.load_model>` loads gets :class:`PatchProjection` in place of such a
convolution: the same parameters (its state dict is the convolution's, so a saved model loads
anywhere) and the same outputs up to the summation order (~1e-6 relative in fp32).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["PatchProjection", "project_patches"]


class PatchProjection(nn.Module):
    """A non-overlapping ``nn.Conv3d`` (kernel = stride, no padding) as a matrix product: it
    takes what the convolution takes (``[N, C, T, H, W]``, one patch per row, as the patch
    embeddings call it) and returns what it returns (``[N, out, 1, 1, 1]``)."""

    def __init__(self, conv: nn.Conv3d):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias  # the convolution's own parameters, as they are
        self.kernel_size = conv.kernel_size

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if tuple(patches.shape[2:]) != tuple(self.kernel_size):
            raise ValueError(f"patches must be [N, C, {', '.join(map(str, self.kernel_size))}], got "
                             f"{tuple(patches.shape)}")
        out = F.linear(patches.reshape(patches.shape[0], -1), self.weight.flatten(1), self.bias)
        return out.view(*out.shape, 1, 1, 1)


def projectable(module: nn.Module) -> bool:
    """Whether ``module`` is a convolution whose patches do not overlap (kernel = stride)."""
    return (isinstance(module, nn.Conv3d) and module.stride == module.kernel_size and module.padding == (0, 0, 0)
            and module.dilation == (1, 1, 1) and module.groups == 1)


def project_patches(model: nn.Module) -> int:
    """Every patch embedding's non-overlapping convolution in ``model`` (a module's ``proj``)
    replaced by its :class:`PatchProjection`; how many were."""
    owners = [m for m in model.modules() if projectable(getattr(m, "proj", None))]
    for owner in owners:
        owner.proj = PatchProjection(owner.proj)
    return len(owners)
