"""Count what one decode step asks of the device: tensor ops, kernel launches, host syncs.

:class:`OpWatch` is a ``TorchDispatchMode``: it sees every aten op the Python code issues, on
any device (so the CPU test suite can check the CUDA path's bookkeeping), and it counts a
Triton kernel launch as one op without looking inside it (:func:`watch_kernels` wraps the
kernels; under the interpreter a kernel's body would otherwise show as many tensor ops).

A *sync* is an op that makes the host wait for the device on CUDA: reading a value
(``aten._local_scalar_dense``: ``.item()``, ``int()``, ``bool()``) or an op whose output shape
depends on the data (``nonzero``, ``masked_select``, ``unique``, indexing with a boolean mask),
or a copy from the device into host memory (``.cpu()``; a non-blocking one into pinned memory
would not wait, but the decode path has none, so every such copy counts).
``.tolist()`` does not go through the dispatcher, so the watch cannot see it; the code keeps
it out of decode steps by review.

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

from .dispatch import load_triton_module

#: Ops that read device data on the host or size their output by it.
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default"}

#: Ops that launch no device work: views and allocations.
FREE_OPS = {"aten.select.int", "aten.slice.Tensor", "aten.view.default", "aten._unsafe_view.default",
            "aten.unsqueeze.default", "aten.squeeze.dim", "aten.expand.default", "aten.t.default",
            "aten.transpose.int", "aten.permute.default", "aten.as_strided.default", "aten.alias.default",
            "aten.empty.memory_format", "aten.empty_like.default", "aten.lift_fresh.default",
            "aten.detach.default", "aten.unbind.int"}

#: Kernel modules and their launchable kernels.
KERNELS = {
    "_decode_attention_triton": ("ragged_decode_stage1_kernel", "merge_splits_kernel"),
    "_chunk_topk_triton": ("chunk_scores_kernel", "topk_select_kernel"),
    "_chunk_gather_triton": ("gather_plan_kernel", "chunk_gather_kernel"),
    "_quant_keys_triton": ("quant_key_scores_kernel",),
}


class OpWatch(TorchDispatchMode):
    """Records the aten ops (and kernel launches) issued inside the block.

    Attributes
    ----------
    ops : Counter
        Op name -> calls; launches as ``"launch:<kernel>"``.
    """

    def __init__(self, trace: bool = False):
        super().__init__()
        self.ops: Counter = Counter()
        self.trace: list | None = [] if trace else None
        self._made: set[int] = set()  # addresses of tensors the block's ops returned
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = None
        if not self._paused:
            name = str(func)
            if name == "aten.index.Tensor" and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
                name = "aten.index.Tensor(bool mask)"  # sizes its output by the mask: a sync
            elif _to_host(name, args, kwargs or {}):
                name = f"{name}(device->host)"  # the host waits for the copy: a sync
            self.ops[name] += 1
        out = func(*args, **(kwargs or {}))
        if name is not None:
            self.record(name, args, kwargs, out)
        return out

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

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def syncs(self) -> Counter:
        return Counter({k: v for k, v in self.ops.items() if k in SYNC_OPS or k.endswith(("(bool mask)", "(device->host)"))})

    def total(self) -> int:
        return sum(self.ops.values())

    def launches(self) -> int:
        """Ops that run device work (kernel launches and aten ops other than views and
        allocations): what a step costs in launch latency on a GPU."""
        return sum(v for k, v in self.ops.items() if k not in FREE_OPS)


def _to_host(name: str, args, kwargs) -> bool:
    """Whether the op copies a device tensor into host memory (``.cpu()``, ``.to("cpu")``,
    ``host.copy_(device)``)."""
    if name in ("aten._to_copy.default", "aten.to.dtype_layout"):
        target = kwargs.get("device")
        return args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
    if name == "aten.copy_.default":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
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
