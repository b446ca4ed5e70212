"""One process vs N Ray workers (`ask DIR --each --workers N`) on a folder of demo clips, on the CPU.

Answering time only: the single process is timed after its model load, the workers from the first
input sent to the last record written (hybridkv_cli.distributed's ``timings``); the start-up (the
local Ray runtime and every worker's model load) is reported apart. Each side runs ``--repeats``
times; the best run counts.

    OMP_NUM_THREADS=1 python benchmarks/scale_out.py --out docs/scale_out.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from media_fixtures import make_video  # noqa: E402

from hybridkv_cli.batch import run_batch  # noqa: E402
from hybridkv_cli.distributed import run_distributed  # noqa: E402
from hybridkv_cli.inputs import plan_inputs  # noqa: E402
from hybridkv_cli.session import AskOptions, Session  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="scale_out"))
    for i in range(a.clips):
        make_video(folder / f"clip{i:02d}.mp4", n=64, w=448, h=336)
    items = plan_inputs([str(folder)], each=True)
    options = AskOptions(model="demo", frames=a.frames, max_new_tokens=64)
    quiet = Console(file=io.StringIO())

    session = Session(options)
    started = time.perf_counter()
    session.model()
    load = time.perf_counter() - started
    one = []
    for _ in range(a.repeats):
        started = time.perf_counter()
        run_batch(items, "What happens?", session, console=quiet, quiet=True)
        one.append(time.perf_counter() - started)
    many = []
    for _ in range(a.repeats):
        timings: dict = {}
        summary = run_distributed(items, "What happens?", options, workers=a.workers, num_cpus=a.workers,
                                  console=quiet, quiet=True, timings=timings)
        assert summary.ok == a.clips, summary
        many.append(timings)
    best = min(many, key=lambda t: t["answer_s"])
    result = {
        "clips": a.clips, "frames": a.frames, "workers": a.workers, "model": "demo", "device": "cpu",
        "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(),
        "one_process_s": round(min(one), 3), "one_process_model_load_s": round(load, 3),
        "workers_answer_s": round(best["answer_s"], 3), "workers_startup_s": round(best["startup_s"], 3),
        "speedup": round(min(one) / best["answer_s"], 2),
        "runs": {"one_process_s": [round(t, 3) for t in one], "workers_answer_s": [round(t["answer_s"], 3) for t in many]},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
