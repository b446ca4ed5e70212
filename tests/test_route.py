"""The ``route`` method (a method per layer) and the route builder (``hybridkv route``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridkv_cli import cli
from hybridkv_cli.compression import make_policy
from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.io.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


def layer(index: int, num_layers: int = 3, n: int = 300) -> PrefillLayer:
    g = torch.Generator().manual_seed(index)
    return PrefillLayer(index=index, num_layers=num_layers, query=torch.randn(2, 2, n, 16, generator=g),
                        keys=torch.randn(2, n, 16, generator=g), values=torch.randn(2, n, 16, generator=g),
                        visual=torch.ones(n, dtype=torch.bool), scale=0.25)


def test_each_layer_runs_its_method_under_one_budget(tmp_path):
    path = tmp_path / "route.json"
    path.write_text(json.dumps({"layers": ["snapkv", "streamingllm", "hybridkv"],
                                "options": {"streamingllm": {"sinks": 2}}}))
    policy = make_policy("route", budget=0.1, route=str(path))
    compressed = [policy.compress(layer(i)) for i in range(3)]
    summary = policy.summary([c.report for c in compressed])
    assert summary["per_layer"] == ["snapkv", "streamingllm", "hybridkv"]
    assert summary["methods"]["streamingllm"]["entries_per_head"] == {"sinks": 2, "recent": 28}
    full = 2 * 300 * 16 * 4 * 2  # one layer's prompt K and V
    assert all(c.kv.device_bytes() <= 0.11 * full for c in compressed)
    json.dumps(summary)


def test_a_pattern_repeats_over_the_layers():
    policy = make_policy("route", budget=0.2, route="snapkv,streamingllm")
    names = [policy.compress(layer(i, num_layers=5)).report[0] for i in range(5)]
    assert names == ["snapkv", "streamingllm", "snapkv", "streamingllm", "snapkv"]


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("{nope", "not JSON"),
    (json.dumps({"layers": []}), "expected"),
    (json.dumps({"layers": ["snapkv", "nope", "full"]}), "unknown method 'nope'"),
    (json.dumps({"layers": ["snapkv"] * 3, "options": {"snapkv": {"theta": 1}}}), "'theta' is not an option of snapkv"),
])
def test_bad_route_files_are_usage_errors(tmp_path, content, message):
    path = tmp_path / "route.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=message):
        make_policy("route", budget=0.1, route=str(path))


@pytest.mark.parametrize("name", ["full", "quest"])
def test_a_route_may_not_name_a_method_that_keeps_the_whole_prompt(tmp_path, name):
    """One budget for the whole model: a file or a pattern naming full or quest is refused, with
    the layer."""
    path = tmp_path / "route.json"
    path.write_text(json.dumps({"layers": ["snapkv", name, "snapkv"]}))
    for route in (str(path), f"snapkv,{name}"):
        with pytest.raises(UsageError, match=f"layer 1: '{name}' keeps .* one budget for the whole model") as e:
            make_policy("route", budget=0.1, route=route)
        assert str(e.value).startswith(f"{route}: ") and "\n" not in str(e.value)


def test_the_route_builder_refuses_quest_as_a_candidate(tmp_path, capsys):
    tasks = tmp_path / "dev.jsonl"
    tasks.write_text(json.dumps({"id": "t", "question": "Which?", "context": "x"}))
    out = tmp_path / "route.json"
    assert cli.run(["route", "--tasks", str(tasks), "--model", "demo", "--methods", "snapkv,quest",
                    "-o", str(out), "-q"]) == 2
    assert "--methods: 'quest' keeps the whole prompt on the device" in capsys.readouterr().err
    assert not out.exists()


def test_a_route_for_another_layer_count_is_refused(tmp_path):
    path = tmp_path / "route.json"
    path.write_text(json.dumps({"layers": ["snapkv", "snapkv"]}))
    with pytest.raises(UsageError, match="names methods for 2 layers, the model has 3"):
        make_policy("route", budget=0.1, route=str(path)).compress(layer(0))


def test_route_builder_picks_per_layer_and_writes_the_profile(tmp_path, capsys):
    clip = REPO / "sample_media" / "needle.mp4"
    tasks = tmp_path / "dev.jsonl"
    tasks.write_text("\n".join(json.dumps({"id": f"t{i}", "media": str(clip), "question": q, "answer": a})
                               for i, (q, a) in enumerate([("What colour is the star?", "red"),
                                                            ("What colour is the star?", "red")])))
    out = tmp_path / "route.json"
    code = cli.run(["route", "--tasks", str(tasks), "--model", "demo", "--budget", "0.1", "--methods",
                    "hybridkv,streamingllm", "--max-new-tokens", "3", "--defer-question", "-o", str(out), "-q"])
    assert code == 0, capsys.readouterr().err
    route = json.loads(out.read_text())
    profile = json.loads(out.with_suffix(".profile.json").read_text())
    assert len(route["layers"]) == len(profile["per_layer"]) == 4
    for name, row in zip(route["layers"], profile["per_layer"]):
        scores = {m: (row[m]["accuracy"], row[m]["fidelity"]) for m in ("hybridkv", "streamingllm")}
        assert scores[name] == max(scores.values())  # the best (the earlier one on ties)
    # the built route runs as a method
    code = cli.run(["ask", str(clip), "What colour is the star?", "--model", "demo", "--method", "route",
                    "--route", str(out), "--max-new-tokens", "3", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["heads"]["per_layer"] == route["layers"]
