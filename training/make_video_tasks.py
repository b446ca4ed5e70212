#!/usr/bin/env python
"""Write the held-out synthetic task set as real files plus a JSONL manifest.

    python -m training.make_video_tasks OUTDIR [--seed 20000]

OUTDIR/videos/*.mp4 (64 frames, 112x112, 4 fps, H.264), OUTDIR/images/<id>/*.png (image sets) and
OUTDIR/tasks.jsonl, one row per question (OUTDIR/needle.jsonl: the needle rows only):

    {"id": "needle_colour-003", "media": "videos/needle_colour-003.mp4", "question": "What colour is
     the star?", "answer": "blue", "needle": true, "kind": "needle_colour"}

``media`` is a path relative to the manifest, or a list of them for an image set. The seed differs
from every training seed (training draws scenes from ``[train_seed, step]``, this set from
``[seed, kind, i]``). 200 items: see ``training.synthetic.HELD_OUT_QUOTA`` (60 needle items,
whose star is visible in 1-2 of the 64 frames). Evaluate with ``python -m training.eval_demo OUTDIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from training import synthetic as S


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--seed", type=int, default=S.HELD_OUT_SEED)
    args = ap.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = []
    for item in S.held_out(args.seed):
        media = S.write_item(item, args.outdir)
        rows.append({"id": item.id, "media": media, "question": item.qa.question, "answer": item.qa.answer,
                     "needle": item.qa.needle, "kind": item.qa.kind})
    for name, subset in (("tasks.jsonl", rows), ("needle.jsonl", [r for r in rows if r["needle"]])):
        (args.outdir / name).write_text("".join(json.dumps(r) + "\n" for r in subset), encoding="utf-8")
    needles = sum(r["needle"] for r in rows)
    print(f"wrote {args.outdir / 'tasks.jsonl'}: {len(rows)} items, and needle.jsonl: the {needles} needle items "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
