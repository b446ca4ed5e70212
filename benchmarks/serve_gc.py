"""The garbage collector's pauses in ``hybridkv serve`` under a long load, with the start-up heap
frozen (the server's default) or not.

    python benchmarks/serve_gc.py --clients 16 --videos 4 --requests 180 --out docs/serve_gc.json

A full collection scans every tracked object and holds the interpreter while it does: every
thread of the server (the decode loop, the prefill, the HTTP event loop) waits. The server
freezes what start-up made (the model, the libraries, the warm-up) out of those scans. For each
setting (``frozen``: the server as it is; ``not frozen``: the same server with ``gc.freeze``
made a no-op in its process) the script starts ``hybridkv serve --model demo`` through a launcher
that times every collection (``gc.callbacks``), has N clients ask ``--requests`` questions each
in a row about M synthetic clips (greedy, not streamed, ``openai`` client), and reports each
generation's collections during the load, their total and longest pause, and the load's
latencies.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_port, make_videos, messages, percentile, wait_healthy  # noqa: E402

#: runs the server with every collection timed; SIGUSR1 writes the pauses so far to argv[1] and clears them
LAUNCHER = """
import gc, json, signal, sys, time
pauses, started, out = [], [0.0], sys.argv[1]
def timed(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        pauses.append((info["generation"], time.perf_counter() - started[0]))
gc.callbacks.append(timed)
def dump(*_):
    with open(out, "w") as f:
        json.dump(pauses, f)
    pauses.clear()
signal.signal(signal.SIGUSR1, dump)
if sys.argv[2] == "not frozen":
    gc.freeze = lambda: None
from hybridkv_cli.cli import main
sys.argv = ["hybridkv", *sys.argv[3:]]
sys.exit(main())
"""


def pauses(proc: subprocess.Popen, base: str, path: Path) -> list:
    """The collections timed since the last call: (generation, seconds)."""
    path.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    while not path.is_file() or not path.stat().st_size:
        httpx.get(base + "/health", timeout=5)  # the server's event loop runs a signal's handler when it wakes
        time.sleep(0.02)
    time.sleep(0.05)
    return json.loads(path.read_text())


def run_setting(setting: str, args, videos, folder: Path) -> dict:
    port, dump = free_port(), folder / f"pauses-{setting.replace(' ', '-')}.json"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(dump), setting, "serve", "--model", "demo",
                             "--port", str(port), "--quiet"])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        pauses(proc, base, dump)  # start-up's collections: not the load's
        latencies, lock = [], threading.Lock()

        def client(i: int) -> None:
            c = openai.OpenAI(base_url=base + "/v1", api_key="unused")
            url, questions = videos[i % len(videos)]
            for j in range(args.requests):
                start = time.perf_counter()
                c.chat.completions.create(model="demo", messages=messages(url, questions[j % len(questions)]))
                with lock:
                    latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        during = pauses(proc, base, dump)
    finally:
        proc.terminate()
        proc.wait(30)
    generations = {}
    for g in range(3):
        times = [s for gen, s in during if gen == g]
        generations[str(g)] = {"collections": len(times), "total_ms": round(1e3 * sum(times), 1),
                               "longest_ms": round(1e3 * max(times, default=0.0), 2)}
    return {"setting": setting, "requests": len(latencies), "wall_s": round(wall, 2),
            "latency_p50_ms": round(1e3 * percentile(latencies, 0.5), 1),
            "latency_p99_ms": round(1e3 * percentile(latencies, 0.99), 1),
            "latency_max_ms": round(1e3 * max(latencies), 1), "generations": generations}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--videos", type=int, default=4)
    parser.add_argument("--requests", type=int, default=180, help="questions each client asks in a row")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hybridkv-serve-gc-") as folder:
        videos = make_videos(Path(folder), args.videos, 3, 64)
        rows = [run_setting(setting, args, videos, Path(folder)) for setting in ("frozen", "not frozen")]
    for row in rows:
        gens = "  ".join(f"gen {g}: {v['collections']} x, {v['total_ms']} ms, longest {v['longest_ms']} ms"
                         for g, v in row["generations"].items())
        print(f"{row['setting']:>10}: {row['requests']} requests in {row['wall_s']} s, p50 {row['latency_p50_ms']} ms, "
              f"p99 {row['latency_p99_ms']} ms, max {row['latency_max_ms']} ms | {gens}")
    if args.out:
        Path(args.out).write_text(json.dumps({"clients": args.clients, "videos": args.videos,
                                              "requests_per_client": args.requests, "settings": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
