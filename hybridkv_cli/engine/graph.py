"""Copy and flatten the state a compression leaves behind, with no pickle and no class names.

A compressed cache is a graph of small objects (a layer's ``LayerKV``, its ``RaggedStore``,
landmarks, detectors, refreshers, the reports, the per-run dict with the refresh controller)
holding tensors. :func:`flatten` turns such a graph into

* ``storages``: one flat ``uint8`` tensor per distinct tensor storage (so views of one storage,
  and one tensor reached twice, stay one storage), and
* ``tree``: a JSON-able description of the objects, containers and scalars, in which a tensor is
  (storage, dtype, shape, stride, offset), an object is its *kind* and its attributes
  (:mod:`hybridkv_cli.engine.state_kinds`), and an object reached twice is a reference,

and :func:`rebuild` turns them back into a graph of new objects. A kind is a key of a fixed table
and a dtype a key of another: nothing in a tree is imported or looked up by attribute, no
constructor runs, and every attribute must be one its kind declares, of the declared type.
:class:`Cloner` is the two in one process: independent copies of a compressed state (pinned host
memory stays pinned).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv_cli.compression.host_memory import host_empty
from hybridkv_cli.engine.state_kinds import DTYPES, KIND_OF, KINDS, attributes, conforms, read_only

#: Deepest nesting a tree may have (a state nests a few levels; a deeper tree is not one).
MAX_DEPTH = 32


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
        self._fixed = False  # flattening an attribute nothing writes after compression (state_kinds.read_only)
        self._written: set[str] = set()  # storages some other attribute reaches

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
        if not self._fixed:
            self._written.add(key)
        return {"T": {"s": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "stride": list(t.stride()), "off": t.storage_offset()}}

    def __call__(self, x: Any):
        if x is None or type(x) in (bool, int, str):
            return x
        if type(x) is float:
            return x if x == x and x not in (float("inf"), float("-inf")) else {"F": repr(x)}
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
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
        kind = KIND_OF.get(type(x))
        if kind is None:
            raise GraphError(f"cannot save a {type(x).__module__}.{type(x).__qualname__}")
        state, declared = vars(x), attributes(kind)
        if state.keys() != declared.keys():
            raise GraphError(f"a {kind} holds {sorted(state.keys() ^ declared.keys())}, which its kind does not "
                             "declare: declare it in hybridkv_cli/engine/state_kinds.py (a new cache format)")
        fixed, flat = read_only(kind), {}
        for k, v in state.items():
            self._fixed = k in fixed
            flat[k] = self(v)
        self._fixed = False
        return {"O": kind, "id": n, "s": flat}


def flatten(graph: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict], Any]:
    """``(storages, storage_info, tree)`` of ``graph`` (see the module docstring). The storages
    are byte views of the live tensors' storages, not copies; a storage's info says its device,
    whether it is pinned, and whether only attributes nothing writes reach it (``fixed``)."""
    f = _Flattener()
    with torch.inference_mode():
        tree = f(graph)
    for key, info in f.storage_info.items():
        info["fixed"] = key not in f._written
    return f.storages, f.storage_info, tree


def _ints(value, what: str) -> list[int]:
    if type(value) is not list or not all(type(v) is int and 0 <= v < 2**62 for v in value) or len(value) > 8:
        raise GraphError(f"a tensor's {what} is not a list of sizes")
    return value


class _Rebuilder:
    def __init__(self, storages: dict[str, torch.Tensor], checked: bool = True):
        self.storages = storages
        self.checked = checked  # a tree read from a file is checked; one flatten() just made is not
        self.typed: dict[tuple, torch.Tensor] = {}  # (storage, dtype) -> the storage viewed as that dtype
        self.objects: dict[int, Any] = {}
        self.depth = 0

    def tensor(self, spec) -> torch.Tensor:
        if not self.checked:  # a trusted tree (a clone): a view of its storage as the dtype, made once
            typed = self.typed.get((spec["s"], spec["dtype"]))
            if typed is None:
                data, dtype = self.storages[spec["s"]], DTYPES[spec["dtype"]]
                typed = self.typed[spec["s"], spec["dtype"]] = (
                    data.view(dtype) if data.numel() % dtype.itemsize == 0 else
                    torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), 0,
                                                                        [data.numel() // dtype.itemsize]))
            return typed.as_strided(spec["shape"], spec["stride"], spec["off"])
        if type(spec) is not dict or set(spec) != {"s", "dtype", "shape", "stride", "off"}:
            raise GraphError("a tensor without its storage, dtype, shape, stride and offset")
        data = self.storages.get(spec["s"]) if type(spec["s"]) is str else None
        dtype = DTYPES.get(spec["dtype"]) if type(spec["dtype"]) is str else None
        if data is None or dtype is None:
            raise GraphError(f"a tensor of a missing storage or an unknown dtype ({str(spec['dtype'])[:40]})")
        shape, stride = _ints(spec["shape"], "shape"), _ints(spec["stride"], "stride")
        off = _ints([spec["off"]], "offset")[0]
        if len(shape) != len(stride):
            raise GraphError("a tensor's shape and stride differ in length")
        need = off + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0
        if need * dtype.itemsize > data.numel() or (data.numel() and data.numel() % dtype.itemsize and need):
            raise GraphError("a tensor reaches past the end of its storage")
        return torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), off, shape, stride)

    def _new(self, n, value):
        if type(n) is not int or n in self.objects:
            raise GraphError("an object without a new id")
        self.objects[n] = value
        return value

    def __call__(self, x: Any):
        if x is None or type(x) in (bool, int, float, str):
            return x
        if type(x) is not dict:
            raise GraphError(f"bad node {type(x).__name__}")
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise GraphError(f"nested deeper than {MAX_DEPTH} levels")
            return self._node(x)
        finally:
            self.depth -= 1

    def _node(self, x: dict):
        if "T" in x:
            return self.tensor(x["T"])
        if "F" in x:
            if x["F"] not in ("inf", "-inf", "nan"):
                raise GraphError("a float that is not inf or nan")
            return float(x["F"])
        if "ref" in x:
            try:
                return self.objects[x["ref"]]
            except (KeyError, TypeError):
                raise GraphError("reference to an unknown object") from None
        n = x.get("id")
        if type(x.get("L")) is list:
            out = self._new(n, [])
            out.extend(self(v) for v in x["L"])
            return out
        if type(x.get("U")) is list:
            return self._new(n, tuple(self(v) for v in x["U"]))
        if type(x.get("D")) is list:
            out = self._new(n, {})
            for item in x["D"]:
                if type(item) is not list or len(item) != 2:
                    raise GraphError("a dict entry that is not a key and a value")
                key = self(item[0])
                if type(key) not in (str, int):
                    raise GraphError("a dict key that is not a name or a number")
                out[key] = self(item[1])
            return out
        if "O" in x:
            return self._object(n, x)
        raise GraphError(f"bad node with keys {sorted(map(str, x))[:8]}")

    def _object(self, n, x: dict):
        kind = x["O"]
        if type(kind) is not str or kind not in KINDS:
            raise GraphError(f"unknown kind of state '{str(kind)[:60]}'")
        declared, state = attributes(kind), x.get("s")
        if type(state) is not dict or state.keys() != declared.keys():
            raise GraphError(f"a {kind} without exactly its attributes")
        cls = KINDS[kind][0]
        out = self._new(n, cls.__new__(cls))
        values = {k: self(v) for k, v in state.items()}
        for k, v in values.items():
            if self.checked and not conforms(v, declared[k]):
                raise GraphError(f"a {kind}'s {k} is not a {getattr(declared[k], '__name__', declared[k])}")
        out.__dict__.update(values)
        return out


def rebuild(storages: dict[str, torch.Tensor], tree: Any, checked: bool = True) -> Any:
    """The graph ``tree`` describes, its tensors views of ``storages`` (uint8, one per key);
    ``checked``: every node, type and bound checked (a tree from a file), else trusted (one
    :func:`flatten` just made, in this process)."""
    with torch.inference_mode():
        return _Rebuilder(storages, checked)(tree)


#: where each storage a copy writes starts in its group's one buffer (a multiple of every dtype's
#: size, and of the CUDA allocator's own alignment, so kernels see what a storage of its own gives)
ALIGN = 512
#: a copy's buffers are filled up to this many bytes (a storage beyond it has one of its own):
#: the C library hands a larger block out as fresh pages every time, which costs more to write
#: than the copy (a 37 MB buffer ~2.5x the time of its storages copied one by one, on the CPU)
BUFFER_BYTES = 16 << 20


class Cloner:
    """Copies of one flattened graph that decode independently, made many times (a kept prefix
    is copied for each question): every object new; the storages something writes copied, those
    of a device and kind of memory by one ``cat`` into one buffer (pinned host memory staying
    pinned, each storage at an aligned offset in it; a buffer holds up to :data:`BUFFER_BYTES`);
    the ``fixed`` ones -- the offloaded KV and its landmarks, which nothing writes -- shared,
    their tensors made once and given to every copy. The tree (trusted: :func:`flatten` made it
    in this process) is read once, into a builder of a copy (:meth:`_plan`), so a copy walks no
    tree and checks nothing."""

    def __init__(self, storages: dict[str, torch.Tensor], info: dict[str, dict], tree: Any):
        self.groups: list[tuple] = []  # (device, pinned, the storages and pads in order, bytes)
        self.where: dict[str, tuple[int, int]] = {}  # written storage -> (its group, its byte offset)
        grouped: dict[tuple, list[str]] = {}
        for key, data in storages.items():
            if not info[key]["fixed"]:
                grouped.setdefault((data.device, info[key]["pinned"]), []).append(key)
        for (device, pinned), keys in grouped.items():
            parts, size = [], 0
            for key in keys:
                if parts and size + storages[key].numel() > BUFFER_BYTES:  # this buffer is full: the next
                    self.groups.append((device, pinned, parts, size))
                    parts, size = [], 0
                self.where[key] = (len(self.groups), size)
                parts.append(storages[key])
                size += storages[key].numel()
                if size % ALIGN:
                    parts.append(torch.zeros(ALIGN - size % ALIGN, dtype=torch.uint8, device=device))
                    size += parts[-1].numel()
            self.groups.append((device, pinned, parts, size))
        self.views: set[tuple[int, torch.dtype]] = set()  # (group, dtype): the buffers' views a copy takes
        self.fixed = _Rebuilder(storages, checked=False)  # makes the shared tensors, once
        with torch.inference_mode():
            self.build = self._plan(tree)[1]

    def __call__(self) -> Any:
        with torch.inference_mode():
            buffers = []
            for device, pinned, parts, size in self.groups:
                out = host_empty((size,), torch.uint8) if pinned else torch.empty(size, dtype=torch.uint8,
                                                                                  device=device)
                buffers.append(torch.cat(parts, out=out))
            return self.build({(group, dtype): buffers[group].view(dtype) for group, dtype in self.views}, {})

    def _plan(self, x) -> tuple[bool, Any]:
        """``(True, value)`` for a node every copy shares (a scalar, a fixed tensor), else
        ``(False, build)``: ``build(views, objects)`` makes the node's value for one copy (``views``:
        its buffers as each dtype; ``objects``: the copy's objects so far, by id, for references)."""
        if x is None or type(x) in (bool, int, float, str):
            return True, x
        if "T" in x:
            spec = x["T"]
            if spec["s"] not in self.where:
                return True, self.fixed.tensor(spec)
            group, start = self.where[spec["s"]]
            dtype = DTYPES[spec["dtype"]]
            view, shape, stride = (group, dtype), spec["shape"], spec["stride"]
            offset = start // dtype.itemsize + spec["off"]
            self.views.add(view)
            return False, lambda views, objects: views[view].as_strided(shape, stride, offset)
        if "F" in x:
            return True, float(x["F"])
        if "ref" in x:
            ref = x["ref"]
            return False, lambda views, objects: objects[ref]
        n = x["id"]
        if "O" in x:
            cls = KINDS[x["O"]][0]
            attrs = [(k, *self._plan(v)) for k, v in x["s"].items()]

            def build(views, objects):
                out = objects[n] = cls.__new__(cls)
                out.__dict__.update({k: v if shared else v(views, objects) for k, shared, v in attrs})
                return out
        elif "D" in x:
            items = [(key, *self._plan(v)) for key, v in x["D"]]

            def build(views, objects):
                out = objects[n] = {}
                for key, shared, v in items:
                    out[key] = v if shared else v(views, objects)
                return out
        elif "L" in x:
            items = [self._plan(v) for v in x["L"]]

            def build(views, objects):
                out = objects[n] = []
                out.extend(v if shared else v(views, objects) for shared, v in items)
                return out
        else:  # a tuple
            items = [self._plan(v) for v in x["U"]]

            def build(views, objects):
                out = objects[n] = tuple(v if shared else v(views, objects) for shared, v in items)
                return out
        return False, build


def to_device(graph: Any, device: torch.device) -> Any:
    """``graph`` with its tensors in unpinned host memory moved to ``device``: a state compressed
    in host memory (a streamed prefill's) made ready to decode there. Pinned host memory, the
    state a policy keeps on the host (:func:`~hybridkv_cli.compression.store.to_host`), stays."""
    if device.type == "cpu":
        return graph
    storages, info, tree = flatten(graph)
    with torch.inference_mode():
        moved = {key: data if info[key]["device"] != "cpu" or info[key]["pinned"] else data.to(device)
                 for key, data in storages.items()}
    return rebuild(moved, tree, checked=False)
