"""One process vs N Ray workers (`ask DIR --each --workers N`) on a folder of demo clips, on the CPU.

Answering time only: the single process is timed after its model load (a fresh session each
run, as each run's workers are fresh), the workers from the first
input sent to the last record written (hybridkv_cli.runs.distributed's ``timings``); the start-up (the
local Ray runtime and every worker's model load) is reported apart. The two sides take turns,
``--repeats`` times each; the best run of each counts. Two phases: each workers run starting its
own local runtime (``--workers N``), then joining one started before that has settled (a running
cluster, as ``--ray ADDRESS`` finds it).

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

from hybridkv_cli.runs.batch import run_batch  # noqa: E402
from hybridkv_cli.runs.distributed import run_distributed  # noqa: E402
from hybridkv_cli.runs.inputs import plan_inputs  # noqa: E402
from hybridkv_cli.runs.session import AskOptions, Session  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle", type=float, default=20.0, help="seconds the running cluster idles before its runs")
    ap.add_argument("--out")
    a = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="scale_out"))
    for i in range(a.clips):
        make_video(folder / f"clip{i:02d}.mp4", n=64, w=448, h=336)
    items = plan_inputs([str(folder)], each=True)
    options = AskOptions(model="demo", frames=a.frames, max_new_tokens=64)
    quiet = Console(file=io.StringIO())

    loads = []

    def one_process() -> float:
        """A fresh session each time, timed after its model load, as a worker is: both sides pay
        their first input's warm-up (about 0.4 s here) inside the answering time."""
        session = Session(options)
        started = time.perf_counter()
        session.model()
        loads.append(time.perf_counter() - started)
        started = time.perf_counter()
        run_batch(items, "What happens?", session, console=quiet, quiet=True)
        return time.perf_counter() - started

    def workers() -> dict:
        timings: dict = {}
        summary = run_distributed(items, "What happens?", options, workers=a.workers, num_cpus=a.workers,
                                  console=quiet, quiet=True, timings=timings)
        assert summary.ok == a.clips, summary
        return timings

    def phase() -> dict:
        """One process and the workers taking turns, so that the machine's drift meets both."""
        one, many = [], []
        for _ in range(a.repeats):
            one.append(one_process())
            many.append(workers())
        best = min(many, key=lambda t: t["answer_s"])
        return {"one_process_s": round(min(one), 3), "workers_answer_s": round(best["answer_s"], 3),
                "workers_startup_s": round(best["startup_s"], 3), "speedup": round(min(one) / best["answer_s"], 2),
                "runs": {"one_process_s": [round(t, 3) for t in one],
                         "workers_answer_s": [round(t["answer_s"], 3) for t in many]}}

    cold = phase()  # each workers run starts its own local runtime, as `--workers N` does
    # A cluster that is already up, as `--ray ADDRESS` joins one: Ray's per-node agents are done
    # starting (on a fresh runtime their start-up takes CPU from the first inputs' answers)
    import ray

    ray.init(num_cpus=a.workers, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    time.sleep(a.settle)
    running = phase()
    ray.shutdown()
    result = {
        "clips": a.clips, "frames": a.frames, "workers": a.workers, "model": "demo", "device": "cpu",
        "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(),
        "one_process_model_load_s": round(min(loads), 3), "fresh_runtime": cold, "running_cluster": running,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
