"""Build a route (a compression method per layer) from an offline profile on dev tasks.

For every layer and every candidate method, each task is answered with only that layer
compressed (every other layer keeps its full cache) at the target budget; what that costs is
measured against the full-cache answer: accuracy where the task has answers, ROUGE-L fidelity
always. A layer's route is the method that loses least (accuracy first, then fidelity; ties go to
the earlier method in the candidate list). Cost: layers x methods x tasks generations.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridkv_cli.compression import make_policy
from hybridkv_cli.compression.route import refusal
from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.runs.answers import is_correct
from hybridkv_cli.runs.bench import Task
from hybridkv_cli.runs.fidelity import rouge_l
from hybridkv_cli.runs.requests import Request


def build_route(session, tasks: list[Task], methods: list[str], budget: float, output: Path,
                on_run=None) -> dict:
    """Write the route to ``output`` and the per-layer, per-method scores beside it
    (``ROUTE.profile.json``); returns the route.

    ``session`` answers the tasks (its model, frames and ``max_new_tokens``); ``on_run(label)``
    is called before each generation (progress).
    """
    for name in methods:  # a bad budget or method is refused before the model loads
        if reason := refusal(name):
            raise UsageError(reason, "--methods")
        make_policy(name, budget=budget)
    num_layers = session.model().num_layers
    prepared = [session.prepare_task(t) for t in tasks]
    reference = [session.ask(Request(prepared=p, policy=make_policy("full")))["answer"] for p in prepared]
    scores = {m: [[] for _ in range(num_layers)] for m in methods}
    for layer in range(num_layers):
        for method in methods:
            only = ["full"] * layer + [method] + ["full"] * (num_layers - layer - 1)
            policy = make_policy("route", budget=budget, route=only)
            for task, prep, ref in zip(tasks, prepared, reference):
                if on_run:
                    on_run(f"layer {layer} {method} {task.id}")
                answer = session.ask(Request(prepared=prep, policy=policy))["answer"]
                scores[method][layer].append((is_correct(answer, task.answers) if task.answers else None,
                                              rouge_l(answer, ref)))
    profile = {"budget": budget, "tasks": len(tasks), "methods": methods, "per_layer": []}
    route = []
    for layer in range(num_layers):
        row = {m: _summary(scores[m][layer]) for m in methods}
        best = max(methods, key=lambda m: (_key(row[m]), -methods.index(m)))
        route.append(best)
        profile["per_layer"].append({"layer": layer, "best": best, **row})
    built = {"layers": route, "budget": budget, "built_from": profile["tasks"]}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(built, indent=1))
    output.with_suffix(".profile.json").write_text(json.dumps(profile, indent=1))
    return built


def _summary(runs: list[tuple]) -> dict:
    answered = [c for c, _ in runs if c is not None]
    return {"accuracy": sum(answered) / len(answered) if answered else None,
            "fidelity": sum(f for _, f in runs) / len(runs) if runs else None}


def _key(row: dict) -> tuple:
    return (row["accuracy"] if row["accuracy"] is not None else 0.0, row["fidelity"] or 0.0)
