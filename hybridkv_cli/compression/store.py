"""The per-layer device store: one ragged segment of prompt entries per KV head, plus generated tokens.

Every method keeps its device-resident prompt KV here, so one decode-attention kernel serves
static heads (kept entries), dynamic heads (retrieval slots followed by the resident window) and
the uncompressed cache alike. Generated tokens are the same for every head, so they live in one
dense buffer beside the ragged rows rather than inside each segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.base import LayerKV
from hybridkv_cli.compression.host_memory import host_empty
from hybridkv_kernels import RaggedKV

# Generated tokens are appended in blocks of this many rows: one reallocation per block, and at
# most this much slack per head is ever allocated (and counted) beyond what was generated. A
# batch member reserves all its rows when it joins instead (RaggedStore.reserve).
GEN_BLOCK = 16


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``tensor``, pinned when it comes from CUDA or is compressed in
    host memory for a GPU (a streamed prefill's), so copies back to the device can be
    asynchronous and a kernel can read it in place."""
    pinned = tensor.is_cuda or (tensor.device.type == "cpu" and torch.cuda.is_available())
    return host_empty(tensor.shape, tensor.dtype, pinned).copy_(tensor)


@dataclass
class RaggedStore(LayerKV):
    """Device KV of one layer.

    Attributes
    ----------
    keys, values : Tensor [T, d]
        Flat rows; KV head ``h`` owns rows ``offsets[h] : offsets[h] + lengths[h]``.
    offsets, lengths : Tensor [H_kv] int64
    gen_k, gen_v : Tensor [H_kv, capacity, d]
        Generated tokens; the first ``n_gen`` rows are valid.
    """

    keys: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    gen_k: torch.Tensor
    gen_v: torch.Tensor
    n_gen: int = 0
    max_length: int = 0  # longest head, kept on the host so the kernel launch needs no sync

    @classmethod
    def build(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        keep: torch.Tensor,
        reserve: torch.Tensor | None = None,
    ) -> "RaggedStore":
        """Copy the kept prompt entries of every head into a fresh flat store.

        Parameters
        ----------
        keys, values : Tensor [H_kv, N, d]
            The layer's full prompt KV (post-RoPE keys).
        keep : BoolTensor [H_kv, N]
            Entries each head keeps, stored in position order.
        reserve : LongTensor [H_kv], optional
            Rows left in front of each head's kept entries (retrieval slots of dynamic heads).
        """
        heads, _, dim = keys.shape
        device = keys.device
        kept = keep.sum(dim=1)
        if reserve is None:
            reserve = torch.zeros(heads, dtype=torch.long, device=device)
        lengths = reserve + kept
        offsets = torch.cumsum(lengths, 0) - lengths
        total = int(lengths.sum())

        head_idx, pos_idx = keep.nonzero(as_tuple=True)
        # Rank of each kept entry within its head: flat index minus where its head starts.
        first = torch.cumsum(kept, 0) - kept
        rank = torch.arange(head_idx.numel(), device=device) - first[head_idx]
        rows = offsets[head_idx] + reserve[head_idx] + rank

        flat_k = keys.new_zeros(total, dim)
        flat_v = values.new_zeros(total, dim)
        flat_k[rows] = keys[head_idx, pos_idx]
        flat_v[rows] = values[head_idx, pos_idx]
        empty = keys.new_zeros(heads, 0, dim)
        return cls(flat_k, flat_v, offsets, lengths, empty, empty.clone(), max_length=int(lengths.max()))

    @property
    def num_heads(self) -> int:
        return self.offsets.numel()

    @property
    def store(self) -> "RaggedStore":
        """Itself: the methods that keep nothing beside their store return it as the layer."""
        return self

    replayable = True  # a store does no work of its own per step

    def advance(self) -> None:
        if self.n_gen == self.gen_k.shape[1]:
            raise RuntimeError("a batch member's generated rows are allocated when it joins: none is left")
        self.n_gen += 1

    def next_rows(self, count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if self.n_gen + count > self.gen_k.shape[1]:
            self.reserve(max(count, GEN_BLOCK))
        self.n_gen += count
        return self.gen_k[:, self.n_gen - count:self.n_gen], self.gen_v[:, self.n_gen - count:self.n_gen]

    def segments(self, query: torch.Tensor | None = None, scale: float | None = None) -> RaggedKV:
        """Every head's entries and the generated tokens (a store does no work of its own per step)."""
        return RaggedKV(self.keys, self.values, self.offsets, self.lengths, self.gen_k, self.gen_v, self.n_gen,
                        self.max_length)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more generated tokens, allocated now (a batch reads the generated rows
        through their address, so they must not move while it decodes)."""
        need = self.n_gen + rows - self.gen_k.shape[1]
        if need > 0:
            grow = self.gen_k.new_zeros(self.num_heads, need, self.gen_k.shape[-1])
            self.gen_k = torch.cat([self.gen_k, grow], dim=1)
            self.gen_v = torch.cat([self.gen_v, grow], dim=1)

    def device_bytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.offsets, self.lengths, self.gen_k, self.gen_v)

    def entries(self) -> int:
        """Prompt entries resident on the device (the quantity the budget bounds)."""
        return int(self.lengths.sum())
