"""The kinds of object a compressed state may hold, what each saves, and what a loaded one must meet.

A compressed state (a policy, its layers' ``LayerKV`` and reports, the per-run dict) is copied and
saved by :mod:`hybridkv_cli.engine.graph`. Nothing there names code: an object is saved under a *kind*,
the short name of one class in :data:`KINDS`, with exactly the attributes :func:`attributes`
declares for it (its dataclass fields and the few counters set in ``__post_init__``), each of a
declared type. A file that names another kind, another attribute or a value of another type is
refused; a class that gains an attribute fails at save until it is declared here, and the
declarations are pinned by :func:`schema_digest` (a changed schema is a new file format).

:func:`check_layers` then checks what no type says: that every index a kernel follows (row
offsets, slots, heads, chunk ids) stays inside the tensors it indexes, for the model's geometry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
import typing
from functools import cache

import torch

from hybridkv_cli.compression.allocate import LayerPlan
from hybridkv_cli.compression.base import Policy
from hybridkv_cli.compression.detector import LowRankKeys
from hybridkv_cli.compression.full import Full
from hybridkv_cli.compression.hybridkv import HybridKV, HybridLayerKV, LayerRecord
from hybridkv_cli.compression.landmarks import (HostKeys, LabelKeys, MeanLandmarks, MinMaxLandmarks, QuantKeys,
                                                TokenDetector)
from hybridkv_cli.compression.lookm import LookM
from hybridkv_cli.compression.madakv import MadaKV, ModalityPlan
from hybridkv_cli.compression.quest import Quest, QuestLayerKV
from hybridkv_cli.compression.rcr import RCR
from hybridkv_cli.compression.refresh import RateController, Refresher, RefreshOptions
from hybridkv_cli.compression.retentivekv import RetentiveKV, RetentiveLayerKV
from hybridkv_cli.compression.retrieval import DynamicHeads
from hybridkv_cli.compression.route import Route
from hybridkv_cli.compression.snapkv import SnapKV
from hybridkv_cli.compression.sparsemm import SparseMM
from hybridkv_cli.compression.store import RaggedStore
from hybridkv_cli.compression.streamingllm import StreamingLLM

Tensor = torch.Tensor
_COUNTER = {"transferred": Tensor}

#: Every class a state may hold, by its kind name, with the attributes it sets besides its
#: dataclass fields (``__post_init__`` counters; all of a class that is no dataclass).
KINDS: dict[str, tuple[type, dict[str, object]]] = {
    "RaggedStore": (RaggedStore, {}),
    "HybridLayerKV": (HybridLayerKV, {}),
    "DynamicHeads": (DynamicHeads, _COUNTER),
    "Refresher": (Refresher, {**_COUNTER, "refreshes": Tensor, "clock": Tensor, "key_reads": Tensor}),
    "RateController": (RateController, {"options": RefreshOptions, "tau": Tensor}),
    "RefreshOptions": (RefreshOptions, {}),
    "LowRankKeys": (LowRankKeys, {}),
    "QuantKeys": (QuantKeys, {}),
    "HostKeys": (HostKeys, {}),
    "LabelKeys": (LabelKeys, {}),
    "MeanLandmarks": (MeanLandmarks, {}),
    "MinMaxLandmarks": (MinMaxLandmarks, {}),
    "TokenDetector": (TokenDetector, {}),
    "QuestLayerKV": (QuestLayerKV, {}),
    "RetentiveLayerKV": (RetentiveLayerKV, _COUNTER),
    "LayerRecord": (LayerRecord, {}),
    "LayerPlan": (LayerPlan, {}),
    "ModalityPlan": (ModalityPlan, {}),
    "Full": (Full, {}),
    "HybridKV": (HybridKV, {"_label_weights": list | None}),
    "RCR": (RCR, {}),
    "SnapKV": (SnapKV, {}),
    "LookM": (LookM, {}),
    "MadaKV": (MadaKV, {}),
    "Quest": (Quest, {}),
    "RetentiveKV": (RetentiveKV, {}),
    "StreamingLLM": (StreamingLLM, {}),
    "SparseMM": (SparseMM, {"_file_scores": list | None}),
    "Route": (Route, {"_layers": list[str], "_policies": dict[str, Policy], "_repeat": bool}),
}
KIND_OF: dict[type, str] = {cls: name for name, (cls, _) in KINDS.items()}

#: The dtypes a saved tensor may have, by name (nothing else is looked up).
DTYPES: dict[str, torch.dtype] = {str(t).removeprefix("torch."): t for t in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


@cache
def attributes(kind: str) -> dict[str, object]:
    """The attributes an object of ``kind`` saves, and the type of each."""
    cls, extra = KINDS[kind]
    fields = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return {**{k: v for k, v in fields.items() if k in names}, **extra}


#: Kinds whose every attribute is fixed once a layer is compressed (what ranks the offloaded KV).
_LANDMARKS = frozenset({"LowRankKeys", "QuantKeys", "HostKeys", "LabelKeys", "MeanLandmarks", "MinMaxLandmarks"})
#: The offloaded prompt KV of the kinds that hold it, read by decoding and never written.
_HOST_KV = frozenset({"host_k", "host_v"})


@cache
def read_only(kind: str) -> frozenset[str]:
    """The attributes of ``kind`` whose tensors nothing writes once a layer is compressed: the
    offloaded prompt KV and every landmark. A copy of a compressed state shares them
    (:class:`hybridkv_cli.engine.graph.Cloner`), so a question about a kept prefix copies what its
    decoding writes (the store, the slots, the counters), not the host KV."""
    if kind in _LANDMARKS:
        return frozenset(attributes(kind))
    return _HOST_KV if kind in ("DynamicHeads", "Refresher", "RetentiveLayerKV") else frozenset()


def schema_digest() -> str:
    """A digest of every kind and its attributes: a file written under another schema is another format."""
    text = ";".join(f"{kind}:{','.join(sorted(attributes(kind)))}" for kind in sorted(KINDS))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def conforms(value, hint) -> bool:
    """Whether a rebuilt ``value`` has the declared type ``hint`` (unions, lists, dicts, tuples,
    classes; ``object`` is any saved value; a float field takes an int)."""
    if hint is object or hint is typing.Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list or hint is list:
        return type(value) is list and all(conforms(v, args[0]) for v in value) if args else type(value) is list
    if origin is tuple or hint is tuple:
        return type(value) is tuple
    if origin is dict or hint is dict:
        return type(value) is dict and (not args or all(conforms(k, args[0]) and conforms(v, args[1])
                                                        for k, v in value.items()))
    if hint is float:
        return type(value) in (float, int)
    if hint in (int, bool, str):
        return type(value) is hint
    return isinstance(hint, type) and isinstance(value, hint)


# --- what a loaded state must meet -----------------------------------------------------------------
class StateError(ValueError):
    """A loaded state that breaks an invariant decoding relies on."""


def _need(ok, what: str) -> None:
    if not bool(ok):
        raise StateError(what)


def _tensor(t, what: str, shape: tuple | None = None, dtype: torch.dtype | None = None) -> None:
    _need(isinstance(t, Tensor), f"{what} is not a tensor")
    if shape is not None:
        _need(tuple(t.shape) == tuple(shape), f"{what} has shape {list(t.shape)}, expected {list(shape)}")
    if dtype is not None:
        _need(t.dtype == dtype, f"{what} is {str(t.dtype).removeprefix('torch.')}, expected "
                                f"{str(dtype).removeprefix('torch.')}")


def _within(t: Tensor, low: int, high: int, what: str) -> None:
    """Every value of ``t`` in ``[low, high)``."""
    _need(t.numel() == 0 or (int(t.min()) >= low and int(t.max()) < high), f"{what} out of range")


def _heads(heads, num_heads: int, what: str) -> int:
    _tensor(heads, what, dtype=torch.int64)
    _need(heads.dim() == 1, f"{what} is not a list of heads")
    _within(heads, 0, num_heads, what)
    _need(heads.unique().numel() == heads.numel(), f"{what} repeats a head")
    return heads.numel()


def check_store(s: RaggedStore, heads: int, dim: int, dtype: torch.dtype) -> None:
    _need(isinstance(s, RaggedStore), "a layer without its store")
    _tensor(s.keys, "store keys", dtype=dtype)
    _need(s.keys.dim() == 2 and s.keys.shape[1] == dim, f"store keys of shape {list(s.keys.shape)}, the model's "
                                                       f"heads have {dim} channels")
    _tensor(s.values, "store values", s.keys.shape, dtype)
    for name in ("offsets", "lengths"):
        _tensor(getattr(s, name), f"store {name}", (heads,), torch.int64)
    _within(s.lengths, 0, s.keys.shape[0] + 1, "store lengths")
    _within(s.offsets, 0, s.keys.shape[0] + 1, "store offsets")
    _within(s.offsets + s.lengths, 0, s.keys.shape[0] + 1, "store segments")
    _need(s.max_length == (int(s.lengths.max()) if heads else 0), "store max_length does not match its lengths")
    _tensor(s.gen_k, "generated keys", dtype=dtype)
    _need(s.gen_k.dim() == 3 and s.gen_k.shape[0] == heads and s.gen_k.shape[2] == dim, "generated keys' shape")
    _tensor(s.gen_v, "generated values", s.gen_k.shape, dtype)
    _need(0 <= s.n_gen <= s.gen_k.shape[1], "generated count out of range")


def _segment_end(store: RaggedStore, heads: Tensor) -> Tensor:
    return store.offsets[heads] + store.lengths[heads]


def _check_landmarks(marks, n: int, chunks: int, chunk: int, dim: int) -> None:
    if isinstance(marks, QuantKeys):
        _need(marks.chunk == chunk, "key landmarks of another chunk size")
        _tensor(marks.codes, "key codes", (n, dim // 4, chunks * chunk), torch.uint8)
        _tensor(marks.bounds, "key bounds", (n, 2, dim), torch.float32)
        _need(not isinstance(marks, HostKeys) or marks.codes.device.type == "cpu", "host key codes not in host memory")
    elif isinstance(marks, LabelKeys):
        _need(chunk == 1, "label landmarks of chunks longer than a token")
        labels = marks.channels.shape[-1] if isinstance(marks.channels, Tensor) and marks.channels.dim() == 2 else 0
        _tensor(marks.channels, "label channels", (n, labels), torch.int64)
        _need(0 < labels <= dim and labels % 4 == 0, "label channel count")
        _within(marks.channels, 0, dim, "label channels")
        _tensor(marks.codes, "label codes", (n, labels // 4, chunks), torch.uint8)
        _tensor(marks.bounds, "label bounds", (n, 2, labels), torch.float32)
        _tensor(marks.host_codes, "host key codes", (n, chunks, dim // 4), torch.uint8)
        _need(marks.host_codes.device.type == "cpu", "host key codes not in host memory")
        _tensor(marks.host_bounds, "host key bounds", (n, 2, dim), torch.float32)
    elif isinstance(marks, MeanLandmarks):
        _tensor(marks.codes, "mean landmarks", (n, chunks, dim), torch.int8)
        _tensor(marks.scale, "mean landmark scales", (n, chunks))
    elif isinstance(marks, MinMaxLandmarks):
        for name in ("low", "high"):
            _tensor(getattr(marks, name), f"{name} landmarks", (n, chunks, dim), torch.int8)
            _tensor(getattr(marks, f"{name}_scale"), f"{name} landmark scales", (n, chunks))
    elif isinstance(marks, TokenDetector):
        _need(marks.chunk == chunk, "detector landmarks of another chunk size")
        _check_low_rank(marks.keys, n, chunks * chunk, dim)
    else:
        raise StateError("dynamic heads without landmarks")


def _check_low_rank(keys, n: int, tokens: int, dim: int) -> None:
    _need(isinstance(keys, LowRankKeys), "a detector without its keys")
    _tensor(keys.basis, "detector basis", dtype=torch.float32)
    _need(keys.basis.dim() == 3 and keys.basis.shape[:2] == (n, dim), "detector basis' shape")
    rank = keys.basis.shape[2]
    _tensor(keys.codes, "detector codes", (n, rank, tokens), torch.int8)
    _tensor(keys.scale, "detector scales", (n, rank), torch.float32)


def _check_host(host_k, host_v, shape: tuple, dtype, what: str) -> None:
    _tensor(host_k, f"{what} host keys", shape, dtype)
    _tensor(host_v, f"{what} host values", shape, dtype)
    _need(host_k.device.type == "cpu" and host_v.device.type == "cpu", f"{what} host KV not in host memory")


def check_dynamic(d: DynamicHeads, store: RaggedStore, heads: int, dim: int, dtype) -> None:
    n = _heads(d.heads, heads, "dynamic heads")
    _need(d.host_k.dim() == 4, "dynamic host keys' shape")
    chunks, chunk = d.host_k.shape[1], d.host_k.shape[2]
    _check_host(d.host_k, d.host_v, (n, chunks, chunk, dim), dtype, "dynamic")
    _check_landmarks(d.landmarks, n, chunks, chunk, dim)
    _tensor(d.slot_base, "dynamic slot rows", (n,), torch.int64)
    _tensor(d.resident, "resident chunks", dtype=torch.int64)
    _need(d.resident.dim() == 2 and d.resident.shape[0] == n, "resident chunks' shape")
    _within(d.resident, -1, chunks, "resident chunks")
    slots = d.resident.shape[1] * chunk
    _need(((d.slot_base >= store.offsets[d.heads]) & (d.slot_base + slots <= _segment_end(store, d.heads))).all(),
          "dynamic slots outside their heads' rows")


def check_refresher(r: Refresher, store: RaggedStore, heads: int, dim: int, dtype) -> None:
    n = _heads(r.heads, heads, "refreshed heads")
    _need(r.host_k.dim() == 4, "refresh host keys' shape")
    tokens = r.host_k.shape[1]
    _check_host(r.host_k, r.host_v, (n, tokens, 1, dim), dtype, "refresh")
    _check_low_rank(r.detector, n, tokens, dim)
    _tensor(r.slot_base, "refresh slot rows", (n,), torch.int64)
    _tensor(r.resident, "refresh slots", dtype=torch.int64)
    _need(r.resident.dim() == 2 and r.resident.shape[0] == n, "refresh slots' shape")
    _within(r.resident, -1, tokens, "refresh slots")
    _tensor(r.fixed, "refresh fixed positions", dtype=torch.int64)
    _need(r.fixed.dim() == 2 and r.fixed.shape[0] == n, "refresh fixed positions' shape")
    _within(r.fixed, 0, tokens, "refresh fixed positions")
    _need(r.tail >= 0, "refresh tail out of range")
    rows = r.resident.shape[1] + r.tail
    _need(((r.slot_base >= store.offsets[r.heads]) & (r.slot_base + rows <= _segment_end(store, r.heads))).all(),
          "refresh slots outside their heads' rows")


def check_layer(kv, heads: int, dim: int, dtype: torch.dtype) -> None:
    """Refuse a layer whose indices could reach outside its tensors (:class:`StateError`)."""
    store = kv.store
    check_store(store, heads, dim, dtype)
    if isinstance(kv, HybridLayerKV):
        if kv.dynamic is not None:
            check_dynamic(kv.dynamic, store, heads, dim, dtype)
        if kv.refresher is not None:
            check_refresher(kv.refresher, store, heads, dim, dtype)
    elif isinstance(kv, QuestLayerKV):
        pages = kv.kmin.shape[1] if kv.kmin.dim() == 3 else -1
        _tensor(kv.kmin, "page minima", (heads, pages, dim))
        _tensor(kv.kmax, "page maxima", (heads, pages, dim))
        _need(0 <= kv.pages <= pages and kv.page_size >= 1 and pages * kv.page_size <= kv.length, "page counts")
        _need((store.lengths == kv.length).all(), "quest store is not the whole prompt")
    elif isinstance(kv, RetentiveLayerKV):
        if kv.resident is not None:
            _need(kv.host_k is not None and kv.host_k.dim() == 4, "retentive host keys' shape")
            states, group = kv.host_k.shape[1], kv.host_k.shape[2]
            _check_host(kv.host_k, kv.host_v, (heads, states, group, dim), dtype, "retentive")
            _tensor(kv.state_rows, "state rows", (heads, states), torch.int64)
            _within(kv.state_rows, 0, store.keys.shape[0], "state rows")
            _tensor(kv.slot_base, "retentive slot rows", (heads,), torch.int64)
            _within(kv.slot_base, 0, store.keys.shape[0] - group + 1, "retentive slot rows")
            _tensor(kv.resident, "retentive resident group", (heads, 1), torch.int64)
            _within(kv.resident, -1, states, "retentive resident group")
    else:
        _need(isinstance(kv, RaggedStore), f"a layer of kind {type(kv).__name__}")


def check_layers(layers: list, num_layers: int, heads: int, dim: int, dtype: torch.dtype) -> None:
    """:func:`check_layer` of every layer, and one layer per model layer."""
    _need(type(layers) is list and len(layers) == num_layers,
          f"{len(layers) if type(layers) is list else 'no'} layers, the model has {num_layers}")
    for index, kv in enumerate(layers):
        try:
            check_layer(kv, heads, dim, dtype)
        except StateError as e:
            raise StateError(f"layer {index}: {e}") from None
