"""Long-video needle benchmark (issue 40): accuracy, device KV and prefill time of a streamed
prefill against a one-pass prefill, on needle videos of 64 to thousands of frames.

    python benchmarks/long_video.py --lengths 64 256 1024 4096 --items 4 --chunk 512 --window 1024 \\
        --one-pass-max 4096 --time-frames 64 1024 --out benchmarks/results/long_video.json

(docs/long_video.md: its results; 19 minutes on one CPU core.)

The items are made like the trained demo's data (``training/synthetic.py``): a scene of
``frames`` frames asking "What colour is the star?", the star visible in 1-2 frames only and in
a cell of its own, moved in time so that it shows at a chosen *depth* (share of the video before
it; 0.1 ... 0.9). Media go to a temporary folder. Each item is answered by the trained demo (CPU,
float32) through:

* ``full`` and ``hybridkv one-pass`` (b = ``--budget``): the one-pass prefill, for videos of at
  most ``--one-pass-max`` frames;
* ``hybridkv``, ``snapkv`` and ``streamingllm`` streamed (b = ``--budget``):
  ``Streaming("on", --chunk, --window)``.

An answer is right when it contains the expected colour (``hybridkv_cli.runs.answers.is_correct``,
the bench rule); the *first token* is right when the first generated token is the colour's first
token (computed at the end of the prompt, before any decode step). Per run the engine's counters
are kept: device KV peak while prefilling, the working sets' peak while reading (streamed runs),
device KV after compression, time to the first token. Then, at ``--time-frames`` frames,
``prefill`` alone is timed ``--repeats`` times per setting (median). Writes the JSON to
``--out`` and prints a markdown summary (``--summarise``: of an earlier JSON); progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from hybridkv_cli.compression import make_policy  # noqa: E402
from hybridkv_cli.engine import generate, prefill  # noqa: E402
from hybridkv_cli.engine.stream import Streaming  # noqa: E402
from hybridkv_cli.media import load_media  # noqa: E402
from hybridkv_cli.models import registry  # noqa: E402
from hybridkv_cli.models.prompt import build_prompt  # noqa: E402
from hybridkv_cli.runs.answers import is_correct  # noqa: E402
from training import synthetic as S  # noqa: E402

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
SEED = S.HELD_OUT_SEED  # not a training seed; the window was chosen on seed 1 (stream_window.py)
MAX_NEW_TOKENS = 6  # a colour and the end of the turn
STREAMED = ("hybridkv", "snapkv", "streamingllm")  # compressed after a streamed prefill
MiB = 1 << 20


# --- items ---------------------------------------------------------------------------------------
def needle_item(frames: int, depth: float, index: int) -> S.Item:
    """A needle-colour item of ``frames`` frames with its star moved to ``depth`` of the video.

    The scene is drawn as the held-out set draws it (a star of 1-2 frames in a cell of its own);
    the star is then erased (its pixels become background: nothing else shares its cell) and
    drawn again, same place, same colour, starting at frame ``round(depth * (frames - n))``, if
    its cell is empty at those frames (else the scene is redrawn)."""
    rng = np.random.default_rng([SEED, frames, round(depth * 100), index])
    while True:
        scene = S.make_scene(rng, frames, kinds=("needle_colour",))
        qa = next((qa for qa in scene.qas if qa.kind == "needle_colour"), None)
        if qa is None or not S.star_in_the_clear(scene):
            continue
        video, labels = scene.video, scene.label_maps[0]
        old = list(scene.shown["star"])
        star = labels[old[0]] == qa.pixel_labels[0]  # [H, W] the star's pixels (a needle star stays put)
        new = [round(depth * (frames - len(old))) + k for k in range(len(old))]
        ys, xs = np.nonzero(star)
        y0, x0 = ys.min() // S.CELL * S.CELL, xs.min() // S.CELL * S.CELL
        cell = (slice(y0, y0 + S.CELL), slice(x0, x0 + S.CELL))
        if any(np.any(~np.isin(labels[t][cell], (0, qa.pixel_labels[0]))) for t in new):  # the cell is not free
            continue
        for t in old:
            video[t][star], labels[t][star] = S.BACKGROUND, 0
        for t in new:
            video[t][star], labels[t][star] = S.COLOURS[qa.answer], qa.pixel_labels[0]
        scene.shown["star"] = qa.evidence = tuple(new)
        return S.Item(f"f{frames}-d{round(depth * 100):02d}-{index}", scene, qa)


# --- runs ----------------------------------------------------------------------------------------
def settings(frames: int, args) -> dict:
    """name -> (method, budget, streaming or None for a one-pass prefill) for a video of ``frames``."""
    streaming = Streaming("on", args.chunk, args.window)
    out = {}
    if frames <= args.one_pass_max:
        out["full"] = ("full", None, None)
        out["hybridkv one-pass"] = ("hybridkv", args.budget, None)
    for method in STREAMED:
        out[f"{method} streamed"] = (method, args.budget, streaming)
    if args.kv_tokens:  # the compressed KV capped in tokens: device KV flat in length
        out[f"hybridkv streamed, {args.kv_tokens} tokens"] = (
            "hybridkv", args.budget, Streaming("on", args.chunk, args.window, args.kv_tokens))
    return {name: run for name, run in out.items() if not args.settings or name in args.settings}


def policy(method: str, budget: float | None):
    return make_policy(method) if budget is None else make_policy(method, budget=budget)


def answer(demo, prompt, expected: str, method, budget, streaming) -> dict:
    """One greedy generation: its answer, whether it is right, and the engine's KV and time counters."""
    gen = generate(demo.model, prompt, policy(method, budget), MAX_NEW_TOKENS, streaming=streaming)
    streamed = gen.cache.streamed
    text = demo.processor.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    return {
        "answer": text,
        "correct": bool(is_correct(text, [expected])),
        "first_token_correct": gen.tokens[:1] == demo.processor.tokenizer.encode(expected)[:1],
        "prefill_peak_bytes": gen.cache.prefill_peak_bytes,
        "read_peak_bytes": streamed["read_peak_bytes"] if streamed else None,
        "chunks": streamed["chunks"] if streamed else None,
        "device_bytes": gen.device_bytes_after_prefill,
        "ttft_s": gen.prefill_s,
    }


def time_prefill(demo, prompt, runs: dict, repeats: int) -> dict:
    """Median seconds of ``prefill`` alone per setting, the settings interleaved (one warm-up each)."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        for name, (method, budget, streaming) in runs.items():
            start = time.perf_counter()
            prefill(demo.model, prompt, policy(method, budget), streaming=streaming)
            if repeat:  # the first round warms up
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


# --- summary -------------------------------------------------------------------------------------
def summarise(rows: list[dict]) -> dict:
    """Accuracy by (frames, setting) and (depth, setting), and the counters by (frames, setting)."""
    acc: dict[tuple, list[dict]] = {}
    for r in rows:
        acc.setdefault(("frames", r["frames"], r["setting"]), []).append(r)
        acc.setdefault(("depth", r["depth"], r["setting"]), []).append(r)
    memory: dict[tuple, dict] = {}
    for r in rows:
        m = memory.setdefault((r["frames"], r["setting"]), {"tokens": r["tokens"], "chunks": r["chunks"]})
        for key in ("prefill_peak_bytes", "read_peak_bytes", "device_bytes", "ttft_s"):
            if r[key] is not None:
                m.setdefault(key, []).append(r[key])
    for m in memory.values():  # the largest counter over the items (token counts differ by a few)
        for key in ("prefill_peak_bytes", "read_peak_bytes", "device_bytes"):
            m[key] = max(m[key]) if key in m else None
        m["ttft_s"] = statistics.median(m["ttft_s"])
    return {
        "accuracy": [{"by": by, "value": v, "setting": s, "right": sum(r["correct"] for r in rs),
                      "first_token": sum(r["first_token_correct"] for r in rs), "n": len(rs)}
                     for (by, v, s), rs in acc.items()],
        "memory": [{"frames": f, "setting": s, **m} for (f, s), m in memory.items()],
    }


def table(head: list[str], lines: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(str(x) for x in line) + " |" for line in lines)])


def markdown(result: dict) -> str:
    """The summary tables of ``result`` (what docs/long_video.md quotes)."""
    names = list(dict.fromkeys(a["setting"] for a in result["summary"]["accuracy"]))
    cells = {(a["by"], a["value"], a["setting"]): f"{a['right']}/{a['n']}" for a in result["summary"]["accuracy"]}
    firsts = {(a["by"], a["value"], a["setting"]): f"{a['first_token']}/{a['n']}"
              for a in result["summary"]["accuracy"]}
    lengths = sorted({a["value"] for a in result["summary"]["accuracy"] if a["by"] == "frames"})
    depths = sorted({a["value"] for a in result["summary"]["accuracy"] if a["by"] == "depth"})
    tokens = {m["frames"]: m["tokens"] for m in result["summary"]["memory"]}
    out = []
    for title, got in (("Accuracy (answer contains the colour)", cells), ("First token right", firsts)):
        out += [f"### {title} by length", table(["frames (tokens)", *names], [
            [f"{f} ({tokens[f]})", *(got.get(("frames", f, n), "-") for n in names)] for f in lengths])]
        out += [f"### {title} by depth (all lengths)", table(["depth", *names], [
            [d, *(got.get(("depth", d, n), "-") for n in names)] for d in depths])]
    mem = {(m["frames"], m["setting"]): m for m in result["summary"]["memory"]}

    def mib(x):
        return "-" if x is None else f"{x / MiB:.2f}"

    out += ["### Device KV (MiB, largest over the items)", table(
        ["frames", "full peak", "full after", "hkv one-pass peak", "hkv streamed peak", "hkv streamed read peak",
         "hkv streamed after", "chunks"],
        [[f, mib(mem.get((f, "full"), {}).get("prefill_peak_bytes")),
          mib(mem.get((f, "full"), {}).get("device_bytes")),
          mib(mem.get((f, "hybridkv one-pass"), {}).get("prefill_peak_bytes")),
          mib(mem[f, "hybridkv streamed"]["prefill_peak_bytes"]), mib(mem[f, "hybridkv streamed"]["read_peak_bytes"]),
          mib(mem[f, "hybridkv streamed"]["device_bytes"]), mem[f, "hybridkv streamed"]["chunks"]] for f in lengths])]
    out += ["### Growth of the peak device KV, shortest to longest video", table(
        ["setting", "counter", "ratio"],
        [[g["setting"], g["counter"], f"{g['ratio']:.2f}x ({g['from']}→{g['to']} frames)"]
         for g in result["growth"]])]
    out += ["### Time to the first token (s, median over the items)", table(["frames", *names], [
        [f, *(f"{mem[f, n]['ttft_s']:.2f}" if (f, n) in mem else "-" for n in names)] for f in lengths])]
    for timing in result["timing"]:
        seconds = timing["seconds"]
        out += [f"### Prefill time at {timing['frames']} frames ({timing['tokens']} tokens; median of "
                f"{timing['repeats']}, chunk {timing['chunk']}, window {timing['window']})",
                table(["setting", "seconds", "/ full one-pass", "/ hybridkv one-pass"], [
                    [n, f"{s:.3f}", f"{s / seconds['full']:.2f}", f"{s / seconds['hybridkv one-pass']:.2f}"]
                    for n, s in seconds.items()])]
    return "\n\n".join(out)


def growth(summary: dict) -> list[dict]:
    """Peak device KV at the longest length a setting ran, over its peak at the shortest."""
    out = []
    capped = sorted({m["setting"] for m in summary["memory"] if m["setting"].startswith("hybridkv streamed, ")})
    for setting, counter in (("full", "prefill_peak_bytes"), ("hybridkv one-pass", "prefill_peak_bytes"),
                             ("hybridkv streamed", "prefill_peak_bytes"), ("hybridkv streamed", "read_peak_bytes"),
                             ("hybridkv streamed", "device_bytes"),
                             *((name, counter) for name in capped for counter in ("prefill_peak_bytes", "device_bytes"))):
        ms = sorted((m for m in summary["memory"] if m["setting"] == setting), key=lambda m: m["frames"])
        if len(ms) >= 2:
            out.append({"setting": setting, "counter": counter, "from": ms[0]["frames"], "to": ms[-1]["frames"],
                        "ratio": ms[-1][counter] / ms[0][counter]})
    return out


def plot(result: dict, path: Path, others: list[dict] = ()) -> None:
    """Peak device KV against frames (log-log): full and HybridKV one-pass, HybridKV streamed, and
    the capped streamed settings of ``others`` (runs with --kv-tokens)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    drawn = []
    for setting, counter, label in (("full", "prefill_peak_bytes", "full, one pass"),
                                    ("hybridkv one-pass", "prefill_peak_bytes", "hybridkv b=0.1, one pass"),
                                    ("hybridkv streamed", "prefill_peak_bytes", "hybridkv b=0.1, streamed"),
                                    ("hybridkv streamed", "read_peak_bytes", "hybridkv streamed, while reading")):
        ms = sorted((m for m in result["summary"]["memory"] if m["setting"] == setting), key=lambda m: m["frames"])
        drawn += [m[counter] / MiB for m in ms]
        ax.plot([m["frames"] for m in ms], [m[counter] / MiB for m in ms], "o-" if "read" not in counter else "s--",
                label=label)
    for other in others:
        c = other["config"]
        for setting in sorted({m["setting"] for m in other["summary"]["memory"] if ", " in m["setting"]}):
            ms = sorted((m for m in other["summary"]["memory"] if m["setting"] == setting), key=lambda m: m["frames"])
            drawn += [m["prefill_peak_bytes"] / MiB for m in ms]
            ax.plot([m["frames"] for m in ms], [m["prefill_peak_bytes"] / MiB for m in ms], "^-",
                    label=f"{setting.replace('hybridkv', 'hybridkv b=0.1')} cap, window {c['window']}")
    c = result["config"]
    ax.set(xscale="log", yscale="log", xlabel="frames", ylabel="peak device KV while prefilling (MiB)",
           title=f"demo model, chunk {c['chunk']}, window {c['window']} tokens")
    ax.set_xticks(c["lengths"], [str(f) for f in c["lengths"]])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_yticks([t for t in (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200) if min(drawn) / 2 <= t <= max(drawn) * 2])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024], help="frames per video")
    parser.add_argument("--items", type=int, default=2, help="items per (length, depth)")
    parser.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS))
    parser.add_argument("--chunk", type=int, default=512, help="streamed prefill: tokens a chunk")
    parser.add_argument("--window", type=int, default=1024, help="streamed prefill: working-set tokens a layer")
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--kv-tokens", type=int, default=None,
                        help="also run hybridkv streamed with its compressed KV capped at this many tokens a head")
    parser.add_argument("--settings", nargs="+", default=None, help="run only these settings (by name)")
    parser.add_argument("--one-pass-max", type=int, default=1024, help="longest video prefilled in one pass (frames)")
    parser.add_argument("--time-frames", type=int, nargs="+", default=[64], help="video lengths of the prefill timing")
    parser.add_argument("--repeats", type=int, default=9, help="timed prefills per setting (median)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/long_video.json"))
    parser.add_argument("--plot", type=Path, default=None, help="also draw peak device KV vs frames (PNG)")
    parser.add_argument("--summarise", type=Path, default=None,
                        help="run nothing: print the summary (and --plot) of an earlier run's JSON")
    parser.add_argument("--also", type=Path, nargs="*", default=[],
                        help="with --summarise --plot: also draw the capped settings of these runs' JSON")
    args = parser.parse_args()
    if args.summarise:
        result = json.loads(args.summarise.read_text())
        print(markdown(result))
        if args.plot:
            plot(result, args.plot, [json.loads(path.read_text()) for path in args.also])
        return

    began = time.perf_counter()
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    demo = registry.load_model("demo", device="cpu", dtype="float32")
    max_pixels = registry.max_pixels_for("demo", None)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        def prompt_of(item: S.Item):
            path = Path(folder) / S.write_item(item, folder)
            media = load_media([path], frames=item.scene.video.shape[0], max_pixels=max_pixels)
            return build_prompt(demo.processor, media, item.qa.question)

        for frames in args.lengths:
            for depth in args.depths:
                for index in range(args.items):
                    item = needle_item(frames, depth, index)
                    prompt = prompt_of(item)
                    for name, run in settings(frames, args).items():
                        r = answer(demo, prompt, item.qa.answer, *run)
                        r.update(id=item.id, frames=frames, depth=depth, setting=name, tokens=prompt.length,
                                 expected=item.qa.answer)
                        rows.append(r)
                        print(f"[{time.perf_counter() - began:6.0f}s] {item.id} {name:22s} {r['answer']!r:12} "
                              f"{'right' if r['correct'] else 'wrong'} ({r['ttft_s']:.1f}s, {prompt.length} tokens)",
                              file=sys.stderr, flush=True)
        streaming = Streaming("on", args.chunk, args.window)
        timed = {"full": ("full", None, None), "hybridkv one-pass": ("hybridkv", args.budget, None),
                 "hybridkv streamed": ("hybridkv", args.budget, streaming)}
        timing = []
        for frames in args.time_frames:  # the same process, the settings interleaved
            print(f"[{time.perf_counter() - began:6.0f}s] timing prefill at {frames} frames", file=sys.stderr,
                  flush=True)
            prompt = prompt_of(needle_item(frames, 0.5, 0))
            timing.append({"frames": frames, "tokens": prompt.length, "repeats": args.repeats, "chunk": args.chunk,
                           "window": args.window, "seconds": time_prefill(demo, prompt, timed, args.repeats)})
    summary = summarise(rows)
    result = {
        "config": {"commit": commit, "model": "demo (trained)", "device": "cpu", "dtype": "float32",
                   "max_pixels": max_pixels, "lengths": args.lengths, "depths": args.depths, "items": args.items,
                   "chunk": args.chunk, "window": args.window, "budget": args.budget,
                   "one_pass_max": args.one_pass_max, "seed": SEED, "max_new_tokens": MAX_NEW_TOKENS},
        "summary": summary,
        "growth": growth(summary),
        "timing": timing,
        "rows": rows,
        "seconds": time.perf_counter() - began,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    if args.plot:
        plot(result, args.plot)
    print(f"\n{len(rows)} answers, {result['seconds']:.0f} s; wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
