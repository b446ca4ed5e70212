"""The library entry point: one question about one media input, answered and measured."""

from __future__ import annotations

from hybridkv_cli.compression import Policy, make_policy
from hybridkv_cli.generation import generate
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models import LoadedModel
from hybridkv_cli.errors import UsageError
from hybridkv_cli.prompt import Prompt, build_prompt, build_text_prompt
from hybridkv_cli.report import DEMO_NOTE, latency_stats


def make_prompt(loaded: LoadedModel, media: MediaInput | None, question: str, context: str | None = None) -> Prompt:
    """The prompt for ``question`` about ``media`` (a media prompt) or about ``context`` (a text
    prompt: ``media`` None)."""
    if media is None:
        return build_text_prompt(loaded.tokenizer, context or "", question)
    if context is not None:
        raise UsageError("give media or a text context, not both", "--context")
    loaded.refuse_media(media.label)
    return build_prompt(loaded.processor, media, question)


def ask(
    loaded: LoadedModel,
    media: MediaInput | None,
    question: str,
    *,
    context: str | None = None,
    method: str | Policy = "hybridkv",
    max_new_tokens: int = 128,
    defer_question: bool = False,
    **options,
) -> dict:
    """Answer ``question`` about ``media``, or about the text ``context`` when ``media`` is None,
    with the KV cache compressed by ``method``.

    ``method`` is a registered name or a ready ``Policy``; ``options`` are the method's
    parameters (``budget``, ``window``, ``theta``, ...), ignored where a method does not take
    them. In a text prompt the context's tokens take the role visual tokens have in a media
    prompt. ``defer_question`` compresses the cache before the question is read (see
    :func:`hybridkv_cli.generation.generate`). Returns the result record documented in README
    ("JSON output").
    """
    policy = method if isinstance(method, Policy) else make_policy(method, **options)
    prompt = make_prompt(loaded, media, question, context)
    run = generate(loaded.model, prompt, policy, max_new_tokens=max_new_tokens, defer_question=defer_question)
    cached_tokens = run.cache.get_seq_length()
    full_bytes = 2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * cached_tokens
    full_bytes *= loaded.dtype.itemsize
    device_bytes = run.cache.device_bytes()
    steps = len(run.step_s)
    return {
        "input": input_record(media, prompt),
        "question": question,
        "answer": loaded.tokenizer.decode(run.tokens, skip_special_tokens=True).strip(),
        "method": policy.name,
        "budget": policy.budget,
        "defer_question": defer_question,
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


def input_record(media: MediaInput | None, prompt: Prompt) -> dict:
    """What was asked about: the media and their token count, or the text context's."""
    if media is None:
        return {"kind": "text", "label": "text", "files": [], "context_tokens": prompt.visual_tokens,
                "text_tokens": prompt.text_tokens}
    return {
        "kind": media.kind,
        "label": media.label,
        "files": [str(p) for p in media.sources],
        "frames_total": media.frames_total,
        "frames_used": media.frames_used,
        "visual_tokens": prompt.visual_tokens,
        "text_tokens": prompt.text_tokens,
    }
