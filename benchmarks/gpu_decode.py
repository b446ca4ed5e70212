"""GPU decode benchmark: Qwen2.5-VL-7B's full text geometry (28 layers) in bf16, 8k/32k/64k prompts.

Randomly initialised weights (nothing downloaded); prompts are random token ids whose middle is
marked visual. Reports per method per-token latency, KV bytes and `torch.cuda.max_memory_allocated`
deltas for stock generate (transformers cache + SDPA), `full` through the ragged kernel, and
hybridkv at b = 0.1 / 0.2. Kernel-level times and GB/s: `benchmarks/kernels_bench.py`.

    python benchmarks/gpu_decode.py --out docs/gpu_decode.json
"""

import decode

if __name__ == "__main__":
    decode.main(lengths=[8192, 32768, 65536], layers=28, intermediate=18944, device="cuda",
                dtype="bfloat16", stock=True)
