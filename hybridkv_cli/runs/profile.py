"""``hybridkv profile``: how a model's heads behave on one input, and what each budget costs."""

from __future__ import annotations

from dataclasses import replace

from hybridkv_cli.compression import make_policy
from hybridkv_cli.runs.fidelity import rouge_l
from hybridkv_cli.runs.requests import Prepared, Request
from hybridkv_cli.runs.session import Session

SWEEP_BUDGETS = (0.05, 0.1, 0.2, 0.4, 1.0)


def profile(
    session: Session,
    prepared: Prepared,
    *,
    budgets: tuple[float, ...] = SWEEP_BUDGETS,
    on_run=None,
) -> dict:
    """Classify the heads on the prepared input with the session's HybridKV policy, and sweep its
    options over ``budgets`` and its own budget.

    Every answer is compared with the full-cache answer (ROUGE-L F1 = fidelity). ``on_run``
    is called with a short label before each generation (for progress display).
    """
    def run(label: str, policy) -> dict:
        if on_run:
            on_run(label)
        return session.ask(Request(prepared=prepared, policy=policy))

    profiled = session.policy
    reference = run("full", make_policy("full"))
    sweep = []
    for b in sorted({*budgets, profiled.budget}):
        result = run(f"hybridkv b={b:g}", profiled if b == profiled.budget else replace(profiled, budget=b))
        if b == profiled.budget:
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
        "question": prepared.question,
        "budget": profiled.budget,
        "heads": main["heads"],
        "reference": {
            "answer": reference["answer"],
            "device_bytes": reference["kv"]["device_bytes"],
            "ms_per_token_mean": reference["decode"]["ms_per_token_mean"],
        },
        "sweep": sweep,
        "model": main["model"],
        "device": main["device"],
        "dtype": main["dtype"],
        "note": main["note"],
    }
