"""``hybridkv bench``: outputs, scoring, exactness at budget 1, task-file errors, the text task set.

Runs in process through ``cli.run(argv)`` with the demo model built once; 2 methods, tiny images,
4 new tokens.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv_cli import cli
from hybridkv_cli.runs.answers import is_correct, normalise
from hybridkv_cli.runs.bench import aggregate, read_tasks

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "sample_media" / "images"
TASKS = REPO / "benchmarks" / "tasks" / "text_tasks.jsonl"
GENERATOR = REPO / "scripts" / "make_text_tasks.py"
FAST = ["--model", "demo-random", "--methods", "hybridkv,snapkv", "--max-new-tokens", "4",
        "--max-pixels", str(28 * 28 * 6), "-q"]


@pytest.fixture(scope="module")
def demo():
    from hybridkv_cli.models.demo import build_demo

    loaded = build_demo()
    loaded.name = "demo-random"
    return loaded


@pytest.fixture(autouse=True)
def cached_demo(demo, monkeypatch):
    monkeypatch.setattr("hybridkv_cli.models.registry.load_model", lambda name, **kw: demo)


def bench(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.run(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- scoring --------------------------------------------------------------------------------------
def test_normalise_and_accuracy():
    assert normalise("  The Pass\nKEY is 48213.  ") == "the pass key is 48213"
    assert normalise("«Paris!»") == "paris"
    assert is_correct("The pass key is 48213.", ["48213"]) is True
    assert is_correct("It is 4821.", ["48213"]) is False
    assert is_correct("a RED   circle", ["Blue square", "red circle."]) is True  # any of several
    assert is_correct("anything", []) is None
    items = [{"method": "m", "budget": 0.1, "error": None, "correct": c, "fidelity": f, "kv_ratio": 0.25,
              "ms_per_token": 2.0, "h2d_bytes_per_step": None} for c, f in ((True, 1.0), (False, 0.5), (None, 0.0))]
    items.append({"method": "m", "budget": 0.1, "error": {"type": "MediaError", "message": "x"}})
    [row] = aggregate(items, [("m", 0.1)])
    assert row == {"method": "m", "budget": 0.1, "n": 4, "errors": 1, "accuracy": 0.5, "fidelity": 0.5,
                   "kv_ratio": 0.25, "ms_per_token": 2.0, "h2d_bytes_per_step": None,
                   "accuracy_ci": [0.0, 1.0], "fidelity_ci": [0.0, 1.0]}  # 2 and 3 items: all-0 and all-1 resamples
    many = [{**items[0], "correct": c, "fidelity": 0.8} for c in [True] * 30 + [False] * 10]
    [row] = aggregate(many, [("m", 0.1)])
    assert row["accuracy"] == 0.75 and 0.6 < row["accuracy_ci"][0] < 0.75 < row["accuracy_ci"][1] < 0.9
    assert row["fidelity_ci"] == [0.8, 0.8]
    [row] = aggregate(items[2:], [("m", 0.1)])  # no expected answer, one error
    assert (row["accuracy"], row["accuracy_ci"], row["fidelity_ci"]) == (None, None, [0.0, 0.0])



def test_table_shows_the_intervals_uncut_when_piped():
    import io

    from rich.console import Console

    from hybridkv_cli.io.bench_report import render_bench

    items = [{"method": "streamingllm", "budget": 0.05, "error": None, "correct": True, "fidelity": 0.5,
              "kv_ratio": 0.1, "ms_per_token": 1234.5, "h2d_bytes_per_step": 1.2e6}] * 4
    out = io.StringIO()
    console = Console(file=out, width=80)
    render_bench({"config": {"model": "m", "inputs": 4, "max_new_tokens": 4},
                  "aggregates": aggregate(items, [("streamingllm", 0.05)])}, console)
    line = out.getvalue().splitlines()[-1]
    assert "100% [100–100]" in line and "0.500 [0.50–0.50]" in line and line.endswith("1.14 MiB")
    assert console.width == 80


# --- one media input: every output file -----------------------------------------------------------
@pytest.fixture(scope="module")
def media_run(tmp_path_factory, demo):
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hybridkv_cli.models.registry.load_model", lambda name, **kw: demo)
        code = cli.run(["bench", str(IMAGES / "red_circle.png"), str(IMAGES / "blue_square.jpg"), "Which shape?",
                        "--answer", "circle", "--budgets", "0.1,1.0", "--out", str(out), *FAST])
    return code, out


def test_csv_has_full_and_every_method_budget(media_run):
    code, out = media_run
    assert code == 0
    with open(out / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["method", "budget", "n", "errors", "accuracy", "fidelity", "kv_ratio", "ms_per_token",
                             "h2d_bytes_per_step", "accuracy_lo", "accuracy_hi", "fidelity_lo", "fidelity_hi"]
    # one input per row: a zero-width interval at the value
    assert all(r["fidelity_lo"] == r["fidelity_hi"] == r["fidelity"] for r in rows)
    assert all(r["accuracy_lo"] == r["accuracy_hi"] == r["accuracy"] for r in rows)
    assert [(r["method"], float(r["budget"])) for r in rows] == [
        ("full", 1.0), ("hybridkv", 0.1), ("hybridkv", 1.0), ("snapkv", 0.1), ("snapkv", 1.0)]
    fidelity = {(r["method"], float(r["budget"])): float(r["fidelity"]) for r in rows}
    assert fidelity[("full", 1.0)] == 1.0
    assert fidelity[("hybridkv", 1.0)] == 1.0 and fidelity[("snapkv", 1.0)] == 1.0  # exactness at b = 1


def test_json_items_and_accuracy(media_run):
    result = json.loads((media_run[1] / "bench.json").read_text())
    assert set(result) == {"config", "aggregates", "items"}
    assert result["config"]["methods"] == ["hybridkv", "snapkv"] and result["config"]["budgets"] == [0.1, 1.0]
    items = result["items"]
    assert len(items) == 5 and all(it["error"] is None for it in items)
    assert set(items[0]) >= {"id", "method", "budget", "answer", "expected", "correct", "fidelity", "kv_ratio",
                             "ms_per_token", "h2d_bytes_per_step", "tokens", "error"}
    for it, row in zip(items, result["aggregates"]):  # one input: each aggregate is its one run
        assert it["expected"] == ["circle"] and it["correct"] == is_correct(it["answer"], ["circle"])
        assert row["accuracy"] == float(it["correct"]) and row["fidelity"] == it["fidelity"]
    traffic = {(r["method"], r["budget"]): r["h2d_bytes_per_step"] for r in result["aggregates"]}
    assert traffic[("snapkv", 0.1)] is None  # no host store: no traffic


def test_png(media_run):
    assert (media_run[1] / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- task files -----------------------------------------------------------------------------------
def test_bad_row_or_media_is_an_error_record(tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    (tmp_path / "red.png").write_bytes((IMAGES / "red_circle.png").read_bytes())
    tasks.write_text("\n".join(json.dumps(row) for row in [
        {"id": "missing", "question": "What?", "media": "nope.png"},
        {"id": "image", "question": "What shape?", "media": ["red.png"], "extra": 1},
        {"id": "text", "question": "What is the pass key?", "context": "The pass key is 48213.", "answer": "48213"},
    ]) + "\n\n")
    code, out, err = bench(["--tasks", str(tasks), "--budgets", "0.2", "--json", *FAST], capsys)
    assert code == 1
    assert err == f"error: missing: {tmp_path / 'nope.png'}: no such file or directory\n"
    result = json.loads(out)
    by_id = {}
    for it in result["items"]:
        by_id.setdefault(it["id"], []).append(it)
    assert [it["error"] is not None for it in by_id["missing"]] == [True] * 3
    assert all(it["error"] is None for it in by_id["image"] + by_id["text"])
    assert by_id["text"][0]["tokens"]["context_tokens"] > 0
    assert [(r["n"], r["errors"]) for r in result["aggregates"]] == [(3, 1)] * 3


def test_failed_run_is_recorded_and_the_rest_goes_on(capsys, monkeypatch):
    from hybridkv_cli.engine import jobs

    real = jobs.prefill

    def flaky(model, prompt, policy, *args, **kw):
        if policy.name == "snapkv":
            raise MemoryError("out of host memory")
        return real(model, prompt, policy, *args, **kw)

    monkeypatch.setattr(jobs, "prefill", flaky)
    code, out, err = bench([str(IMAGES / "red_circle.png"), "What?", "--budgets", "0.1", "--json", *FAST], capsys)
    assert code == 1 and err.count("\n") == 1
    assert err.endswith("snapkv b=0.1: out of host memory; try a lower --budget, fewer --frames or a lower "
                        "--max-pixels\n")
    rows = {r["method"]: (r["n"], r["errors"]) for r in json.loads(out)["aggregates"]}
    assert rows == {"full": (1, 0), "hybridkv": (1, 0), "snapkv": (1, 1)}


@pytest.mark.parametrize("lines,reason", [
    (['{"question": "q", "context": "c"}', "{not json"], "2: not valid JSON ("),
    (['["q"]'], "1: a task must be a JSON object"),
    (['{"context": "c"}'], "1: 'question' (a string) is missing"),
    (['{"question": " ", "context": "c"}'], "1: the question is empty"),
    (['{"question": "q"}'], "1: a task needs 'context' (a text prompt) or 'media'"),
    (['{"question": "q", "context": "c", "media": "a.png"}'],
     "1: a task has 'context' (a text prompt) or 'media', not both"),
    (['{"question": "q", "context": "c", "answer": 5}'], "1: 'answer' must be a non-empty string or a list of them"),
    (['{"id": "a", "question": "q", "context": "c"}', '{"id": "a", "question": "q", "context": "c"}'],
     "2: 'id' must be a unique string, got 'a'"),
])
def test_bad_task_file_is_one_line_exit_2(tmp_path, capsys, lines, reason):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("\n".join(lines) + "\n")
    code, out, err = bench(["--tasks", str(tasks), *FAST], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {tasks}:{reason}") and err.count("\n") == 1  # one line, no traceback


def test_route_rows_with_a_route_file(tmp_path, capsys):
    """``--methods route --route FILE``: the route's rows at each budget, exact at b = 1, within
    the budget at b = 0.1 (a video of ~600 tokens, 4 layers of the demo)."""
    route = tmp_path / "route.json"
    route.write_text(json.dumps({"layers": ["hybridkv", "snapkv", "streamingllm", "snapkv"]}))
    out = tmp_path / "bench"
    code, _, err = bench([str(REPO / "sample_media" / "shapes.mp4"), "Which shape?", "--frames", "8",
                          "--budgets", "0.1,1.0", "--out", str(out), "--model", "demo-random", "--methods", "route",
                          "--route", str(route), "--max-new-tokens", "4", "-q"], capsys)
    assert code == 0, err
    result = json.loads((out / "bench.json").read_text())
    assert result["config"]["options"]["route"] == str(route)
    runs = {(it["method"], it["budget"]): it for it in result["items"]}
    assert list(runs) == [("full", 1.0), ("route", 0.1), ("route", 1.0)]
    assert all(it["error"] is None for it in runs.values())
    assert runs[("route", 1.0)]["answer"] == runs[("full", 1.0)]["answer"]
    assert runs[("route", 1.0)]["fidelity"] == 1.0
    assert runs[("route", 0.1)]["tokens"]["visual_tokens"] > 500
    assert runs[("route", 0.1)]["kv_ratio"] < 0.13  # b plus rounding and the 4 generated tokens


@pytest.mark.parametrize("argv,message", [
    (["{image}", "q", "--methods", "hybridkv,nope"], "error: --methods: unknown method 'nope' (available: "),
    (["{image}", "q", "--budgets", "0.1,2"], "error: --budgets: budget must be in (0, 1], got 2"),
    (["{image}", "q", "--tasks", "t.jsonl"], "error: --tasks: give either --tasks FILE or MEDIA... QUESTION"),
    (["q"], "error: arguments: give one or more media files"),
    (["{image}", "q", "--methods", "snapkv,lookm", "--theta", "0.5"],
     "error: --theta: does not apply to any of the methods snapkv, lookm"),
    (["{image}", "q", "--methods", "rcr", "--refresh", "often"], "error: --refresh: refresh must be one of"),
])
def test_usage_errors(capsys, argv, message):
    argv = [a.format(image=IMAGES / "red_circle.png") for a in argv]
    code, out, err = bench([*argv, "--model", "demo-random", "-q"], capsys)
    assert (code, out) == (2, "") and err.startswith(message) and err.count("\n") == 1


# --- the text task set ----------------------------------------------------------------------------
def test_generator_is_deterministic(tmp_path):
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    procs = [subprocess.Popen([sys.executable, str(GENERATOR), "--out", str(p)], stdout=subprocess.DEVNULL)
             for p in outs]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert outs[0].read_bytes() == outs[1].read_bytes()
    check_task_set(outs[0])


def test_committed_task_set():
    assert TASKS.stat().st_size < 300_000
    check_task_set(TASKS)


def check_task_set(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(read_tasks(path)) == len(rows)
    passkeys = [r for r in rows if r["kind"] == "passkey"]
    assert len(passkeys) == 20 and {r["approx_tokens"] // 1000 for r in passkeys} == {1, 2}
    for r in passkeys:
        assert len(r["answer"]) == 5 and r["context"].count(r["answer"]) == 1
    summaries = [r for r in rows if r["kind"] == "summary"]
    assert summaries and all("answer" not in r and r["approx_tokens"] >= 1000 for r in summaries)
