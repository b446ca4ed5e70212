"""Admission: which made jobs join the batch being decoded, and when.

:func:`~hybridkv_cli.engine.jobs.decode` asks it before it makes a job (is there room for any
other member?) and before it starts one (is there room for this one?); a server reads the same
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

    def full(self, members) -> bool:
        """No room for another member, whatever its size."""
        most = self.limits.most
        return bool(members) and most is not None and len(members) >= most

    def fits(self, members, device_bytes: int) -> bool:
        """Whether the first waiting job may start beside ``members`` (holding ``device_bytes``)."""
        if not members:
            return True
        if self.full(members):
            return False
        cap = self.limits.kv_memory
        if cap is None:
            return True
        job, measured = self.waiting[0]
        need = measured if measured is not None else self.per_token * job.length
        return device_bytes + need <= cap

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
