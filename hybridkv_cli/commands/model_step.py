"""``hybridkv model-step``: the modelled decode step of every method on a device profile."""

from __future__ import annotations

import json
from typing import Optional

import typer

from hybridkv_cli.costs.step_model import MISS_SHARE
from hybridkv_cli.io.errors import UsageError

PROFILE = typer.Option(None, "--device-profile", metavar="NAME|FILE", help="A preset (h200-pcie5, gh200, "
                       "l40s-pcie4, a100-pcie4, cpu), a JSON file, or 'measured' (the CUDA probe) [default: "
                       "measured on CUDA, else h200-pcie5].")


def _numbers(text: str, flag: str, kind=int, low=1, high=1 << 24) -> list:
    """Comma-separated numbers in [low, high] (``k`` = 1024 for token counts)."""
    try:
        values = [kind(float(v[:-1]) * 1024) if v.lower().endswith("k") else kind(v)
                  for v in (p.strip() for p in text.split(",")) if v]
    except ValueError:
        raise UsageError(f"not a comma-separated list of numbers: '{text}'", flag) from None
    if not values or any(not low <= v <= high for v in values):
        raise UsageError(f"give numbers in [{low}, {high}], got '{text}'", flag)
    return values


def model_step(
    profile: Optional[str] = PROFILE,
    tokens: str = typer.Option("8k,32k,64k", help="Prompt lengths (k = 1024)."),
    batch: str = typer.Option("1,16", help="Sequences decoded together."),
    budget: float = typer.Option(0.1, help="Budget of every compressed method."),
    dtype: str = typer.Option("bfloat16", help="KV and weight dtype: bfloat16 | float16 | float32."),
    miss_share: float = typer.Option(MISS_SHARE, help="Share of a dynamic head's slots a step copies in (measured "
                                     "on the dev rows: docs/step_model.md)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON rows, not the table."),
):
    """Modelled step time of every method at Qwen2.5-VL-7B geometry (estimates, not measurements:
    docs/step_model.md), with the speed-up over the full cache and the step against the
    compressed roofline (weights + budget × the full KV read from device memory)."""
    from hybridkv_cli.compression.base import check_budget
    from hybridkv_cli.costs.profiles import resolve_profile
    from hybridkv_cli.costs.step_model import QWEN25_VL_7B, with_dtype
    from hybridkv_cli.costs.table import step_table

    check_budget(budget, "--budget")
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4}
    if dtype not in sizes:
        raise UsageError(f"dtype must be one of {', '.join(sizes)}, got '{dtype}'", "--dtype")
    if not 0 <= miss_share <= 1:
        raise UsageError(f"a share in [0, 1], got {miss_share}", "--miss-share")
    lengths, batches = _numbers(tokens, "--tokens"), _numbers(batch, "--batch", high=4096)
    device = _cuda_if_any() if profile in (None, "measured") else None
    chosen = resolve_profile(profile, device)
    geometry = with_dtype(QWEN25_VL_7B, sizes[dtype])
    rows = step_table(chosen, geometry, lengths, batches, budget, miss_share)
    if as_json:
        print(json.dumps({"profile": chosen.as_dict(), "geometry": geometry.name, "dtype": dtype, "budget": budget,
                          "miss_share": miss_share, "rows": rows}))
        return 0
    _render(rows, chosen, budget, dtype)
    return 0


def _cuda_if_any():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else None


def _render(rows: list[dict], profile, budget: float, dtype: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"modelled decode step, Qwen2.5-VL-7B {dtype}, b = {budget:g}, {profile.name} "
                        f"({profile.source}: HBM {profile.hbm_gbps:g} GB/s, link {profile.link_gbps:g} / "
                        f"scattered {profile.link_scattered_gbps:g} GB/s, {profile.launch_us:g} µs a kernel)")
    for name in ("tokens", "batch", "method", "ms", "tokens/s", "× full", "÷ roofline"):
        table.add_column(name, justify="left" if name == "method" else "right")
    for r in rows:
        table.add_row(str(r["tokens"]), str(r["batch"]), r["method"], f"{r['ms']:.3f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['speedup_vs_full']:.2f}", f"{r['vs_roofline']:.3f}")
    Console().print(table)
