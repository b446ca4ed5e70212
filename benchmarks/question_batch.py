"""Questions per second of one compressed video's questions decoded together against one by one.

The `hybridkv ask VIDEO -Q q1 ... -Q q8 --batch-size N` path, in one process: `Session.compress`
once, then `Session.answer` of one request with its questions under `Limits(batch_size=N)` for each N,
the batch sizes alternating over ``--repeats`` rounds (so a slower stretch of the machine hits
them alike). Questions/s: the questions over the seconds of the question phase (suffixes fed
and answers decoded; the compression is outside it). The answers of every batch size are
checked to be the same.

    python benchmarks/question_batch.py --threads 1
    python benchmarks/question_batch.py --method snapkv --batch-sizes 1 8 --repeats 3

Prints one JSON object: per batch size the seconds of each round, the best, questions/s (from
the best round) and the ratio of each batch size's questions/s to the first one's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybridkv_cli.engine.jobs import Limits
from hybridkv_cli.runs.inputs import Item
from hybridkv_cli.runs.requests import Request
from hybridkv_cli.runs.session import AskOptions, Session

MEDIA = Path(__file__).resolve().parents[1] / "sample_media"
#: Asked after the file's own questions when it has fewer than ``--questions``.
MORE = ["What happens in the video?", "Which shape appears last?", "What colour is the square?",
        "How many shapes are there in all?", "What moves across the frame?"]


def questions(path: Path, media: str, count: int) -> list[str]:
    """``count`` distinct questions: those about ``media`` in the JSONL file ``path``, then :data:`MORE`."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = list(dict.fromkeys([r["question"] for r in rows if r["media"] == media] + MORE))
    if len(found) < count:
        raise SystemExit(f"only {len(found)} questions about {media}, not {count}")
    return found[:count]


def timed(session: Session, prefix, asked: list[str], batch_size: int) -> tuple[float, list[str]]:
    """Seconds of the question phase at ``batch_size`` and the answers, in question order."""
    start = time.perf_counter()
    done = {}
    for answer in session.answer([Request(questions=tuple(asked), prefix=prefix)], Limits(batch_size=batch_size)):
        if answer.error is not None:
            raise answer.error
        done[answer.index] = answer.record
    seconds = time.perf_counter() - start
    return seconds, [done[i]["answer"] for i in range(len(asked))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-random")
    ap.add_argument("--media", default=str(MEDIA / "needle.mp4"))
    ap.add_argument("--questions-file", type=Path, default=MEDIA / "questions.jsonl")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--method", default="hybridkv")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every batch size, alternating")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    asked = questions(args.questions_file, Path(args.media).name, args.questions)
    session = Session(AskOptions(model=args.model, method=args.method, frames=args.frames, device=args.device,
                                 max_new_tokens=args.max_new_tokens, defer_question=True))
    start = time.perf_counter()
    prefix = session.compress(Item((args.media,)))
    compress_s = time.perf_counter() - start
    timed(session, prefix, asked[:1], 1)  # warm-up: first-call costs
    seconds: dict[int, list[float]] = {n: [] for n in args.batch_sizes}
    answers: dict[int, list[str]] = {}
    for _ in range(args.repeats):
        for n in args.batch_sizes:
            s, answers[n] = timed(session, prefix, asked, n)
            seconds[n].append(s)
    base = args.batch_sizes[0]
    rate = {n: len(asked) / min(s) for n, s in seconds.items()}
    out = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "prompt_tokens": prefix.seen, "compress_s": compress_s},
        "results": {str(n): {"seconds": seconds[n], "best_s": min(seconds[n]), "questions_per_s": rate[n],
                             "ratio": rate[n] / rate[base]} for n in args.batch_sizes},
        "same_answers": all(a == answers[base] for a in answers.values()),
    }
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
