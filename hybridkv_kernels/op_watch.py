"""Count what one decode step asks of the device: tensor ops, kernel launches, host syncs.

:class:`OpWatch` is a ``TorchDispatchMode``: it sees every aten op the Python code issues, on
any device (so the CPU test suite can check the CUDA path's bookkeeping), and it counts a
Triton kernel launch as one op without looking inside it (:func:`watch_kernels` wraps the
kernels; under the interpreter a kernel's body would otherwise show as many tensor ops).

A *sync* is an op that makes the host wait for the device on CUDA: reading a value
(``aten._local_scalar_dense``: ``.item()``, ``int()``, ``bool()``) or an op whose output shape
depends on the data (``nonzero``, ``masked_select``, ``unique``, indexing with a boolean mask),
or a copy from the device into host memory (``.cpu()``; a non-blocking one into pinned memory
would not wait, but the decode path has none, so every such copy counts). Copies the other way
count when they block: from pageable host memory into the device, and a tensor made from host
data during the step (``torch.tensor(data, device=...)`` on a device of the CUDA path). That
call, ``.tolist()``, ``.cpu()`` and ``.numpy()`` are counted by name while the watch is active
(they do not reach the dispatcher, or not on CPU tensors).

On the CPU with ``HYBRIDKV_EMULATE_CUDA=1`` every tensor is a host tensor, so a copy cannot show
by its devices: give the watch the host stores (``host=``) and every torch op that reads or
writes them counts as a sync (on CUDA it would be a CPU op whose result a pageable copy sends to
the device). A Triton kernel reading them in place (pinned memory on CUDA) is a launch.

Launches: an aten op that runs device work counts as one launch, except the ops of
:data:`KERNELS_PER_OP` (``sort``, ``topk``: several kernels on CUDA), and each Triton launch
counts one.

With ``trace`` the watch also keeps each op's *signature*: its name, every tensor argument's
shape, dtype and strides (and its address, unless an op of the block made it), and every other
argument's value. Two steps with equal traces launch the same work on the same persistent
tensors with the same host values, which is what a CUDA graph replay of the first does for the
second: a host value that changes per step (a count, a grid size) or a tensor reallocated
between steps shows as a difference.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .dispatch import cuda_path, load_triton_module

#: Ops that read device data on the host or size their output by it.
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.nonzero_numpy.default",
            "aten.argwhere.default", "aten.masked_select.default",
            "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default"}

#: Ops that launch several kernels on CUDA: torch's ``topk`` is a radix select, a gather of the
#: selected entries and a sort of them (more for long rows: the select goes multi-block); ``sort``
#: a bitonic or segmented sort and the index fill. Lower bounds: the profiler on a GPU settles them.
KERNELS_PER_OP = {"aten.topk.default": 3, "aten.sort.default": 2, "aten.sort.stable": 2}

#: Ops that launch no device work: views and allocations.
FREE_OPS = {"aten.select.int", "aten.slice.Tensor", "aten.view.default", "aten._unsafe_view.default",
            "aten.unsqueeze.default", "aten.squeeze.dim", "aten.expand.default", "aten.t.default",
            "aten.transpose.int", "aten.permute.default", "aten.as_strided.default", "aten.alias.default",
            "aten.empty.memory_format", "aten.empty_like.default", "aten.lift_fresh.default",
            "aten.detach.default", "aten.detach_.default", "aten.new_empty.default", "aten.unbind.int", "aten.split.Tensor", "aten.split_with_sizes.default"}

#: Ops that may return their input (``.to`` to what it already is, ``reshape`` of a contiguous
#: tensor: no device work) or a new tensor (a copy: one launch).
MAYBE_ALIAS = {"aten.to.dtype", "aten.to.device", "aten.to.dtype_layout", "aten.to.other", "aten.reshape.default",
               "aten.contiguous.default", "aten.flatten.using_ints"}

#: Suffixes of the names under which the watch counts a sync.
SYNC_SUFFIXES = ("(bool mask)", "(device->host)", "(pageable->device)", "(host data)", "(host memory)", "(host read)")

#: Kernel modules and their launchable kernels.
KERNELS = {
    "_decode_attention_triton": ("ragged_decode_stage1_kernel", "merge_splits_kernel"),
    "_chunk_topk_triton": ("chunk_scores_kernel", "topk_select_kernel", "capped_topk_kernel"),
    "_chunk_gather_triton": ("gather_plan_kernel", "chunk_gather_kernel"),
    "_quant_keys_triton": ("quant_key_scores_kernel",),
    "_candidate_keys_triton": ("candidate_scores_kernel",),
    "_refresh_triton": ("refresh_scores_kernel", "refresh_trigger_kernel", "refresh_candidates_kernel"),
}


class OpWatch(TorchDispatchMode):
    """Records the aten ops (and kernel launches) issued inside the block.

    Attributes
    ----------
    ops : Counter
        Op name -> calls; launches as ``"launch:<kernel>"``.
    """

    def __init__(self, trace: bool = False, host=()):
        super().__init__()
        self.ops: Counter = Counter()
        self._host = {t.untyped_storage().data_ptr() for t in host if t is not None and t.numel()}
        self._patched: list = []
        self.trace: list | None = [] if trace else None
        self._made: set[int] = set()  # addresses of tensors the block's ops returned
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = str(func)
        if name in MAYBE_ALIAS:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.data_ptr() == args[0].data_ptr():
                return out  # a no-op conversion or a view: no device work
            name = self._count(name, args, kwargs)
        else:
            name = self._count(name, args, kwargs)  # counted first: a copy that fails was still asked for
            out = func(*args, **kwargs)
        self.record(name, args, kwargs, out)
        return out

    def _count(self, name: str, args, kwargs) -> str:
        """Count the op under its name, marked when it syncs (the module docstring)."""
        if name == "aten.index.Tensor" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            name = "aten.index.Tensor(bool mask)"  # sizes its output by the mask: a sync
        elif _to_host(name, args, kwargs):
            name = f"{name}(device->host)"  # the host waits for the copy: a sync
        elif _from_pageable(name, args, kwargs):
            name = f"{name}(pageable->device)"  # a blocking copy
        elif self._host and name not in FREE_OPS and any(
                t.untyped_storage().data_ptr() in self._host for t in _tensors((args, kwargs))):
            name = f"{name}(host memory)"  # a torch op on a host store: a CPU op + a pageable copy
        self.ops[name] += 1
        return name

    def record(self, name: str, args, kwargs, out=None) -> None:
        """Add an op's signature to the trace (see the module docstring)."""
        if self.trace is None:
            return
        self.trace.append((name, self._sig(args), self._sig(kwargs or {})))
        for t in _tensors(out):
            self._made.add(t.data_ptr())

    def _sig(self, x):
        if isinstance(x, torch.Tensor):
            where = "made" if x.data_ptr() in self._made else x.data_ptr()
            return ("T", tuple(x.shape), str(x.dtype), x.stride(), where)
        if isinstance(x, (list, tuple)):
            return tuple(self._sig(v) for v in x)
        if isinstance(x, dict):
            return tuple((k, self._sig(v)) for k, v in sorted(x.items()))
        return repr(x)

    def __enter__(self):
        self._patch(torch.Tensor, "tolist", "Tensor.tolist(host read)")
        for method in ("cpu", "numpy"):  # (a CUDA tensor's copy reaches the dispatcher: counted there)
            self._patch(torch.Tensor, method, f"Tensor.{method}(host read)", _emulated_host_read)
        self._patch(torch, "tensor", "torch.tensor(host data)", _to_step_device)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._patched:
                owner, method, original = self._patched.pop()
                setattr(owner, method, original)

    def _patch(self, owner, method: str, label: str, when=None) -> None:
        """Count calls of ``owner.method`` (those ``when(*args, **kwargs)`` accepts) as ``label``."""
        watch, original = self, getattr(owner, method)

        def counted(*args, **kwargs):
            if not watch._paused and (when is None or when(*args, **kwargs)):
                watch.ops[label] += 1
            return original(*args, **kwargs)

        self._patched.append((owner, method, original))
        setattr(owner, method, counted)

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def syncs(self) -> Counter:
        return Counter({k: v for k, v in self.ops.items() if k in SYNC_OPS or k.endswith(SYNC_SUFFIXES)})

    def total(self) -> int:
        return sum(self.ops.values())

    def launches(self) -> int:
        """Ops that run device work (kernel launches and aten ops other than views and
        allocations): what a step costs in launch latency on a GPU."""
        return sum(v * KERNELS_PER_OP.get(k, 1) for k, v in self.ops.items()
                   if k not in FREE_OPS and not k.startswith("Tensor."))


def _target(name: str, args, kwargs):
    """The device a conversion op copies to (None: the source's)."""
    if name == "aten.to.device":
        return args[1]
    if name == "aten.to.other":
        return args[1].device
    return kwargs.get("device")


def _to_host(name: str, args, kwargs) -> bool:
    """Whether the op copies a device tensor into host memory (``.cpu()``, ``.to("cpu")``,
    ``host.copy_(device)``)."""
    if name in ("aten._to_copy.default", "aten.to.dtype_layout", "aten.to.device", "aten.to.other"):
        target = _target(name, args, kwargs)
        return args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
    if name == "aten.copy_.default":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def _emulated_host_read(tensor, *args, **kwargs) -> bool:
    """Whether ``.cpu()``/``.numpy()`` of ``tensor`` is a device-to-host read the dispatcher does
    not see: a CPU tensor standing for a device one (``HYBRIDKV_EMULATE_CUDA``)."""
    return tensor.device.type == "cpu" and cuda_path(tensor)


def _to_step_device(data=None, *args, device=None, **kwargs) -> bool:
    """Whether ``torch.tensor(data, device=device)`` makes host data into a tensor on a device the
    CUDA path runs on (``cuda_path``: on CUDA, or any device when emulated): a blocking copy."""
    return device is not None and cuda_path(device)


def _from_pageable(name: str, args, kwargs) -> bool:
    """Whether the op copies pageable host memory into a device tensor (a blocking copy)."""
    if name in ("aten._to_copy.default", "aten.to.dtype_layout", "aten.to.device", "aten.to.other"):
        target = _target(name, args, kwargs)
        return (args[0].device.type == "cpu" and target is not None and torch.device(target).type != "cpu"
                and not args[0].is_pinned())
    if name == "aten.copy_.default":
        return args[0].device.type != "cpu" and args[1].device.type == "cpu" and not args[1].is_pinned()
    return False


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


class _Launcher:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` counts one launch."""

    def __init__(self, kernel, name: str, watch: OpWatch):
        self.kernel, self.name, self.watch = kernel, name, watch

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.watch.ops[f"launch:{self.name}"] += 1
            self.watch.record(f"launch:{self.name}", (grid, *args), kwargs)
            with self.watch.paused():
                return launch(*args, **kwargs)

        return run


@contextlib.contextmanager
def watch_kernels(watch: OpWatch):
    """Inside the block, every Triton kernel launch of this package counts as one op of
    ``watch`` and its body is not watched. The modules are restored on exit."""
    swapped = []
    try:
        for module_name, names in KERNELS.items():
            module = load_triton_module(module_name)
            for name in names:
                swapped.append((module, name, getattr(module, name)))
                setattr(module, name, _Launcher(getattr(module, name), name, watch))
        yield watch
    finally:
        for module, name, kernel in swapped:
            setattr(module, name, kernel)
