"""Text-centric window attention used at prefill (head classification and static pruning).

No Triton kernel: on a GPU this is one batched matmul + softmax over [H_kv, G, w, N] (w = 32),
a few hundred microseconds per layer at 64k tokens next to a prefill of seconds, and it runs
once per layer. A fused kernel would only save the transient [H_kv, G, w, N] fp32 buffer; not
worth a kernel that cannot be measured here. Every backend runs the torch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import resolve_backend

__all__ = ["window_scores", "window_scores_torch"]


def window_scores_torch(q_win, k, scale=None, pool_kernel=7):
    """Torch implementation of :func:`window_scores`.

    Peak extra memory: one [H_kv, G, w, N] fp32 score tensor (softmax is done in place on it)
    plus an fp32 copy of k, which is smaller ([H_kv, N, d] with d < G*w).
    """
    if q_win.dim() != 4 or k.dim() != 3 or q_win.shape[0] != k.shape[0] \
            or q_win.shape[3] != k.shape[2]:
        raise ValueError(f"q_win must be [H, G, w, d] and k [H, N, d], got "
                         f"{tuple(q_win.shape)}, {tuple(k.shape)}")
    H, G, w, d = q_win.shape
    N = k.shape[1]
    if w > N:
        raise ValueError(f"window w={w} longer than the prompt N={N}")
    scale = d ** -0.5 if scale is None else float(scale)
    # [H, G*w, d] @ [H, d, N]: fp32 so scores are not rounded to bf16 before the exp
    s = torch.bmm(q_win.reshape(H, G * w, d).float(), k.float().transpose(1, 2))
    s = s.view(H, G, w, N)
    # query i sits at absolute position N - w + i and sees keys j <= N - w + i: only the
    # last w columns can be masked
    causal = torch.ones(w, w, dtype=torch.bool, device=k.device).triu_(1)
    s[..., N - w:].masked_fill_(causal, float("-inf"))
    s.mul_(scale)
    s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # every row has >= 1 unmasked key
    s.div_(s.sum(dim=-1, keepdim=True))
    attn = s.mean(dim=(1, 2))  # [H, N]
    pooled = F.max_pool1d(attn[:, None], pool_kernel, 1, pool_kernel // 2)[:, 0]
    return attn, pooled


def window_scores(q_win, k, scale=None, pool_kernel=7, backend="auto"):
    """Window attention of the last w prompt queries, averaged over queries and the group.

    Parameters
    ----------
    q_win : Tensor [H_kv, G, w, d]
        Post-RoPE queries of prompt positions N-w .. N-1, grouped by KV head.
    k : Tensor [H_kv, N, d]
        All post-RoPE prompt keys.
    scale : float, optional
        Softmax scale, default ``d ** -0.5``.
    pool_kernel : int
        Odd max-pool width (stride 1, same padding), default 7.
    backend : {"auto", "torch", "triton"}
        Accepted for a uniform API; every backend runs the torch path (module docstring).

    Returns
    -------
    attn : Tensor [H_kv, N] fp32
        ``attn[h, j]`` = mean over the w queries and G heads of the causal softmax
        probability of key j (each row of attn sums to 1).
    pooled : Tensor [H_kv, N] fp32
        ``F.max_pool1d(attn, pool_kernel, 1, pool_kernel // 2)``.
    """
    resolve_backend(backend, q_win, k)  # validates the name; no kernel to dispatch to
    return window_scores_torch(q_win, k, scale, pool_kernel)
