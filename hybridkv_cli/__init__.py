"""hybridkv: answer questions about videos and image sets with Qwen2.5-VL under a KV-cache budget.

``from hybridkv_cli import ask, load_media, load_model``, and ``compress`` (compression around a
model of one's own: ``with compress(model, method="snapkv", budget=0.1) as run: model.generate(...)``,
docs/library.md); they are imported on first use so that
the CLI's ``--help`` and error paths do not pay for torch and transformers.
"""

__all__ = ["ask", "compress", "load_media", "load_model"]

_HOMES = {"ask": "hybridkv_cli.api", "compress": "hybridkv_cli.library", "load_media": "hybridkv_cli.media",
          "load_model": "hybridkv_cli.models.registry"}


def __getattr__(name):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'hybridkv_cli' has no attribute {name!r}")
