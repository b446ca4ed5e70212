"""The split-merge kernel at the split counts an H200 picks for long prompts.

``ragged_decode_attention_triton`` merges all splits of a head in one block of the merge kernel
(``BLOCK_S = next_power_of_2(num_splits)``, at most ``_MAX_SPLITS`` = 128). On an H200 (132 SMs,
4 KV heads) the heuristic picks 66 splits from about 17k tokens on, so a 32k-64k prompt merges in
a 128-wide block; the other Triton tests use a few splits. These cases force 65 splits (a
128-wide block, 63 lanes masked) and 128 splits (the block full), with ``block_n=128`` and the
default block, plus one case on the default heuristics, each against the torch reference, and
check from the merge launch itself that it ran with that many splits. The values ramp along
each head so that every split moves the output: a merge capped at 64 splits fails all three
forced cases.

As in ``test_kernels.py``: compiled on CUDA, otherwise this file reruns itself in a fresh pytest
process with ``TRITON_INTERPRET=1`` (through that file's ``_run``). Heads are few and narrow
(d = 16) so that the ~16k-row store takes a few seconds under the interpreter.
"""

from __future__ import annotations

import pytest
import torch

import hybridkv_kernels as hk
from hybridkv_kernels.dispatch import load_triton_module, next_power_of_2
from hybridkv_kernels.testing import assert_close, ragged_store
from test_kernels import ROOT, _run

INTERPRET = hk.HAS_TRITON and hk.triton_interpreting()
RUNS_HERE = hk.HAS_TRITON and (INTERPRET or torch.cuda.is_available())
DEV = torch.device("cuda" if RUNS_HERE and not INTERPRET else "cpu")
here = pytest.mark.skipif(not RUNS_HERE, reason="Triton runs compiled on CUDA or under TRITON_INTERPRET=1 "
                                                "(test_merge_splits_under_interpreter)")

# (num_splits, block_n, KV-head lengths, n_gen, splits the merge must see). The long head sets
# max_total = max(lengths) + n_gen; the short heads leave most of their splits empty (-inf LSE).
CASES = {
    "65 splits, block_n=128": (65, 128, [8316, 300, 0], 4, 65),       # 8320 rows -> 65 x 128
    "128 splits, block_n=128": (128, 128, [16380, 1000, 7], 4, 128),  # 16384 rows -> 128 x 128
    "128 splits, default block_n": (128, None, [8190, 64, 0], 2, 128),  # 8192 rows -> 128 x 64
    "default heuristics": (None, None, [8192, 300, 0], 1, None),
}


class _MergeSpy:
    """Stands in for the module's ``merge_splits_kernel``: records (splits, BLOCK_S) of each launch."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(o_part, *args, **kwargs):  # o_part: [H, num_splits, G, d]
            self.seen.append((o_part.shape[1], kwargs["BLOCK_S"]))
            return launch(o_part, *args, **kwargs)

        return call


@here
@pytest.mark.parametrize("case", sorted(CASES))
def test_merge_at_many_splits(case, monkeypatch):
    num_splits, block_n, lengths, n_gen, want_splits = CASES[case]
    d, G, H = 16, 2, len(lengths)
    keys, values, offsets, lengths_t = ragged_store(lengths, d, torch.float32, seed=3)
    # values ramp up along each head's rows (0 -> 4, the generated rows at 4): every split moves
    # the output, so a merge that drops or misweights one (the block's tail) is well over rtol
    for start, n in zip(offsets.tolist(), lengths):
        values[start:start + n] += torch.linspace(0, 4, n).unsqueeze(1)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(H, G, d, generator=g)
    gen_k = torch.randn(H, 8, d, generator=g)
    gen_v = torch.randn(H, 8, d, generator=g) + 4
    keys, values, offsets, lengths_t, q, gen_k, gen_v = (
        t.to(DEV) for t in (keys, values, offsets, lengths_t, q, gen_k, gen_v))

    mod = load_triton_module("_decode_attention_triton")
    spy = _MergeSpy(mod.merge_splits_kernel)
    monkeypatch.setattr(mod, "merge_splits_kernel", spy)
    out = hk.ragged_decode_attention_triton(q, keys, values, offsets, lengths_t, gen_k, gen_v, n_gen,
                                            num_splits=num_splits, block_n=block_n)
    ref = hk.ragged_decode_attention_torch(q, keys, values, offsets, lengths_t, gen_k, gen_v, n_gen)
    assert_close(ref, out, 1e-4, case)

    [(splits, block_s)] = spy.seen
    if want_splits is not None:
        assert splits == want_splits, (case, splits)
        assert block_s == 128 == next_power_of_2(want_splits)
    else:  # the heuristic's own pick (8 "SMs" off CUDA): whatever it is, the block covers it
        assert 1 <= splits <= 128 and block_s == next_power_of_2(splits)


def test_merge_splits_under_interpreter():
    """Run this file's Triton cases in a fresh process with TRITON_INTERPRET=1 (module docstring)."""
    if not hk.HAS_TRITON:
        pytest.skip("triton not installed")
    if RUNS_HERE:
        pytest.skip("the Triton cases run in this process")
    r = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
              "-k", "test_merge_at_many_splits", str(ROOT / "tests" / "test_merge_splits.py")],
             {"TRITON_INTERPRET": "1"}, 600)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    last = r.stdout.strip().splitlines()[-1]
    assert f"{len(CASES)} passed" in last and "skipped" not in last and "failed" not in last, tail
