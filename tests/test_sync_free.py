"""A decode step issues no host sync and a bounded number of launches (the CUDA path, checked on the CPU).

``benchmarks/step_ops.py`` runs one layer-step per method under an op watch with the Triton
kernels' launchers (the interpreter stands in for the GPU), so what it counts is what a CUDA
step would launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Launches per layer-step (a torch ``topk``/``sort`` counts as the kernels it launches on CUDA).
# Static-only layers: the design's 4 (attention: 2 kernels; the new token: 2 copies). Dynamic
# heads: the design's 12 (chunk scores + top-k, the fused gather plan + the copies, attention,
# the token; the byte counter is added to by the plan kernel) with 2-bit keys (the default) and
# mean landmarks, whose scores are kernels; 13 with the keys on the host (their read counted, one
# sequence at a time). Label channels: 14 (the query's labels gathered, their
# scores + top-k, the candidates' scores from the host codes + top-k, the ids gathered, the gather
# plan + copies, the read counter, attention, the token; one sequence at a time). Refresh: the
# five refresh launches, the gather's two and the selection's merge (``refresh_step.py``). Min/max landmarks and Quest have no design
# target yet: their ceilings are today's counts, so that a change adding launches fails here.
CEILINGS = {
    "full": 4,
    "snapkv": 4,
    "hybridkv, static heads, no refresh": 4,
    "hybridkv, dynamic heads": 12,
    "hybridkv, dynamic heads, 2-bit keys": 12,
    "hybridkv, dynamic heads, 2-bit keys on the host": 13,
    "hybridkv, dynamic heads, label channels": 14,
    "hybridkv, dynamic heads, min/max landmarks": 24,
    "quest": 28,
    "hybridkv, static heads + refresh": 13,
    "rcr": 13,
}


@pytest.fixture(scope="module")
def counts():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "benchmarks/step_ops.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", sorted(CEILINGS))
def test_decode_step_has_no_host_sync(counts, method):
    assert counts[method]["syncs"] == {}, counts[method]["ops"]


@pytest.mark.parametrize("method", sorted(CEILINGS))
def test_decode_step_launches_stay_within_their_ceiling(counts, method):
    assert 0 < counts[method]["launches"] <= CEILINGS[method], counts[method]["ops"]


def test_the_watch_sees_a_sync():
    """The watch itself catches what the step must not do."""
    import torch

    from hybridkv_kernels.op_watch import OpWatch

    t = torch.arange(6)
    with OpWatch() as watch:
        int(t.sum())
        t[t > 2]
        t.nonzero()
    assert set(watch.syncs()) == {"aten._local_scalar_dense.default", "aten.index.Tensor(bool mask)",
                                  "aten.nonzero.default"}


def test_the_watch_sees_a_copy_to_the_host():
    """A device tensor copied into host memory is a sync. The CPU suite has no accelerator, so the
    meta device stands in for one: the copy cannot run, but the watch has counted it first."""
    import torch

    from hybridkv_kernels.op_watch import OpWatch

    on_device, host = torch.empty(4, device="meta"), torch.empty(4)
    for copy in (lambda: on_device.cpu(), lambda: host.copy_(on_device)):
        with OpWatch() as watch:
            with pytest.raises((NotImplementedError, RuntimeError)):
                copy()
        assert sum(watch.syncs().values()) == 1, watch.ops
    with OpWatch() as watch:
        host.clone().cpu()
        torch.empty(4, device="meta").to(torch.float16)
    assert not watch.syncs()
