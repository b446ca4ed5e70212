#!/usr/bin/env bash
# One GPU validation run (under 8 minutes on one H200), results as JSON in OUT_DIR (default gpu_check/):
#   kernel_tests.xml   the compiled Triton kernel tests (tests/test_kernel_triton.py, test_merge_splits.py on CUDA)
#   kernels.json       each kernel's time and GB/s (benchmarks/kernels_bench.py), with the device's peak
#   step_ops.json      launches and host syncs per decode layer-step, per method (benchmarks/step_ops.py)
#   decode.json        decode at 8k/32k/64k: stock SDPA, full and hybridkv 0.1/0.2 on the same kernel
#   throughput.json    batched decoding at 16k under a KV cap: concurrent sequences and tokens/s (full, hybridkv 0.1)
#   graphs.xml         CUDA-graph replay of the batch step gives the eager tokens (tests/test_step_replay.py)
#   throughput_graphs.json  the throughput step with its decode steps replayed as CUDA graphs (--cuda-graphs)
#   gpu_check.json     all of the above in one file
# Run from the repository root with the project installed (pip install -e ".[test]").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-gpu_check}"
mkdir -p "$OUT_DIR"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')" || exit 1
step() {  # name, time limit in seconds, command...: a failed or slow step is recorded, the rest still run
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)" >&2
    local started=$SECONDS
    timeout "$limit" "$@"
    echo "{\"step\": \"$name\", \"rc\": $?, \"seconds\": $((SECONDS - started))}" >> "$OUT_DIR/steps.jsonl"
}
: > "$OUT_DIR/steps.jsonl"
step kernel_tests 150 python -m pytest -q tests/test_kernel_triton.py tests/test_merge_splits.py --junitxml="$OUT_DIR/kernel_tests.xml"
step kernels 90 python benchmarks/kernels_bench.py --iters 20 --warmup 5 --json "$OUT_DIR/kernels.json"
step step_ops 30 sh -c "python benchmarks/step_ops.py --device cuda > '$OUT_DIR/step_ops.json'"
step decode 200 python benchmarks/gpu_decode.py --new-tokens 32 --out "$OUT_DIR/decode.json"
step throughput 60 python -m benchmarks.throughput --device cuda --dtype bfloat16 --layers 28 --lengths 16384 --methods hybridkv --budgets 0.1 --caps 4 --sequences 32 --out "$OUT_DIR/throughput.json"
step graphs 60 python -m pytest -q tests/test_step_replay.py -k cuda --junitxml="$OUT_DIR/graphs.xml"
step throughput_graphs 60 python -m benchmarks.throughput --device cuda --dtype bfloat16 --layers 28 --lengths 16384 --methods hybridkv --budgets 0.1 --caps 4 --sequences 32 --cuda-graphs --out "$OUT_DIR/throughput_graphs.json"
python - "$OUT_DIR" <<'PY'
import json, sys, pathlib, torch
out = pathlib.Path(sys.argv[1])
props = torch.cuda.get_device_properties(0)
clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
result = {"device": props.name, "peak_bandwidth_gbs": 2 * clock * 1e3 * bus / 8 / 1e9 if clock and bus else None,
          "steps": [json.loads(l) for l in (out / "steps.jsonl").read_text().splitlines() if l.strip()]}
for name in ("kernels", "step_ops", "decode", "throughput", "throughput_graphs"):
    path = out / f"{name}.json"
    result[name] = json.loads(path.read_text()) if path.exists() and path.stat().st_size else None
(out / "gpu_check.json").write_text(json.dumps(result, indent=1))
print(f"wrote {out / 'gpu_check.json'}")
PY
