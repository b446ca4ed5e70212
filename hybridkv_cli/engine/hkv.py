"""``.hkv`` files: a compressed media prefix saved to disk and asked later (``hybridkv compress``).

A ``.hkv`` file is a safetensors file (no pickle): one ``uint8`` tensor per storage of the
compressed state (:mod:`hybridkv_cli.engine.graph`: the device store, landmarks and detectors, the
host-offloaded KV, the refresh state; a storage of no bytes is left out), plus the prefix's token
roles, its token ids, attention mask and token types (of the media tokens, one value each, kept
in the header: :func:`_pack_tokens`) and the model's mRoPE offset; its metadata (``hybridkv``,
compact JSON) holds the format and library versions, the model fingerprint (name + a hash of its
config), the dtype, the method and its options, the object tree of the state (kinds and named
attributes from a fixed table, :mod:`hybridkv_cli.engine.state_kinds`, and a digest of that table), what
the record says about the media, and a SHA-256 of the tensor bytes and the rest of the header. It is
written to a temporary file beside the target and renamed over it (atomic); a temporary file that a
killed run left is removed by the next save to the same target.

Nothing in a file names code: kinds and dtypes are keys of fixed tables, and a loaded state is
checked against the model's geometry (every index a kernel follows stays inside its tensors).
Loading checks, in order, that the path is a regular file, a safetensors file with hybridkv
metadata, its format (version and schema) and library version, model, dtype and method, then the
checksum, then the state; any failure is one :class:`CacheFileError` line (exit 1; a batch goes on
with the next input).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from hybridkv_cli.compression.base import Policy, check_budget
from hybridkv_cli.compression.host_memory import host_empty
from hybridkv_cli.engine.graph import GraphError, flatten, rebuild
from hybridkv_cli.engine.prefix import Prefix
from hybridkv_cli.engine.state_kinds import StateError, check_layers, schema_digest
from hybridkv_cli.engine.token_pack import pack_tokens, unpack_tokens
from hybridkv_cli.io.atomic import write_atomically
from hybridkv_cli.io.errors import HybridKVError
from hybridkv_cli.io.user_files import kind_of, stat_checked
from hybridkv_cli.models.prompt import QuestionTemplate

SUFFIX = ".hkv"
FORMAT = "hybridkv-cache"
FORMAT_VERSION = 5  # 2: kinds from a fixed table, the header under the checksum; 3: label landmarks;
# 4: host-resident 2-bit keys; 5: dynamic heads' swap cap and stickiness
_META_KEY = "hybridkv"
_EXTRA = ("visual", "rope_deltas", "text_deltas")


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


def _digest(tensors: dict[str, torch.Tensor], header: dict) -> str:
    """SHA-256 of the tensors and of the header without its own ``sha256``."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(key.encode())
        h.update(memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else b"")
    rest = {k: v for k, v in header.items() if k != "sha256"}
    h.update(json.dumps(rest, sort_keys=True, separators=(",", ":"), default=str).encode())
    return h.hexdigest()


def save(path: str | os.PathLike, prefix: Prefix, loaded) -> int:
    """Write ``prefix`` to ``path`` atomically; returns the file's size in bytes."""
    from safetensors.torch import save_file

    storages, info, tree = flatten((prefix.policy, prefix.state))
    # a storage of no bytes (an empty generated-KV buffer) is rebuilt empty: not stored
    tensors = {key: data.detach().cpu().contiguous() for key, data in storages.items() if data.numel()}
    tensors["visual"] = prefix.visual.cpu().to(torch.uint8)
    dtypes = {key: str(value.dtype).removeprefix("torch.") for key, value in prefix.tokens.items()}
    on_visual = pack_tokens(prefix.tokens, prefix.visual.cpu(), tensors)
    for name in ("rope_deltas", "text_deltas"):
        if getattr(prefix, name) is not None:
            tensors[name] = getattr(prefix, name).cpu().contiguous()
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "schema": schema_digest(),
        "library_version": library_version(),
        "model": model_fingerprint(loaded),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "method": prefix.policy.name,
        "options": _policy_options(prefix.policy),
        "seen": prefix.seen,
        "template": {"head": prefix.template.head, "tail": prefix.template.tail},
        "prefix_dtypes": dtypes,
        "prefix_on_visual": on_visual,
        "storages": {key: {"device": i["device"], "pinned": i["pinned"]} for key, i in info.items()},
        "tree": tree,
        "input": prefix.info,
        "role": prefix.role,
        "prefill_s": prefix.prefill_s,
        "compress_seconds": prefix.compress_seconds,
        "prefill_peak_bytes": prefix.prefill_peak_bytes,
        "device_bytes": prefix.device_bytes,
        "host_bytes": prefix.host_bytes,
    }
    header = json.loads(json.dumps(header, default=str))  # as a reader sees it
    header["sha256"] = _digest(tensors, header)
    metadata = {_META_KEY: json.dumps(header, separators=(",", ":"))}
    return write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _regular_file(path: str | os.PathLike, source: str) -> None:
    """Refuse what is not a regular file before opening it (a FIFO would block the reader)."""
    kind = kind_of(stat_checked(path, CacheFileError, source).st_mode)
    if kind is not None:
        raise CacheFileError(f"not a regular file ({kind}), not a cache file", source)


def read_header(path: str | os.PathLike) -> dict:
    """The metadata of a ``.hkv`` file (no tensor is read); :class:`CacheFileError` if it is none."""
    from safetensors import safe_open

    source = str(path)
    _regular_file(path, source)
    try:
        with safe_open(source, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:
        raise CacheFileError(f"not a hybridkv cache file, or truncated ({_short(e)})", source) from None
    try:
        header = json.loads(meta[_META_KEY])
        if type(header) is not dict or header.get("format") != FORMAT:
            raise ValueError
    except RecursionError:
        raise CacheFileError("corrupt cache file (its header is nested too deep)", source) from None
    except (KeyError, ValueError, TypeError, AttributeError):
        raise CacheFileError("not a hybridkv cache file (a safetensors file without hybridkv metadata)",
                             source) from None
    return header


def check_header(header: dict, loaded, source: str, method: str | None = None) -> None:
    """Refuse a file written by another format or library version, for another model or dtype,
    or (``method`` given) with another method."""
    found = header.get("format_version")
    if found != FORMAT_VERSION or header.get("schema") != schema_digest():
        found = found if type(found) is int else str(found)[:20]
        raise CacheFileError(f"the cache format changed: this file is format {found}, this hybridkv reads format "
                             f"{FORMAT_VERSION}{'' if found != FORMAT_VERSION else ' of another schema'}; "
                             "compress the media again", source)
    if header.get("library_version") != library_version():
        raise CacheFileError(f"written by hybridkv {str(header.get('library_version'))[:40]}, this is "
                             f"{library_version()}; compress the media again", source)
    mine, theirs = model_fingerprint(loaded), header.get("model")
    if type(theirs) is not dict:
        theirs = {}
    if theirs != mine:
        name = str(theirs.get("name"))[:200]
        what = f"model {name}" if theirs.get("name") != mine["name"] else f"another configuration of {mine['name']}"
        raise CacheFileError(f"compressed with {what}, not {mine['name']}; pass --model {name} or "
                             "compress again", source)
    dtype = str(loaded.dtype).removeprefix("torch.")
    if header.get("dtype") != dtype:
        theirs = str(header.get("dtype"))[:40]
        raise CacheFileError(f"compressed in {theirs}, the model runs in {dtype}; pass --dtype {theirs}", source)
    if method is not None and header.get("method") != method:
        raise CacheFileError(f"compressed with method {str(header.get('method'))[:40]}, not {method}; drop --method "
                             "(the file's method answers) or compress again", source)


def matches(header: dict, loaded, policy, system: str | None = None) -> bool:
    """Whether a file with ``header`` holds what ``policy`` on ``loaded`` would write now (``compress
    --resume`` keeps it): the same format and library version, model, dtype, method and options,
    and system prompt."""
    try:
        check_header(header, loaded, "", policy.name)
    except CacheFileError:
        return False
    written = header.get("input") if type(header.get("input")) is dict else {}
    return (header.get("options") == json.loads(json.dumps(_policy_options(policy), default=str))
            and written.get("system") == system)


def intact(path: str | os.PathLike) -> bool:
    """Whether the whole file at ``path`` reads and matches its checksum (``compress --resume``
    keeps no file that a crash or a disk cut short)."""
    from safetensors.torch import load_file

    try:
        header = read_header(path)
        return _digest(load_file(str(path), device="cpu"), header) == header.get("sha256")
    except Exception:
        return False


def load(path: str | os.PathLike, loaded, method: str | None = None) -> Prefix:
    """The compressed prefix saved in ``path``, on the model's device (see the module docstring)."""
    from safetensors.torch import load_file

    source = str(path)
    header = read_header(path)
    check_header(header, loaded, source, method)
    try:
        tensors = load_file(source, device="cpu")
    except Exception as e:
        raise CacheFileError(f"truncated or corrupt cache file ({_short(e)})", source) from None
    if _digest(tensors, header) != header.get("sha256"):
        raise CacheFileError("corrupt cache file (checksum mismatch)", source)
    try:
        return _build(header, tensors, loaded)
    except (GraphError, StateError) as e:
        raise CacheFileError(f"corrupt cache file ({_short(e)})", source) from None
    except RecursionError:
        raise CacheFileError("corrupt cache file (nested too deep)", source) from None
    except Exception as e:  # anything else a crafted file can provoke is still this file's fault
        raise CacheFileError(f"corrupt cache file ({type(e).__name__}: {_short(e)})", source) from None


def _build(header: dict, tensors: dict, loaded) -> Prefix:
    """The prefix a checked header and its tensors describe (:class:`GraphError`/:class:`StateError`
    or another exception when they do not fit together)."""
    device = loaded.device
    storages = {}
    infos = header["storages"]
    if type(infos) is not dict:
        raise GraphError("no storage table")
    for key, info in infos.items():
        if type(info) is not dict or type(info.get("device")) is not str:
            raise GraphError("a storage without its device")
        data = tensors[key] if key in tensors else torch.empty(0, dtype=torch.uint8)
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise GraphError(f"storage {key[:20]} is not bytes")
        if info["device"] != "cpu":
            data = data.to(device)
        elif device.type == "cuda" and data.numel():  # host state read in place by the kernels: pinned,
            data = host_empty(data.shape, data.dtype).copy_(data)  # however the file was saved
        storages[key] = data
    rebuilt = rebuild(storages, header["tree"])
    if type(rebuilt) is not tuple or len(rebuilt) != 2 or type(rebuilt[1]) is not tuple or len(rebuilt[1]) != 3:
        raise GraphError("the tree is not a policy and a state")
    policy, state = rebuilt
    if type(policy).name != header["method"] or not isinstance(policy, Policy):
        raise GraphError("the tree's policy is not the header's method")
    check_budget(policy.budget)
    if json.loads(json.dumps(_policy_options(policy), default=str)) != header["options"]:
        raise GraphError("the tree's policy has other options than the header")
    layers, reports, run = state
    text = loaded.text_config
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    check_layers(layers, loaded.num_layers, loaded.num_kv_heads, dim, loaded.dtype)
    if type(reports) is not dict or sorted(reports) != list(range(len(layers))) or type(run) is not dict:
        raise GraphError("the state's reports are not one per layer, or its run state is not a mapping")
    seen = header["seen"]
    visual = tensors["visual"]
    if type(seen) is not int or visual.dtype != torch.uint8 or visual.shape != (seen,):
        raise StateError("the prefix's token roles do not match its length")
    visual = visual.to(torch.bool)
    prefix = unpack_tokens(tensors, visual, header["prefix_dtypes"], header.get("prefix_on_visual", {}), device)
    template = header["template"]
    if not all(type(t) is int for t in (*template["head"], *template["tail"])):
        raise GraphError("a question template that is not token ids")
    info = header.get("input") or {}
    if type(info) is not dict:
        raise GraphError("the media description is not a mapping")
    cache = Prefix.cache_of(policy, tuple(state), seen, visual, device, compress_seconds=float(
        header["compress_seconds"]), prefill_peak_bytes=int(header["prefill_peak_bytes"]))
    return Prefix(
        policy=policy, cache=cache, seen=seen, visual=visual, tokens=prefix, shared=True,
        rope_deltas=tensors.get("rope_deltas"), text_deltas=tensors.get("text_deltas"),
        template=QuestionTemplate(list(template["head"]), list(template["tail"])),
        prefill_s=float(header["prefill_s"]), compress_seconds=cache.compress_seconds,
        prefill_peak_bytes=cache.prefill_peak_bytes, device_bytes=int(header["device_bytes"]),
        host_bytes=int(header["host_bytes"]), info=dict(info), role=str(header.get("role", "visual")),
    )


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."
