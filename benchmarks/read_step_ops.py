"""Aten operations and milliseconds of the decode thread's two passes on the demo model (CPU).

What a server's decode thread does for answers about a kept prefix: a **read** (``Decoder.start``
of N questions: each question's copy of the prefix, then their suffixes in one forward pass and
their first tokens) and a **step** (``Decoder.step`` of N members: one token each). The prefix is
one of the demo's synthetic clips (112x112, 64 frames, as ``benchmarks/serve_load.py`` sends),
compressed once with the default method. Operations are counted by a dispatch mode (the same
count on every machine); times are the best of ``--rounds`` rounds of ``--repeats`` passes, one
thread. Run it from each checkout to compare them (``PYTHONPATH=<checkout>``):

    OMP_NUM_THREADS=1 python benchmarks/read_step_ops.py
    OMP_NUM_THREADS=1 python benchmarks/read_step_ops.py --members 1 8 16 --rounds 7

Prints one JSON object: per N, the read's and the step's operations and best ms.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridkv_cli.compression.cache import policy_attention
from hybridkv_cli.engine.decoder import Decoder
from hybridkv_cli.runs.inputs import Item
from hybridkv_cli.runs.requests import Request
from hybridkv_cli.runs.session import AskOptions, Session

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training import synthetic as S  # noqa: E402  (the repository's training package)


class Ops(TorchDispatchMode):
    """Counts the aten operations run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        scene = S.make_scene(np.random.default_rng(7), S.FRAMES)
        clip = Path(folder) / "clip.mp4"
        S.write_mp4(clip, scene.video)
        session = Session(AskOptions(model="demo", defer_question=True))
        prefix = session.compress(Item((str(clip),)))
    model = session.model().model
    question = scene.qas[0].question

    def jobs(n: int) -> list:
        return [session.question_job(prefix, Request(None, (question,), prefix=prefix), 0) for _ in range(n)]

    def decoding(n: int) -> Decoder:  # n members that never finish
        decoder = Decoder(model, 1)
        decoder.eos, decoder.limit = set(), lambda job: 1 << 30
        for member in decoder.start(jobs(n)):
            decoder.join(member)
        return decoder

    out = {}
    with policy_attention(model):
        for n in args.members:
            row = {}
            reader, stepper = Decoder(model, 1), decoding(n)
            reader.start(jobs(n))
            stepper.step()  # warm: the first step after joining allocates
            with Ops() as ops:
                reader.start(jobs(n))
            row["read_ops"] = ops.count
            with Ops() as ops:
                stepper.step()
            row["step_ops"] = ops.count
            for name, run in (("read", lambda: reader.start(jobs(n))), ("step", stepper.step)):
                best = float("inf")
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    for _ in range(args.repeats):
                        run()
                    best = min(best, (time.perf_counter() - start) / args.repeats)
                row[f"{name}_ms"] = round(best * 1e3, 3)
            out[n] = row
    print(json.dumps({"prompt_tokens": prefix.seen, "question": question, "members": out}))


if __name__ == "__main__":
    main()
