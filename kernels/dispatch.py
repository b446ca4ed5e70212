"""Backend selection and lazy loading of the Triton kernel modules.

Every public op takes ``backend="auto" | "torch" | "triton"``:

* ``"torch"``  -- the torch reference (also the production path on CPU).
* ``"triton"`` -- the Triton kernel: compiled for CUDA tensors; for CPU tensors the Triton
  interpreter, which needs ``TRITON_INTERPRET=1`` (see below), else ``RuntimeError``.
* ``"auto"``   -- Triton when the tensors are on CUDA and triton imports; Triton through the
  interpreter when the tensors are on the CPU and the interpreter is active; else torch.
  One exception: ``chunk_gather`` on CUDA picks its torch side-stream copy under "auto" until
  the zero-copy kernel has been validated on a GPU (``chunk_gather.GATHER_AUTO_ZERO_COPY``).

The interpreter switch
----------------------
``@triton.jit`` picks compiled vs interpreted *when the decorator runs*, and that includes
triton's own library functions (``tl.zeros``, ``tl.max``, ``tl.sum``, ``tl.cumsum`` are
``@jit`` functions in ``triton/language/standard.py``). So the interpreter works only if
``TRITON_INTERPRET=1`` was set before ``triton`` was first imported -- by anyone: importing
the transformers Qwen2.5-VL model imports triton, for example. A process is therefore in one
mode for good; :func:`triton_interpreting` reports which, by looking at how triton's own
library was built (not at the environment, which may have changed since).

To follow that mode, this package never imports triton at import time: the ``@triton.jit``
code lives in ``_*_triton.py`` modules that :func:`load_triton_module` executes on first use,
with ``TRITON_INTERPRET`` set to the process's mode while the decorators run, so our kernels
always match triton's library. The tests run the Triton cases in a subprocess started with
``TRITON_INTERPRET=1`` (see ``tests/test_kernels.py``), which works whatever the rest of the
suite imported before.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import warnings
from types import ModuleType

import torch

__all__ = [
    "BACKENDS",
    "HAS_TRITON",
    "interpret_requested",
    "load_triton_module",
    "next_power_of_2",
    "resolve_backend",
    "triton_interpreting",
]

BACKENDS = ("auto", "torch", "triton")

# triton is optional: the package and every torch path work without it. Only look for it
# here; importing it would freeze the interpreter mode (see the module docstring).
HAS_TRITON = importlib.util.find_spec("triton") is not None

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOCK = threading.Lock()
_MODULES: dict[str, ModuleType] = {}
_WARNED: set[str] = set()


def interpret_requested() -> bool:
    """Whether the environment asks for the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_language():
    """``triton.language`` or None when triton is missing or does not import."""
    if not HAS_TRITON:
        return None
    try:
        import triton.language as tl
    except Exception:  # pragma: no cover - broken installs
        return None
    return tl


def triton_interpreting() -> bool:
    """Whether this process's triton was imported in interpreter mode (imports triton).

    Returns False when triton is missing.
    """
    tl = _triton_language()
    return tl is not None and type(tl.standard.zeros).__name__ == "InterpretedFunction"


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Choose the implementation for tensors on one device.

    Parameters
    ----------
    backend : {"auto", "torch", "triton"}
        The caller's request.
    *tensors : torch.Tensor
        The op's device tensors (host-side tensors of ``chunk_gather`` are not passed).

    Returns
    -------
    str
        ``"torch"`` or ``"triton"``. Whether the Triton kernels are compiled or interpreted is
        the process's mode (:func:`triton_interpreting`).

    Raises
    ------
    ValueError
        Unknown backend name.
    RuntimeError
        ``backend="triton"`` while triton is not importable, or on CPU tensors while the
        interpreter is not active.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    on_cuda = any(t.is_cuda for t in tensors)
    if backend == "triton":
        if _triton_language() is None:
            raise RuntimeError("backend='triton' requested but triton is not importable")
        if not on_cuda and not triton_interpreting():
            raise RuntimeError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before triton is first imported (e.g. in the environment "
                "of the process)")
        return "triton"
    # auto
    if not HAS_TRITON:
        return "torch"
    if on_cuda:
        return "triton" if _triton_language() is not None else "torch"
    if interpret_requested():
        if triton_interpreting():
            return "triton"
        _warn_once("TRITON_INTERPRET=1 but triton was imported before it was set; "
                   "using the torch path")
    return "torch"


def load_triton_module(name: str) -> ModuleType:
    """Execute ``kernels/<name>.py`` (the ``@triton.jit`` code) once, in the process's mode.

    Parameters
    ----------
    name : str
        File stem of the kernel module, e.g. ``"_decode_attention_triton"``.
    """
    mod = _MODULES.get(name)
    if mod is not None:
        return mod
    with _LOCK:
        mod = _MODULES.get(name)
        if mod is not None:
            return mod
        if not HAS_TRITON:
            raise RuntimeError("triton is not importable")
        interpret = triton_interpreting()
        qualname = f"{__package__ or 'hybridkv_kernels'}.{name}"
        spec = importlib.util.spec_from_file_location(qualname, os.path.join(_HERE, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            sys.modules[qualname] = mod  # so inspect / triton can resolve the module by name
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(qualname, None)
            raise
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
        mod.INTERPRET = interpret
        _MODULES[name] = mod
        return mod


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)``."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-int(a) // int(b))
