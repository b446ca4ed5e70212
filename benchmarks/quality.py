"""Quality protocol: method variants on a task split, with 95% bootstrap intervals.

Runs every row of a task file (``scripts/make_text_tasks.py``: pass-key, multi-key and summary
rows) once with the full cache, then with each variant at each budget, and writes per variant
and row kind: n, accuracy [95% CI], fidelity (ROUGE-L F1 vs the full-cache output) [95% CI],
device prompt KV after prefill as a share of the full prompt KV, host→device bytes per decode
step, ms/token and the refresh rate. Paired differences (variant − reference variant) with
their intervals answer "better by a margin whose interval excludes zero".

    python benchmarks/quality.py --tasks benchmarks/tasks/text_dev.jsonl --budgets 0.1 \\
        --variants default,paper,snapkv --out docs/results/quality_dev.json

Choose settings on the dev split; report the test split once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository root
from benchmarks.decode import parse_method  # noqa: E402
from hybridkv_cli.api import ask  # noqa: E402
from hybridkv_cli.models.registry import load_model  # noqa: E402
from hybridkv_cli.runs.answers import is_correct  # noqa: E402
from hybridkv_cli.runs.bench import read_tasks  # noqa: E402
from hybridkv_cli.runs.fidelity import rouge_l  # noqa: E402
from hybridkv_cli.runs.stats import bootstrap_ci, paired_diff_ci  # noqa: E402

# name -> (method, options). "paper" is HybridKV with the paper's settings and no refresh.
VARIANTS = {
    "paper": ("hybridkv", {"refresh": "none", "landmark": "mean", "sink_aware": False, "chunk_size": 8, "window": 32}),
    "hybridkv": ("hybridkv", {}),  # the shipped defaults
    "hkv-rcr": ("hybridkv", {"refresh": "rcr"}),
    "hkv-periodic": ("hybridkv", {"refresh": "periodic"}),
    "hkv-rcr-sink": ("hybridkv", {"refresh": "rcr", "sink_aware": True}),
    "hkv-rcr-detector": ("hybridkv", {"refresh": "rcr", "landmark": "detector"}),
    "hkv-rcr-minmax": ("hybridkv", {"refresh": "rcr", "landmark": "minmax"}),
    "hkv-detector": ("hybridkv", {"landmark": "detector"}),
    "hkv-minmax": ("hybridkv", {"landmark": "minmax"}),
    "hkv-sink": ("hybridkv", {"sink_aware": True}),
    "hkv-labels": ("hybridkv", {"landmark": "labels"}),  # label channels chosen from the prompt
    # SmolLM2's label file: hybridkv calibrate --model smollm2 --dtype bfloat16 --tasks text_dev2.jsonl
    "hkv-labels-file": ("hybridkv", {"landmark": "labels", "index_file": "benchmarks/labels/smollm2.json"}),
    "hkv-rcr-sink-0.8": ("hybridkv", {"refresh": "rcr", "sink_aware": True, "refresh_rate": 0.8}),
    "hkv-rcr-sink-t99": ("hybridkv", {"refresh": "rcr", "sink_aware": True, "theta": 0.99}),
    "hkv-dyn-detector": ("hybridkv", {"theta": 1.0, "landmark": "detector"}),
    "hkv-dyn": ("hybridkv", {"theta": 1.0}),
    "hkv-dyn-minmax": ("hybridkv", {"theta": 1.0, "landmark": "minmax"}),
    "hkv-rcr-sink-detector": ("hybridkv", {"refresh": "rcr", "sink_aware": True, "landmark": "detector"}),
    "hkv-rcr-sink-minmax": ("hybridkv", {"refresh": "rcr", "sink_aware": True, "landmark": "minmax"}),
    "hkv-rcr-sink-c16": ("hybridkv", {"refresh": "rcr", "sink_aware": True, "chunk_size": 16}),
    "hkv-rcr-sink-r1": ("hybridkv", {"refresh": "rcr", "sink_aware": True, "share": 1.0}),
    "hkv-periodic-sink": ("hybridkv", {"refresh": "periodic", "sink_aware": True}),
    "rcr": ("rcr", {}),
    "rcr-periodic": ("rcr", {"refresh": "periodic"}),
    **{name: (name, {}) for name in ("snapkv", "lookm", "madakv", "sparsemm", "streamingllm", "quest", "retentivekv")},
}


def variant(name: str) -> tuple[str, dict]:
    """A named variant, or ``method:key=value;key=value`` (any method's options)."""
    return VARIANTS[name] if name in VARIANTS else parse_method(name.replace(";", ","))


def task_rows(path) -> list[tuple]:
    """Each task of a JSONL task file with its raw row (the ``kind``, ``max_new_tokens`` and other
    keys the benchmarks read and :func:`read_tasks` ignores)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return list(zip(read_tasks(path), rows))


def run_row(loaded, task, method, options, budget, max_new_tokens, defer_question=False) -> dict:
    start = time.perf_counter()
    r = ask(loaded, None, task.question, context=task.context, method=method, budget=budget,
            max_new_tokens=max_new_tokens, defer_question=defer_question, **options)
    prompt_tokens = r["input"]["context_tokens"] + r["input"]["text_tokens"]
    full_prompt = r["kv"]["full_bytes"] * prompt_tokens / (prompt_tokens + r["decode"]["tokens"] - 1)
    heads = r["heads"] or {}
    refresh = heads.get("refresh") or {}
    return {
        "answer": r["answer"],
        "correct": is_correct(r["answer"], task.answers) if task.answers else None,
        "prompt_kv_ratio": r["kv"]["device_bytes_after_prefill"] / full_prompt,
        "h2d_per_step": (r["traffic"] or {}).get("h2d_bytes_per_step_mean", 0.0),
        "ms_per_token": r["decode"]["ms_per_token_mean"],
        "refresh_rate": refresh.get("refresh_rate"),
        "tokens": prompt_tokens,
        "seconds": time.perf_counter() - start,
    }


def summarise(items: list[dict], reference: dict[str, list[dict]] | None) -> dict:
    def mean(key):
        vals = [i[key] for i in items if i[key] is not None]
        return sum(vals) / len(vals) if vals else None

    acc = [float(i["correct"]) for i in items if i["correct"] is not None]
    fid = [i["fidelity"] for i in items]
    out = {
        "n": len(items),
        "accuracy": sum(acc) / len(acc) if acc else None, "accuracy_ci": bootstrap_ci(acc),
        "fidelity": sum(fid) / len(fid) if fid else None, "fidelity_ci": bootstrap_ci(fid),
        **{k: mean(k) for k in ("prompt_kv_ratio", "h2d_per_step", "ms_per_token", "refresh_rate")},
    }
    if reference is not None:
        ref = {i["id"]: i for i in reference}
        key = "correct" if acc else "fidelity"
        pairs = [(float(i[key]), float(ref[i["id"]][key])) for i in items  # the rows both measured
                 if i[key] is not None and i["id"] in ref]
        out["diff_vs_reference"] = paired_diff_ci([a for a, _ in pairs], [b for _, b in pairs])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budgets", default="0.1")
    parser.add_argument("--variants", default="paper,hybridkv,snapkv",
                        help="comma-separated names of VARIANTS, or method:key=value;key=value")
    parser.add_argument("--reference", help="variant the paired differences are taken against")
    parser.add_argument("--kinds", help="only these row kinds (comma-separated)")
    parser.add_argument("--rows", help="only rows START:END (after --kinds), e.g. to split a run over processes")
    parser.add_argument("--merge", nargs="+", type=Path, help="tabulate the items of earlier --out files instead "
                        "(every variant of each; a row measured by two of them counts once)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: float32 on the CPU)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="rows without their own max_new_tokens")
    parser.add_argument("--defer-question", action="store_true",
                        help="compress the context before the question is read (as -Q and .hkv caches do)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.merge:
        runs = [json.loads(path.read_text()) for path in args.merge]
        items: dict[str, dict] = {}  # every variant of every run; a row two runs measured counts once
        for run in runs:
            for key, rows in run["items"].items():
                for row in rows:
                    items.setdefault(key, {}).setdefault(row["id"], row)
        return report({key: list(rows.values()) for key, rows in items.items()}, args, {
            "tasks": runs[0]["tasks"], "model": runs[0]["model"], "dtype": runs[0].get("dtype"),
            "budgets": sorted({b for run in runs for b in run["budgets"]}),
            "variants": {k: v for run in runs for k, v in run["variants"].items()},
            "defer_question": runs[0].get("defer_question", False)})
    loaded = load_model(args.model, device="cpu", dtype=args.dtype)
    pairs = task_rows(args.tasks)
    if args.kinds:
        keep = set(args.kinds.split(","))
        pairs = [(t, r) for t, r in pairs if r.get("kind") in keep]
    start, _, end = (args.rows or ":").partition(":")
    pairs = pairs[int(start or 0):int(end) if end else None]
    budgets = [float(b) for b in args.budgets.split(",")]
    names = args.variants.split(",")
    config = {"tasks": args.tasks, "model": args.model, "dtype": str(loaded.dtype), "budgets": budgets,
              "variants": {n: variant(n) for n in names}, "defer_question": args.defer_question}
    items: dict[str, list[dict]] = {}
    full_out: dict[str, str] = {}
    for task, row in pairs:
        new = int(row.get("max_new_tokens", args.max_new_tokens))
        full = run_row(loaded, task, "full", {}, 1.0, new, args.defer_question)
        full_out[task.id] = full["answer"]
        items.setdefault("full", []).append({"id": task.id, "kind": row.get("kind"), "fidelity": 1.0, **full})
        for name in names:
            method, options = variant(name)
            for budget in budgets:
                r = run_row(loaded, task, method, options, budget, new, args.defer_question)
                r["fidelity"] = rouge_l(r["answer"], full["answer"])
                items.setdefault(f"{name}@{budget}", []).append({"id": task.id, "kind": row.get("kind"), **r})
                print(f"{task.id:28s} {name:18s} b={budget} {r['correct']!s:5s} fid={r['fidelity']:.2f} "
                      f"{r['answer'][:40]!r} ({r['seconds']:.1f}s)", file=sys.stderr, flush=True)
        if args.out:  # after every row: an interrupted run keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**config, "items": items}))
    report(items, args, config)


def report(items: dict[str, list[dict]], args, config: dict) -> None:
    """Print the table and write ``--out`` (config, per-variant summaries, every item)."""
    kinds = sorted({i["kind"] for i in items["full"]})
    table = {}
    for key, rows in items.items():
        ref_key = f"{args.reference}@{key.split('@')[1]}" if args.reference and "@" in key else None
        ref = items.get(ref_key) if ref_key and ref_key != key else None
        table[key] = {"all": summarise(rows, ref)}
        for kind in kinds:
            sub = [r for r in rows if r["kind"] == kind]
            table[key][kind] = summarise(sub, [r for r in ref if r["kind"] == kind] if ref else None)
    for key, by_kind in table.items():
        cells = [f"{kind}: acc {fmt(s['accuracy'])} {fmt_ci(s['accuracy_ci'])} fid {s['fidelity']:.3f}"
                 for kind, s in by_kind.items() if kind != "all"]
        s = by_kind["all"]
        print(f"{key:24s} kv {s['prompt_kv_ratio']:.3f} h2d/step {s['h2d_per_step']:.0f} "
              f"ms/tok {s['ms_per_token'] or 0:.1f} refresh {fmt(s['refresh_rate'])} | " + " | ".join(cells))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**config, "table": table, "items": items}, indent=1))


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def fmt_ci(ci) -> str:
    return "" if not ci else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


if __name__ == "__main__":
    main()
