"""Human rendering of result records (``ask``, ``profile``) and the head heatmap."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def prompt_tokens(inp: dict) -> str:
    """'4480 visual + 37 text tokens' (media) or '1503 context + 30 text tokens' (text prompt)."""
    role = "context" if inp["kind"] == "text" else "visual"
    return f"{inp[role + '_tokens']} {role} + {inp['text_tokens']} text tokens"


def input_detail(inp: dict) -> str:
    """``8 frames, 224x168, turned 90° upright``: what the model saw of the media."""
    parts = [f"{inp['frames_used']} {'frames' if inp['kind'] == 'video' else 'images'}"]
    if inp.get("frame_size"):
        parts.append("{}x{}".format(*inp["frame_size"]))
    if inp.get("rotation"):
        parts.append(f"turned {inp['rotation']}° upright")
    return ", ".join(parts)


def render(result: dict, console: Console) -> None:
    """Print the answer, then a compact table of the measurements."""
    console.print(result["answer"], markup=False, highlight=False)
    if result.get("note"):
        console.print(f"[dim]({result['note']})[/dim]")
    inp, dec, kv = result["input"], result["decode"], result["kv"]
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    if inp["kind"] != "text":
        table.add_row("input", f"{inp['label']}  ({input_detail(inp)})")
    table.add_row("prompt", prompt_tokens(inp))
    deferred = "  (question read after compression)" if result.get("defer_question") else ""
    table.add_row("method", f"{result['method']}  budget {result['budget']:g}{deferred}")
    table.add_row("prefill", f"{result['prefill_s']:.3f} s")
    if dec["ms_per_token_mean"] is not None:
        table.add_row(
            "decode",
            f"{dec['tokens']} tokens, {dec['ms_per_token_mean']:.2f} ms/token (p50 {dec['p50']:.2f}, p90 {dec['p90']:.2f})",
        )
    else:
        table.add_row("decode", f"{dec['tokens']} tokens")
    if result.get("sampling"):
        s = result["sampling"]
        table.add_row("sampling", f"temperature {s['temperature']:g}, top-p {s['top_p']:g}, seed {s['seed']}")
    table.add_row(
        "KV memory",
        f"device {human_bytes(kv['device_bytes'])}, host {human_bytes(kv['host_bytes'])}, "
        f"full {human_bytes(kv['full_bytes'])} ({kv['ratio_vs_full']:.3f} of full)",
    )
    budget = f"prompt KV after prefill {kv['prompt_ratio']:.3f} of full (budget {result['budget']:g})"
    if kv["over_budget_bytes"]:
        budget += f"; over budget by {human_bytes(kv['over_budget_bytes'])}"
    if 0 in ((result.get("heads") or {}).get("window") or [1]):
        budget += "; below a usable minimum: too few entries per head for an observation window"
    table.add_row("budget", budget)
    table.add_row("prefill peak", human_bytes(kv["prefill_peak_bytes"]))
    if result.get("streamed"):  # read in chunks: the working sets' peak, and a cap's budget
        s = result["streamed"]
        cap = f"; capped at {s['kv_tokens']} tokens a head (budget {s['budget']:.3g})" if s.get("kv_tokens") else ""
        table.add_row("streamed", f"{s['chunks']} chunks of ~{s['chunk_tokens']} tokens, window {s['window']}, "
                      f"{human_bytes(s['read_peak_bytes'])} peak while reading{cap}")
    if result.get("traffic"):
        table.add_row("traffic", f"{human_bytes(round(result['traffic']['h2d_bytes_per_step_mean']))} host->device per step")
    heads = result.get("heads")
    if heads and "static" in heads:
        table.add_row(
            "heads",
            f"{heads['static']} static / {heads['dynamic']} dynamic "
            f"({heads['static_share']:.0%} static); per layer: "
            + " ".join(f"{s}/{d}" for s, d in zip(heads["per_layer"]["static"], heads["per_layer"]["dynamic"])),
        )
    refresh = (heads or {}).get("refresh")
    if refresh and not refresh["refreshed_heads"]:
        table.add_row("refresh", f"{refresh['kind']}: no pruned heads to refresh (every head is dynamic)"
                      if heads.get("static") == 0 else f"{refresh['kind']}: no head had entries to refresh")
    elif refresh:
        rate = "-" if refresh["refresh_rate"] is None else f"{refresh['refresh_rate']:.0%}"
        target = f" (target {refresh['target_rate']:.0%})" if refresh["target_rate"] is not None else ""
        table.add_row("refresh", f"{refresh['kind']}: {refresh['refreshed_heads']} heads, {rate} of layer-steps"
                                 f"{target}, {human_bytes(refresh['h2d_bytes'])} host->device")
    table.add_row("model", f"{result['model']} on {result['device']} ({result['dtype']})")
    console.print(table)


def render_profile(result: dict, console: Console) -> None:
    """Layer × head sparsity/classes, the budget allocation, and the budget sweep."""
    heads = result["heads"]
    per = heads["per_layer"]
    if result.get("note"):
        console.print(f"[dim]({result['note']})[/dim]")
    inp = result["input"]
    console.print(f"{inp['label']}: {prompt_tokens(inp)}; "
                  f"θ={heads['theta']:g}, p={heads['p']:g}, r={heads['r']:g}, chunk={heads['chunk_size']}")

    classes = Table(title="sparsity score per KV head (S static, D dynamic)")
    classes.add_column("layer", justify="right")
    for h in range(len(per["sparsity"][0])):
        classes.add_column(f"head {h}", justify="right")
    for layer, (scores, entries) in enumerate(zip(per["sparsity"], per["entries"])):
        cells = [f"[green]{s:.3f} S[/green]" if s >= heads["theta"] else f"[yellow]{s:.3f} D[/yellow]" for s in scores]
        classes.add_row(str(layer), *cells)
    console.print(classes)

    alloc = Table(title=f"budget allocation at b={result['budget']:g} (entries per head)")
    for col in ("layer", "static", "dynamic", "chunks/dyn head", "entries per head"):
        alloc.add_column(col, justify="right")
    for layer, (s, d, c, e) in enumerate(zip(per["static"], per["dynamic"], per["chunks_per_dynamic_head"], per["entries"])):
        alloc.add_row(str(layer), str(s), str(d), str(c), " ".join(map(str, e)))
    console.print(alloc)
    console.print(f"budget {heads['budget_entries']} entries; rounding {heads['padding_entries']:+d} "
                  f"({heads['padding_share']:+.1%})")

    sweep = Table(title="budget sweep (fidelity = ROUGE-L vs the full-cache answer)")
    for col in ("budget", "device KV", "host KV", "ratio vs full", "ms/token", "fidelity"):
        sweep.add_column(col, justify="right")
    ref = result["reference"]
    sweep.add_row("full", human_bytes(ref["device_bytes"]), "-", "1.000", _ms(ref["ms_per_token_mean"]), "1.000")
    for row in result["sweep"]:
        sweep.add_row(f"{row['budget']:g}", human_bytes(row["device_bytes"]), human_bytes(row["host_bytes"]),
                      f"{row['ratio_vs_full']:.3f}", _ms(row["ms_per_token_mean"]), f"{row['fidelity']:.3f}")
    console.print(sweep)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def save_heatmap(heads: dict, path) -> None:
    """PNG heatmap of the sparsity scores (layer × KV head), dynamic heads hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scores = np.array(heads["per_layer"]["sparsity"])
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * scores.shape[1], 1.0 + 0.35 * scores.shape[0]))
    im = ax.imshow(scores, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for (layer, head), s in np.ndenumerate(scores):
        ax.text(head, layer, f"{s:.2f}\n{'S' if s >= heads['theta'] else 'D'}", ha="center", va="center",
                color="white" if s < 0.6 else "black", fontsize=7)
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title(f"text-centric sparsity (static if ≥ {heads['theta']:g})", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
