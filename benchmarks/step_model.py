"""The modelled decode step of every method on every device preset, as markdown tables and JSON.

    python -m benchmarks.step_model --out docs/results/step_model.json > docs/results/step_model.md

Estimates from the step model (hybridkv_cli/costs), not measurements: docs/step_model.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridkv_cli.costs.profiles import PRESETS
from hybridkv_cli.costs.step_model import MISS_SHARE, QWEN25_VL_7B
from hybridkv_cli.costs.table import step_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,32768,65536")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--budgets", default="0.1,0.05")
    parser.add_argument("--miss-share", type=float, default=MISS_SHARE)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    g = QWEN25_VL_7B
    out = {}
    for budget in (float(b) for b in args.budgets.split(",")):
        for name, profile in PRESETS.items():
            if name == "cpu":
                continue
            rows = step_table(profile, g, lengths, batches, budget, args.miss_share)
            out[f"{name}@{budget:g}"] = rows
            print(f"\n**{name}**, b = {budget:g} ({profile.hbm_gbps:g} GB/s HBM, {profile.link_gbps:g} / "
                  f"{profile.link_scattered_gbps:g} GB/s host link large / scattered, {profile.launch_us:g} µs a "
                  f"kernel): ms a step (× the full cache's tokens/s)\n")
            methods = list(dict.fromkeys(r["method"] for r in rows))
            cols = [(t, b) for t in lengths for b in batches]
            print("| method | " + " | ".join(f"{t // 1024}k × {b}" for t, b in cols) + " |")
            print("|---|" + "---|" * len(cols))
            for m in methods:
                cells = {(r["tokens"], r["batch"]): r for r in rows if r["method"] == m}
                print(f"| {m} | " + " | ".join(f"{cells[c]['ms']:.2f} ({cells[c]['speedup_vs_full']:.2f}×)"
                                               for c in cols) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"geometry": g.name, "miss_share": args.miss_share, "tables": out}, indent=1))


if __name__ == "__main__":
    main()
