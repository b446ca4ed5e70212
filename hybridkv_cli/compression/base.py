"""What every compression method sees at prefill and what it hands back for decoding."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from hybridkv_kernels import RaggedKV, ragged_decode_attention

from hybridkv_cli.io.errors import UsageError


@dataclass
class PrefillLayer:
    """One text layer right after its prefill attention (batch size 1).

    Attributes
    ----------
    index : int
        Layer number.
    num_layers : int
        Layers of the model (a method carrying budget across layers knows which one is last).
    query : Tensor [H_kv, G, N, d]
        Post-RoPE prompt queries, grouped by the KV head they read (HF ``repeat_kv`` order).
    keys, values : Tensor [H_kv, N, d]
        The full prompt KV of the layer (post-RoPE keys).
    visual : BoolTensor [N]
        Token roles: True for visual (image/video pad) tokens, False for text. For text
        prompts True marks the context and False the question and chat template.
    scale : float
        Softmax scale of the attention.
    run : dict
        Scratch space shared by the layers of one generation (e.g. a refresh controller whose
        threshold all layers update); a fresh dict per generation.
    device : torch.device, optional
        Where the layer will be decoded, when its KV sits elsewhere (a streamed prefill
        compresses in host memory for a GPU); None: where ``keys`` are.
    budget_cap : int, optional
        At most this many tokens' worth of KV a head (a streamed prefill's
        ``--stream-kv-tokens``): the budget is then ``min(b, budget_cap / N)``.
    """

    index: int
    num_layers: int
    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    visual: torch.Tensor
    scale: float
    run: dict = dataclasses.field(default_factory=dict)
    device: torch.device | None = None
    budget_cap: int | None = None

    @property
    def decode_device(self) -> torch.device:
        """The device the layer is decoded on (its profile prices the indexes)."""
        return self.device or self.keys.device

    @property
    def num_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def window_query(self, window: int) -> torch.Tensor:
        """Queries of the last ``window`` prompt positions, [H_kv, G, w, d]."""
        return self.query[:, :, -window:]


class LayerKV:
    """A compressed layer as decoding uses it.

    A decode step is the chunk retrieval of :attr:`dynamic` heads, the refresh of the
    :attr:`refresher`'s, :meth:`segments` (the method's own work for this query: page selection)
    and then one attention over what it returns, so the layers of several
    sequences, whatever their methods, are attended in one launch
    (:func:`hybridkv_kernels.batched_decode_attention`). Every method keeps something on the
    device; host state and host->device traffic are what only offloading methods have, so they
    default to none.
    """

    #: Chunk retrieval of the layer's dynamic heads (a ``DynamicHeads``; None: the method has
    #: none), run before :meth:`segments`: a batch runs all its members' in one pass.
    dynamic = None
    #: Refresh of the layer's pruned heads (a ``Refresher``; None: none), run after the retrieval
    #: and before :meth:`segments`: a batch runs all its members' together (``Refresher.refresh_all``).
    refresher = None

    def segments(self, query: torch.Tensor, scale: float) -> RaggedKV:
        """Do this step's work for ``query`` [H_kv, G, d]; return the rows the step attends."""
        raise NotImplementedError

    def attend(self, query: torch.Tensor, scale: float, q_len: int = 1) -> torch.Tensor:
        """Attention of one sequence's ``query`` [H_kv, G, d]: a decode step (``q_len`` 1), or a
        chunk of ``q_len`` new tokens read in one pass (``G`` = query heads x ``q_len``, row
        ``g * q_len + t`` at position ``t``; their rows appended already, :meth:`append`).

        The step's work (retrieval, refresh, :meth:`segments`) runs once, with the chunk's queries
        as one query group: what they select is ranked by the best of them, as a step's ``G``
        query heads are ranked (so a question's words, not only its last token, choose what is
        retrieved); every position then attends it and the chunk's rows up to its own
        (``ragged_decode_attention``'s ``q_len``). Ranking by the last query alone lost both
        needle questions of ``sample_media/questions.jsonl`` on the demo at b = 0.05 and 0.1,
        which this ranking and the former token-by-token reading answer.
        """
        if self.dynamic is not None:
            self.dynamic.refresh(query, self.store)
        if self.refresher is not None:
            self.refresher.refresh(query, self.store, scale)
        kv = self.segments(query, scale)
        return ragged_decode_attention(query, *kv[:7], scale=scale, max_length=kv.max_length, q_len=q_len)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append the new tokens of every head (``key``/``value`` [H_kv, n, d]: a step's one, a
        chunk's ``n``) as generated rows."""
        rows_k, rows_v = self.next_rows(key.shape[1])
        rows_k.copy_(key)
        rows_v.copy_(value)

    def next_rows(self, count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ([H_kv, count, d] keys and values) the next ``count`` generated tokens go to,
        counted as written from now on (a single run; a batch writes at its device counts, see
        :meth:`advance`)."""
        return self.store.next_rows(count)

    #: Whether a decode step of this layer repeats the same device work every step, on tensors
    #: that stay put (no per-step host work in :meth:`segments`, retrieval by the table kernels):
    #: a batch then builds its launch tables once and a CUDA graph can replay the step.
    replayable = False

    def advance(self) -> None:
        """Count one generated token as appended (a batch step writes the rows on the device, at
        a device count, before the layer is attended; this is the host's count of them)."""
        self.store.advance()

    def reserve(self, rows: int) -> None:
        """Allocate room for ``rows`` more generated tokens now (a method keeps them in its
        ``store``, a :class:`~hybridkv_cli.compression.store.RaggedStore`)."""
        self.store.reserve(rows)

    def device_bytes(self) -> int:
        raise NotImplementedError

    def host_bytes(self) -> int:
        return 0

    def transferred_bytes(self) -> int:
        return 0


class Compressed(NamedTuple):
    """What :meth:`Policy.compress` returns for one layer: the layer as decoding reads it, and
    the method's report of that layer (read by :meth:`Policy.summary` once the run is over;
    it may hold device counters that decoding updates)."""

    kv: LayerKV
    report: Any = None


@dataclass
class Policy:
    """Base of every method: how a layer's prompt KV becomes what decoding reads.

    A policy is configuration only: one instance serves any number of generations, and all that
    a generation changes lives in what :meth:`compress` returns (or, for what the layers of one
    generation share, in :attr:`PrefillLayer.run`).

    Parameters
    ----------
    budget : float
        Device-resident prompt KV per layer as a share of the full cache, in (0, 1].
    """

    name: ClassVar[str] = ""
    budget: float = 0.1

    def __post_init__(self):
        check_budget(self.budget)

    def compress(self, layer: PrefillLayer) -> Compressed:
        raise NotImplementedError

    def summary(self, reports: list) -> dict | None:
        """Head-level report (classes, budgets) of one generation from its layers' reports, in
        layer order; None for methods without one."""
        return None

    @classmethod
    def options(cls) -> list[str]:
        """The parameters ``make_policy`` accepts for this method."""
        return [f.name for f in dataclasses.fields(cls)]


def check_budget(budget: float, flag: str = "--budget") -> None:
    """The one check of a budget's range."""
    if not 0 < budget <= 1:
        raise UsageError(f"budget must be in (0, 1], got {budget:g}", flag)


def check_choice(option: str, value: str, choices) -> None:
    """Refuse an option value that is not one of ``choices`` (a usage error naming the flag)."""
    if value not in choices:
        raise UsageError(f"{option} must be one of {', '.join(choices)}, got '{value}'", "--" + option.replace("_", "-"))
