"""A batch's decode step can be replayed as a CUDA graph: checked on the CPU by its trace, on CUDA for real.

A CUDA graph replays the launches of the step it captured, with the host values and the
addresses they had then. So a step is replayable when the next step issues exactly the same ops
and launches, on the same persistent tensors, with the same host values, and reads nothing back
on the host. ``OpWatch(trace=True)`` records that signature; under the Triton interpreter the
launches are the CUDA path's own. The script decodes two prompts together with the demo model and
compares the traces of consecutive steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "full": ("full", {}),
    "hybridkv, every head dynamic": ("hybridkv", {"budget": 0.5, "window": 4, "theta": 1.0}),  # 2-bit keys
    "hybridkv, mean landmarks": ("hybridkv", {"budget": 0.5, "window": 4, "theta": 1.0, "chunk_size": 4,
                                              "landmark": "mean"}),
    "hybridkv, no refresh": ("hybridkv", {"budget": 0.3, "window": 8, "refresh": "none"}),
    "hybridkv, min/max landmarks": ("hybridkv", {"budget": 0.5, "window": 4, "theta": 1.0, "chunk_size": 4,
                                                 "landmark": "minmax"}),
}

SCRIPT = """
import json, sys, torch
from types import SimpleNamespace
from hybridkv_cli.engine import prompt_job
from hybridkv_cli.engine.decoder import Decoder
from hybridkv_cli.compression import make_policy
from hybridkv_cli.models.demo import build_demo
from hybridkv_cli.engine import generate
from hybridkv_cli.media import load_media
from hybridkv_cli.models.prompt import build_prompt
from hybridkv_kernels import RaggedKV, batched_decode_attention, ragged_decode_attention, segment_table
from hybridkv_kernels.op_watch import OpWatch, watch_kernels

NEW = 6
cases = json.loads(sys.argv[1])
demo = build_demo()
prompts = [build_prompt(demo.processor, load_media(paths, max_pixels=56 * 56), question) for paths, question in (
    (["sample_media/images/red_circle.png", "sample_media/images/blue_square.jpg"], "Which image shows a square?"),
    (["sample_media/images/green_triangle.webp"], "What shape is it?"))]

def watched(fn):
    with OpWatch(trace=True) as watch, watch_kernels(watch):
        fn()
    return watch

out = {}
for name, (method, options) in cases.items():
    policy = make_policy(method, **options)
    single = [generate(demo.model, p, policy, max_new_tokens=NEW).tokens for p in prompts]
    decoder = Decoder(demo.model, NEW)
    decoder.eos = set()  # every member decodes NEW tokens: the members stay the same
    for member in decoder.start([prompt_job(demo.model, p, policy, tag=i) for i, p in enumerate(prompts)]):
        decoder.join(member)
    members = list(decoder.members)
    step, watches, planned = decoder.replay.step, [], []
    decoder.replay.step = lambda: (watches.append(watched(step)), planned.append(decoder.cache.planned))
    for _ in range(NEW - 1):
        decoder.step()
    traces = [w.trace for w in watches]
    out[name] = {
        "planned": all(planned),
        "same_trace": [traces[i] == traces[i + 1] for i in range(1, len(traces) - 1)],
        "first_differs": traces[0] != traces[1],
        "syncs": sum(sum(w.syncs().values()) for w in watches),
        "launches": watches[-1].launches(),
        "ops": len(traces[-1]),
        "batched": [m.tokens for m in members],
        "single": single,
    }

# the watch's own control: a host count passed to a launch changes the trace, a device count does not
H, G, d, T, cap = 2, 2, 16, 24, 8
q, keys, values = torch.randn(H, G, d), torch.randn(T, d), torch.randn(T, d)
offsets, lengths = torch.tensor([0, 12]), torch.tensor([12, 12])
gen_k, gen_v = torch.randn(H, cap, d), torch.randn(H, cap, d)
host = [watched(lambda n=n: ragged_decode_attention(q, keys, values, offsets, lengths, gen_k, gen_v, n, backend="triton",
                                                    max_length=12)).trace for n in (3, 4)]
counts = torch.tensor([3])
table = segment_table([RaggedKV(keys, values, offsets, lengths, gen_k, gen_v, 3, 12)], counts)
device = []
for _ in range(2):
    device.append(watched(lambda: batched_decode_attention(q, [RaggedKV(keys, values, offsets, lengths, gen_k, gen_v,
                                                                        int(counts), 12)], backend="triton",
                                                           table=table)).trace)
    counts.add_(1)
out["control"] = {"host_count_same": host[0] == host[1], "device_count_same": device[0] == device[1]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def traced():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_step_repeats_its_launches_exactly(traced, case):
    run = traced[case]
    assert run["planned"] is True
    assert run["same_trace"] and all(run["same_trace"]), run  # steps 2, 3, ... trace as step 2 did
    assert run["first_differs"]  # the first step of the members builds their launch tables
    assert run["syncs"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_replayable_step_gives_the_single_run_tokens(traced, case):
    run = traced[case]
    for batched, single in zip(run["batched"], run["single"]):
        assert batched[:len(single)] == single  # (the single run may stop at its end of sequence)


@pytest.mark.slow
def test_trace_sees_a_host_count_and_not_a_device_one(traced):
    assert traced["control"] == {"host_count_same": False, "device_count_same": True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method,options", [("full", {}), ("hybridkv", CASES["hybridkv, every head dynamic"][1])])
def test_cuda_graph_replay_gives_the_eager_tokens(method, options):
    """On a GPU: ``--cuda-graphs`` captures the step and replays it, with the eager batch's tokens."""
    from types import SimpleNamespace

    from hybridkv_cli.compression import make_policy
    from hybridkv_cli.engine import Limits, decode, prompt_job
    from hybridkv_cli.media import load_media
    from hybridkv_cli.models.demo import build_demo
    from hybridkv_cli.models.prompt import build_prompt

    demo = build_demo(device="cuda")
    prompts = [build_prompt(demo.processor, load_media([f"sample_media/images/{name}"], max_pixels=56 * 56), question)
               for name, question in (("red_circle.png", "What shape is it?"), ("blue_square.jpg", "Which colour?"))]
    policy = make_policy(method, **options)
    runs = {}
    for graphs in (False, True):
        jobs = [(i, lambda i=i, p=p: prompt_job(demo.model, p, policy, tag=i)) for i, p in enumerate(prompts)]
        done = sorted(decode(lambda: demo.model, jobs, max_new_tokens=8, limits=Limits(batch_size=2, cuda_graphs=graphs)),
                      key=lambda o: o.job.tag)
        runs[graphs] = [(o.generation.tokens, o.batch["graph_replayed_steps"]) for o in done]
    assert [t for t, _ in runs[True]] == [t for t, _ in runs[False]]
    assert all(n == 0 for _, n in runs[False])
    assert any(n > 0 for _, n in runs[True]) or all(len(t) <= 3 for t, _ in runs[True])
