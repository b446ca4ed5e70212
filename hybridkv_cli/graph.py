"""Copy and flatten the state a compression leaves behind, with no pickle.

A compressed cache is a graph of small objects from ``hybridkv_cli.compression`` (a layer's
``LayerKV``, its ``RaggedStore``, landmarks, detectors, refreshers, the reports, the per-run
dict with the refresh controller) holding tensors. :func:`flatten` turns such a graph into

* ``storages``: one flat ``uint8`` tensor per distinct tensor storage (so views of one storage,
  and one tensor reached twice, stay one storage), and
* ``tree``: a JSON-able description of the objects, containers and scalars, in which a tensor is
  (storage, dtype, shape, stride, offset) and an object reached twice is a reference,

and :func:`rebuild` turns them back into a graph of new objects. Only classes defined in
``hybridkv_cli.compression`` are rebuilt (by ``__new__`` and their ``__dict__``; no constructor
runs); anything else is refused, so a file can name no other code. :func:`clone` is the two in
one process: an independent copy of a compressed state (pinned host memory stays pinned).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

ALLOWED_MODULE = "hybridkv_cli.compression"


class GraphError(ValueError):
    """A graph that cannot be flattened or rebuilt (an unknown class, a bad tree)."""


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _Flattener:
    def __init__(self):
        self.storages: dict[str, torch.Tensor] = {}
        self.storage_info: dict[str, dict] = {}
        self._storage_keys: dict[tuple, str] = {}
        self._objects: dict[int, int] = {}
        self._alive: list = []  # keeps ids stable while flattening

    def tensor(self, t: torch.Tensor) -> dict:
        storage = t.untyped_storage()
        ident = (str(t.device), storage.data_ptr(), storage.nbytes())
        key = self._storage_keys.get(ident) if storage.nbytes() else None
        if key is None:
            key = f"s{len(self.storages)}"
            self.storages[key] = _byte_view(storage, t.device)
            self.storage_info[key] = {"device": t.device.type,
                                      "pinned": bool(t.device.type == "cpu" and storage.nbytes() and t.is_pinned())}
            if storage.nbytes():
                self._storage_keys[ident] = key
        return {"T": {"s": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "stride": list(t.stride()), "off": t.storage_offset()}}

    def __call__(self, x: Any):
        if x is None or type(x) in (bool, int, str):
            return x
        if type(x) is float:
            return x if x == x and x not in (float("inf"), float("-inf")) else {"F": repr(x)}
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        if isinstance(x, torch.device):
            return {"dev": str(x)}
        if isinstance(x, torch.dtype):
            return {"dt": str(x).removeprefix("torch.")}
        if id(x) in self._objects:
            return {"ref": self._objects[id(x)]}
        n = len(self._objects)
        self._objects[id(x)] = n
        self._alive.append(x)
        if type(x) is list:
            return {"L": [self(v) for v in x], "id": n}
        if type(x) is tuple:
            return {"U": [self(v) for v in x], "id": n}
        if type(x) is dict:
            return {"D": [[self(k), self(v)] for k, v in x.items()], "id": n}
        cls = type(x)
        if not cls.__module__.startswith(ALLOWED_MODULE) or not hasattr(x, "__dict__"):
            raise GraphError(f"cannot save a {cls.__module__}.{cls.__qualname__}")
        if isinstance(x, tuple):  # a NamedTuple
            return {"O": f"{cls.__module__}:{cls.__qualname__}", "id": n, "items": [self(v) for v in x]}
        return {"O": f"{cls.__module__}:{cls.__qualname__}", "id": n,
                "s": {k: self(v) for k, v in vars(x).items()}}


def flatten(graph: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict], Any]:
    """``(storages, storage_info, tree)`` of ``graph`` (see the module docstring). The storages
    are byte views of the live tensors' storages, not copies."""
    f = _Flattener()
    with torch.inference_mode():
        tree = f(graph)
    return f.storages, f.storage_info, tree


def _class(name: str):
    module, _, qualname = name.partition(":")
    if not (module == ALLOWED_MODULE or module.startswith(ALLOWED_MODULE + ".")):
        raise GraphError(f"refusing to rebuild {name}: not a compression class")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise GraphError(f"unknown class {name}") from None
    if not isinstance(obj, type):
        raise GraphError(f"{name} is not a class")
    return obj


class _Rebuilder:
    def __init__(self, storages: dict[str, torch.Tensor]):
        self.storages = storages
        self.objects: dict[int, Any] = {}

    def tensor(self, spec: dict) -> torch.Tensor:
        try:
            data = self.storages[spec["s"]]
            dtype = getattr(torch, spec["dtype"])
        except (KeyError, AttributeError):
            raise GraphError(f"tensor of a missing storage or dtype: {spec}") from None
        if not isinstance(dtype, torch.dtype):
            raise GraphError(f"not a dtype: {spec['dtype']}")
        shape, stride, off = spec["shape"], spec["stride"], spec["off"]
        need = off + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0
        if need * dtype.itemsize > data.numel():
            raise GraphError("a tensor reaches past the end of its storage")
        return torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), off, shape, stride)

    def __call__(self, x: Any):
        if x is None or type(x) in (bool, int, float, str):
            return x
        if type(x) is not dict:
            raise GraphError(f"bad node {type(x).__name__}")
        if "T" in x:
            return self.tensor(x["T"])
        if "F" in x:
            return float(x["F"])
        if "dev" in x:
            return torch.device(x["dev"])
        if "dt" in x:
            return getattr(torch, x["dt"])
        if "ref" in x:
            try:
                return self.objects[x["ref"]]
            except KeyError:
                raise GraphError("reference to an unknown object") from None
        n = x.get("id")
        if "L" in x:
            out = self.objects[n] = []
            out.extend(self(v) for v in x["L"])
            return out
        if "U" in x:
            out = self.objects[n] = tuple(self(v) for v in x["U"])
            return out
        if "D" in x:
            out = self.objects[n] = {}
            for k, v in x["D"]:
                out[self(k)] = self(v)
            return out
        if "O" in x:
            cls = _class(x["O"])
            if "items" in x:
                out = self.objects[n] = cls(*(self(v) for v in x["items"]))
                return out
            out = self.objects[n] = cls.__new__(cls)
            out.__dict__.update({k: self(v) for k, v in x["s"].items()})
            return out
        raise GraphError(f"bad node with keys {sorted(x)}")


def rebuild(storages: dict[str, torch.Tensor], tree: Any) -> Any:
    """The graph ``tree`` describes, its tensors views of ``storages`` (uint8, one per key)."""
    with torch.inference_mode():
        return _Rebuilder(storages)(tree)


def clone(graph: Any) -> Any:
    """An independent copy of ``graph``: every storage copied once (views stay views of the copy,
    pinned host memory stays pinned), every object new."""
    storages, info, tree = flatten(graph)
    with torch.inference_mode():
        copies = {}
        for key, data in storages.items():
            if info[key]["pinned"]:
                copies[key] = torch.empty(data.shape, dtype=torch.uint8, pin_memory=True).copy_(data)
            else:
                copies[key] = data.clone()
    return rebuild(copies, tree)
