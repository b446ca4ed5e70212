"""Backend selection and loading of the Triton kernel modules.

Every public op takes ``backend="auto" | "torch" | "triton"`` and resolves it once per call,
with :func:`resolve_backend`, the one place the rule lives:

* ``"torch"``  -- the torch reference (also the production path on CPU).
* ``"triton"`` -- the Triton kernel: compiled for CUDA tensors; for CPU tensors the Triton
  interpreter, which needs ``TRITON_INTERPRET=1`` (see below), else ``RuntimeError``.
* ``"auto"``   -- Triton when the tensors take the CUDA path (:func:`cuda_path`) and triton
  imports; Triton through the interpreter when the tensors are on the CPU and the interpreter is
  active; else torch.

The CUDA path, emulated
-----------------------
Every choice that differs between CUDA and the CPU -- which backend ``"auto"`` takes, whether a
step may branch on a device value on the host -- asks :func:`cuda_path`. With
``HYBRIDKV_EMULATE_CUDA=1`` (and ``TRITON_INTERPRET=1``) it answers True for CPU tensors too, so
a CPU run takes exactly the choices and branches CUDA takes, its kernels under the interpreter:
what an op watch counts there (``op_watch.py``) is what a GPU step would launch and wait for.
Only memory facts stay real (pinned host memory and streams exist on CUDA only).

The interpreter mode
--------------------
``@triton.jit`` picks compiled vs interpreted *when the decorator runs*, from
``TRITON_INTERPRET``, and that includes triton's own library functions (``tl.zeros``,
``tl.max``, ``tl.sum``, ``tl.cumsum`` are ``@jit`` functions in ``triton/language/standard.py``).
So the interpreter works only if ``TRITON_INTERPRET=1`` was set before ``triton`` was first
imported -- by anyone: importing the transformers Qwen2.5-VL model imports triton, for example.
A process is therefore in one mode for good; :func:`triton_interpreting` reports which, by
looking at how triton's own library was built.

This package never imports triton at import time: the ``@triton.jit`` code lives in
``_*_triton.py`` modules that :func:`load_triton_module` imports on first use. Nothing here
changes the environment: a kernel module decorated in another mode than triton's library (the
variable changed after triton was imported) is refused with an error that says so. The tests
run the Triton cases in a subprocess started with ``TRITON_INTERPRET=1`` (see
``tests/test_kernels.py``), which works whatever the rest of the suite imported before.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from types import ModuleType

import torch

__all__ = [
    "BACKENDS",
    "EMULATE_ENV",
    "cuda_path",
    "emulating_cuda",
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

#: The environment variable that makes CPU tensors take the CUDA path (module docstring).
EMULATE_ENV = "HYBRIDKV_EMULATE_CUDA"

_WARNED: set[str] = set()


def interpret_requested() -> bool:
    """Whether the environment asks for the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def emulating_cuda() -> bool:
    """Whether ``HYBRIDKV_EMULATE_CUDA=1`` asks CPU tensors to take the CUDA path."""
    return os.environ.get(EMULATE_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def cuda_path(*where) -> bool:
    """Whether work on these tensors (or devices) takes the CUDA path: they are on CUDA, or
    :func:`emulating_cuda`. The one place the rule lives: every backend choice and every
    "may the host branch on a device value" decision asks it."""
    return emulating_cuda() or any(
        (w.is_cuda if isinstance(w, torch.Tensor) else torch.device(w).type == "cuda") for w in where)


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
    """Choose the implementation for tensors on one device (the rules: module docstring).

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
        interpreter is not active (with ``HYBRIDKV_EMULATE_CUDA=1``, ``"auto"`` too).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    on_gpu = any(t.is_cuda for t in tensors)
    emulated = not on_gpu and cuda_path(*tensors)
    if backend == "triton" or (emulated and HAS_TRITON):
        if _triton_language() is None:
            raise RuntimeError("backend='triton' requested but triton is not importable")
        if not on_gpu and not triton_interpreting():
            raise RuntimeError(
                f"backend='triton' on CPU tensors{' (' + EMULATE_ENV + '=1)' if emulated else ''} needs the "
                "Triton interpreter: set TRITON_INTERPRET=1 before triton is first imported (e.g. in the "
                "environment of the process)")
        return "triton"
    # auto
    if not HAS_TRITON:
        return "torch"
    if on_gpu:
        return "triton" if _triton_language() is not None else "torch"
    if interpret_requested():
        if triton_interpreting():
            return "triton"
        _warn_once("TRITON_INTERPRET=1 but triton was imported before it was set; "
                   "using the torch path")
    return "torch"


def load_triton_module(name: str) -> ModuleType:
    """Import the kernel module ``hybridkv_kernels/<name>.py`` (its ``@triton.jit`` code) on first use.

    Parameters
    ----------
    name : str
        File stem of the kernel module, e.g. ``"_decode_attention_triton"``.

    Raises
    ------
    RuntimeError
        triton is missing, or the module was decorated in another mode than triton's own
        library (``TRITON_INTERPRET`` changed after triton was first imported).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable")
    mod = importlib.import_module(f".{name}", __package__ or "hybridkv_kernels")
    interpreted = {type(v).__name__ == "InterpretedFunction" for v in vars(mod).values()
                   if type(v).__name__ in ("InterpretedFunction", "JITFunction")}
    if interpreted - {triton_interpreting()}:  # (a watched module's kernels are wrapped: nothing to compare)
        raise RuntimeError(f"{name}: its kernels and triton's library were built in different modes "
                           "(TRITON_INTERPRET changed after triton was first imported); set it before "
                           "the process starts")
    return mod


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)``."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-int(a) // int(b))
