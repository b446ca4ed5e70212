"""A kept prefix from each tier of ``hybridkv serve``'s prefix cache: memory, host, disk.

    python benchmarks/serve_prefix_tiers.py --videos 8 --out docs/serve_prefix_tiers.json

One server (``--model demo``, a fresh ``--prefix-cache-dir``): for each of M fresh videos, one
streamed question (a miss: decoded, encoded, prefilled, compressed, then written to the folder)
and a second (a memory hit). The server stops and a new one starts on the same folder: a third
question about each video (its prefix read from the folder's ``.hkv`` file), then a fourth (a
memory hit again). Then a server that keeps no prefix on the device
(``--prefix-cache-device-bytes 1``: each is parked in host memory once made) asks the first two
questions again: a miss, then a host hit (the prefix copied back). Time to the first streamed
token of each, medians over the videos; the restarted server's startup time; the folder's size;
whether each video's answers equal those of the first server for the same questions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_load as load  # noqa: E402  (the load benchmark's helpers: videos, server, first token)


def serve_round(server_args: list[str], videos, questions_at: tuple[int, int]) -> tuple[list, list, list, float, str]:
    """One server's life: per video the TTFT and answer of two questions."""
    proc, base, startup = load.start_server(1, server_args)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    try:
        first, second, answers = [], [], []
        for url, questions in videos:
            ttft_a, text_a = load.first_token(client, url, questions[questions_at[0] % len(questions)])
            ttft_b, text_b = load.first_token(client, url, questions[questions_at[1] % len(questions)])
            first.append(ttft_a)
            second.append(ttft_b)
            answers.append((text_a, text_b))
        metrics = httpx.get(base + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    return first, second, answers, startup, metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--videos", type=int, default=8)
    parser.add_argument("--frames", type=int, default=load.S.FRAMES, help="frames of each synthetic clip")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as media, tempfile.TemporaryDirectory() as folder:
        videos = load.make_videos(Path(media), args.videos, 3, args.frames)
        on_disk = ["--prefix-cache-dir", folder]
        miss, hit, before, _, _ = serve_round(on_disk, videos, (0, 1))
        stored = sum(p.stat().st_size for p in Path(folder).glob("*.hkv"))
        files = len(list(Path(folder).glob("*.hkv")))
        disk, hit_after, after, startup, metrics = serve_round(on_disk, videos, (1, 0))
        _, host, parked, _, host_metrics = serve_round(["--prefix-cache-device-bytes", "1"], videos, (0, 1))
    median = lambda xs: statistics.median(xs)  # noqa: E731
    result = {
        "videos": args.videos, "frames": args.frames,
        "ttft_miss_s": median(miss), "ttft_memory_hit_s": median(hit), "ttft_disk_hit_s": median(disk),
        "ttft_memory_hit_after_restart_s": median(hit_after), "ttft_host_hit_s": median(host),
        "host_hits": load.metric(host_metrics, "hybridkv_prefix_cache_host_hits_total"),
        "miss_vs_disk_hit": median(miss) / median(disk), "restart_startup_s": startup,
        "files": files, "folder_bytes": stored,
        "disk_hits": load.metric(metrics, "hybridkv_prefix_cache_disk_hits_total"),
        "misses_after_restart": load.metric(metrics, "hybridkv_prefix_cache_misses_total"),
        "same_answers": all(a == b[::-1] == c for a, b, c in zip(before, after, parked)),
    }
    print(f"TTFT medians over {args.videos} videos: miss {result['ttft_miss_s'] * 1e3:.0f} ms, memory hit "
          f"{result['ttft_memory_hit_s'] * 1e3:.1f} ms | restart ({startup:.1f} s): disk hit "
          f"{result['ttft_disk_hit_s'] * 1e3:.1f} ms ({result['miss_vs_disk_hit']:.1f}x below the miss), memory "
          f"hit {result['ttft_memory_hit_after_restart_s'] * 1e3:.1f} ms | {files} files, {stored / 2**20:.1f} MiB | "
          f"no prefix on the device: host hit {result['ttft_host_hit_s'] * 1e3:.1f} ms ({result['host_hits']}) | "
          f"disk hits {result['disk_hits']}, misses after restart {result['misses_after_restart']} | same answers: "
          f"{result['same_answers']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
