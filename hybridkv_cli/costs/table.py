"""The modelled step of every method, per length and batch, on a device profile (``hybridkv model-step``)."""

from __future__ import annotations

from hybridkv_cli.compression.index_choice import choose_index
from hybridkv_cli.costs.profiles import DeviceProfile
from hybridkv_cli.costs.step_model import MISS_SHARE_STICKY, Geometry, method_traffic, roofline_ms, step_ms

# name in the table -> (the step model's method, share of slots a step copies or None: the default's, swaps)
METHODS = {"full": ("full", None, 0), "snapkv (prune once)": ("one-shot", None, 0), "quest": ("quest", None, 0),
           "hybridkv keys": ("keys", None, 0), "hybridkv keys, stickiness 1": ("keys", MISS_SHARE_STICKY, 0),
           "hybridkv keys, swaps 16": ("keys", None, 16), "hybridkv host-keys": ("host-keys", None, 0),
           "hybridkv labels": ("labels", None, 0), "hybridkv mean": ("mean", None, 0)}


def step_table(profile: DeviceProfile, geometry: Geometry, lengths: list[int], batches: list[int], budget: float,
               miss_share: float) -> list[dict]:
    """One row per length, batch and method: modelled ms a step, tokens/s, speed-up over the full
    cache and the step against the compressed roofline. A HybridKV index copies ``miss_share`` of
    its slots a step (the measured share of the default selection), but for the rows that say
    otherwise; the last row is the index ``--landmark auto`` takes at this budget."""
    g = geometry
    default, _ = choose_index(budget, max(lengths), g.kv_heads, g.head_dim, g.dtype_bytes, profile)
    rows = []
    names = {**METHODS, f"hybridkv (default: {default})": (default, None, 0)}
    for tokens in lengths:
        for batch in batches:
            full = step_ms(profile, geometry, method_traffic("full", geometry, tokens, 1.0, miss_share=0), batch)
            roof = roofline_ms(profile, geometry, tokens, budget, batch)
            for name, (method, share, swaps) in names.items():
                b = 1.0 if method == "full" else budget
                traffic = method_traffic(method, geometry, tokens, b, miss_share=miss_share if share is None else share,
                                         swaps=swaps)
                ms = step_ms(profile, geometry, traffic, batch)
                rows.append({"profile": profile.name, "tokens": tokens, "batch": batch, "method": name,
                             "ms": round(ms, 4), "tokens_per_s": round(1e3 * batch / ms, 1),
                             "speedup_vs_full": round(full / ms, 3), "vs_roofline": round(ms / roof, 3)})
    return rows
