"""The torch path of refresh (the CPU path): the refreshers of one geometry, one op a step.

``Refresher.refresh_all`` hands this module the refreshed heads of one layer of several
generations (a batch's members; one alone is a group of one) whose shapes all agree
(:func:`geometry`): :func:`evidence` is their drift, the controllers fire, and
:func:`reselect_fired` re-selects. On the CPU a step's cost is mostly per op, so their heads go
side by side: each step of the algorithm is one op for all of them, and only what reads a member's own
tensors (its store rows, generated keys, host keys and chunk copies) stays per member. Every op
a member meets has the shapes it has alone and works row by row, so its numbers do not depend on
the others (the drift avoids ``sigmoid``, whose vector and scalar paths differ in the last bit).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridkv_cli.compression.detector import LowRankKeys
from hybridkv_kernels.chunk_gather import GatherTarget, copy_assigned, gather_plan
from hybridkv_kernels.tensors import joined


def geometry(refresher, query: torch.Tensor, store) -> tuple:
    """What refreshers must share to be refreshed together: every shape but the member's."""
    r = refresher
    return (len(r.heads), r.host_k.shape[1:], r.host_k.dtype, r.resident.shape[1], r.fixed.shape[1], r.tail,
            r.options, r.branching, r.detector.codes.shape[1], store.n_gen, store.keys.dtype, query.dtype)


class Evidence(NamedTuple):
    """What a step of a group's refresh decides from (R: the members' refreshed heads, B: the members).

    q [R, G, d] fp32 queries; kept [R, G, c] unscaled exact logits of the moving slots; approx
    [R, G, P] low-rank logits of every token; held [R, P] resident mask; drift [B].
    """

    q: torch.Tensor
    kept: torch.Tensor
    approx: torch.Tensor
    held: torch.Tensor
    drift: torch.Tensor


def evidence(items: list[tuple], scale: float) -> Evidence:
    """The :class:`Evidence` of a step of the ``(refresher, query [H_kv, G, d], store)`` items
    (one :func:`geometry`).

    Drift of a (head, query) is ``E / (E + R)`` with ``E`` the low-rank softmax mass of the
    evicted tokens and ``R`` the exact mass of what the device holds; ``E`` is one pass of
    ``exp`` over the low-rank logits and a product with the evicted mask, so the [R, G, P]
    tensor is walked a few times, not masked, copied and reduced twice.
    """
    first, _, store = items[0]
    q = joined([query.index_select(0, r.heads) for r, query, _ in items]).float()
    heads, c, dim = len(first.heads), first.resident.shape[1], store.keys.shape[-1]
    rows = joined([r.slot_base for r, _, _ in items])[:, None] + torch.arange(c + first.tail, device=q.device)
    held_keys = joined([s.keys.index_select(0, rows[i * heads:(i + 1) * heads].flatten())
                        for i, (_, _, s) in enumerate(items)]).view(q.shape[0], -1, dim)
    exact = torch.bmm(q, held_keys.float().transpose(1, 2))  # slots + fixed + window
    gen_k = joined([s.gen_k[:, :s.n_gen].index_select(0, r.heads) for r, _, s in items])
    gen = torch.bmm(q, gen_k.float().transpose(1, 2))
    resident = torch.cat([exact, gen], dim=-1).mul_(scale).logsumexp(dim=-1)  # log R, [R, G]
    detector = LowRankKeys(*(joined([getattr(r.detector, name) for r, _, _ in items])
                               for name in ("basis", "codes", "scale")))
    approx = detector.logits(q)
    held = torch.zeros(approx.shape[::2], dtype=torch.bool, device=q.device)
    held.scatter_(1, joined([r.resident for r, _, _ in items]), True)
    held.scatter_(1, joined([r.fixed for r, _, _ in items]), True)
    top = approx.amax(dim=-1, keepdim=True)
    mass = (((approx - top) * scale).exp_() * (~held).float().unsqueeze(1)).sum(dim=-1)
    evicted = mass.log() + top.squeeze(-1) * scale  # log E, [R, G]
    drift = torch.exp(resident - evicted).add_(1).reciprocal_()  # sigmoid(log E - log R)
    return Evidence(q, exact[..., :c], approx, held, drift.view(len(items), -1).mean(dim=1))


def reselect_fired(items: list[tuple], fired: torch.Tensor, seen: Evidence) -> None:
    """Re-select and load the moving slots of the ``(refresher, query, store)`` items (one
    :func:`geometry`) whose trigger ``fired`` [B]: with ``branching``, only theirs (the host
    reads the trigger); else every member's, the unfired keeping what they hold."""
    refreshers = [r for r, _, _ in items]
    heads = len(refreshers[0].heads)
    if refreshers[0].branching:
        live = [i for i, f in enumerate(fired.tolist()) if f]
        if not live:
            return
        if len(live) < len(items):
            rows = torch.tensor([i * heads + h for i in live for h in range(heads)], device=fired.device)
            seen = Evidence(*(t.index_select(0, rows) for t in seen[:4]), seen.drift)
        want = _reselect([items[i] for i in live], seen)
    else:
        live = list(range(len(items)))
        mask = fired.repeat_interleave(heads)[:, None]
        want = torch.where(mask, _reselect(items, seen), joined([r.resident for r in refreshers]))
    chosen = [items[i] for i in live]
    targets = [GatherTarget(r.host_k, r.host_v, s.keys, s.values, r.slot_base, r.resident, r.transferred)
               for r, _, s in chosen]
    copy_assigned(targets, gather_plan(joined([r.resident for r, _, _ in chosen]), want, refreshers[0].host_k.shape[1]))
    counts = fired.long()
    for i, (r, _, _) in zip(live, chosen):
        r.refreshes += counts[i]
        r.key_reads += counts[i] * (heads * r.candidates * r.host_k[0, 0].nbytes)


def _reselect(items: list[tuple], seen: Evidence) -> torch.Tensor:
    """The top ``c`` positions among the detector's top candidates (fixed ones excluded), by
    exact logit, for the heads of ``items`` (the rows of ``seen``)."""
    first, (q, kept, approx, held, _) = items[0][0], seen
    heads, tokens, dim = len(first.heads), first.host_k.shape[1], first.host_k.shape[-1]
    score = approx.amax(dim=1).masked_fill_(held, float("-inf"))
    score.scatter_(1, joined([r.resident for r, _, _ in items]), kept.amax(dim=1))  # moving slots: exact logits
    cand = score.topk(first.candidates, dim=1).indices  # [R, 4c]
    host_rows = (torch.arange(heads, device=q.device)[:, None] * tokens + cand.view(len(items), heads, -1))
    keys = joined([r.host_k.view(-1, dim).index_select(0, host_rows[i].flatten().to(r.host_k.device))
                   for i, (r, _, _) in enumerate(items)]).view(*cand.shape, dim)
    exact = torch.bmm(q, keys.to(q.device).float().transpose(1, 2)).amax(dim=1)  # [R, 4c]
    return cand.gather(1, exact.topk(first.resident.shape[1], dim=1).indices)
