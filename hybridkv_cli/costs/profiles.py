"""Device profiles: the bandwidths and launch cost that price a decode step's bytes.

A profile is a preset name (``h200-pcie5``, ``gh200``, ``l40s-pcie4``, ``a100-pcie4``, and
``cpu``, where host and device are one memory), a JSON file with the same fields, or — on CUDA —
measured by a short probe at first use and cached per machine (:func:`probe_profile`).

The presets are **estimates** from the parts' specifications, not measurements: HBM at its
nominal read bandwidth; the host link at what large pinned reads reach (about 80 % of PCIe 5 x16
or 4 x16 one way; NVLink-C2C's 450 GB/s one way for GH200); scattered rows (the 256- to
512-byte rows a retrieval gathers) at 40 % of that; and a kernel at 3 µs (a small kernel's time
on the GPU plus its share of launch latency when the CPU keeps ahead).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from hybridkv_cli.io.errors import UsageError

# Far beyond any device made: a larger value is a typo (bytes for gigabytes), not a device.
LIMITS = {"hbm_gbps": 1e5, "link_gbps": 1e5, "link_scattered_gbps": 1e5, "launch_us": 1e4}
PROFILE_FILE_LIMIT = 2**16
FILE_FORMAT = ('{"name": str, "hbm_gbps": float, "link_gbps": float, "link_scattered_gbps": float, '
               '"launch_us": float}')


@dataclass(frozen=True)
class DeviceProfile:
    """A device, as the step model sees it.

    Attributes
    ----------
    name : str
    hbm_gbps : float
        Device-memory read bandwidth, GB/s (weights, the device KV and device indexes).
    link_gbps : float
        Host→device bandwidth for large contiguous reads, GB/s (codes read in place, bulk copies).
    link_scattered_gbps : float
        Host→device bandwidth for scattered rows, GB/s (a gather of retrieved tokens).
    launch_us : float
        Time of one small kernel, launch included, µs.
    source : str
        ``preset``, ``measured`` (the CUDA probe) or the file it was read from.
    """

    name: str
    hbm_gbps: float
    link_gbps: float
    link_scattered_gbps: float
    launch_us: float
    source: str = "preset"

    def __post_init__(self):
        for key, limit in LIMITS.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0 or value > limit:
                raise UsageError(f"device profile {self.name!r}: {key} must be a number in (0, {limit:g}], "
                                 f"got {value!r}", "--device-profile")

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {p.name: p for p in (
    DeviceProfile("h200-pcie5", hbm_gbps=4800, link_gbps=50, link_scattered_gbps=20, launch_us=3),
    DeviceProfile("gh200", hbm_gbps=4000, link_gbps=400, link_scattered_gbps=160, launch_us=3),
    DeviceProfile("l40s-pcie4", hbm_gbps=864, link_gbps=25, link_scattered_gbps=10, launch_us=3),
    DeviceProfile("a100-pcie4", hbm_gbps=1935, link_gbps=25, link_scattered_gbps=10, launch_us=3),
    # Host and device are one memory: the link costs what a memory read costs.
    DeviceProfile("cpu", hbm_gbps=20, link_gbps=20, link_scattered_gbps=10, launch_us=5),
)}
DEFAULT_PRESET = "h200-pcie5"


def profile_from_file(path: str | os.PathLike) -> DeviceProfile:
    """A profile from a JSON file with :data:`FILE_FORMAT`'s fields; one line naming the file otherwise."""
    from hybridkv_cli.io.user_files import read_json

    data = read_json(path, "--device-profile", FILE_FORMAT, limit=PROFILE_FILE_LIMIT)
    wanted = {f.name for f in fields(DeviceProfile)} - {"source"}
    if not isinstance(data, dict) or set(data) - wanted or not set(data) >= wanted - {"name"}:
        missing = sorted(wanted - {"name"} - set(data)) if isinstance(data, dict) else []
        extra = sorted(set(data) - wanted) if isinstance(data, dict) else []
        what = "; ".join(filter(None, [missing and f"missing {', '.join(missing)}",
                                       extra and f"unknown {', '.join(extra)}"])) or "not an object"
        raise UsageError(f"is not a device profile ({what}); expected {FILE_FORMAT}", str(path))
    name = data.get("name", Path(path).stem)
    if not isinstance(name, str):
        raise UsageError(f"is not a device profile (name must be a string); expected {FILE_FORMAT}", str(path))
    try:
        return DeviceProfile(**{**data, "name": name}, source=str(path))
    except UsageError as e:
        raise UsageError(e.reason, str(path)) from None


def resolve_profile(spec: str | None, device=None) -> DeviceProfile:
    """The profile a flag names: a preset, a file, ``measured`` (the CUDA probe), or None: measured
    on CUDA, the default preset elsewhere."""
    if spec is None or spec == "measured":
        on_cuda = device is not None and getattr(device, "type", str(device)) == "cuda"
        if on_cuda or spec == "measured":
            return probe_profile(device)
        return PRESETS[DEFAULT_PRESET]
    if spec in PRESETS:
        return PRESETS[spec]
    if os.path.sep in spec or spec.endswith(".json") or os.path.exists(spec):
        return profile_from_file(spec)
    raise UsageError(f"unknown device profile {spec!r}; use one of {', '.join(PRESETS)}, measured, or a JSON file "
                     f"{FILE_FORMAT}", "--device-profile")


_NOTED: set[str] = set()


def _note_once(message: str) -> None:
    if message not in _NOTED:
        _NOTED.add(message)
        from hybridkv_cli.io.console import err

        err.print(message, highlight=False, soft_wrap=True)


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridkv" / "device_profiles.json"


def probe_profile(device=None) -> DeviceProfile:
    """The CUDA device's profile, measured once per machine and device name and cached; where the
    probe cannot run (no CUDA, no pinned memory) the default preset, said once."""
    import torch

    if not torch.cuda.is_available():
        _note_once(f"no CUDA device to measure: the step model uses the {DEFAULT_PRESET} preset")
        return PRESETS[DEFAULT_PRESET]
    index = torch.device(device or "cuda").index or 0
    key = f"{torch.cuda.get_device_name(index)} / torch {torch.__version__}"
    path = cache_path()
    try:
        cached = json.loads(path.read_text()) if path.is_file() and path.stat().st_size < PROFILE_FILE_LIMIT else {}
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached, dict) and isinstance(cached.get(key), dict):
        try:
            return DeviceProfile(**{**cached[key], "source": "measured"})
        except (TypeError, UsageError):
            pass
    try:
        from hybridkv_cli.costs.probe import measure

        profile = DeviceProfile(name=key, **measure(index), source="measured")
    except (RuntimeError, UsageError) as e:
        _note_once(f"the device probe could not run ({e}): the step model uses the {DEFAULT_PRESET} preset")
        return PRESETS[DEFAULT_PRESET]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cached = cached if isinstance(cached, dict) else {}
        cached[key] = {k: v for k, v in profile.as_dict().items() if k != "source"}
        path.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass  # a read-only home: measured again next time
    return profile


def device_profile(device) -> DeviceProfile:
    """The profile a run on ``device`` is priced with (``--landmark auto``'s choice, the record's
    estimate): ``HYBRIDKV_DEVICE_PROFILE`` (a preset, a file or ``measured``) where set, else
    measured on CUDA and ``cpu`` elsewhere."""
    override = os.environ.get("HYBRIDKV_DEVICE_PROFILE")
    if override:
        return resolve_profile(override, device)
    if getattr(device, "type", str(device)) == "cuda":
        return resolve_profile(None, device)
    return PRESETS["cpu"]
