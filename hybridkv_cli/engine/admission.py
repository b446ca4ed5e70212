"""Admission: which made jobs join the batch being decoded, and when.

:func:`~hybridkv_cli.engine.jobs.decode` asks it before it makes a job (is there room for any
other member?) and before it starts one (is there room for this one, beside the members and the
jobs starting with it?); a server reads the same
state for its metrics (:attr:`Admission.waiting`). The rule is :class:`~hybridkv_cli.engine.jobs.Limits`':
at most ``limits.most`` members, and under ``kv_memory`` a job joins while the members' device KV
and its own stay within the cap -- its own measured when it last tried to join, else predicted
from the most bytes per prompt token of any member so far. A job that turns out not to fit waits,
measured, at the head of the line; one over the cap on its own can never join.
"""

from __future__ import annotations

from collections import deque


class Admission:
    """The admission state of one decode loop (see the module docstring)."""

    def __init__(self, limits):
        self.limits = limits
        self.waiting: deque = deque()  # (job, measured device bytes or None): made, not yet admitted
        self.per_token = 0.0  # most device bytes per prompt token of any member so far

    def full(self, count: int) -> bool:
        """No room for another member beside ``count``, whatever its size."""
        most = self.limits.most
        return count > 0 and most is not None and count >= most

    def admit(self, count: int, device_bytes: float) -> tuple | None:
        """The first waiting job and its device bytes (measured, else predicted), taken from the
        line if it may start beside ``count`` members and jobs starting with them (holding
        ``device_bytes``); else None. Under a cap, a job whose bytes nothing predicts yet (no
        member so far) starts alone."""
        if not self.waiting:
            return None
        job, measured = self.waiting[0]
        need = measured if measured is not None else self.per_token * job.length
        cap = self.limits.kv_memory
        if count and (self.full(count) or cap is not None and (
                device_bytes + need > cap or measured is None and not self.per_token)):
            return None
        self.waiting.popleft()
        return job, need

    def joined(self, member) -> None:
        """A member joined: its bytes per prompt token refine the prediction."""
        self.per_token = max(self.per_token, member.bytes / max(member.job.length, 1))

    def over(self, device_bytes: int) -> bool:
        """The members' device KV is over the cap (the last one to join must leave)."""
        cap = self.limits.kv_memory
        return cap is not None and device_bytes > cap

    def wait(self, job, measured: int) -> None:
        """``job`` did not fit: it waits first in line for ``measured`` bytes of room."""
        self.waiting.appendleft((job, measured))
