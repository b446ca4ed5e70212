"""The modelled step of every method, per length and batch, on a device profile (``hybridkv model-step``)."""

from __future__ import annotations

from hybridkv_cli.costs.profiles import DeviceProfile
from hybridkv_cli.costs.step_model import Geometry, method_traffic, roofline_ms, step_ms

# name in the table -> the step model's method
METHODS = {"full": "full", "snapkv (prune once)": "one-shot", "quest": "quest", "hybridkv keys, no cap": "keys",
           "hybridkv host-keys": "host-keys", "hybridkv labels": "labels", "hybridkv mean": "mean"}


def step_table(profile: DeviceProfile, geometry: Geometry, lengths: list[int], batches: list[int], budget: float,
               miss_share: float, default: str, swaps: int) -> list[dict]:
    """One row per length, batch and method: modelled ms a step, tokens/s, speed-up over the full
    cache and the step against the compressed roofline. The HybridKV indexes copy ``miss_share``
    of their slots a step; the default (``default``, the index ``--landmark auto`` takes at this
    budget) at most ``swaps`` a head."""
    rows = []
    default_name = f"hybridkv (default: {default}, swaps {swaps})"
    names = {**METHODS, default_name: default}
    for tokens in lengths:
        for batch in batches:
            full = step_ms(profile, geometry, method_traffic("full", geometry, tokens, 1.0, miss_share=0), batch)
            roof = roofline_ms(profile, geometry, tokens, budget, batch)
            for name, method in names.items():
                b = 1.0 if method == "full" else budget
                cap = swaps if name == default_name else 0
                traffic = method_traffic(method, geometry, tokens, b, miss_share=miss_share, swaps=cap)
                ms = step_ms(profile, geometry, traffic, batch)
                rows.append({"profile": profile.name, "tokens": tokens, "batch": batch, "method": name,
                             "ms": round(ms, 4), "tokens_per_s": round(1e3 * batch / ms, 1),
                             "speedup_vs_full": round(full / ms, 3), "vs_roofline": round(ms / roof, 3)})
    return rows
