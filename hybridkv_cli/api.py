"""The library entry point: one question about one media input, answered and measured."""

from __future__ import annotations

from hybridkv_cli.compression import Policy, make_policy
from hybridkv_cli.generation import generate
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models import LoadedModel
from hybridkv_cli.prompt import build_prompt
from hybridkv_cli.report import DEMO_NOTE, latency_stats


def ask(
    loaded: LoadedModel,
    media: MediaInput,
    question: str,
    *,
    method: str | Policy = "hybridkv",
    max_new_tokens: int = 128,
    **options,
) -> dict:
    """Answer ``question`` about ``media`` with the KV cache compressed by ``method``.

    ``method`` is a registered name or a ready ``Policy``; ``options`` are the method's
    parameters (``budget``, ``window``, ``theta``, ...), ignored where a method does not take them. Returns the result record documented in README
    ("JSON output").
    """
    policy = method if isinstance(method, Policy) else make_policy(method, **options)
    prompt = build_prompt(loaded.processor, media, question)
    run = generate(loaded.model, prompt, policy, max_new_tokens=max_new_tokens)
    tokenizer = loaded.processor.tokenizer
    text_cfg = loaded.model.config.get_text_config()
    head_dim = text_cfg.hidden_size // text_cfg.num_attention_heads
    cached_tokens = run.cache.get_seq_length()
    full_bytes = 2 * text_cfg.num_hidden_layers * text_cfg.num_key_value_heads * head_dim * cached_tokens
    full_bytes *= loaded.dtype.itemsize
    device_bytes = run.cache.device_bytes()
    steps = len(run.step_s)
    return {
        "input": {
            "kind": media.kind,
            "label": media.label,
            "files": [str(p) for p in media.sources],
            "frames_total": media.frames_total,
            "frames_used": media.frames_used,
            "visual_tokens": prompt.visual_tokens,
            "text_tokens": prompt.text_tokens,
        },
        "question": question,
        "answer": tokenizer.decode(run.tokens, skip_special_tokens=True).strip(),
        "method": policy.name,
        "budget": policy.budget,
        "prefill_s": run.prefill_s,
        "decode": {"tokens": len(run.tokens), **latency_stats(run.step_s)},
        "kv": {
            "device_bytes": device_bytes,
            "device_bytes_after_prefill": run.device_bytes_after_prefill,
            "host_bytes": run.cache.host_bytes(),
            "full_bytes": full_bytes,
            "ratio_vs_full": device_bytes / full_bytes if full_bytes else None,
            "prefill_peak_bytes": run.cache.prefill_peak_bytes,
            "cuda_peak_bytes": run.cuda_peak_bytes,
        },
        "traffic": (
            {"h2d_bytes_total": run.cache.transferred_bytes(),
             "h2d_bytes_per_step_mean": run.cache.transferred_bytes() / steps if steps else 0.0}
            if run.cache.host_bytes() else None
        ),
        "heads": policy.summary(),
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "note": DEMO_NOTE if loaded.is_demo else None,
    }
