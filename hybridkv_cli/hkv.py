"""``.hkv`` files: a compressed media prefix saved to disk and asked later (``hybridkv compress``).

A ``.hkv`` file is a safetensors file (no pickle): one ``uint8`` tensor per storage of the
compressed state (:mod:`hybridkv_cli.graph`: the device store, landmarks and detectors, the
host-offloaded KV, the refresh state; a storage of no bytes is left out), plus the prefix's token
roles, its token ids, attention mask and token types (of the media tokens, one value each, kept
in the header: :func:`_pack_tokens`) and the model's mRoPE offset; its metadata (``hybridkv``,
compact JSON) holds the format and library versions, the model fingerprint (name + a hash of its
config), the dtype, the method and its options, the object tree of the state, what the record
says about the media, and a SHA-256 of the tensor bytes. It is written to a temporary file beside the target and renamed over it (atomic).

Loading checks, in order, that the file is a safetensors file with hybridkv metadata, its format
and library version, model, dtype and method, then the checksum; any failure is one
:class:`CacheFileError` line (exit 1; a batch goes on with the next input).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from hybridkv_cli.errors import HybridKVError
from hybridkv_cli.graph import GraphError, flatten, rebuild
from hybridkv_cli.multi import CompressedPrefix, QuestionTemplate

SUFFIX = ".hkv"
FORMAT = "hybridkv-cache"
FORMAT_VERSION = 1
_META_KEY = "hybridkv"
_PREFIX = "prefix."  # tensor names of the prefix's per-token inputs
_EXTRA = ("visual", "rope_deltas")


class CacheFileError(HybridKVError):
    """A ``.hkv`` file that cannot be used: not a cache, truncated or corrupt, or written for
    another model, dtype, method or library version."""


def library_version() -> str:
    try:
        from importlib.metadata import version

        return version("hybridkv")
    except Exception:  # pragma: no cover - running from a checkout that is not installed
        return "0.1.0"


def model_fingerprint(loaded) -> dict:
    """The model's name and a SHA-256 of its config (dtype and attention settings left out)."""
    config = loaded.model.config.to_dict()

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()
                    if k not in ("dtype", "torch_dtype", "transformers_version") and not str(k).startswith("_")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    text = json.dumps(strip(config), sort_keys=True, default=str)
    return {"name": loaded.name, "config_sha256": hashlib.sha256(text.encode()).hexdigest()}


def is_cache_path(path: str) -> bool:
    return str(path).lower().endswith(SUFFIX)


def _policy_options(policy) -> dict:
    import dataclasses

    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(key.encode())
        h.update(memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else b"")
    return h.hexdigest()


def save(path: str | os.PathLike, prefix: CompressedPrefix, loaded) -> int:
    """Write ``prefix`` to ``path`` atomically; returns the file's size in bytes."""
    from safetensors.torch import save_file

    storages, info, tree = flatten((prefix.policy, prefix.state))
    # a storage of no bytes (an empty generated-KV buffer) is rebuilt empty: not stored
    tensors = {key: data.detach().cpu().contiguous() for key, data in storages.items() if data.numel()}
    tensors["visual"] = prefix.visual.cpu().to(torch.uint8)
    dtypes = {key: str(value.dtype).removeprefix("torch.") for key, value in prefix.prefix.items()}
    on_visual = _pack_tokens(prefix.prefix, prefix.visual.cpu(), tensors)
    if prefix.rope_deltas is not None:
        tensors["rope_deltas"] = prefix.rope_deltas.cpu().contiguous()
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": library_version(),
        "model": model_fingerprint(loaded),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "method": prefix.policy.name,
        "options": _policy_options(prefix.policy),
        "seen": prefix.seen,
        "template": {"head": prefix.template.head, "tail": prefix.template.tail},
        "prefix_dtypes": dtypes,
        "prefix_on_visual": on_visual,
        "storages": info,
        "tree": tree,
        "input": prefix.info,
        "role": prefix.role,
        "prefill_s": prefix.prefill_s,
        "compress_seconds": prefix.compress_seconds,
        "prefill_peak_bytes": prefix.prefill_peak_bytes,
        "device_bytes": prefix.device_bytes,
        "host_bytes": prefix.host_bytes,
        "sha256": _digest(tensors),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={_META_KEY: json.dumps(header, default=str, separators=(",", ":"))})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what a plain open() would give
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_header(path: str | os.PathLike) -> dict:
    """The metadata of a ``.hkv`` file (no tensor is read); :class:`CacheFileError` if it is none."""
    from safetensors import safe_open

    source = str(path)
    if not os.path.exists(path):
        raise CacheFileError("no such file", source)
    if os.path.isdir(path):
        raise CacheFileError("is a directory, not a cache file", source)
    try:
        with safe_open(source, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:
        raise CacheFileError(f"not a hybridkv cache file, or truncated ({_short(e)})", source) from None
    try:
        header = json.loads(meta[_META_KEY])
        if header.get("format") != FORMAT:
            raise ValueError
    except (KeyError, ValueError, TypeError, AttributeError):
        raise CacheFileError("not a hybridkv cache file (a safetensors file without hybridkv metadata)",
                             source) from None
    return header


def check_header(header: dict, loaded, source: str, method: str | None = None) -> None:
    """Refuse a file written by another format or library version, for another model or dtype,
    or (``method`` given) with another method."""
    if header.get("format_version") != FORMAT_VERSION:
        raise CacheFileError(f"cache format {header.get('format_version')}, this hybridkv reads format "
                             f"{FORMAT_VERSION}; compress the media again", source)
    if header.get("library_version") != library_version():
        raise CacheFileError(f"written by hybridkv {header.get('library_version')}, this is {library_version()}; "
                             "compress the media again", source)
    mine, theirs = model_fingerprint(loaded), header.get("model") or {}
    if theirs != mine:
        what = (f"model {theirs.get('name')}" if theirs.get("name") != mine["name"]
                else f"another configuration of {mine['name']}")
        raise CacheFileError(f"compressed with {what}, not {mine['name']}; pass --model {theirs.get('name')} or "
                             "compress again", source)
    dtype = str(loaded.dtype).removeprefix("torch.")
    if header.get("dtype") != dtype:
        raise CacheFileError(f"compressed in {header.get('dtype')}, the model runs in {dtype}; pass --dtype "
                             f"{header.get('dtype')}", source)
    if method is not None and header.get("method") != method:
        raise CacheFileError(f"compressed with method {header.get('method')}, not {method}; drop --method (the "
                             "file's method answers) or compress again", source)


def matches(header: dict, loaded, policy) -> bool:
    """Whether a file with ``header`` holds what ``policy`` on ``loaded`` would write now (``compress
    --resume`` keeps it): the same format and library version, model, dtype, method and options."""
    try:
        check_header(header, loaded, "", policy.name)
    except CacheFileError:
        return False
    return header.get("options") == json.loads(json.dumps(_policy_options(policy), default=str))


def load(path: str | os.PathLike, loaded, method: str | None = None) -> CompressedPrefix:
    """The compressed prefix saved in ``path``, on the model's device (see the module docstring)."""
    from safetensors.torch import load_file

    source = str(path)
    header = read_header(path)
    check_header(header, loaded, source, method)
    try:
        tensors = load_file(source, device="cpu")
    except Exception as e:
        raise CacheFileError(f"truncated or corrupt cache file ({_short(e)})", source) from None
    if _digest(tensors) != header.get("sha256"):
        raise CacheFileError("corrupt cache file (checksum mismatch)", source)
    device = loaded.device
    try:
        storages = {}
        for key, info in header["storages"].items():
            data = tensors[key] if key in tensors else torch.empty(0, dtype=torch.uint8)
            if info["device"] != "cpu":
                data = data.to(device)
            elif info.get("pinned") and torch.cuda.is_available():
                data = data.pin_memory()
            storages[key] = data
        policy, state = rebuild(storages, header["tree"])
        visual = tensors["visual"].to(torch.bool)
        prefix = _unpack_tokens(tensors, visual, header["prefix_dtypes"], header.get("prefix_on_visual", {}), device)
        template = QuestionTemplate(list(header["template"]["head"]), list(header["template"]["tail"]))
        return CompressedPrefix(
            policy=policy, state=tuple(state), seen=int(header["seen"]),
            visual=visual, prefix=prefix,
            rope_deltas=tensors.get("rope_deltas"), template=template,
            prefill_s=float(header["prefill_s"]), compress_seconds=float(header["compress_seconds"]),
            prefill_peak_bytes=int(header["prefill_peak_bytes"]), device_bytes=int(header["device_bytes"]),
            host_bytes=int(header["host_bytes"]), info=dict(header.get("input") or {}),
            role=str(header.get("role", "visual")),
        )
    except (GraphError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CacheFileError(f"corrupt cache file ({_short(e)})", source) from None


def _pack_tokens(per_token: dict, visual: torch.Tensor, tensors: dict) -> dict:
    """Put the prefix's per-token tensors (ids, attention mask, token types) into ``tensors``, in the
    narrowest dtype that holds them; one that has one value on every visual token (the media pad
    id, its token type, the mask) keeps only its other tokens, and that value is returned (by key)
    for the header: most of a prefix is media tokens."""
    on_visual = {}
    for key, value in per_token.items():
        flat = value.cpu().reshape(-1)
        media = flat[visual]
        if media.numel() and bool((media == media[0]).all()):
            on_visual[key], flat = int(media[0]), flat[~visual]
        tensors[_PREFIX + key] = _narrow(flat).contiguous()
    return on_visual


def _unpack_tokens(tensors: dict, visual: torch.Tensor, dtypes: dict, on_visual: dict, device) -> dict:
    """The per-token tensors ``[1, seen]`` that :func:`_pack_tokens` stored."""
    per_token = {}
    for name, stored in tensors.items():
        if name.startswith(_PREFIX):
            key = name.removeprefix(_PREFIX)
            value = stored.to(getattr(torch, dtypes[key])).reshape(-1)
            if key in on_visual:
                value = torch.full(visual.shape, on_visual[key], dtype=value.dtype).masked_scatter(~visual, value)
            per_token[key] = value.view(1, -1).to(device)
    return per_token


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """An integer tensor as uint8 or int32 when its values fit (token ids, masks, token types)."""
    if t.dtype.is_floating_point or t.numel() == 0:
        return t
    low, high = int(t.min()), int(t.max())
    if 0 <= low and high < 256:
        return t.to(torch.uint8)
    if -2**31 <= low and high < 2**31:
        return t.to(torch.int32)
    return t


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."
