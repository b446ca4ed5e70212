"""The decode step CUDA takes, counted on the CPU: no host sync, launches within their ceilings.

The script runs with ``HYBRIDKV_EMULATE_CUDA=1`` and ``TRITON_INTERPRET=1``: every backend choice
and branch is the one CUDA takes (``hybridkv_kernels.cuda_path``), the Triton kernels run under the
interpreter where CUDA would launch them, and an op watch with the layer's host stores counts,
per layer-step (the new token's append and the layer's attention with its retrieval and refresh),
every sync (a value read on the host, a data-dependent shape, a copy to the host, a torch op on a
host store, a tensor made from host data) and every launch (``topk``/``sort`` as the kernels they
launch). The model is a tiny Llama whose KV heads are forced half static, half dynamic, with the
default HybridKV (2-bit keys, rate-controlled refresh, whose trigger fires on some layer-steps and
not on others), decoded alone and as a batch of two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Launches per layer-step with both head kinds: the design's targets.
CEILING_NO_REFRESH = 14
CEILING_REFRESH = 24

SCRIPT = r"""
import json, sys
from collections import Counter
from types import SimpleNamespace
import torch
sys.path.insert(0, "tests")
from test_methods import CONTEXT, QUESTION, tiny_text_model
import hybridkv_cli.compression.batch_cache as batch_mod
import hybridkv_cli.compression.cache as cache_mod
import hybridkv_cli.compression.hybridkv as hybrid_mod
from hybridkv_cli.engine import prompt_job
from hybridkv_cli.engine.decoder import Decoder
from hybridkv_cli.compression import make_policy
from hybridkv_cli.models.demo import build_demo
from hybridkv_cli.engine import generate
from hybridkv_cli.models.prompt import build_text_prompt
from hybridkv_kernels import cuda_path
from hybridkv_kernels.op_watch import OpWatch, watch_kernels

NEW = 8
assert cuda_path(torch.zeros(1)), "HYBRIDKV_EMULATE_CUDA is not on"

def forced_mix(attn, theta, topk_share, sink_aware=False):  # KV head 0 static, the others dynamic
    static, scores = original(attn, theta, topk_share, sink_aware)
    return torch.arange(static.shape[0]) % 2 == 0, scores
original = hybrid_mod.classify_static
hybrid_mod.classify_static = forced_mix

llama = tiny_text_model("llama", build_demo().tokenizer)
prompts = [build_text_prompt(llama.tokenizer, CONTEXT, QUESTION),
           build_text_prompt(llama.tokenizer, CONTEXT[: len(CONTEXT) * 2 // 3], "Which box is on shelf 3?")]

steps = []  # one Counter per layer-step (append + attention), with whether its refresh fired
current = {}

def host_of(kvs):
    return [t for kv in kvs for part in (kv.dynamic, getattr(kv, "refresher", None)) if part is not None
            for t in (part.host_k, part.host_v)]

def refreshes(kvs):
    return sum(int(kv.refresher.refreshes) for kv in kvs if getattr(kv, "refresher", None) is not None)

steps_enabled = True

def watched(kvs, fn):
    if not steps_enabled:
        return fn()
    watch = OpWatch(host=host_of(kvs))
    with watch, watch_kernels(watch):
        out = fn()
    current.setdefault("ops", Counter()).update(watch.ops)
    return out

def wrap_update(cls):
    update = cls.update
    def run(self, key_states, value_states, *args, **kwargs):
        kvs = [self.kv] if isinstance(self, cache_mod.PolicyLayer) else [m.layers[self.index].kv for m in self.owner.members]
        if any(kv is None for kv in kvs):
            return update(self, key_states, value_states, *args, **kwargs)
        return watched(kvs, lambda: update(self, key_states, value_states, *args, **kwargs))
    cls.update = run

wrap_update(cache_mod.PolicyLayer)
wrap_update(batch_mod.BatchLayer)
attend = cache_mod.attend
def attend_watched(module, *args, **kwargs):
    cache = kwargs.get(cache_mod.CACHE_KWARG)
    if not steps_enabled or cache is None or not isinstance(cache, (cache_mod.PolicyCache, batch_mod.BatchCache)) \
            or cache.layers[module.layer_idx].kv is None:  # (a packed question read is counted whole, below)
        return attend(module, *args, **kwargs)
    kvs = [cache.layers[module.layer_idx].kv] if isinstance(cache, cache_mod.PolicyCache) else \
        [m.layers[module.layer_idx].kv for m in cache.members]
    before = refreshes(kvs)
    out = watched(kvs, lambda: attend(module, *args, **kwargs))
    ops = current.pop("ops")
    watch = OpWatch()
    watch.ops = ops
    steps.append({"launches": watch.launches(), "members": len(kvs), "syncs": dict(watch.syncs()),
                  "fired": refreshes(kvs) > before,
                  "refresh": any(getattr(kv, "refresher", None) is not None for kv in kvs),
                  "dynamic": any(kv.dynamic is not None for kv in kvs), "ops": dict(ops)})
    return out
cache_mod.attend = attend_watched

def summary(rows):
    out = {}
    for label, keep in (("both kinds, refresh fired", lambda r: r["refresh"] and r["fired"]),
                        ("both kinds, refresh not fired", lambda r: r["refresh"] and not r["fired"])):
        picked = [r for r in rows if r["dynamic"] and keep(r)]
        out[label] = {"layer_steps": len(picked), "max_launches": max((r["launches"] for r in picked), default=None),
                      "max_launches_per_member": max((r["launches"] / r["members"] for r in picked), default=None),
                      "syncs": sum(sum(r["syncs"].values()) for r in picked),
                      "sync_ops": dict(sum((Counter(r["syncs"]) for r in picked), Counter())),
                      "ops_of_max": max(picked, key=lambda r: r["launches"])["ops"] if picked else None}
    return out

result = {}
for label, options in (("default", {}), ("no refresh", {"refresh": "none"}),
                       ("host keys", {"refresh": "none", "landmark": "host-keys"})):
    policy = make_policy("hybridkv", budget=0.2, **options)
    steps.clear()
    generation = generate(llama.model, prompts[0], policy, max_new_tokens=NEW)
    single = summary(steps)
    single["all"] = {"max_launches": max(r["launches"] for r in steps), "syncs": sum(sum(r["syncs"].values()) for r in steps),
                     "layer_steps": len(steps), "max_launches_per_member": max(r["launches"] for r in steps)}
    decoder = Decoder(llama.model, NEW)
    decoder.eos = set()
    for member in decoder.start([prompt_job(llama.model, p, policy, tag=i) for i, p in enumerate(prompts)]):
        decoder.join(member)
    steps.clear()
    members, planned = list(decoder.members), []
    for _ in range(NEW - 1):
        planned.append(decoder.cache.planned)
        decoder.step()
    batch = summary(steps)
    batch["all"] = {"max_launches": max(r["launches"] for r in steps), "syncs": sum(sum(r["syncs"].values()) for r in steps),
                    "layer_steps": len(steps), "planned": all(planned),
                    "max_launches_per_member": max(r["launches"] / r["members"] for r in steps)}
    result[label] = {"single": single, "batch": batch, "tokens": generation.tokens,
                     "batch_tokens": [m.tokens for m in members]}

# The question pass on CUDA's path: two members' questions read after their kept prefixes, one at
# a time and packed in one pass, counted whole (the prefix copy, the pass, the first tokens)
from hybridkv_cli.engine import Job, prefill
steps_enabled = False
policy = make_policy("hybridkv", budget=0.2)
prefixes = [prefill(llama.model, p, policy, p.question_start, shared=True) for p in prompts]
def jobs(which):
    return [Job(i, prompts[i].inputs["input_ids"][0, prompts[i].question_start:].tolist(), prefix=prefixes[i])
            for i in which]
def started(group):
    watch = OpWatch()
    with watch, watch_kernels(watch):
        members = Decoder(llama.model, NEW).start(group)
    return watch.launches(), sum(watch.syncs().values()), [m.tokens for m in members]
alone = [started(jobs([i])) for i in range(2)]
packed = started(jobs([0, 1]))
result["read"] = {"alone_launches": sum(a[0] for a in alone), "alone_syncs": sum(a[1] for a in alone),
                  "packed_launches": packed[0], "packed_syncs": packed[1],
                  "same_tokens": packed[2] == [a[2][0] for a in alone]}

# CUDA graphs with the default configuration: StepReplay's own bookkeeping, its graph calls stood
# in for (capture runs the step as CUDA's warm-up would; a replay reruns it), and the traces of
# consecutive device steps, which a replay repeats exactly
class FakeGraph:
    def __init__(self):
        self.fresh = True
    def replay(self):
        if self.fresh:  # the capture ran the step already
            self.fresh = False
        else:
            replay_step()
import contextlib
torch.cuda.CUDAGraph = FakeGraph
torch.cuda.graph = lambda graph: contextlib.nullcontext()
torch.cuda.Stream = lambda *a, **k: SimpleNamespace(wait_stream=lambda other: None)
torch.cuda.stream = lambda stream: contextlib.nullcontext()
torch.cuda.current_stream = lambda *a, **k: SimpleNamespace(wait_stream=lambda other: None)
steps_enabled = False
policy = make_policy("hybridkv", budget=0.2)
decoder = Decoder(llama.model, NEW, cuda_graphs=True)
decoder.replay.enabled = True
decoder.eos = set()
for member in decoder.start([prompt_job(llama.model, p, policy, tag=i) for i, p in enumerate(prompts)]):
    decoder.join(member)
traces, device_step = [], decoder.replay.step
def replay_step():
    watch = OpWatch(trace=True)
    with watch, watch_kernels(watch):
        device_step()
    traces.append(watch.trace)
decoder.replay.step = replay_step
members = list(decoder.members)
from hybridkv_cli.engine import Limits
from hybridkv_cli.engine.jobs import batch_info
for _ in range(NEW - 1):
    decoder.step()
limits = Limits(batch_size=2, cuda_graphs=True)
result["graphs"] = {"replayed": [m.replayed for m in members], "warning": [batch_info(limits, m.joined, m.sizes, m.bytes, m.replayed)["graph_warning"] for m in members],
                    "same_trace": [traces[i] == traces[i + 1] for i in range(1, len(traces) - 1)],
                    "tokens": [m.tokens for m in members]}
print(json.dumps(result))
"""


def run_script(env_extra: dict) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", **env_extra}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def counts():
    pytest.importorskip("triton")
    return run_script({"HYBRIDKV_EMULATE_CUDA": "1"})


@pytest.mark.parametrize("run", ["single", "batch"])
def test_no_sync_in_any_layer_step(counts, run):
    for label in ("default", "no refresh"):
        assert counts[label][run]["all"]["syncs"] == 0, counts[label][run]


@pytest.mark.parametrize("run", ["single", "batch"])
def test_host_keys_take_the_launches_of_device_keys(counts, run):
    """Codes in host memory change where the scores kernel reads, not the step: no sync, and the
    launches of 2-bit keys on the device, a batch's members ranked in one pass."""
    host, device = counts["host keys"][run]["all"], counts["no refresh"][run]["all"]
    assert host["syncs"] == 0, counts["host keys"][run]
    assert host["max_launches"] == device["max_launches"], (host, device)


@pytest.mark.parametrize("run", ["single", "batch"])
def test_refresh_fires_on_some_layer_steps_and_not_on_others(counts, run):
    part = counts["default"][run]
    assert part["both kinds, refresh fired"]["layer_steps"] > 0, part
    assert part["both kinds, refresh not fired"]["layer_steps"] > 0, part


@pytest.mark.parametrize("run", ["single", "batch"])
def test_launches_within_the_ceilings(counts, run):
    """Per layer-step of one sequence (a batch's layer-step over its members: the retrieval of all
    of them is one pass, attention one launch, the appends and refreshes each member's own)."""
    no_refresh = counts["no refresh"][run]["all"]
    assert 0 < no_refresh["max_launches_per_member"] <= CEILING_NO_REFRESH, counts["no refresh"][run]
    for label in ("both kinds, refresh fired", "both kinds, refresh not fired"):
        part = counts["default"][run][label]
        assert 0 < part["max_launches_per_member"] <= CEILING_REFRESH, part


def test_the_batch_is_planned_and_gives_the_single_runs_tokens(counts):
    for label in ("default", "no refresh", "host keys"):
        assert counts[label]["batch"]["all"]["planned"] is True
        assert counts[label]["batch_tokens"][0] == counts[label]["tokens"]


def test_a_packed_question_read_takes_fewer_launches_and_no_more_syncs(counts):
    """Two questions read after their prefixes in one pass, on CUDA's path: the first tokens of
    one at a time, fewer launches (the model's layers run once for both) and no more host syncs
    (their first tokens are read on the host together)."""
    read = counts["read"]
    assert read["same_tokens"], read
    assert read["packed_launches"] < read["alone_launches"], read
    assert read["packed_syncs"] <= read["alone_syncs"], read


def test_cuda_graphs_replay_the_default_configuration(counts):
    """Eight tokens of the default HybridKV (refresh included) in a batch with ``--cuda-graphs``:
    the first step runs eagerly, the second is captured, the others replay; consecutive device
    steps trace identically, and the record has no warning."""
    graphs = counts["graphs"]
    assert all(n >= 1 for n in graphs["replayed"]), graphs
    assert graphs["same_trace"] and all(graphs["same_trace"]), graphs["same_trace"]
    assert graphs["warning"] == [None, None]
    assert graphs["tokens"] == counts["default"]["batch_tokens"]


REFRESH_SCRIPT = r"""
import json, torch
import hybridkv_cli.compression.refresh as refresh
from hybridkv_cli.compression import make_policy
from hybridkv_cli.compression.base import PrefillLayer

def layer(n=160, heads=2, group=2, dim=32):
    g = torch.Generator().manual_seed(0)
    return PrefillLayer(index=0, num_layers=1, query=torch.randn(heads, group, n, dim, generator=g),
                        keys=torch.randn(heads, n, dim, generator=g), values=torch.randn(heads, n, dim, generator=g),
                        visual=torch.zeros(n, dtype=torch.bool), scale=dim**-0.5)

out = []
for options in ({"refresh": "periodic", "refresh_period": 1}, {"refresh": "rcr"},
                {"refresh": "periodic", "refresh_period": 2, "refresh_slots": 4}):
    runs = {}
    for backend in ("torch", "triton"):
        refresh.resolve_backend = lambda requested, *tensors, chosen=backend: chosen
        prefill = layer()
        kv = make_policy("rcr", budget=0.25, **options).compress(prefill).kv
        kv.refresher.branching = False
        g = torch.Generator().manual_seed(5)
        held, outs = [], []
        for _ in range(6):
            outs.append(kv.attend(torch.randn(2, 2, 32, generator=g), prefill.scale))
            kv.append(torch.randn(2, 1, 32, generator=g), torch.randn(2, 1, 32, generator=g))
            held.append([sorted(row.tolist()) for row in kv.refresher.resident])
        r = kv.refresher
        runs[backend] = {"held": held, "outs": outs, "refreshes": int(r.refreshes), "transferred": int(r.transferred),
                         "key_reads": int(r.key_reads), "tau": float(r.controller.tau)}
    a, b = runs["torch"], runs["triton"]
    out.append({"options": options, "same_held": a["held"] == b["held"],
                "counters": [(a[k], b[k]) for k in ("refreshes", "transferred", "key_reads")],
                "tau": (a["tau"], b["tau"]), "out_diff": max(float((x - y).abs().max()) for x, y in zip(a["outs"], b["outs"]))})
print(json.dumps(out))
"""


def test_refresh_kernels_select_what_the_torch_refresh_selects():
    """The device refresh (``refresh_want``, under the interpreter) against the torch reference's
    branch-free form: the same slots after every step, the same counters and threshold."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", REFRESH_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for case in json.loads(done.stdout.strip().splitlines()[-1]):
        assert case["same_held"], case
        assert all(a == b and a > 0 for a, b in case["counters"]), case
        assert abs(case["tau"][0] - case["tau"][1]) < 1e-5, case
        assert case["out_diff"] < 1e-4, case
