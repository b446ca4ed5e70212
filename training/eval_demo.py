#!/usr/bin/env python
"""Full-cache accuracy of a model on a task manifest (``python -m training.make_video_tasks`` output).

    python -m training.eval_demo TASKS [--model demo | --weights FILE] [--method full] [--limit N] [--json out.json]

TASKS is a ``tasks.jsonl`` file or the folder holding it. Every row goes the way a user's question
goes: ``load_media`` decodes the files (64 frames of the mp4, or the PNG image set) and
``hybridkv_cli.api.ask`` answers greedily. An answer is right when it equals the expected one after
``hybridkv bench``'s normalisation (case, whitespace, punctuation at the ends): exact match, where
the bench counts an answer contained in the output. Prints overall, needle and per-kind
accuracy; exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from hybridkv_cli.api import ask
from hybridkv_cli.media import load_media
from hybridkv_cli.models.registry import load_model, max_pixels_for
from hybridkv_cli.runs.answers import normalise


def read_manifest(path: Path) -> tuple[Path, list[dict]]:
    manifest = path / "tasks.jsonl" if path.is_dir() else path
    rows = [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines() if line.strip()]
    return manifest.parent, rows


def evaluate(loaded, root: Path, rows: list[dict], method: str = "full", progress: bool = True,
             max_pixels: int | None = None) -> dict:
    """Ask every row; return {"overall", "needle", "kinds": {kind: acc}, "n", "rows": [...]}."""
    results = []
    for i, row in enumerate(rows):
        media = row["media"]
        paths = [str(root / m) for m in media] if isinstance(media, list) else str(root / media)
        out = ask(loaded, load_media(paths, max_pixels=max_pixels), row["question"], method=method, max_new_tokens=8)
        ok = normalise(out["answer"]) == normalise(row["answer"])
        results.append({"id": row["id"], "kind": row["kind"], "needle": row["needle"], "expected": row["answer"],
                        "answer": out["answer"], "correct": ok})
        if progress and (i + 1) % 25 == 0:
            print(f"  {i + 1}/{len(rows)}  running accuracy {sum(r['correct'] for r in results) / len(results):.3f}",
                  file=sys.stderr, flush=True)
    by_kind = defaultdict(list)
    for r in results:
        by_kind[r["kind"]].append(r["correct"])
    needles = [r["correct"] for r in results if r["needle"]]

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    return {"n": len(results), "overall": mean([r["correct"] for r in results]), "needle": mean(needles),
            "n_needle": len(needles), "kinds": {k: mean(v) for k, v in sorted(by_kind.items())},
            "kind_counts": {k: len(v) for k, v in sorted(by_kind.items())}, "rows": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tasks", type=Path)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--method", default="full")
    ap.add_argument("--limit", type=int, default=None, help="only the first N rows")
    ap.add_argument("--weights", type=Path, default=None,
                    help="evaluate these trained-demo weights (a train_demo.py --out file) instead of --model")
    ap.add_argument("--json", type=Path, default=None, help="write the summary and every row here")
    args = ap.parse_args(argv)

    root, rows = read_manifest(args.tasks)
    rows = rows[: args.limit]
    start = time.perf_counter()
    if args.weights:
        from hybridkv_cli.models.demo import TRAINED_MAX_PIXELS, build_trained_demo

        loaded, max_pixels = build_trained_demo(weights=args.weights), TRAINED_MAX_PIXELS
    else:
        loaded, max_pixels = load_model(args.model, device="cpu", dtype="float32"), max_pixels_for(args.model, None)
    summary = evaluate(loaded, root, rows, method=args.method, max_pixels=max_pixels)
    summary["seconds"] = time.perf_counter() - start
    def acc(x):
        return "-" if x is None else f"{x:.3f}"

    print(f"{args.model} / {args.method}: overall {acc(summary['overall'])} ({summary['n']} items), "
          f"needle {acc(summary['needle'])} ({summary['n_needle']} items), {summary['seconds']:.0f} s")
    for kind, value in summary["kinds"].items():
        print(f"  {kind:14s} {acc(value)}  ({summary['kind_counts'][kind]})")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
