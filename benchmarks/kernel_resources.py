"""Registers, stack and compile time of every Triton kernel at Qwen2.5-VL-7B shapes, for sm_90.

No GPU needed: each kernel is compiled for an H100/H200 (``sm_90a``) with Triton's bundled
``ptxas``, and ``ptxas -v`` reports its registers, stack frame and spills.

The launches are the dispatchers' own: every launcher (decode attention, chunk top-k, 2-bit key
scores, candidate re-ranking, gather, the batched retrieval) runs on ``meta`` tensors of the real shapes with its
kernels swapped for recorders, so the block sizes, warps and integer specialisations compiled
here are those a CUDA run would pick (the SM count is an H200's, 132). Then each distinct
specialisation is compiled once, in a child process with a time limit.

Geometry: 28 layers (one layer's launches; every layer launches the same), 4 KV heads, 7 query
heads per KV head, d = 128, bf16; prompts of 8k / 32k / 64k tokens at budgets b = 0.1 / 0.2;
a single sequence and a batch of 8 (the ``TABLE``-mode kernels). Slots per dynamic head: the
allocator's 540 / 1,353 at 8k and 2,210 / 5,461 at 32k (b = 0.1 / 0.2), twice the 32k ones at
64k; 2-bit keys rank single-token chunks (C = N candidates), int8 mean keys chunks of 16; label
keys rank single tokens in two stages (4 candidates a slot, then every channel's 2-bit keys).

    python benchmarks/kernel_resources.py                 # writes docs/kernel_resources.{json,md}
    python benchmarks/kernel_resources.py --prompts 8192 --out /tmp/kr   # a subset elsewhere

Goals it checks: no stack frame and no spill in any kernel at any shape, each compile <= 15 s
(compile times are wall seconds on the machine that runs it, cache disabled).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import multiprocessing as mp
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A fresh cache: compile seconds must not come from an earlier run (set before triton loads).
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kr-triton-cache-"))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

LAYERS, H_KV, G, D = 28, 4, 7, 128
DTYPE = torch.bfloat16
PROMPTS = (8192, 32768, 65536)
BUDGETS = (0.1, 0.2)
BATCHES = (1, 8)
SLOTS = {(8192, 0.1): 540, (8192, 0.2): 1353, (32768, 0.1): 2210, (32768, 0.2): 5461,
         (65536, 0.1): 4420, (65536, 0.2): 10922}
MEAN_CHUNK = 16  # int8 mean-key landmarks: tokens per chunk
CANDIDATES = 4  # label keys: stage-1 candidates per slot (hybridkv_cli's LabelKeys)
N_GEN = 64  # generated rows attended beside the store
SMS = 132  # H200
GOAL_COMPILE_S = 15.0
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- recording launches


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` records the launch."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, self.kernel, tuple(grid), args, kwargs))

        return launch


@contextlib.contextmanager
def recording(log: list):
    """Swap every ``*_kernel`` of the kernel modules for a recorder (restored on exit)."""
    from hybridkv_kernels.dispatch import load_triton_module

    swapped = []
    try:
        for path in sorted((ROOT / "hybridkv_kernels").glob("_*_triton.py")):
            module = load_triton_module(path.stem)
            for name, value in list(vars(module).items()):
                if name.endswith("_kernel") and type(value).__name__ == "JITFunction":
                    swapped.append((module, name, value))
                    setattr(module, name, _Recorder(value, name, log))
        yield log
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


@contextlib.contextmanager
def h200_splits():
    """The decode split heuristic as on an H200 (the meta device has no SM count)."""
    import hybridkv_kernels.decode_attention as dec

    original = dec.decode_split_heuristic
    dec.decode_split_heuristic = lambda total, heads, block_n, device=None: _splits(original, total, heads, block_n)
    try:
        yield
    finally:
        dec.decode_split_heuristic = original


def _splits(original, total, heads, block_n):
    import hybridkv_kernels.decode_attention as dec

    sm_count = dec._sm_count
    dec._sm_count = lambda index: SMS
    try:
        return original(total, heads, block_n, "cuda:0")
    finally:
        dec._sm_count = sm_count


def _meta(*shape, dtype=DTYPE):
    return torch.empty(*shape, dtype=dtype, device="meta")


def decode_launches(tokens: int, budget: float, batch: int) -> None:
    """A layer's decode attention: the store holds about b·N rows per head (+ generated rows)."""
    import hybridkv_kernels.decode_attention as dec

    rows = math.ceil(budget * tokens)
    heads = H_KV * batch
    q = _meta(heads, G, D)
    keys = _meta(heads * rows, D)
    offsets, lengths = _meta(heads, dtype=torch.int64), _meta(heads, dtype=torch.int64)
    with h200_splits():
        if batch == 1:
            gen = _meta(heads, N_GEN * 2, D)
            dec._launch(q, keys, keys, offsets, lengths, gen, gen, N_GEN, max_length=rows)
        else:  # the batch path: a segment table, generated-row counts read on the device
            seg, dummy = _meta(heads, 5, dtype=torch.int64), _meta(1, 1, D)
            dec._run(q, keys, keys, dummy, dummy, offsets, lengths, seg, 0, rows + N_GEN, None, None, None,
                     counted=True)


def retrieval_launches(tokens: int, budget: float, batch: int, chunk: int) -> None:
    """A layer's retrieval for the dynamic heads: scores, top-k (plain, and with ``--stickiness`` /
    ``--swaps``), plan, gather; from 2-bit keys (``chunk`` 1, the default) or from int8 mean keys
    (chunks of ``MEAN_CHUNK``)."""
    br, cg, ct, qk = (importlib.import_module(f"hybridkv_kernels.{m}")  # (modules, not the ops of their names)
                      for m in ("batched_retrieval", "chunk_gather", "chunk_topk", "quant_keys"))
    heads = H_KV * batch
    q = _meta(heads, G, D)
    chunks, n = tokens // chunk, max(1, SLOTS[(tokens, budget)] // chunk)
    host = _meta(heads, chunks, chunk, D)
    store = _meta(heads * n * chunk, D)
    resident = _meta(heads, n, dtype=torch.int64)
    if chunk == 1:
        landmarks, scale = _meta(heads, D // 4, tokens, dtype=torch.uint8), _meta(heads, 2, D, dtype=torch.float32)
    else:
        landmarks, scale = _meta(heads, chunks, D, dtype=torch.int8), _meta(heads, chunks, dtype=torch.float32)
    if batch > 1:
        part = br.RetrievalPart(landmarks, scale, host, host, store, store, _meta(heads, dtype=torch.int64),
                                resident, _meta((), dtype=torch.int64))
        br._launch(q, part, br.RetrievalTable(_meta(heads, 12, dtype=torch.int64), chunks, n, chunk))
        return
    if chunk == 1:  # the plain selection, and the one with the held tokens' bonus and the swap cap
        ct.launch_topk(qk.launch_scores(q, landmarks, scale, 1), n)
        ct.launch_topk(_meta(heads, chunks, dtype=torch.float32), n, resident=resident, limit=16, bonus=1.0)
    else:
        ct._launch(q, landmarks, n, scale)
    cg._launch(host, host, store, store, _meta(heads, dtype=torch.int64), resident, resident)


def label_launches(tokens: int, budget: float) -> None:
    """A layer's two-stage ranking of single tokens (label keys): the label channels' 2-bit keys
    (a quarter of the channels) pick 4 candidates a slot, then every channel's 2-bit keys
    (token-major, host) keep a slot's worth. A batch ranks member by member with the same launches:
    recorded for a single sequence only."""
    ck, ct, qk = (importlib.import_module(f"hybridkv_kernels.{m}")
                  for m in ("candidate_keys", "chunk_topk", "quant_keys"))
    n = SLOTS[(tokens, budget)]
    labels, u8, f32 = D // 4, torch.uint8, torch.float32
    candidates = ct.launch_topk(qk.launch_scores(_meta(H_KV, G, labels), _meta(H_KV, labels // 4, tokens, dtype=u8),
                                                 _meta(H_KV, 2, labels, dtype=f32), 1), min(tokens, CANDIDATES * n))
    ct.launch_topk(ck.launch_candidate_scores(_meta(H_KV, G, D), _meta(H_KV, tokens, D // 4, dtype=u8),
                                              _meta(H_KV, 2, D, dtype=f32), candidates), n)


def refresh_launches(tokens: int, budget: float) -> None:
    """A layer's refresh of its pruned heads (rcr defaults: half the KV heads, c = 256 moving slots,
    4c candidates, detector rank 8), then the gather of what it re-selects. A batch refreshes
    member by member with the same launches: recorded for a single sequence only."""
    rs = importlib.import_module("hybridkv_kernels.refresh_step")
    cg = importlib.import_module("hybridkv_kernels.chunk_gather")
    heads, c, rank, window = H_KV // 2, 256, 8, 32
    held = math.ceil(budget * tokens)
    i64, f32 = torch.int64, torch.float32
    state = rs.RefreshState(
        _meta(heads, dtype=i64), _meta(heads, tokens, 1, D), _meta(heads, D, rank, dtype=f32),
        _meta(heads, rank, tokens, dtype=torch.int8), _meta(heads, rank, dtype=f32), _meta(heads, dtype=i64),
        _meta(heads, c, dtype=i64), _meta(heads, max(0, held - c - window), dtype=i64), held,
        _meta((), dtype=f32), _meta((), dtype=f32), _meta((), dtype=i64), _meta((), dtype=i64))
    store = _meta(H_KV * held, D)
    want = rs.refresh_want(_meta(H_KV, G, D), state, store, _meta(H_KV, 2 * N_GEN, D), N_GEN, D ** -0.5, kind="rcr",
                           rate=0.4, eta=0.05, period=3, candidates=4 * c)
    cg._launch(state.host_k, state.host_k, store, store, state.slot_base, state.resident, want)


def shapes(prompts, budgets, batches):
    for tokens in prompts:
        for budget in budgets:
            for batch in batches:
                yield {"tokens": tokens, "budget": budget, "batch": batch, "slots": SLOTS[(tokens, budget)]}


def record(shape: dict) -> list:
    """The launches of one layer-step at ``shape``: (path, kernel name, kernel, grid, args, kwargs)."""
    paths = {"decode": lambda: decode_launches(shape["tokens"], shape["budget"], shape["batch"]),
             "2-bit keys": lambda: retrieval_launches(shape["tokens"], shape["budget"], shape["batch"], 1),
             f"mean keys, c={MEAN_CHUNK}": lambda: retrieval_launches(shape["tokens"], shape["budget"],
                                                                      shape["batch"], MEAN_CHUNK)}
    if shape["batch"] == 1:
        paths["label keys, two-stage"] = lambda: label_launches(shape["tokens"], shape["budget"])
        paths["refresh (rcr)"] = lambda: refresh_launches(shape["tokens"], shape["budget"])
    out: list = []
    for path, launch in paths.items():
        log: list = []
        with recording(log):
            try:
                launch()
            except Exception as e:  # a launcher whose interface moved: reported, the others measured
                out.append((path, f"({path} launcher)", None, (), (), {"error": f"{type(e).__name__}: {e}"[:300]}))
                continue
        out += [(path, *entry) for entry in log]
    return out


# --------------------------------------------------------------------------- compiling


def _specialise(kernel, args, kwargs):
    """Signature, constexprs, attributes and options exactly as the JIT derives them at launch
    (tensors as 16-byte aligned stand-ins of their dtype)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    args = [MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    return target, options, signature, constexprs, attrs


def _ptxas_report(ptx: str) -> dict:
    """Registers, stack frame and spills from ``ptxas -v`` with the flags Triton compiles with."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([str(ptxas), "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", f.name,
                              "-o", os.devnull], capture_output=True, text=True, check=True).stderr

    def number(pattern):
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0

    return {"registers": number(r"Used (\d+) registers"), "stack_bytes": number(r"(\d+) bytes stack frame"),
            "spill_store_bytes": number(r"(\d+) bytes spill stores"),
            "spill_load_bytes": number(r"(\d+) bytes spill loads")}


def _compile_child(spec, conn) -> None:
    import triton
    from triton.compiler import ASTSource

    kernel, args, kwargs = spec
    try:
        target, options, signature, constexprs, attrs = _specialise(kernel, args, kwargs)
        start = time.perf_counter()
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
        seconds = time.perf_counter() - start
        report = _ptxas_report(compiled.asm["ptx"])
        conn.send({"compile_s": round(seconds, 2), "shared_bytes": compiled.metadata.shared,
                   "num_warps": compiled.metadata.num_warps, "num_stages": compiled.metadata.num_stages, **report})
    except Exception as e:  # reported in the table, not fatal
        conn.send({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]})


def compile_one(kernel, args, kwargs, limit_s: float) -> dict:
    """Compile in a forked child (a compile past ``limit_s`` is killed and reported as such)."""
    parent, child = mp.Pipe(duplex=False)
    proc = mp.get_context("fork").Process(target=_compile_child, args=((kernel, args, kwargs), child))
    proc.start()
    child.close()
    if parent.poll(limit_s):
        result = parent.recv()
    else:
        result = {"error": f"compile exceeded {limit_s:.0f} s (killed)", "compile_s": None}
    proc.kill()
    proc.join()
    return result


def _key(kernel, args, kwargs) -> str:
    _, options, signature, constexprs, attrs = _specialise(kernel, args, kwargs)
    return repr((kernel.fn.__qualname__, sorted(signature.items()), sorted(constexprs.items()),
                 sorted((k, repr(v)) for k, v in attrs.items()), options.num_warps, options.num_stages))


def _constexprs(kernel, kwargs) -> dict:
    names = [p.name for p in kernel.params if p.is_constexpr]
    out = {k: v for k, v in kwargs.items() if k in names or k in ("num_warps", "num_stages")}
    return {k: (v if isinstance(v, (int, float, str, bool)) else repr(v)) for k, v in out.items()}


def measure(shape_list, limit_s: float, log=print) -> list:
    """One row per (shape, launch); a specialisation compiled once, later rows reuse it."""
    done: dict = {}
    rows = []
    for shape in shape_list:
        for path, name, kernel, grid, args, kwargs in record(shape):
            if kernel is None:  # the launcher failed
                rows.append({**shape, "path": path, "kernel": name, "grid": [], "meta": {}, "reused": False, **kwargs})
                continue
            key = _key(kernel, args, kwargs)
            reused = key in done
            if not reused:
                done[key] = compile_one(kernel, args, kwargs, limit_s)
                log(f"{name:30s} N={shape['tokens']:>6} b={shape['budget']} batch={shape['batch']} "
                    f"{json.dumps(_constexprs(kernel, kwargs))} -> {json.dumps(done[key])}")
            rows.append({**shape, "path": path, "kernel": name, "grid": list(grid), "meta": _constexprs(kernel, kwargs),
                         "reused": reused, **done[key]})
    return rows


# --------------------------------------------------------------------------- report


def all_kernels() -> list[str]:
    """Every ``*_kernel`` of the kernel modules (``module.kernel``)."""
    log: list = []
    with recording(log) as _:
        from hybridkv_kernels.dispatch import load_triton_module

        return sorted(f"{p.stem}.{name}" for p in (ROOT / "hybridkv_kernels").glob("_*_triton.py")
                      for name, v in vars(load_triton_module(p.stem)).items() if type(v).__name__ == "_Recorder")


def verdict(rows) -> dict:
    ok = [r for r in rows if "error" not in r]
    launched = {r["kernel"] for r in rows}
    return {
        "not_launched_by_any_shape": [k for k in all_kernels() if k.split(".")[1] not in launched],
        "max_registers": max((r["registers"] for r in ok), default=None),
        "max_stack_bytes": max((r["stack_bytes"] for r in ok), default=None),
        "max_spill_bytes": max((r["spill_store_bytes"] + r["spill_load_bytes"] for r in ok), default=None),
        "max_compile_s": max((r["compile_s"] for r in ok if not r["reused"]), default=None),
        "errors": sorted({f"{r['kernel']}: {r['error']}" for r in rows if "error" in r}),
        "no_stack_no_spill": all(r["stack_bytes"] == 0 and r["spill_store_bytes"] == 0 for r in ok),
        "compiles_within_goal": all(r["compile_s"] <= GOAL_COMPILE_S for r in ok if not r["reused"])
        and len(ok) == len(rows),
    }


def per_kernel(rows) -> dict:
    """kernel -> its worst registers, stack, spill bytes and compile seconds over the rows."""
    out: dict = {}
    for r in rows:
        if "error" in r:
            continue
        w = out.setdefault(r["kernel"], {"registers": 0, "stack_bytes": 0, "spill_bytes": 0, "compile_s": 0.0})
        w["registers"] = max(w["registers"], r["registers"])
        w["stack_bytes"] = max(w["stack_bytes"], r["stack_bytes"])
        w["spill_bytes"] = max(w["spill_bytes"], r["spill_store_bytes"] + r["spill_load_bytes"])
        if not r["reused"]:
            w["compile_s"] = max(w["compile_s"], r["compile_s"])
    for w in out.values():
        w["misses"] = w["stack_bytes"] > 0 or w["spill_bytes"] > 0 or w["compile_s"] > GOAL_COMPILE_S
    return out


def markdown(rows, summary, command) -> str:
    lines = [
        "# Triton kernels at Qwen2.5-VL-7B shapes, compiled for sm_90",
        "",
        f"Produced by `{command}` (compiled with Triton's bundled ptxas for `sm_90a`, no GPU; launch",
        "parameters recorded from the dispatchers at each shape; compile seconds are wall time on the",
        "machine that ran it, a shared 2-core CPU here, Triton's cache disabled).",
        "",
        f"- max registers per thread: **{summary['max_registers']}**; max stack frame: "
        f"**{summary['max_stack_bytes']} B**; max spill: **{summary['max_spill_bytes']} B**",
        f"- slowest compile: **{summary['max_compile_s']} s** (goal <= {GOAL_COMPILE_S:.0f} s)",
        f"- goals met: no stack/spill {summary['no_stack_no_spill']}, compile time "
        f"{summary['compiles_within_goal']}",
    ]
    if summary["not_launched_by_any_shape"]:
        unmeasured = ", ".join(summary["not_launched_by_any_shape"])
        lines.append(f"- kernels no path here launches (not measured): {unmeasured}")
    if summary["errors"]:
        lines.append(f"- failures: {'; '.join(summary['errors'])}")
    lines += ["", "Per kernel, the worst over every shape and path:", "",
              "| kernel | max regs | max stack B | max spill B | slowest compile s | misses the goal |",
              "|---|---|---|---|---|---|"]
    for name, worst in per_kernel(rows).items():
        lines.append(f"| {name} | {worst['registers']} | {worst['stack_bytes']} | {worst['spill_bytes']} | "
                     f"{worst['compile_s']} | {'**yes**' if worst['misses'] else 'no'} |")
    lines += ["", "A row whose *compile s* is `=` reuses an identical specialisation compiled for an earlier row.",
              "", "| N | b | batch | slots | path | kernel | grid | block sizes, warps | regs | stack B | spill B | "
              "smem B | compile s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        meta = ", ".join(f"{k}={v}" for k, v in r["meta"].items() if k not in ("UPCAST", "PREC", "TABLE", "COUNTS",
                                                                             "HAS_SCALE"))
        mode = "table " if r["meta"].get("TABLE") else ""
        if "error" in r:
            cells = ["-", "-", "-", "-", f"**{r['error']}**"]
        else:
            cells = [r["registers"], r["stack_bytes"], r["spill_store_bytes"] + r["spill_load_bytes"],
                     r["shared_bytes"], "=" if r["reused"] else r["compile_s"]]
        lines.append(f"| {r['tokens']} | {r['budget']} | {r['batch']} | {r['slots']} | {r['path']} | "
                     f"{mode}{r['kernel']} | {'x'.join(map(str, r['grid']))} | {meta} | "
                     + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS), choices=PROMPTS)
    p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS), choices=BUDGETS)
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), choices=BATCHES)
    p.add_argument("--limit", type=float, default=120.0, help="seconds before a compile is killed [120]")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "kernel_resources",
                   help="path stem of the .json and .md written [docs/kernel_resources]")
    args = p.parse_args(argv)
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as e:
        print(f"triton with its CUDA backend is needed to compile: {e}")
        return 0
    command = "python benchmarks/kernel_resources.py" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    rows = measure(shapes(args.prompts, args.budgets, args.batches), args.limit)
    summary = verdict(rows)
    import triton

    doc = {"command": command, "triton": triton.__version__, "torch": torch.__version__,
           "python": platform.python_version(), "target": "cuda sm_90a (ptxas bundled with triton)",
           "geometry": {"layers": LAYERS, "kv_heads": H_KV, "group": G, "head_dim": D, "dtype": "bf16",
                        "sms": SMS, "mean_chunk": MEAN_CHUNK, "n_gen": N_GEN},
           "summary": summary, "wall_s": round(time.perf_counter() - start, 1), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, summary, command))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
