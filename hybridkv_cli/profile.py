"""``hybridkv profile``: how a model's heads behave on one input, and what each budget costs."""

from __future__ import annotations

from hybridkv_cli.api import ask
from hybridkv_cli.fidelity import rouge_l
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models import LoadedModel

SWEEP_BUDGETS = (0.05, 0.1, 0.2, 0.4, 1.0)


def profile(
    loaded: LoadedModel,
    media: MediaInput | None,
    question: str,
    *,
    context: str | None = None,
    budget: float = 0.1,
    budgets: tuple[float, ...] = SWEEP_BUDGETS,
    max_new_tokens: int = 32,
    on_run=None,
    **options,
) -> dict:
    """Classify the heads on ``media`` (or the text ``context``) + ``question`` and sweep HybridKV
    over ``budgets``.

    Every answer is compared with the full-cache answer (ROUGE-L F1 = fidelity). ``on_run``
    is called with a short label before each generation (for progress display).
    """
    def run(label: str, **kw) -> dict:
        if on_run:
            on_run(label)
        return ask(loaded, media, question, context=context, max_new_tokens=max_new_tokens, **options, **kw)

    reference = run("full", method="full")
    sweep = []
    for b in sorted({*budgets, budget}):
        result = run(f"hybridkv b={b:g}", method="hybridkv", budget=b)
        if b == budget:
            main = result
        sweep.append({
            "budget": b,
            "device_bytes": result["kv"]["device_bytes"],
            "host_bytes": result["kv"]["host_bytes"],
            "ratio_vs_full": result["kv"]["ratio_vs_full"],
            "ms_per_token_mean": result["decode"]["ms_per_token_mean"],
            "fidelity": rouge_l(result["answer"], reference["answer"]),
            "answer": result["answer"],
        })
    return {
        "input": main["input"],
        "question": question,
        "budget": budget,
        "heads": main["heads"],
        "reference": {
            "answer": reference["answer"],
            "device_bytes": reference["kv"]["device_bytes"],
            "ms_per_token_mean": reference["decode"]["ms_per_token_mean"],
        },
        "sweep": sweep,
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": main["dtype"],
        "note": main["note"],
    }
