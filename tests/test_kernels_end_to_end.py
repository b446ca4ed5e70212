"""The Triton kernels (interpreted on CPU) and the torch references give the same tokens end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, torch
from hybridkv_cli.compression import make_policy
from hybridkv_cli.engine import generate
from hybridkv_cli.media import load_media
from hybridkv_cli.models.demo import build_demo
from hybridkv_cli.models.prompt import build_prompt
from hybridkv_kernels import resolve_backend
demo = build_demo()
media = load_media(["sample_media/images/red_circle.png", "sample_media/images/blue_square.jpg"], max_pixels=56 * 56)
prompt = build_prompt(demo.processor, media, "Which image shows a square?")
out = {"backend": resolve_backend("auto", torch.zeros(1))}
# every head dynamic, 5 chunks each; mean landmarks: their scores are a kernel, one pass for a batch
RETRIEVING = {"budget": 0.5, "window": 4, "theta": 1.0, "chunk_size": 4, "landmark": "mean"}
for name, method, options in (("full", "full", {}), ("hybridkv", "hybridkv", {"budget": 0.3, "window": 8}),
                              ("retrieving", "hybridkv", RETRIEVING)):
    run = generate(demo.model, prompt, make_policy(method, **options), max_new_tokens=5)
    out[name], out[name + "_dynamic_heads"] = run.tokens, (run.cache.summary() or {}).get("dynamic")
# two prompts decoded together: one attention launch and one retrieval pass per layer for both
from types import SimpleNamespace
from hybridkv_cli.engine import Limits, decode, prompt_job
other = build_prompt(demo.processor, load_media(["sample_media/images/green_triangle.webp"], max_pixels=56 * 56),
                     "What shape is it?")
policy = make_policy("hybridkv", **RETRIEVING)
jobs = [(i, lambda i=i, p=p: prompt_job(demo.model, p, policy, tag=i)) for i, p in enumerate([prompt, other])]
done = decode(lambda: demo.model, jobs, max_new_tokens=5, limits=Limits(batch_size=2))
out["batched"] = [o.generation.tokens for o in sorted(done, key=lambda o: o.job.tag)]
print(json.dumps(out))
"""


def run(interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_tokens_identical_with_triton_kernels_and_torch_references():
    pytest.importorskip("triton")
    reference, kernels = run(interpret=False), run(interpret=True)
    assert reference["backend"] == "torch" and kernels["backend"] == "triton"
    assert kernels["full"] == reference["full"]
    assert kernels["hybridkv"] == reference["hybridkv"]
    assert kernels["retrieving"] == reference["retrieving"] and reference["retrieving_dynamic_heads"] == 8
    assert kernels["batched"] == reference["batched"] and reference["batched"][0] == reference["retrieving"]
