"""``hybridkv bench`` output: the rich table, ``bench.csv``, ``bench.json`` and ``bench.png``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from hybridkv_cli.io.report import human_bytes

#: Columns of bench.csv: one row per (method, budget), the full-cache reference first; the 95 %
#: bootstrap intervals of accuracy and fidelity come last (``*_lo``, ``*_hi``).
COLUMNS = ("method", "budget", "n", "errors", "accuracy", "fidelity", "kv_ratio", "ms_per_token", "h2d_bytes_per_step",
           "accuracy_lo", "accuracy_hi", "fidelity_lo", "fidelity_hi")
#: Aggregate interval -> its two CSV columns.
INTERVALS = {"accuracy_ci": ("accuracy_lo", "accuracy_hi"), "fidelity_ci": ("fidelity_lo", "fidelity_hi")}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _with_ci(value, ci, spec: str, ci_spec: str, scale: float = 1.0) -> str:
    """``value`` and its interval ``ci`` (scaled), e.g. ``85% [70–95]``; the value alone without one."""
    text = _fmt(value, spec)
    if value is None or ci is None:
        return text
    lo, hi = (v * scale for v in ci)
    return f"{text} [{lo:{ci_spec}}–{hi:{ci_spec}}]"


def render_bench(result: dict, console: Console) -> None:
    """The aggregate table (and the demo note)."""
    config = result["config"]
    if config.get("note"):
        console.print(f"[dim]({config['note']})[/dim]")
    console.print(f"{config['model']}: {config['inputs']} input(s), {config['max_new_tokens']} new tokens; "
                  "fidelity = ROUGE-L F1 vs the full-cache output", highlight=False, soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for column in ("method", "budget", "n", "err", "accuracy", "fidelity", "KV ratio", "ms/tok", "h2d/step"):
        # a narrow terminal: a value above its interval
        table.add_column(column, justify="left" if column == "method" else "right",
                         no_wrap=column not in ("accuracy", "fidelity"), min_width=11 if column == "fidelity" else None)
    for row in result["aggregates"]:
        traffic = row["h2d_bytes_per_step"]
        table.add_row(row["method"], f"{row['budget']:g}", str(row["n"]), str(row["errors"]),
                      _with_ci(row["accuracy"], row.get("accuracy_ci"), ".0%", ".0f", 100),
                      _with_ci(row["fidelity"], row.get("fidelity_ci"), ".3f", ".2f"), _fmt(row["kv_ratio"], ".3f"),
                      _fmt(row["ms_per_token"], ".2f"), human_bytes(None if traffic is None else round(traffic)))
    width = console.width
    if not console.is_terminal:  # a pipe or a file: the whole table, however wide, rather than cut cells
        console.width = max(width, console.measure(table, options=console.options.update_width(1000)).maximum)
    try:
        console.print(table)
    finally:
        console.width = width


def write_csv(aggregates: list[dict], path: Path) -> None:
    """One row per (method, budget); a missing value is an empty cell."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in aggregates:
            flat = dict(row)
            for interval, (lo, hi) in INTERVALS.items():
                flat[lo], flat[hi] = row.get(interval) or (None, None)
            writer.writerow({k: "" if flat[k] is None else flat[k] for k in COLUMNS})


def save_plot(result: dict, path: Path) -> None:
    """Accuracy (when any input has an answer) and fidelity vs budget, one line per method; the
    full-cache reference as a dashed horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["aggregates"]
    reference = next(r for r in rows if r["budget"] == 1.0 and r["method"] == "full")
    metrics = [m for m in ("accuracy", "fidelity") if any(r[m] is not None for r in rows)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "full"):
            points = [(r["budget"], r[metric]) for r in rows if r["method"] == method and r[metric] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=method)
        if reference[metric] is not None:
            ax.axhline(reference[metric], color="black", linestyle="--", linewidth=1, label="full")
        ax.set_xlabel("budget (device KV share)")
        ax.set_ylabel(metric)
        ax.set_xticks(result["config"]["budgets"])
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{result['config']['model']}: quality vs budget", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(result: dict, out: Path) -> list[Path]:
    """Write bench.csv, bench.json and bench.png into ``out`` (created); returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.csv", out / "bench.json", out / "bench.png"]
    write_csv(result["aggregates"], paths[0])
    paths[1].write_text(json.dumps(result, indent=1), encoding="utf-8")
    save_plot(result, paths[2])
    return paths
