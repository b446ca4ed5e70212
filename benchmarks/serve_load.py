"""Load on ``hybridkv serve``: N concurrent clients over M distinct videos, batched vs one at a time.

    python benchmarks/serve_load.py --clients 32 --videos 8 --batch 8 32 --out docs/serve_load.json

For each server setting (``--max-batch`` of each ``--batch``, then ``--max-batch 1``, then the
baseline: ``--max-batch 1`` with the clients taking turns, so the server holds one request at a
time, its prefill included) the script starts ``hybridkv serve --model demo`` on a free port (time
to a healthy ``/health``), then

1. **first vs second question**: for each of M fresh videos, one streamed question (a prefix-cache
   miss: the video is decoded, encoded, prefilled and compressed) then another question about the
   same video (a hit), one request at a time; time to the first streamed token of each;
2. **load**: N clients at once, each asking ``--requests`` questions in a row about its video
   (client i: video i mod M) through the official ``openai`` client; answers/s over the whole
   wall clock, p50 / p99 latency (a baseline client's wait for its turn included), failures (with
   their reasons, and the requests the server counted as cancelled), the CPU seconds the server
   and the clients spent, the most device KV of the decoding answers at once (the server's
   metric; under ``--server-args --kv-memory SIZE`` never above it), and whether
   every setting gave the same answer to the same question about the same video.

The videos are the demo's synthetic clips (``training/synthetic.py``: 112x112, 64 frames by
default, ``--frames`` for longer ones), written to a temporary folder and sent as ``data:`` URLs.
The load phase uses videos of its own, so its caches start cold. ``--ttft-video FILE`` adds a
video file of the user's size to phase 1 (e.g. the repository's ``sample_media/shapes.mp4``,
320x240): each server asks it two questions (``TTFT_QUESTIONS``) after the synthetic clips'.

Runs on a shared machine vary by a tenth or more, so ``--rounds R`` runs every setting R times
(the settings' order reversed every other round, so a drift of the machine's speed falls on all
of them) and reports each number's median over the rounds with the lowest and highest of the
answers/s and the two ratios; each round's ratio is against that round's one-at-a-time server.
"""

from __future__ import annotations

import argparse
import contextlib
import base64
import json
import mimetypes
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from training import synthetic as S  # noqa: E402  (the repository's training package)


def make_videos(folder: Path, count: int, seed: int, frames: int) -> list[tuple[str, list[str]]]:
    """``count`` distinct clips as ``(data URL, questions)``, each with at least two questions."""
    videos, rng = [], np.random.default_rng(seed)
    while len(videos) < count:
        scene = S.make_scene(rng, frames)
        questions = list(dict.fromkeys(qa.question for qa in scene.qas))
        if len(questions) < 2:
            continue
        path = folder / f"clip{seed}-{len(videos)}.mp4"
        S.write_mp4(path, scene.video)
        videos.append((file_url(path), questions))
    return videos


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(max_batch: int, extra: list[str]) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv_cli.cli", "serve", "--model", "demo", "--port", str(port),
                             "--max-batch", str(max_batch), "--queue-size", "1024", "--quiet", *extra])
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base)
    return proc, base, time.perf_counter() - started


def wait_healthy(proc: subprocess.Popen, base: str, limit_s: float = 120) -> None:
    """Back once the server ``proc`` at ``base`` answers ``/health``; exits if it dies or takes too long."""
    started = time.perf_counter()
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            if proc.poll() is not None or time.perf_counter() - started > limit_s:
                raise SystemExit(f"the server did not start (exit {proc.poll()})")
            time.sleep(0.05)


def messages(url: str, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def first_token(client, url: str, question: str) -> tuple[float, str]:
    start, ttft, text = time.perf_counter(), None, []
    for chunk in client.chat.completions.create(model="demo", messages=messages(url, question), stream=True):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            ttft = ttft or time.perf_counter() - start
            text.append(piece)
    return ttft if ttft is not None else time.perf_counter() - start, "".join(text)


#: what phase 1 asks about a ``--ttft-video`` (any two questions: the second reads the kept prefix)
TTFT_QUESTIONS = ("What happens in the video?", "What colour is the first shape?")


def file_url(path: Path) -> str:
    kind = mimetypes.guess_type(path.name)[0] or "video/mp4"
    return f"data:{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(text: str, name: str) -> int:
    return int(float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_setting(max_batch: int, args, ttft_videos, load_videos, serial: bool = False) -> dict:
    proc, base, startup = start_server(max_batch, args.server_args)
    turn = threading.Lock() if serial else contextlib.nullcontext()
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600,
                           http_client=httpx.Client(limits=httpx.Limits(max_connections=args.clients + 8)))
    try:
        first, second = [], []
        for url, questions in ttft_videos:
            first.append(first_token(client, url, questions[0])[0])
            second.append(first_token(client, url, questions[1])[0])
        files = []  # after the clips: a warm server, as theirs after the first
        for path in args.ttft_video:
            url = file_url(path)
            miss, hit = (first_token(client, url, question)[0] for question in TTFT_QUESTIONS)
            files.append({"video": str(path), "ttft_first_s": miss, "ttft_second_s": hit, "ttft_ratio": miss / hit})

        def one_client(i: int) -> list[tuple]:
            url, questions = load_videos[i % len(load_videos)]
            done = []
            for r in range(args.requests):
                question = questions[(i // len(load_videos) + r) % len(questions)]
                start = time.perf_counter()
                with turn:
                    try:
                        reply = client.chat.completions.create(model="demo", messages=messages(url, question))
                        done.append((i % len(load_videos), question, reply.choices[0].message.content,
                                     time.perf_counter() - start, None))
                    except openai.APIError as e:
                        why = f"{type(e).__name__}: {e}" + (f" ({e.__cause__!r})" if e.__cause__ else "")
                        done.append((i % len(load_videos), question, None, time.perf_counter() - start, why))
            return done

        start, server_cpu, client_cpu = time.perf_counter(), cpu_seconds(proc.pid), time.process_time()
        with ThreadPoolExecutor(args.clients) as pool:
            results = [row for rows in pool.map(one_client, range(args.clients)) for row in rows]
        wall = time.perf_counter() - start
        client_cpu = time.process_time() - client_cpu
        server_cpu = cpu_seconds(proc.pid) - server_cpu if server_cpu is not None else None
        metrics = httpx.get(base + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    latencies = [r[3] for r in results]
    return {
        "max_batch": max_batch, "serial": serial, "startup_s": startup,
        "ttft_first_s": statistics.median(first), "ttft_second_s": statistics.median(second),
        "ttft_ratio": statistics.median(first) / statistics.median(second), "ttft_files": files,
        "answers": len(results), "failures": sum(r[4] is not None for r in results),
        "failure_reasons": dict(Counter(r[4] for r in results if r[4] is not None)), "wall_s": wall,
        "answers_per_s": len(results) / wall, "latency_p50_s": percentile(latencies, 0.5),
        "latency_p99_s": percentile(latencies, 0.99),
        "server_cpu_s": server_cpu, "client_cpu_s": client_cpu,
        "hits": metric(metrics, "hybridkv_prefix_cache_hits_total"),
        "kv_device_bytes_peak": metric(metrics, "hybridkv_decoding_kv_device_bytes_peak"),
        "misses": metric(metrics, "hybridkv_prefix_cache_misses_total"),
        "cancelled": metric(metrics, "hybridkv_cancelled_total"),
        "answers_by_question": {f"{v}|{q}": a for v, q, a, _, e in results if e is None},
    }


def median_row(rows: list[dict]) -> dict:
    """One setting's rounds as one row: each number the median of its rounds (failures: their
    sum, with every reason), each ``--ttft-video`` file's likewise, and ``spread``: the lowest and
    highest of the rounds' answers/s and ratios."""
    first = rows[0]
    row = {key: middle([r[key] for r in rows]) if isinstance(value, (int, float)) and not isinstance(value, bool)
           else value for key, value in first.items()}
    row["failures"] = sum(r["failures"] for r in rows)
    row["cancelled"] = sum(r["cancelled"] for r in rows)
    row["failure_reasons"] = dict(sum((Counter(r["failure_reasons"]) for r in rows), Counter()))
    row["ttft_files"] = [{**f, **{key: middle([r["ttft_files"][i][key] for r in rows])
                                  for key in ("ttft_first_s", "ttft_second_s", "ttft_ratio")}}
                         for i, f in enumerate(first["ttft_files"])]
    row["spread"] = {key: [min(r[key] for r in rows), max(r[key] for r in rows)]
                     for key in ("answers_per_s", "throughput_vs_one_at_a_time", "ttft_ratio")}
    return row


def middle(values: list):
    """The median; of counts, the lower middle one (a count stays whole)."""
    return statistics.median_low(values) if all(isinstance(v, int) for v in values) else statistics.median(values)


def spread(row: dict, key: str) -> str:
    """`` [lowest-highest]`` of a number over the rounds (nothing for one round)."""
    low, high = row["spread"][key]
    return "" if low == high else f" [{low:.1f}-{high:.1f}]"


def failed(row: dict) -> str:
    """The reasons of a setting's failed requests and its server's cancellations, for the summary line."""
    reasons = "; ".join(f"{n}x {reason[:120]}" for reason, n in row["failure_reasons"].items())
    return f" ({reasons}; {row['cancelled']} cancelled)" if row["failures"] else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--videos", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="questions each client asks in a row")
    parser.add_argument("--frames", type=int, default=S.FRAMES, help="frames of each synthetic clip")
    parser.add_argument("--batch", type=int, nargs="+", default=[8], help="--max-batch of the batched servers")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="more flags for `hybridkv serve` (last on the line)")
    parser.add_argument("--ttft-video", type=Path, nargs="*", default=[], metavar="FILE",
                        help="video files whose first and second question phase 1 also times")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every setting this many times, alternating their order; report medians")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        ttft_videos = make_videos(Path(folder), args.videos, 1, args.frames)
        load_videos = make_videos(Path(folder), args.videos, 2, args.frames)
    plan = [(b, False) for b in (*args.batch, 1)] + [(1, True)]
    rounds = []
    for r in range(args.rounds):  # every other round in reverse: a drift of the machine's speed cancels out
        order = plan if r % 2 == 0 else plan[::-1]
        rows = {setting: run_setting(setting[0], args, ttft_videos, load_videos, serial=setting[1]) for setting in order}
        rows = [rows[setting] for setting in plan]
        for row in rows:
            row["throughput_vs_one_at_a_time"] = row["answers_per_s"] / rows[-1]["answers_per_s"]
        rounds.append(rows)
    answers = [row.pop("answers_by_question") for rows in rounds for row in rows]
    same = all(a == answers[-1] for a in answers)
    settings = [median_row([rows[i] for rows in rounds]) for i in range(len(plan))]
    summary = {"clients": args.clients, "videos": args.videos, "requests_per_client": args.requests,
               "frames": args.frames, "ttft_videos": [str(p) for p in args.ttft_video],
               "server_args": args.server_args, "rounds": len(rounds), "settings": settings,
               "each_round": rounds if len(rounds) > 1 else None, "same_answers": same}
    if len(rounds) > 1:
        print(f"medians of {len(rounds)} rounds [lowest-highest]:")
    for r in settings:
        label = f"max-batch {r['max_batch']:>3}" + (" one at a time" if r["serial"] else "")
        print(f"{label}: startup {r['startup_s']:.1f} s | TTFT first {r['ttft_first_s'] * 1e3:.0f} ms, second "
              f"{r['ttft_second_s'] * 1e3:.0f} ms ({r['ttft_ratio']:.1f}x{spread(r, 'ttft_ratio')}) | {r['answers']} "
              f"answers in {r['wall_s']:.1f} s = {r['answers_per_s']:.1f}/s{spread(r, 'answers_per_s')}, p50 "
              f"{r['latency_p50_s'] * 1e3:.0f} ms, p99 {r['latency_p99_s'] * 1e3:.0f} ms, {r['failures']} failed"
              f"{failed(r)} | cache {r['hits']} hits / {r['misses']} misses | CPU s: server "
              f"{r['server_cpu_s'] or float('nan'):.2f}, clients {r['client_cpu_s']:.2f} | decoding KV peak "
              f"{r['kv_device_bytes_peak'] / 2**20:.2f} MiB"
              + "".join(f" | {Path(f['video']).name}: TTFT first {f['ttft_first_s'] * 1e3:.0f} ms, second "
                        f"{f['ttft_second_s'] * 1e3:.0f} ms ({f['ttft_ratio']:.1f}x)" for f in r["ttft_files"]))
    print("throughput vs one at a time: " + ", ".join(f"max-batch {r['max_batch']} "
                                                      f"{r['throughput_vs_one_at_a_time']:.1f}x"
                                                      f"{spread(r, 'throughput_vs_one_at_a_time')}"
                                                      for r in settings[:-1])
          + f"; every setting gave the same answers: {same}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
