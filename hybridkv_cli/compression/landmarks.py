"""How dynamic heads rank their offloaded chunks at each decode step: one scorer per landmark kind.

Every scorer keeps a small per-chunk summary on the device and returns the ``n`` best chunk ids
for a query; they differ in how sharply one strongly matching token inside a chunk shows:

* ``mean``: the chunk's mean post-RoPE key, int8 with a per-chunk scale; score = max over the
  query group of ``q·landmark`` (the fused ``chunk_topk`` kernel). A single matching key is
  diluted c-fold by the other keys of its chunk.
* ``minmax``: element-wise min and max of the chunk's keys (Quest), int8; score = the upper
  bound ``sum_d max(q_d·min_d, q_d·max_d)`` of any key's logit in the chunk. Twice the bytes.
* ``detector``: the low-rank keys of every token (:class:`LowRankKeys`); score = the chunk's
  best token. About the bytes of ``mean`` at c = 8 and R = 8, resolved to single tokens.
* ``keys``: every token's key at 2 bits per channel (:class:`QuantKeys`); score = the chunk's
  best token. ``d/4`` bytes a token (1/32 of its fp32 KV, 1/16 of its bf16 KV), sharp enough
  to rank single tokens: with 1- or 2-token chunks it keeps what exact top-k attention keeps.
* ``labels``: two stages (:class:`LabelKeys`). A quarter of the channels ("labels", chosen per
  head from calibration prose or from the prompt) at 2 bits on the device pick ``CANDIDATES·n``
  tokens; every channel at 2 bits, in host memory, ranks those. The device pays ``d/8`` bytes a
  token (1/64 of its bf16 KV); a step reads ``d/4`` bytes per candidate from the host.
* ``host-keys``: the 2-bit keys of ``keys`` kept in host memory (:class:`HostKeys`, pinned on
  CUDA, read in place by the Triton kernel): the device pays only each channel's range, and a
  step reads every token's ``d/4`` bytes from the host (1/16 of the head's bf16 KV a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv_cli.compression.detector import LowRankKeys
from hybridkv_cli.compression.host_memory import host_empty
from hybridkv_cli.compression.store import tensor_bytes, to_host
from hybridkv_kernels import (aligned_rows, candidate_key_topk, chunk_topk, code_row, pack_keys, pack_keys_by_token,
                              quant_key_topk)

DETECTOR_RANK = 8
CANDIDATES = 4  # label-ranked candidates per retrieved token (the oracle's factor, benchmarks/index_bounds.py)


def label_count(dim: int) -> int:
    """Label channels per head: a quarter of them (at 2 bits, 1/64 of a bf16 key and value)."""
    return max(4, dim // 4)


def quantize_landmarks(landmarks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per chunk: ``landmarks ≈ q * scale``. Returns ``(q [.., C, d], scale [.., C])``."""
    scale = landmarks.float().abs().amax(dim=-1).clamp_min(1e-12) / 127.0
    q = torch.round(landmarks.float() / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def page_bounds(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound per page: ``max_g sum_d max(q·kmin, q·kmax)``, [H, P] fp32.

    Uses ``max(a, b) = (a + b)/2 + |a - b|/2`` with ``kmax >= kmin``, i.e.
    ``(q·(kmin + kmax) + |q|·(kmax - kmin)) / 2``: two matmuls instead of an [H, G, P, d] tensor.

    Parameters
    ----------
    query : Tensor [H, G, d]
    kmin, kmax : Tensor [H, P, d]
        Element-wise minimum and maximum of the keys of each page.
    """
    q = query.float()
    lo, hi = kmin.float(), kmax.float()
    bound = torch.bmm(q, (lo + hi).transpose(1, 2)) + torch.bmm(q.abs(), (hi - lo).transpose(1, 2))
    return bound.amax(dim=1) * 0.5



def code_bytes(codes: torch.Tensor) -> int:
    """Bytes of 2-bit codes [H, d/4, P] with their rows' padding (:func:`pack_keys` aligns them)."""
    return codes.shape[0] * codes.shape[1] * codes.stride(1)


def top_ids(scores: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` best chunk ids per head [H, n], ascending."""
    return scores.topk(min(n, scores.shape[1]), dim=1).indices.sort(dim=1).values


class Landmarks:
    """What every landmark kind shares: what it keeps in host memory and what a step reads from
    there (none but the label index's second stage). ``top(query, n, resident, swaps=,
    stickiness=)`` ranks; the 2-bit key kinds change their selection less
    (:mod:`hybridkv_kernels.swap_cap`), the others ignore ``resident`` and the rest."""

    def host_bytes(self) -> int:
        return 0

    def read_bytes(self, n: int) -> int:
        """Host bytes one step reads to rank for ``n`` slots a head."""
        return 0


@dataclass
class MeanLandmarks(Landmarks):
    codes: torch.Tensor  # int8 [H, C, d]
    scale: torch.Tensor  # [H, C]

    @classmethod
    def build(cls, chunks: torch.Tensor) -> "MeanLandmarks":
        return cls(*quantize_landmarks(chunks.float().mean(dim=2)))

    @staticmethod
    def bytes_for(heads: int, num_chunks: int, chunk: int, dim: int) -> int:
        return heads * num_chunks * (dim + 4)

    def top(self, query: torch.Tensor, n: int, resident=None, **churn) -> torch.Tensor:
        return chunk_topk(query, self.codes, n, landmark_scale=self.scale)

    @property
    def pass_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``chunk_retrieve`` ranks by (``RetrievalPart.landmarks``, ``.landmark_scale``)."""
        return self.codes, self.scale

    def device_bytes(self) -> int:
        return tensor_bytes(self.codes, self.scale)


@dataclass
class MinMaxLandmarks(Landmarks):
    low: torch.Tensor  # int8 [H, C, d]
    high: torch.Tensor
    low_scale: torch.Tensor  # [H, C]
    high_scale: torch.Tensor

    @classmethod
    def build(cls, chunks: torch.Tensor) -> "MinMaxLandmarks":
        low, low_scale = quantize_landmarks(chunks.float().amin(dim=2))
        high, high_scale = quantize_landmarks(chunks.float().amax(dim=2))
        return cls(low, high, low_scale, high_scale)

    @staticmethod
    def bytes_for(heads: int, num_chunks: int, chunk: int, dim: int) -> int:
        return 2 * heads * num_chunks * (dim + 4)

    def top(self, query: torch.Tensor, n: int, resident=None, **churn) -> torch.Tensor:
        low = self.low.float() * self.low_scale[..., None]
        high = self.high.float() * self.high_scale[..., None]
        return top_ids(page_bounds(query, low, high), n)

    def device_bytes(self) -> int:
        return tensor_bytes(self.low, self.high, self.low_scale, self.high_scale)


@dataclass
class TokenDetector(Landmarks):
    keys: LowRankKeys
    chunk: int

    @classmethod
    def build(cls, chunks: torch.Tensor) -> "TokenDetector":
        heads, num_chunks, chunk, dim = chunks.shape
        return cls(LowRankKeys.build(chunks.reshape(heads, num_chunks * chunk, dim), DETECTOR_RANK), chunk)

    @staticmethod
    def bytes_for(heads: int, num_chunks: int, chunk: int, dim: int) -> int:
        return LowRankKeys.bytes_for(heads, num_chunks * chunk, dim, DETECTOR_RANK)

    def top(self, query: torch.Tensor, n: int, resident=None, **churn) -> torch.Tensor:
        best = self.keys.logits(query).amax(dim=1)  # [H, C*c]
        return top_ids(best.unflatten(1, (-1, self.chunk)).amax(dim=2), n)

    def device_bytes(self) -> int:
        return self.keys.device_bytes()


@dataclass
class QuantKeys(Landmarks):
    """Every token's key at 2 bits per channel (:func:`hybridkv_kernels.pack_keys`): one range
    per channel of a head, over the prompt (channels differ in spread far more than tokens do,
    as in KIVI's per-channel key quantisation); a chunk scores as its best token."""

    codes: torch.Tensor  # uint8 [H, d/4, P]
    bounds: torch.Tensor  # [H, 2, d] fp32: each channel's low and scale
    chunk: int

    @classmethod
    def build(cls, chunks: torch.Tensor) -> "QuantKeys":
        heads, num_chunks, chunk, dim = chunks.shape
        return cls(*pack_keys(chunks.reshape(heads, num_chunks * chunk, dim)), chunk)

    @staticmethod
    def bytes_for(heads: int, num_chunks: int, chunk: int, dim: int) -> int:
        return heads * (dim // 4 * code_row(num_chunks * chunk) + 2 * dim * 4)

    def top(self, query: torch.Tensor, n: int, resident: torch.Tensor | None = None, **churn) -> torch.Tensor:
        return quant_key_topk(query, self.codes, self.bounds, self.chunk, n, resident=resident, **churn)

    @property
    def pass_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``chunk_retrieve`` ranks by (``RetrievalPart.landmarks``, ``.landmark_scale``)."""
        return self.codes, self.bounds

    def device_bytes(self) -> int:
        return code_bytes(self.codes) + tensor_bytes(self.bounds)


class HostKeys(QuantKeys):
    """:class:`QuantKeys` whose codes stay in host memory: the device holds each channel's range
    (8·d bytes a head), and every step reads all the codes from the host to rank (the traffic
    this trades for device bytes, counted). A batch's members are ranked in ``chunk_retrieve``'s
    one pass, its table pointing at each member's pinned codes."""

    @classmethod
    def build(cls, chunks: torch.Tensor) -> "HostKeys":
        keys = super().build(chunks)
        host = aligned_rows(keys.codes, lambda shape, dtype: host_empty(shape, dtype, torch.cuda.is_available()))
        return cls(host, keys.bounds, keys.chunk)

    @staticmethod
    def bytes_for(heads: int, num_chunks: int, chunk: int, dim: int) -> int:
        return heads * 2 * dim * 4

    def read_bytes(self, n: int) -> int:
        return tensor_bytes(self.codes)  # the kernel reads each row's tokens, not its padding

    def device_bytes(self) -> int:
        return tensor_bytes(self.bounds)

    def host_bytes(self) -> int:
        return code_bytes(self.codes)


@dataclass
class LabelKeys(Landmarks):
    """Two-stage ranking of single tokens (Double Sparsity's label channels, then 2-bit keys).

    ``channels`` [H, K] are each head's label channels; ``codes``/``bounds`` their keys at 2 bits
    (:func:`pack_keys`, device); ``host_codes``/``host_bounds`` every channel at 2 bits, token
    after token (:func:`pack_keys_by_token`: a candidate's bytes are contiguous; host memory,
    pinned on CUDA, read in place by the Triton path)."""

    channels: torch.Tensor  # int64 [H, K]
    codes: torch.Tensor  # uint8 [H, K/4, P]
    bounds: torch.Tensor  # [H, 2, K] fp32
    host_codes: torch.Tensor  # uint8 [H, P, d/4], host
    host_bounds: torch.Tensor  # [H, 2, d] fp32, device

    @classmethod
    def build(cls, chunks: torch.Tensor, channels: torch.Tensor) -> "LabelKeys":
        heads, num_chunks, chunk, dim = chunks.shape
        keys = chunks.reshape(heads, num_chunks * chunk, dim)
        codes, bounds = pack_keys(keys.gather(2, channels[:, None].expand(-1, keys.shape[1], -1)))
        host_codes, host_bounds = pack_keys_by_token(keys)
        return cls(channels, codes, bounds, to_host(host_codes), host_bounds)

    @staticmethod
    def bytes_for(heads: int, num_chunks: int, chunk: int, dim: int) -> int:
        labels = label_count(dim)
        return heads * (labels // 4 * code_row(num_chunks * chunk) + 2 * labels * 4 + 8 * labels + 2 * dim * 4)

    def top(self, query: torch.Tensor, n: int, resident=None, **churn) -> torch.Tensor:
        labelled = query.gather(2, self.channels[:, None].expand(-1, query.shape[1], -1))
        candidates = quant_key_topk(labelled, self.codes, self.bounds, 1, CANDIDATES * n)
        return candidate_key_topk(query, self.host_codes, self.host_bounds, candidates, n)

    def read_bytes(self, n: int) -> int:
        heads, tokens, quarter = self.host_codes.shape
        return heads * min(tokens, CANDIDATES * n) * quarter

    def device_bytes(self) -> int:
        return code_bytes(self.codes) + tensor_bytes(self.channels, self.bounds, self.host_bounds)

    def host_bytes(self) -> int:
        return tensor_bytes(self.host_codes)


LANDMARKS = {"keys": QuantKeys, "host-keys": HostKeys, "minmax": MinMaxLandmarks, "mean": MeanLandmarks,
             "detector": TokenDetector, "labels": LabelKeys}
