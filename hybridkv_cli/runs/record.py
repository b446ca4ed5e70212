"""The result record of one answer: the JSON schema of README ("JSON output").

This is the one place the application reads a policy's head report (``PolicyCache.summary()``).
"""

from __future__ import annotations

import statistics

from hybridkv_cli.compression import Policy
from hybridkv_cli.engine.measure import Generation
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models.loaded import LoadedModel
from hybridkv_cli.models.prompt import Prompt

RANDOM_WEIGHTS_NOTE = "demo model: randomly initialised weights, the answer is meaningless"


def note(loaded: LoadedModel) -> str | None:
    """The warning a result carries: set for a model whose weights are random."""
    return RANDOM_WEIGHTS_NOTE if loaded.random_weights else None


def latency_stats(step_s: list[float]) -> dict:
    """Mean, p50 and p90 of per-token decode latency in milliseconds (None without steps)."""
    if not step_s:
        return {"ms_per_token_mean": None, "p50": None, "p90": None}
    ms = sorted(s * 1e3 for s in step_s)

    def pct(q: float) -> float:
        return ms[min(len(ms) - 1, round(q * (len(ms) - 1)))]

    return {"ms_per_token_mean": statistics.fmean(ms), "p50": pct(0.5), "p90": pct(0.9)}


def input_record(media: MediaInput | None, prompt: Prompt) -> dict:
    """What was asked about: the media and their token count, or the text context's (and the
    system prompt, when one was given)."""
    system = {} if prompt.system is None else {"system": prompt.system}
    if media is None:
        return {"kind": "text", "label": "text", "files": [], "context_tokens": prompt.visual_tokens,
                "text_tokens": prompt.text_tokens, **system}
    record = {
        "kind": media.kind,
        "label": media.label,
        "files": [str(p) for p in media.sources],
        "frames_total": media.frames_total,
        "frames_used": media.frames_used,
        "frame_size": media.frame_size,  # [w, h] the model saw (None: images of several sizes)
        "visual_tokens": prompt.visual_tokens,
        "text_tokens": prompt.text_tokens,
    }
    if media.rotation:  # only when the frames were turned upright
        record["rotation"] = media.rotation
    return {**record, **system}


def measurements(loaded: LoadedModel, policy: Policy, run: Generation) -> dict:
    """The measured fields of a record: ``prefill_s``, ``decode``, ``kv``, ``traffic``, ``heads``
    (the budget's base: the prompt tokens the policy compressed, ``run.compressed``). Shared by
    the CLI record and :meth:`hybridkv_cli.library.CompressionRun.report`.
    """
    compressed = run.compressed
    per_token = 2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * loaded.dtype.itemsize
    full_bytes = per_token * run.cache.get_seq_length()
    budget_bytes = policy.budget * per_token * compressed
    device_bytes = run.cache.device_bytes()
    steps = len(run.step_s)
    h2d = run.cache.transferred_bytes() if run.cache.host_bytes() else 0
    heads = run.cache.summary()
    decode = {"tokens": len(run.tokens), **latency_stats(run.step_s)}
    if loaded.device.type == "cuda":  # the step model's estimate beside the measured time
        decode["modelled"] = modelled_step(loaded, device_bytes, h2d / steps if steps else 0.0, heads)
    return {
        "prefill_s": run.prefill_s,
        "streamed": run.cache.streamed,
        "decode": decode,
        "kv": {
            "device_bytes": device_bytes,
            "device_bytes_after_prefill": run.device_bytes_after_prefill,
            "host_bytes": run.cache.host_bytes(),
            "full_bytes": full_bytes,
            "ratio_vs_full": device_bytes / full_bytes if full_bytes else None,
            "prompt_ratio": run.device_bytes_after_prefill / (per_token * compressed) if compressed else None,
            "over_budget_bytes": max(0, round(run.device_bytes_after_prefill - budget_bytes)),
            "prefill_peak_bytes": run.cache.prefill_peak_bytes,
            "cuda_peak_bytes": run.cuda_peak_bytes,
        },
        "traffic": (
            {"h2d_bytes_total": h2d, "h2d_bytes_per_step_mean": h2d / steps if steps else 0.0}
            if run.cache.host_bytes() else None
        ),
        "heads": heads,
    }


def modelled_step(loaded: LoadedModel, device_kv_bytes: int, h2d_per_step: float, heads: dict | None) -> dict:
    """:func:`~hybridkv_cli.costs.step_model.run_estimate` for a run on ``loaded``'s device: the
    language model's weights (:attr:`LoadedModel.language_weight_bytes`) read once a step."""
    from hybridkv_cli.costs.profiles import device_profile
    from hybridkv_cli.costs.step_model import run_estimate

    return run_estimate(device_profile(loaded.device), layers=loaded.num_layers,
                        weight_bytes=loaded.language_weight_bytes,
                        device_kv_bytes=device_kv_bytes, h2d_bytes_per_step=h2d_per_step,
                        index=(heads or {}).get("landmark"))


def make_record(loaded: LoadedModel, info: dict, question: str, policy: Policy, run: Generation,
                defer_question: bool, batch: dict | None = None) -> dict:
    """The record of ``run``, the answer to ``question`` about the input ``info`` describes
    (:func:`input_record`); ``batch``: how a batching run decoded it (None: no ``batch`` field)."""
    record = {
        "input": info,
        "question": question,
        "answer": loaded.tokenizer.decode(run.tokens, skip_special_tokens=True).strip(),
        "method": policy.name,
        "budget": policy.budget,
        "defer_question": defer_question,
        **measurements(loaded, policy, run),
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "note": note(loaded),
    }
    if batch is not None:
        record["batch"] = batch
    return record


def prefix_record(record: dict, prefix, *, index: int, of: int, cache_file: str | None) -> dict:
    """``record`` (one question answered from a shared compressed prefix) with the shared work:
    ``shared.prefill_s``, the one prefill + compression of the media, is given on the first
    question's record only (None on the others; from a ``.hkv`` file: the time it took when it
    was compressed), and ``prefill_s`` is this question's own time to its first token."""
    record["shared"] = {
        "questions": of,
        "index": index,
        "prefill_s": prefix.prefill_s if index == 0 else None,
        "compress_s": prefix.compress_seconds if index == 0 else None,
        "from_cache_file": cache_file,
    }
    return record
