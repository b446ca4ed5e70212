"""Runs over many workers on Ray (distributed.py): the same records, error records and --resume as one
process, a worker that dies, and the one-line error without Ray. On a local Ray with 2 CPU workers and
the demo model."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

from hybridkv_cli import cli
from hybridkv_cli.runs.batch import run_batch
from hybridkv_cli.runs.inputs import plan_inputs
from hybridkv_cli.runs.session import AskOptions, Session

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import make_image, make_video  # noqa: E402

SMALL = 28 * 28 * 6
FAST = ["--model", "demo", "--frames", "4", "--max-pixels", str(SMALL), "--max-new-tokens", "2"]
OPTS = AskOptions(model="demo", frames=4, max_pixels=SMALL, max_new_tokens=2)
QUESTION = "What happens?"

try:
    import ray
except ImportError:  # pragma: no cover - CI installs the extra
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason='needs Ray: pip install -e ".[ray]"')


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray runtime with 2 CPUs for the module (a run joins it and leaves it running)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers inherit it: 2 cores, 2 workers
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Sample clips, an image and bad files."""
    d = tmp_path_factory.mktemp("media")
    for i in range(4):
        make_video(d / f"clip{i}.mp4", n=8)
    make_image(d / "still.png")
    (d / "text.mp4").write_text("not a video")
    (d / "empty.mp4").write_bytes(b"")
    return d


def comparable(record: dict) -> tuple:
    """What a record says, without its timings."""
    if "error" in record:
        return ("error", record["input"], record["error"]["type"], record["error"]["message"])
    inp = dict(record["input"])
    return ("ok", inp["label"], json.dumps(inp, sort_keys=True), record["question"], record["answer"])


def distributed(items, tmp_path=None, **kw):
    from hybridkv_cli.runs.distributed import run_distributed

    err, out = io.StringIO(), io.StringIO()
    summary = run_distributed(items, QUESTION, OPTS, workers=2, console=Console(file=err, width=300), jsonl=out,
                              **kw)
    return summary, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def test_workers_without_ray_is_one_line(monkeypatch, folder, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert cli.run(["ask", str(folder), QUESTION, "--each", "--workers", "2", *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--workers" in err and 'pip install -e ".[ray]"' in err, err


@needs_ray
def test_two_workers_give_the_single_process_records(local_ray, folder):
    items = plan_inputs([str(folder)], each=True)
    out = io.StringIO()
    single = run_batch(items, QUESTION, Session(OPTS), console=Console(file=io.StringIO()), jsonl=out)
    expected = sorted(comparable(json.loads(line)) for line in out.getvalue().splitlines())

    summary, records, err = distributed(items)
    got = sorted(comparable(r) for r in records)
    assert got == expected  # answers and error records, in any order
    assert len({g[1] for g in got}) == len(items) == len(got)  # one line per input, none twice
    assert (summary.ok, summary.failed, summary.exit_code) == (single.ok, single.failed, single.exit_code) == (5, 2, 1)
    assert "2 workers ready" in err and "done: 5 answered, 2 failed" in err


@needs_ray
def test_batching_workers_give_the_single_process_records(local_ray, folder):
    """``--workers 2 --batch-size 3``: each worker takes 3 inputs at a time and decodes them
    together; the same answers and error records as one process, each line saying its batch."""
    from hybridkv_cli.engine import Limits

    items = plan_inputs([str(folder)], each=True)
    out = io.StringIO()
    run_batch(items, QUESTION, Session(OPTS), console=Console(file=io.StringIO()), jsonl=out)
    expected = sorted(comparable(json.loads(line)) for line in out.getvalue().splitlines())
    summary, records, _ = distributed(items, limits=Limits(batch_size=3))
    assert sorted(comparable(r) for r in records) == expected and (summary.ok, summary.failed) == (5, 2)
    sizes = [r["batch"]["size_max"] for r in records if "batch" in r]
    assert len(sizes) == 5 and max(sizes) > 1 and all(size <= 3 for size in sizes)


@needs_ray
def test_several_questions_and_cache_files_on_two_workers_give_the_single_process_records(local_ray, folder,
                                                                                          tmp_path, capsys):
    def records(argv, code):
        assert cli.run(argv) == code
        return sorted(comparable(json.loads(line)) for line in capsys.readouterr().out.splitlines())

    asked = ["-Q", QUESTION, "-Q", "What colour is it?", "--jsonl", "-q"]
    argv = ["ask", str(folder), "--each", *asked, *FAST]
    single = records(argv, 1)
    assert records([*argv, "--workers", "2"], 1) == single  # one record per question, error records as one process
    assert len(single) == 5 * 2 + 2 and len(set(single)) == len(single)

    caches = tmp_path / "caches"
    assert cli.run(["compress", str(folder / "clip0.mp4"), str(folder / "clip1.mp4"), "--each", "-o", str(caches),
                    "-q", *FAST[:6]]) == 0
    argv = ["ask", *sorted(str(p) for p in caches.iterdir()), *asked, "--max-new-tokens", "2"]
    single = records(argv, 0)
    assert records([*argv, "--workers", "2"], 0) == single and len(single) == 2 * 2


@needs_ray
def test_a_dead_worker_retries_once_then_records_an_error(local_ray, folder, tmp_path):
    flag = tmp_path / "killed-once"

    def fault(item):  # runs in the worker: clip1 kills its worker once, clip2 every time
        import os as _os

        if item is None:  # the model load
            return
        if item.key.endswith("clip1.mp4") and not _os.path.exists(flag):
            open(flag, "w").close()
            _os._exit(1)
        if item.key.endswith("clip2.mp4"):
            _os._exit(1)

    items = plan_inputs([str(folder)], each=True)
    output = tmp_path / "out.jsonl"
    summary, records, err = distributed(items, fault=fault, output=output)
    keys = [r["input"] if "error" in r else r["input"]["label"] for r in records]
    assert sorted(keys) == sorted(it.key for it in items)  # every input once
    by_key = dict(zip(keys, records))
    assert "answer" in by_key[str(folder / "clip1.mp4")]  # retried on a new worker
    lost = by_key[str(folder / "clip2.mp4")]["error"]
    assert lost["type"] == "WorkerLost" and "died 2 times" in lost["message"]
    assert (summary.ok, summary.failed) == (4, 3)
    assert output.read_text().splitlines() == [json.dumps(r) for r in records]


@needs_ray
def test_a_worker_dead_while_loading_is_replaced_once(local_ray, folder, tmp_path):
    from hybridkv_cli.io.errors import ModelError

    flag = tmp_path / "killed-once"

    def once(item):  # runs in the worker: the first model load kills its worker
        import os as _os

        if item is None and not _os.path.exists(flag):
            open(flag, "w").close()
            _os._exit(1)

    items = plan_inputs([str(folder)], each=True)
    summary, records, err = distributed(items, fault=once)
    assert (summary.ok, summary.failed, len(records)) == (5, 2, 7) and "2 workers ready" in err

    def always(item):
        if item is None:
            import os as _os

            _os._exit(1)

    output = tmp_path / "out.jsonl"
    output.write_text(json.dumps(records[0]) + "\n")  # a line of an earlier run
    with pytest.raises(ModelError, match=r"^demo: a worker died loading the model 2 times \(\w+\); see how much memory"):
        distributed(items, fault=always, output=output)
    assert output.read_text() == json.dumps(records[0]) + "\n"


@needs_ray
def test_resume_after_an_interrupted_run_answers_only_what_is_missing(local_ray, folder, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    argv = ["ask", str(folder), QUESTION, "--each", "--workers", "2", "-o", str(output), *FAST]
    assert cli.run(argv) == 1
    lines = output.read_text().splitlines()
    answered = [line for line in lines if '"error"' not in line]
    # an interrupted run: two answered lines and half a third survive
    output.write_text("\n".join(answered[:2]) + "\n" + answered[2][:40])
    capsys.readouterr()
    assert cli.run([*argv, "--resume"]) == 1
    err = capsys.readouterr().err
    assert "resume: skipping 2 inputs" in err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    ok = [r["input"]["label"] for r in records if "error" not in r]
    assert len(ok) == len(set(ok)) == 5  # the missing three answered, none twice
    assert sum("error" in r for r in records) == 2  # the bad files: tried again, failed again


@needs_ray
@pytest.mark.parametrize("signame, code, said", [("SIGINT", 130, "interrupted after"),
                                                  ("SIGTERM", 143, "stopped by SIGTERM after")])
def test_a_stop_signal_stops_the_workers_and_keeps_the_completed_lines(local_ray, folder, tmp_path, signame, code,
                                                                       said):
    from hybridkv_cli.io.signals import stop_on_signals

    driver = os.getpid()

    def fault(item):  # clip3 sends the driver the signal (Ctrl-C, kill) and never finishes
        import os as _os
        import signal as _signal
        import time as _time

        if item is not None and item.key.endswith("clip3.mp4"):
            _os.kill(driver, getattr(_signal, signame))
            _time.sleep(60)

    items = plan_inputs([str(folder)], each=True)
    output = tmp_path / "out.jsonl"
    with stop_on_signals():  # the CLI's handlers (Ray's own, which abort on SIGTERM, are put back)
        summary, records, err = distributed(items, fault=fault, output=output)
    assert summary.exit_code == code and summary.interrupted
    assert said in err and "--resume" in err
    lines = output.read_text().splitlines()
    assert lines == [json.dumps(r) for r in records] and len(lines) == summary.ok + summary.failed < len(items)
    assert not any(str(folder / "clip3.mp4") in line for line in lines)

    def answered(rs):
        return [r["input"]["label"] for r in rs if "error" not in r]

    again, more, _ = distributed(items, output=output, resume=True)  # --resume: only what is missing
    assert again.skipped == summary.ok and again.exit_code == 1
    assert not set(answered(more)) & set(answered(records))  # nothing answered twice
    final = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(answered(final)) == sorted(set(answered(final))) and len(answered(final)) == 5
    assert {r["input"] if "error" in r else r["input"]["label"] for r in final} == {it.key for it in items}


@needs_ray
@pytest.mark.slow
def test_ray_address_joins_a_running_cluster(folder, tmp_path):
    """`ray start --head`, then `hybridkv ask ... --ray ADDRESS` in another process."""
    import shutil
    import signal
    import socket
    import subprocess
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bindir = Path(sys.executable).parent
    temp = tempfile.mkdtemp(prefix="hkvray")  # short: Ray's socket paths must fit 107 characters
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    # --block: the head lives in this process group, which the test ends (`ray stop` would end every
    # Ray runtime on the machine, another test's too)
    head = subprocess.Popen([str(bindir / "ray"), "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
                             "--include-dashboard=false", "--temp-dir", temp], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        output = tmp_path / "out.jsonl"
        run = subprocess.run([sys.executable, "-m", "hybridkv_cli.cli", "ask", str(folder), QUESTION, "--each",
                              "--ray", f"127.0.0.1:{port}", "--workers", "2", "-o", str(output), *FAST],
                             env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 1, run.stderr
        records = [json.loads(line) for line in output.read_text().splitlines()]
        assert sum("error" not in r for r in records) == 5 and len(records) == 7
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@needs_ray
def test_bench_on_two_workers_gives_the_single_process_answers(local_ray, folder, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t{i}", "question": QUESTION, "answer": "x", "media": str(folder / f"clip{i}.mp4")}
            for i in range(4)] + [{"id": "bad", "question": QUESTION, "media": str(folder / "text.mp4")}]
    tasks.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    argv = ["bench", "--tasks", str(tasks), "--methods", "hybridkv,snapkv", "--budgets", "0.2", "--json", "-q",
            *FAST]
    assert cli.run(argv) == 1  # the bad task's runs failed
    single = json.loads(capsys.readouterr().out)
    assert cli.run([*argv, "--workers", "2"]) == 1
    spread = json.loads(capsys.readouterr().out)

    def what(result):
        return [(i["id"], i["method"], i["budget"], i["answer"], (i["error"] or {}).get("type")) for i in result["items"]]

    assert what(spread) == what(single)  # the same runs, answers and errors, in task order
    strip = ("ms_per_token", "h2d_bytes_per_step")
    assert [{k: v for k, v in row.items() if k not in strip} for row in spread["aggregates"]] == \
           [{k: v for k, v in row.items() if k not in strip} for row in single["aggregates"]]
    assert spread["config"]["workers"] == 2 and spread["config"]["inputs"] == 5
