"""hybridkv_kernels: decode-path kernels of HybridKV, each beside its torch reference.

Public ops (each takes ``backend="auto" | "torch" | "triton"``, see :mod:`.dispatch`):

- :func:`ragged_decode_attention` -- split-KV decode attention over the per-head ragged store
  plus generated tokens; :func:`dense_decode_attention` runs a full cache through it, and
  :func:`batched_decode_attention` the stores of several sequences in one launch and
  :func:`chunk_decode_attention` their chunks (a question read after each prefix) in one.
- :func:`chunk_topk` -- landmark scores (max over the query group) and top-k chunk ids.
- :func:`quant_key_topk` -- the same from every token's key at 2 bits per channel
  (:func:`pack_keys`): a chunk scores as its best token.
- :func:`candidate_key_topk` -- re-rank stage 1's candidate tokens by their 2-bit keys, kept
  token-major in (pinned) host memory (:func:`pack_keys_by_token`) and read there in place.
- :func:`chunk_gather` -- load missing chunks from the host store into device slots.
- :func:`chunk_retrieve` -- both, for the dynamic heads of several sequences in one pass.
- :func:`cap_scores` -- at most ``limit`` new chunks a head a step (the scores a capped top-k ranks).
- :func:`refresh_want` -- the refresh of pruned heads on the device (drift, trigger, re-selection).
- :func:`window_scores` -- causal window attention + max-pooled scores (prefill; torch only).

There is deliberately no top-level ``kernels`` import, which transformers would take for the
hub-kernels library.
triton is optional: nothing here imports it until a Triton kernel is first used.
"""

from .batched_retrieval import RetrievalPart, RetrievalTable, chunk_retrieve, retrieval_table
from .candidate_keys import candidate_key_scores_torch, candidate_key_topk, pack_keys_by_token
from .chunk_gather import chunk_gather, chunk_gather_torch, chunk_gather_triton, gather_plan
from .chunk_topk import chunk_scores_torch, chunk_topk, chunk_topk_torch, chunk_topk_triton
from .decode_attention import (
    batched_decode_attention,
    chunk_decode_attention,
    decode_split_heuristic,
    dense_decode_attention,
    ragged_decode_attention,
    ragged_decode_attention_torch,
    ragged_decode_attention_triton,
)
from .dispatch import BACKENDS, HAS_TRITON, cuda_path, emulating_cuda, resolve_backend, triton_interpreting
from .quant_keys import aligned_rows, code_row, pack_keys, quant_key_scores_torch, quant_key_topk, unpack_codes
from .refresh_step import RefreshState, refresh_want
from .segments import RaggedKV, SegmentTable, segment_table
from .swap_cap import cap_scores
from .window_scores import window_scores, window_scores_torch

__all__ = [
    "aligned_rows",
    "BACKENDS",
    "RaggedKV",
    "RetrievalPart",
    "RetrievalTable",
    "SegmentTable",
    "batched_decode_attention",
    "chunk_decode_attention",
    "candidate_key_scores_torch",
    "candidate_key_topk",
    "HAS_TRITON",
    "chunk_gather",
    "chunk_gather_torch",
    "chunk_gather_triton",
    "cap_scores",
    "chunk_retrieve",
    "chunk_scores_torch",
    "chunk_topk",
    "chunk_topk_torch",
    "chunk_topk_triton",
    "code_row",
    "cuda_path",
    "decode_split_heuristic",
    "dense_decode_attention",
    "emulating_cuda",
    "gather_plan",
    "pack_keys",
    "pack_keys_by_token",
    "quant_key_scores_torch",
    "quant_key_topk",
    "ragged_decode_attention",
    "ragged_decode_attention_torch",
    "ragged_decode_attention_triton",
    "refresh_want",
    "RefreshState",
    "resolve_backend",
    "retrieval_table",
    "segment_table",
    "triton_interpreting",
    "unpack_codes",
    "window_scores",
    "window_scores_torch",
]
