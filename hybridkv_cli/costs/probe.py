"""The CUDA probe behind a measured device profile: about a second of copies and kernels.

* ``hbm_gbps``: a device-to-device copy of 512 MiB (bytes read).
* ``link_gbps``: 2-bit key scores read in place from 256 MiB of pinned host codes, the way
  ``--landmark host-keys`` reads them every step (:func:`hybridkv_kernels.quant_key_topk`'s kernel).
* ``link_scattered_gbps``: the retrieval gather copying random single-token rows (bf16, d = 128)
  from pinned host memory into the device store (:func:`hybridkv_kernels.chunk_gather`).
* ``launch_us``: a CUDA graph of 200 tiny kernels, per kernel.
"""

from __future__ import annotations

import torch

MiB = 2**20


def _ms(fn, repeat: int = 5) -> float:
    """Best time of ``fn`` in ms, after one warm-up run."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def measure(index: int = 0) -> dict:
    """The four measured fields of a :class:`~hybridkv_cli.costs.profiles.DeviceProfile`."""
    from hybridkv_kernels import chunk_gather
    from hybridkv_kernels.quant_keys import launch_scores

    dev = torch.device("cuda", index)
    try:
        src = torch.empty(512 * MiB, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        hbm = 2 * src.numel() / _ms(lambda: dst.copy_(src)) / 1e6  # read + write, GB/s

        heads, dim = 8, 128
        tokens = 256 * MiB // (heads * dim // 4)
        codes = torch.randint(0, 256, (heads, dim // 4, tokens), dtype=torch.uint8).pin_memory()
        bounds = torch.rand(heads, 2, dim, device=dev)
        q = torch.randn(heads, 4, dim, device=dev)
        link = codes.numel() / _ms(lambda: launch_scores(q, codes, bounds, 1)) / 1e6

        chunks, slots = 1 << 16, 4096
        host_k = torch.randn(heads, chunks, 1, dim, dtype=torch.bfloat16).pin_memory()
        host_v = torch.randn_like(host_k).pin_memory()
        store_k = torch.zeros(heads * slots, dim, dtype=torch.bfloat16, device=dev)
        store_v = torch.zeros_like(store_k)
        base = torch.arange(heads, device=dev) * slots
        wants = [torch.randperm(chunks, device=dev)[:heads * slots].view(heads, slots).sort(1).values
                 for _ in range(6)]
        moved = 2 * heads * slots * dim * 2

        def gather():  # every slot misses: a fresh random set each call
            resident = torch.full((heads, slots), -1, dtype=torch.long, device=dev)
            chunk_gather(host_k, host_v, store_k, store_v, base, resident, wants[gather.i % len(wants)], "triton")
            gather.i += 1
        gather.i = 0
        scattered = moved / _ms(gather) / 1e6

        x = torch.zeros(16, device=dev)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            x.add_(1)  # warm the kernel outside the capture
            with torch.cuda.graph(graph):
                for _ in range(200):
                    x.add_(1)
        launch = _ms(graph.replay) * 1e3 / 200
    except (RuntimeError, ValueError) as e:  # no pinned memory, Triton missing, out of memory
        raise RuntimeError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    finally:
        torch.cuda.empty_cache()
    return {"hbm_gbps": hbm, "link_gbps": link, "link_scattered_gbps": scattered, "launch_us": launch}
