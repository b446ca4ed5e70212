"""A prefix's per-token inputs (ids, attention mask, token types) packed for a ``.hkv`` file:
most of a prefix is media tokens that share one value, which the file stores once."""

from __future__ import annotations

import torch

from hybridkv_cli.engine.graph import GraphError
from hybridkv_cli.engine.state_kinds import DTYPES, StateError

_PREFIX = "prefix."  # tensor names of the prefix's per-token inputs


def pack_tokens(per_token: dict, visual: torch.Tensor, tensors: dict) -> dict:
    """Put the prefix's per-token tensors (ids, attention mask, token types) into ``tensors``, in the
    narrowest dtype that holds them; one that has one value on every visual token (the media pad
    id, its token type, the mask) keeps only its other tokens, and that value is returned (by key)
    for the header: most of a prefix is media tokens."""
    on_visual = {}
    for key, value in per_token.items():
        flat = value.cpu().reshape(-1)
        media = flat[visual]
        if media.numel() and bool((media == media[0]).all()):
            on_visual[key], flat = int(media[0]), flat[~visual]
        tensors[_PREFIX + key] = _narrow(flat).contiguous()
    return on_visual


def unpack_tokens(tensors: dict, visual: torch.Tensor, dtypes: dict, on_visual: dict, device) -> dict:
    """The per-token tensors ``[1, seen]`` that :func:`pack_tokens` stored."""
    if type(dtypes) is not dict or type(on_visual) is not dict:
        raise GraphError("no per-token dtypes")
    per_token = {}
    for name, stored in tensors.items():
        if name.startswith(_PREFIX):
            key = name.removeprefix(_PREFIX)
            dtype = DTYPES.get(dtypes.get(key)) if type(dtypes.get(key)) is str else None
            if dtype is None or stored.dim() != 1:
                raise GraphError(f"per-token input {key[:40]} of an unknown dtype or shape")
            value = stored.to(dtype)
            if key in on_visual:
                if type(on_visual[key]) is not int or value.numel() != int((~visual).sum()):
                    raise StateError(f"per-token input {key[:40]} does not match the token roles")
                value = torch.full(visual.shape, on_visual[key], dtype=value.dtype).masked_scatter(~visual, value)
            elif value.numel() != visual.numel():
                raise StateError(f"per-token input {key[:40]} does not match the prefix's length")
            per_token[key] = value.view(1, -1).to(device)
    if "input_ids" not in per_token:
        raise GraphError("a prefix without its token ids")
    return per_token


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """An integer tensor as uint8 or int32 when its values fit (token ids, masks, token types)."""
    if t.dtype.is_floating_point or t.numel() == 0:
        return t
    low, high = int(t.min()), int(t.max())
    if 0 <= low and high < 256:
        return t.to(torch.uint8)
    if -2**31 <= low and high < 2**31:
        return t.to(torch.int32)
    return t
