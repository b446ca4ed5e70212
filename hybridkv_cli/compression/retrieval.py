"""Stage 3b: dynamic heads, served by chunk-wise retrieval from their offloaded prompt KV.

The prompt positions before the resident tail are cut into chunks of ``chunk`` tokens. Each
dynamic head's chunks move to host memory (pinned on CUDA), one chunk contiguous; on the device
stay an int8 landmark per chunk (the mean post-RoPE key, with a per-chunk scale), ``chunks``
retrieval slots and the resident tail. Every decode step scores the landmarks against the
query, keeps the slots whose chunk is still wanted and loads only the missing chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.store import RaggedStore, tensor_bytes
from hybridkv_kernels import chunk_gather, chunk_topk


def quantize_landmarks(landmarks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per chunk: ``landmarks ≈ q * scale``. Returns ``(q [.., C, d], scale [.., C])``."""
    scale = landmarks.float().abs().amax(dim=-1).clamp_min(1e-12) / 127.0
    q = torch.round(landmarks.float() / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


@dataclass
class DynamicHeads:
    """Retrieval state of one layer's dynamic heads.

    Attributes
    ----------
    heads : LongTensor [H_dyn]
        Which KV heads of the layer are dynamic.
    host_k, host_v : Tensor [H_dyn, C, chunk, d]
        The offloaded prompt KV (host memory, pinned on CUDA).
    landmarks : int8 Tensor [H_dyn, C, d]; landmark_scale : Tensor [H_dyn, C]
    slot_base : LongTensor [H_dyn]
        Store row of each dynamic head's first slot.
    resident : LongTensor [H_dyn, n]
        Chunk held by each slot (-1: empty).
    """

    heads: torch.Tensor
    host_k: torch.Tensor
    host_v: torch.Tensor
    landmarks: torch.Tensor
    landmark_scale: torch.Tensor
    slot_base: torch.Tensor
    resident: torch.Tensor
    transferred: int = 0
    steps: int = 0

    @classmethod
    def offload(
        cls, keys, values, heads: torch.Tensor, store: RaggedStore, *, chunks: int, chunk: int, num_chunks: int
    ) -> "DynamicHeads":
        """Move the first ``num_chunks * chunk`` prompt positions of ``heads`` to the host and
        build their landmarks.

        ``keys``/``values`` are the layer's full prompt KV [H, N, d]; ``store`` already reserves
        ``chunks * chunk`` slot rows at the start of each dynamic head's segment.
        """
        dim = keys.shape[-1]
        span = num_chunks * chunk
        k = keys[heads, :span].reshape(len(heads), num_chunks, chunk, dim)
        v = values[heads, :span].reshape(len(heads), num_chunks, chunk, dim)
        landmarks, scale = quantize_landmarks(k.float().mean(dim=2))
        pin = keys.is_cuda
        host_k = torch.empty(k.shape, dtype=k.dtype, pin_memory=pin)
        host_v = torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
        host_k.copy_(k)
        host_v.copy_(v)
        resident = torch.full((len(heads), chunks), -1, dtype=torch.long, device=keys.device)
        return cls(heads, host_k, host_v, landmarks, scale, store.offsets[heads].clone(), resident)

    def refresh(self, query: torch.Tensor, store: RaggedStore) -> None:
        """Load into the slots the top chunks for this step's ``query`` [H_kv, G, d]."""
        if self.resident.shape[1] == 0:
            return
        want = chunk_topk(query[self.heads], self.landmarks, self.resident.shape[1], landmark_scale=self.landmark_scale)
        self.transferred += chunk_gather(
            self.host_k, self.host_v, store.keys, store.values, self.slot_base, self.resident, want
        )
        self.steps += 1

    def device_bytes(self) -> int:
        return tensor_bytes(self.heads, self.landmarks, self.landmark_scale, self.slot_base, self.resident)

    def host_bytes(self) -> int:
        return tensor_bytes(self.host_k, self.host_v)
