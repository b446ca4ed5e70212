"""Launches and host syncs of one decode layer-step, per method (JSON on stdout).

Every method compresses the same random layer (3 KV heads x 3 queries, head dim 64, 600
prompt tokens), takes one warm-up step, then one step under
:class:`hybridkv_kernels.op_watch.OpWatch`: the aten ops that run device work plus the Triton
kernel launches, and the ops that would make the host wait for a GPU. Refresh runs its device
path (the trigger merged under a mask), as on CUDA.

On the CPU run it with ``TRITON_INTERPRET=1`` (the kernels' launchers are then the CUDA ones):

    TRITON_INTERPRET=1 python benchmarks/step_ops.py
    python benchmarks/step_ops.py --device cuda          # on a GPU machine
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from hybridkv_cli.compression import make_policy
from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_kernels.op_watch import OpWatch, watch_kernels

HEADS, GROUP, DIM, N = 3, 3, 64, 600
METHODS = {
    "full": ("full", {}),
    "snapkv": ("snapkv", {"budget": 0.1}),
    "quest": ("quest", {"budget": 0.1}),
    "hybridkv, dynamic heads": ("hybridkv", {"budget": 0.2, "theta": 1.0, "landmark": "mean"}),
    "hybridkv, dynamic heads, 2-bit keys": ("hybridkv", {"budget": 0.2, "theta": 1.0, "landmark": "keys"}),
    "hybridkv, dynamic heads, 2-bit keys on the host": ("hybridkv", {"budget": 0.2, "theta": 1.0,
                                                                     "landmark": "host-keys"}),
    "hybridkv, dynamic heads, label channels": ("hybridkv", {"budget": 0.2, "theta": 1.0, "landmark": "labels"}),
    "hybridkv, dynamic heads, min/max landmarks": ("hybridkv", {"budget": 0.2, "theta": 1.0, "landmark": "minmax"}),
    "hybridkv, static heads + refresh": ("hybridkv", {"budget": 0.2, "theta": 0.0}),
    "hybridkv, static heads, no refresh": ("hybridkv", {"budget": 0.2, "theta": 0.0, "refresh": "none"}),
    "rcr": ("rcr", {"budget": 0.2}),
}


def random_layer(device: torch.device) -> PrefillLayer:
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    return PrefillLayer(index=0, num_layers=1, query=rand(HEADS, GROUP, N, DIM), keys=rand(HEADS, N, DIM),
                        values=rand(HEADS, N, DIM), visual=torch.ones(N, dtype=torch.bool, device=device),
                        scale=DIM ** -0.5)


def watch_step(name: str, options: dict, device: torch.device) -> dict:
    layer = random_layer(device)
    kv = make_policy(name, **options).compress(layer).kv
    if getattr(kv, "refresher", None) is not None:
        kv.refresher.branching = False  # the device path
    g = torch.Generator().manual_seed(1)
    steps = [[torch.randn(*shape, generator=g).to(device) for shape in ((HEADS, GROUP, DIM), (HEADS, 1, DIM),
                                                                         (HEADS, 1, DIM))] for _ in range(2)]
    for i, (q, k, v) in enumerate(steps):  # a warm-up step, then the watched one
        watch = OpWatch()
        with contextlib.ExitStack() as stack:
            if i:
                stack.enter_context(watch_kernels(watch))
                stack.enter_context(watch)
            kv.attend(q, layer.scale)
            kv.append(k, v)
    return {"launches": watch.launches(), "syncs": dict(watch.syncs()), "ops": dict(watch.ops)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(json.dumps({label: watch_step(name, options, device) for label, (name, options) in METHODS.items()}))


if __name__ == "__main__":
    main()
