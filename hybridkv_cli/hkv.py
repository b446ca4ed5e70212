"""``.hkv`` files: a compressed media prefix saved to disk and asked later (``hybridkv compress``).

A ``.hkv`` file is a safetensors file (no pickle): one ``uint8`` tensor per storage of the
compressed state (:mod:`hybridkv_cli.graph`: the device store, landmarks and detectors, the
host-offloaded KV, the refresh state), plus the prefix's token ids, roles and token types and the
model's mRoPE offset; its metadata (``hybridkv``, JSON) holds the format and library versions,
the model fingerprint (name + a hash of its config), the dtype, the method and its options, the
object tree of the state, what the record says about the media, and a SHA-256 of the tensor
bytes. It is written to a temporary file beside the target and renamed over it (atomic).

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
    tensors = {key: data.detach().cpu().contiguous() for key, data in storages.items()}
    tensors["visual"] = prefix.visual.cpu().to(torch.uint8)
    dtypes = {}
    for key, value in prefix.prefix.items():  # ids and token types, stored in the narrowest dtype that holds them
        dtypes[key] = str(value.dtype).removeprefix("torch.")
        tensors[_PREFIX + key] = _narrow(value.cpu()).contiguous()
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
        save_file(tensors, tmp, metadata={_META_KEY: json.dumps(header, default=str)})
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
            data = tensors[key]
            if info["device"] != "cpu":
                data = data.to(device)
            elif info.get("pinned") and torch.cuda.is_available():
                data = data.pin_memory()
            storages[key] = data
        policy, state = rebuild(storages, header["tree"])
        dtypes = header["prefix_dtypes"]
        prefix = {k.removeprefix(_PREFIX): v.to(device=device, dtype=getattr(torch, dtypes[k.removeprefix(_PREFIX)]))
                  for k, v in tensors.items() if k.startswith(_PREFIX)}
        template = QuestionTemplate(list(header["template"]["head"]), list(header["template"]["tail"]))
        return CompressedPrefix(
            policy=policy, state=tuple(state), seen=int(header["seen"]),
            visual=tensors["visual"].to(torch.bool), prefix=prefix,
            rope_deltas=tensors.get("rope_deltas"), template=template,
            prefill_s=float(header["prefill_s"]), compress_seconds=float(header["compress_seconds"]),
            prefill_peak_bytes=int(header["prefill_peak_bytes"]), device_bytes=int(header["device_bytes"]),
            host_bytes=int(header["host_bytes"]), info=dict(header.get("input") or {}),
            role=str(header.get("role", "visual")),
        )
    except (GraphError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CacheFileError(f"corrupt cache file ({_short(e)})", source) from None


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
