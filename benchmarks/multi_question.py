"""Per-question latency with one compression vs running `ask` again, and .hkv save / load times.

For each method: one input (64 frames of the sample video at Qwen's frame size, ~4.6k prompt
tokens with --max-pixels 112896) is answered

* as `ask --defer-question` would, once per question: media decode + processor + vision encoder
  + prefill + compression + the question + decoding (`Session.ask` of a media request, the model
  already loaded);
* compressed once (`Session.compress`), then each question from a copy of that cache
  (`Session.ask` of a request with that prefix);
* saved to a .hkv file, loaded back (`hkv.load`), and asked again.

    python benchmarks/multi_question.py --out docs/multi_question.json
    python benchmarks/multi_question.py --model demo-random --methods hybridkv snapkv --questions 3
    python benchmarks/multi_question.py --geometry --layers 2 --out docs/multi_question_7b.json

``--geometry``: instead of a model and a video, a randomly initialised Qwen2.5-VL text stack with
the 7B attention geometry (benchmarks/decode.py: hidden 3584, 28 query / 4 KV heads, few layers,
narrow MLP) and a random 4.6k-token video-like prompt; "ask again" is then prefill + compression +
question + decoding (no media decode or vision encoder, so the speed-up is a lower bound).

Prints one JSON object: per method the seconds of each path, the speed-up of a question from
the cache over a repeated `ask`, the file size against the device + host bytes of the report,
and the load time against a fresh compression.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridkv_cli.engine import hkv
from hybridkv_cli.runs.inputs import Item
from hybridkv_cli.runs.requests import Request
from hybridkv_cli.runs.session import AskOptions, Session

SAMPLE = Path(__file__).resolve().parents[1] / "sample_media" / "shapes.mp4"
QUESTIONS = ["What happens in the video?", "What colour is the square?", "How many shapes are there?",
             "Where does the circle go?", "What is in the last frame?"]


def geometry_run(args, methods: list[str], n_questions: int) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from decode import build_model, video_like_prompt

    from hybridkv_cli.compression import make_policy
    from hybridkv_cli.engine import Job, decode, generate, prefill
    from hybridkv_cli.models.prompt import Prompt

    vocab = 2048
    model = build_model(args.layers, 1024, vocab)
    base = video_like_prompt(args.tokens, vocab)
    base.visual[16:] = True
    base.visual[args.tokens - args.question_tokens:] = False  # the question + template tail
    cut = base.question_start
    g = torch.Generator().manual_seed(1)
    prompts = []
    for _ in range(n_questions):  # the same media prefix, a different 64-token question each
        ids = base.inputs["input_ids"].clone()
        ids[0, cut:] = torch.randint(10, vocab, (base.length - cut,), generator=g)
        prompts.append(Prompt(inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)}, visual=base.visual))
    assert cut == args.tokens - args.question_tokens
    out = {}
    for method in methods:
        generate(model, prompts[0], make_policy(method), max_new_tokens=2, defer_question=True)  # warm-up
        ask_s, ask_tokens = [], []
        for p in prompts:
            start = time.perf_counter()
            ask_tokens.append(generate(model, p, make_policy(method), max_new_tokens=args.max_new_tokens,
                                       defer_question=True).tokens)
            ask_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        prefix = prefill(model, prompts[0], make_policy(method), cut, shared=True)
        compress_s = time.perf_counter() - start
        q_s, q_tokens = [], []
        for p in prompts:
            start = time.perf_counter()
            job = Job(0, p.inputs["input_ids"][0, cut:].tolist(), prefix=prefix)
            outcome, = decode(lambda: model, [(0, lambda: job)], max_new_tokens=args.max_new_tokens)
            q_tokens.append(outcome.generation.tokens)
            q_s.append(time.perf_counter() - start)
        out[method] = {"prompt_tokens": base.length, "ask_again_s": statistics.fmean(ask_s),
                       "compress_once_s": compress_s, "question_from_cache_s": statistics.fmean(q_s),
                       "speedup_per_question": statistics.fmean(ask_s) / statistics.fmean(q_s),
                       "same_tokens_as_ask": q_tokens == ask_tokens}
        print(json.dumps({method: out[method]}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-random")
    ap.add_argument("--media", default=str(SAMPLE))
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--max-pixels", type=int, default=336 * 336)
    ap.add_argument("--methods", nargs="+", default=["hybridkv", "snapkv", "full"])
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--geometry", action="store_true", help="Qwen2.5-VL-7B attention geometry, random prompt")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4608)
    ap.add_argument("--question-tokens", type=int, default=24, help="--geometry: tokens after the media "
                    "(vision end, question, template tail)")
    args = ap.parse_args()
    questions = QUESTIONS[: args.questions]
    if args.geometry:
        results = geometry_run(args, args.methods, args.questions)
        out = {"config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                          "torch": torch.__version__, "threads": torch.get_num_threads()}, "results": results}
        if args.out:
            args.out.write_text(json.dumps(out, indent=1) + "\n")
        return
    item = Item((args.media,))
    results = {}
    for method in args.methods:
        options = AskOptions(model=args.model, method=method, frames=args.frames, max_pixels=args.max_pixels,
                             max_new_tokens=args.max_new_tokens, defer_question=True)
        session = Session(options)
        ask = lambda q, **where: session.ask(Request(questions=(q,), **where))  # noqa: E731
        ask(questions[0], item=item)  # warm-up: model load, first-call costs
        ask_s, ask_answers = [], []
        for q in questions:
            start = time.perf_counter()
            ask_answers.append(ask(q, item=item)["answer"])
            ask_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        prefix = session.compress(item)
        compress_s = time.perf_counter() - start
        question_s, answers, records = [], [], []
        for i, q in enumerate(questions):
            start = time.perf_counter()
            record = ask(q, prefix=prefix)
            question_s.append(time.perf_counter() - start)
            answers.append(record["answer"])
            records.append(record)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "clip.hkv"
            start = time.perf_counter()
            size = hkv.save(path, prefix, session.model())
            save_s = time.perf_counter() - start
            start = time.perf_counter()
            loaded = hkv.load(path, session.model())
            load_s = time.perf_counter() - start
        reloaded = [ask(q, prefix=loaded)["answer"] for q in questions]
        kv_bytes = prefix.device_bytes + prefix.host_bytes
        results[method] = {
            "prompt_tokens": prefix.seen + len(prefix.template.suffix(session.model().tokenizer, questions[0])),
            "ask_again_s": statistics.fmean(ask_s),
            "compress_once_s": compress_s,
            "question_from_cache_s": statistics.fmean(question_s),
            "speedup_per_question": statistics.fmean(ask_s) / statistics.fmean(question_s),
            "same_answers_as_ask": answers == ask_answers,
            "same_answers_after_reload": reloaded == answers,
            "file_bytes": size,
            "device_plus_host_bytes": kv_bytes,
            "file_over_kv": size / kv_bytes - 1,
            "save_s": save_s,
            "load_s": load_s,
            "load_speedup_vs_compress": compress_s / load_s,
            "decode_tokens": [r["decode"]["tokens"] for r in records],
        }
        print(json.dumps({method: results[method]}), flush=True)
    out = {"config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                      "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                      "threads": torch.get_num_threads()},
           "results": results}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
