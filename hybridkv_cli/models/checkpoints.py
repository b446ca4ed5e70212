"""The generic loader: a multimodal (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision) or text-decoder
checkpoint from a directory, a GGUF file or the hub.

It knows nothing of particular models: names with a loader of their own (the demo, SmolLM2) are
in the registry of :mod:`hybridkv_cli.models.registry`. Every model comes back in eval mode on its device
and dtype with ``"sdpa"`` attention; every failure is one :class:`~hybridkv_cli.io.errors.ModelError`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import torch

from hybridkv_cli.io.errors import ModelError
from hybridkv_cli.models.families import VL_MODEL_TYPES, supported_line
from hybridkv_cli.models.loaded import LoadedModel

TEXT_MODEL_TYPES = ("llama", "qwen2")  # RoPE + GQA decoders the policies are tested on

_FIX_HINT = (
    "download it first (`hf download {name}` while online), pass a local checkpoint directory "
    "to --model, or use --model demo"
)
_HUB_PROBE_TIMEOUT_S = 5.0


def load_checkpoint(name: str, dev: torch.device, dt: torch.dtype) -> LoadedModel:
    """Load ``name``: a ``.gguf`` file, a local checkpoint directory, or a hub id.

    Raises
    ------
    ModelError
        The path is not a supported checkpoint; the hub id is not cached locally and the hub is
        offline or unreachable; or loading failed (one line, no traceback).
    """
    path = Path(name).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".gguf":
            return load_gguf(str(path.parent), path.name, name, dev, dt)
        if not path.is_dir():
            raise ModelError("not a directory or a .gguf file (a model is a checkpoint directory, a GGUF file or "
                             "a hub id)", source=name)
        _check_local_checkpoint(path, name)
        return _from_pretrained(str(path), name, dev, dt, local_files_only=True)

    if _looks_like_path(name):
        raise ModelError("no such file or directory", source=name)
    _validate_hub_id(name)
    return _load_hub(name, dev, dt)


def load_gguf(folder: str, file: str, name: str, dev: torch.device, dt: torch.dtype) -> LoadedModel:
    """Load the GGUF ``file`` in ``folder`` (a text decoder), shown to the user as ``name``."""
    return _from_pretrained(folder, name, dev, dt, local_files_only=True, gguf_file=file)


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a filesystem path rather than a hub id (org/name)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")


def _validate_hub_id(name: str) -> None:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except Exception:  # HFValidationError
        raise ModelError("no such directory, and not a valid hub id (expected org/name)", source=name) from None


def _check_local_checkpoint(path: Path, name: str) -> None:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError("no config.json in this directory: not a Hugging Face model checkpoint", source=name)
    _check_model_type(_read_model_type(config_file, name), name)


def _read_model_type(config_file: Path, name: str) -> str | None:
    try:
        return json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as exc:
        raise ModelError(f"config.json is unreadable ({_first_line(exc)})", source=name) from None


def _check_model_type(model_type: str | None, name: str) -> None:
    if model_type is not None and model_type not in VL_MODEL_TYPES and model_type not in TEXT_MODEL_TYPES:
        raise ModelError(f"is a {model_type!r} model; {supported_line(TEXT_MODEL_TYPES)}", source=name)


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (the variable is re-read: it may change at run time)."""
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in {"1", "ON", "YES", "TRUE"}
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover
        return False


def _cached_config(name: str) -> Path | None:
    """The cached ``config.json`` of hub repo ``name`` (no network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:
        return None
    return Path(found) if isinstance(found, str) else None


def _hub_reachable() -> bool:
    """A cheap reachability probe (a HEAD on the hub endpoint, a few seconds at most)."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session

        get_session().head(constants.ENDPOINT, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001
        return not _is_network_failure(exc)
    return True


def _load_hub(name: str, dev: torch.device, dt: torch.dtype) -> LoadedModel:
    offline = _hub_offline()
    cached = _cached_config(name)
    if cached is not None:
        _check_model_type(_read_model_type(cached, name), name)
        try:  # everything cached: no network at all
            return _from_pretrained(name, name, dev, dt, local_files_only=True)
        except _NotCached:
            pass
    state = "is only partly cached locally" if cached is not None else "is not cached locally"
    if offline:
        raise ModelError(
            f"{state} and the Hugging Face hub is offline (HF_HUB_OFFLINE is set); {_FIX_HINT.format(name=name)}",
            source=name,
        )
    unreachable = f"{state} and the Hugging Face hub is unreachable; {_FIX_HINT.format(name=name)}"
    if not _hub_reachable():
        raise ModelError(unreachable, source=name)
    try:
        return _from_pretrained(name, name, dev, dt, local_files_only=False)
    except _NotCached:
        raise ModelError(unreachable, source=name) from None


class _NotCached(Exception):
    """Files missing locally and the hub not reachable (internal signal)."""


_NETWORK_ERROR_NAMES = {
    "LocalEntryNotFoundError",
    "OfflineModeIsEnabled",
    "ConnectionError",
    "ConnectError",
    "ConnectTimeout",
    "ReadTimeout",
    "Timeout",
    "TimeoutException",
    "NetworkError",
    "TransportError",
    "ProxyError",
}


def _is_network_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or its cause chain) says: hub unreachable / file not in the local cache."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ in _NETWORK_ERROR_NAMES for cls in type(exc).__mro__):
            return True
        text = str(exc)
        if (
            "couldn't connect to" in text
            or "offline mode" in text.lower()
            or "Cannot find the requested files" in text
            or "local_files_only" in text
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _from_pretrained(
    source: str, name: str, dev: torch.device, dt: torch.dtype, *, local_files_only: bool,
    gguf_file: str | None = None,
) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    is_dir = os.path.isdir(source)
    where = dict(local_files_only=local_files_only, gguf_file=gguf_file)
    # GGUF de-quantisation draws a raw tqdm bar on stderr; callers show their own status.
    hush = contextlib.redirect_stderr(io.StringIO()) if gguf_file else contextlib.nullcontext()
    try:
        model_type = AutoConfig.from_pretrained(source, **where).model_type
        _check_model_type(model_type, name)
        if model_type in VL_MODEL_TYPES:
            model_class, processor_class = AutoModelForImageTextToText, AutoProcessor
        else:
            model_class, processor_class = AutoModelForCausalLM, AutoTokenizer
        with hush:
            model = model_class.from_pretrained(source, dtype=dt, attn_implementation="sdpa", **where)
        processor = processor_class.from_pretrained(source, **where)
        # device_map= would need `accelerate` (not a dependency): load on CPU, then move.
        model.to(dev).eval()
    except (KeyboardInterrupt, MemoryError, ModelError):
        raise
    except Exception as exc:  # noqa: BLE001 - the user gets one line, not a traceback
        # A hub id read from the cache only: a missing file means "not (completely) cached".
        missing_locally = local_files_only and isinstance(exc, OSError)
        if not is_dir and (missing_locally or _is_network_failure(exc)):
            raise _NotCached(str(exc)) from None
        raise ModelError(f"could not load the model: {_first_line(exc)}", source=name) from None
    return LoadedModel(model=model, processor=processor, name=name, device=dev, dtype=dt)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]
