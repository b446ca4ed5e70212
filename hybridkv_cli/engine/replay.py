"""A batch's decode step replayed as a CUDA graph.

A step of a :class:`~hybridkv_cli.engine.decoder.Decoder` whose members are all
:attr:`~hybridkv_cli.compression.cache.PolicyCache.replayable` reads and writes only tensors that
stay where they are while the members do not change: the tokens fed and their positions, the
generated-row counts (on the device), the stores with their rows allocated up front, and the
launch tables built at the members' first step. Its launches are then the same every step, so on
CUDA it is captured once and replayed: one graph launch a step instead of hundreds of kernel
launches from Python. The host's own counts of the step are kept outside the graph
(:meth:`PolicyCache.advance`).

Per set of members: the first step runs eagerly on a side stream (Triton compiles, the tables
are built, the caching allocator settles), the second is captured and replayed, later ones are
replayed. A member joining or leaving resets it.
"""

from __future__ import annotations

from typing import Callable

import torch


class StepReplay:
    """Runs ``step`` (device work only); with ``enabled`` on CUDA, as a replayed graph.

    Attributes
    ----------
    replays : int
        Steps replayed so far (for the records).
    """

    def __init__(self, step: Callable[[], None], enabled: bool):
        self.step = step
        self.enabled = enabled and torch.cuda.is_available()
        self.graph = None
        self.warm = False
        self.replays = 0

    def reset(self) -> None:
        """The members changed: the next step runs eagerly again, the one after is captured."""
        self.graph, self.warm = None, False

    def __call__(self, replayable: bool) -> None:
        if not (self.enabled and replayable):
            self.step()
            return
        if self.graph is None:
            if not self.warm:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.step()
                torch.cuda.current_stream().wait_stream(side)
                self.warm = True
                return
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step()
        self.graph.replay()
        self.replays += 1
