"""The command line: the JSON schema, stdout/stderr discipline, exit codes, one-line errors.

Two real subprocesses (started together: each pays ~5 s of imports) check the console entry
points; the rest runs in process through ``cli.run(argv)`` with the demo model built once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridkv_cli import cli

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import make_image, make_video  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_media" / "shapes.mp4"
FAST = ["--model", "demo", "--frames", "4", "--max-pixels", str(28 * 28 * 6), "--max-new-tokens", "2"]

SCHEMA = {
    "input": {"kind": str, "label": str, "files": list, "frames_total": (int, type(None)), "frames_used": int,
              "frame_size": (list, type(None)), "visual_tokens": int, "text_tokens": int},
    "question": str, "answer": str, "method": str, "budget": float, "defer_question": bool, "prefill_s": float,
    "streamed": (dict, type(None)),
    "decode": {"tokens": int, "ms_per_token_mean": (float, type(None)), "p50": (float, type(None)),
               "p90": (float, type(None))},
    "kv": {"device_bytes": int, "device_bytes_after_prefill": int, "host_bytes": int, "full_bytes": int,
           "ratio_vs_full": (float, type(None)), "prompt_ratio": float, "over_budget_bytes": int,
           "prefill_peak_bytes": int, "cuda_peak_bytes": (int, type(None))},
    "traffic": (dict, type(None)), "heads": (dict, type(None)), "model": str, "device": str, "dtype": str,
    "note": (str, type(None)),
}


def check_schema(record: dict, schema: dict = SCHEMA) -> None:
    assert set(record) == set(schema), set(record) ^ set(schema)
    for key, kind in schema.items():
        if isinstance(kind, dict):
            check_schema(record[key], kind)
        else:
            assert isinstance(record[key], kind) and (kind is bool or not isinstance(record[key], bool)), (key, record[key])


# --- real processes -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    if not SAMPLE.exists():
        pytest.skip("run scripts/make_sample_media.py")
    missing = str(tmp_path_factory.mktemp("p") / "missing clip.mp4")
    hybridkv = Path(sys.executable).parent / "hybridkv"
    cmds = {
        "json": [str(hybridkv) if hybridkv.exists() else sys.executable, *([] if hybridkv.exists() else
                 ["-m", "hybridkv_cli.cli"]), "ask", str(SAMPLE), "What happens?", "--model", "demo", "--json",
                 "--max-new-tokens", "4"],
        "missing": [sys.executable, "-m", "hybridkv_cli.cli", "ask", missing, "What?", "--model", "demo"],
    }
    running = {k: subprocess.Popen(c, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for k, c in cmds.items()}
    done = {k: (p.wait(timeout=300), *p.communicate()) for k, p in running.items()}
    return done, missing


def test_json_subprocess_prints_exactly_one_object(procs):
    (code, out, err), _ = procs[0]["json"], procs[1]
    assert code == 0, err
    assert out.count("\n") == 1 and out.endswith("}\n")
    record = json.loads(out)
    check_schema(record)
    assert record["input"]["kind"] == "video" and record["input"]["frames_used"] == 64
    assert record["question"] == "What happens?" and record["model"] == "demo" and record["decode"]["tokens"] <= 4
    assert "{" not in err  # status and progress never reach stdout, and nothing JSON on stderr


def test_runtime_error_subprocess_is_one_line(procs):
    done, missing = procs
    code, out, err = done["missing"]
    assert code == 1 and out == ""
    assert err == f"error: {missing}: no such file or directory\n"  # no traceback (--debug: in process below)


# --- in process -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    from hybridkv_cli.models.demo import build_demo

    return build_demo()


@pytest.fixture(autouse=True)
def cached_demo(demo, monkeypatch):
    monkeypatch.setattr("hybridkv_cli.models.registry.load_model", lambda name, **kw: demo)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return make_video(tmp_path_factory.mktemp("clip") / "clip.mp4", n=8)


@pytest.mark.parametrize("argv,reason", [
    (["{clip}", "q", "--budget", "0"], "error: --budget: budget must be in (0, 1], got 0"),
    (["{clip}", "q", "--budget", "1.5"], "error: --budget: budget must be in (0, 1], got 1.5"),
    (["{clip}", "q", "--method", "nope"], "error: --method: unknown method 'nope' (available: "),
    (["{clip}", ""], "error: QUESTION: the question is empty"),
    (["{clip}", " \t\n "], "error: QUESTION: the question is empty"),
    (["{clip}", "\x1b[0m\x07"], "error: QUESTION: the question is empty (after removing control characters)"),
    ([], "error: arguments: give one or more media files"),
    (["{clip}"], "error: arguments: give one or more media files"),
    (["{clip}", "q", "--max-new-tokens", "0"], "error: Invalid value for '--max-new-tokens'"),
    (["{clip}", "q", "--nope"], "error: No such option: --nope"),
    (["{clip}", "q", "--frames", "0"], "error: frames must be positive"),
    (["{clip}", "q", "--sinks", "2"], "error: --sinks: does not apply to method 'hybridkv'"),
    (["{clip}", "q", "--method", "streamingllm", "--window", "8"],
     "error: --window: does not apply to method 'streamingllm'"),
    (["{clip}", "q", "--method", "lookm", "--theta", "0.5"], "error: --theta: does not apply to method 'lookm'"),
    (["{clip}", "q", "--method", "full", "--budget", "0.1"],
     "error: --budget: full keeps the whole cache: its budget is 1, got 0.1"),
    (["{clip}", "q", "--method", "snapkv", "--refresh", "rcr"], "error: --refresh: does not apply to method 'snapkv'"),
    (["{clip}", "q", "--landmark", "nope"],
     "error: --landmark: landmark must be one of auto, keys, host-keys, minmax, mean, detector, labels, got 'nope'"),
    (["{clip}", "q", "--method", "rcr", "--refresh", "often"],
     "error: --refresh: refresh must be one of none, rcr, periodic, got 'often'"),
    (["{clip}", "q", "--method", "sparsemm", "--head-scores", "/nope.json"],
     "error: /nope.json: no such file or directory"),
    (["{clip}", "q", "--temperature", "2.5"], "error: --temperature: temperature must be between 0 and 2"),
    (["{clip}", "q", "--temperature", "nan"], "error: --temperature: temperature must be between 0 and 2"),
    (["{clip}", "q", "--temperature", "1", "--top-p", "0"], "error: --top-p: top_p must be above 0 and at most 1"),
    (["{clip}", "q", "--temperature", "1", "--seed", str(2**64)], "error: --seed: the seed must be a 64-bit integer"),
    (["{clip}", "q", "--presence-penalty", "-2.5"],
     "error: --presence-penalty: presence_penalty must be between -2 and 2"),
    (["{clip}", "q", "--frequency-penalty", "inf"],
     "error: --frequency-penalty: frequency_penalty must be between -2 and 2"),
])
def test_usage_errors_exit_2_with_one_line(argv, reason, clip, capsys):
    code = cli.run(["ask", *[a.format(clip=clip) for a in argv], "--model", "demo"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith(reason) and err.count("\n") == 1, err


def test_a_seed_draws_a_sampled_answer_again_as_the_library_does(clip, capsys):
    from hybridkv_cli.api import ask
    from hybridkv_cli.engine.sampling import Sampling
    from hybridkv_cli.media import load_media
    from hybridkv_cli.models.registry import load_model, max_pixels_for

    argv = ["ask", str(clip), "What happens?", "--model", "demo", "--max-new-tokens", "6", "--temperature", "1.8",
            "--json"]
    assert cli.run(argv) == 0
    drawn = json.loads(capsys.readouterr().out)
    check_schema({k: v for k, v in drawn.items() if k != "sampling"})
    assert drawn["sampling"]["temperature"] == 1.8 and drawn["sampling"]["top_p"] == 1.0  # and a fresh seed
    assert cli.run([*argv, "--seed", str(drawn["sampling"]["seed"])]) == 0
    assert json.loads(capsys.readouterr().out)["answer"] == drawn["answer"]
    media = load_media([clip], frames=64, max_pixels=max_pixels_for("demo", None))  # as the command loads it
    record = ask(load_model("demo"), media, "What happens?", max_new_tokens=6,
                 sampling=Sampling(1.8, 1.0, drawn["sampling"]["seed"]))
    assert record["answer"] == drawn["answer"] and record["sampling"] == drawn["sampling"]


def test_runtime_errors_exit_1_with_one_line(tmp_path, capsys):
    (tmp_path / "text.mp4").write_text("not a video")
    (tmp_path / "empty dir").mkdir()
    cases = {
        str(tmp_path / "gone.mp4"): "no such file or directory",
        str(tmp_path / "text.mp4"): "file content is text, not a video",
        str(tmp_path / "empty dir"): "no image files in directory",
    }
    for path, reason in cases.items():
        assert cli.run(["ask", path, "What?", *FAST]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"error: {path}: {reason}") and err.count("\n") == 1, err


def test_debug_shows_the_traceback(tmp_path):
    from hybridkv_cli.io.errors import MediaError

    with pytest.raises(MediaError):
        cli.run(["ask", str(tmp_path / "gone.mp4"), "What?", "--debug", *FAST])


def test_method_flags_reach_the_method(clip, capsys):
    for flags, key, value in ((["--method", "streamingllm", "--sinks", "2"], "sinks", 2),
                              (["--method", "quest", "--page-size", "4"], "page_size", 4),
                              (["--landmark", "detector", "--sink-aware"], "landmark", "detector"),
                              (["--method", "rcr", "--refresh", "periodic"], "refresh", "periodic")):
        assert cli.run(["ask", str(clip), "What?", "--json", "-q", *flags, *FAST]) == 0
        heads = json.loads(capsys.readouterr().out)["heads"]
        assert (heads[key]["kind"] if key == "refresh" else heads[key]) == value


def test_human_report_on_stdout_nothing_else(clip, capsys):
    assert cli.run(["ask", str(clip), "What happens?", *FAST]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    for row in ("input", "prompt", "method", "prefill", "decode", "KV memory", "heads", "model"):
        assert f"\n{row} " in out
    assert "demo model" in out and "{" not in out


def test_json_in_process(clip, capsys):
    assert cli.run(["ask", str(clip), "  What\r\nhappens?\x07 ", "--json", "--quiet", *FAST]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)
    check_schema(record)
    assert record["question"] == "What\nhappens?" and err == ""


def test_defer_question_reaches_the_record_and_the_report(clip, capsys):
    assert cli.run(["ask", str(clip), "What happens?", "--json", "--quiet", "--defer-question", *FAST]) == 0
    record = json.loads(capsys.readouterr().out)
    check_schema(record)
    assert record["defer_question"] is True and record["decode"]["tokens"] >= 1
    assert cli.run(["ask", str(clip), "What happens?", "--quiet", "--defer-question", *FAST]) == 0
    assert "question read after compression" in capsys.readouterr().out


def test_out_of_memory_single_input(clip, capsys, monkeypatch):
    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    monkeypatch.setattr("hybridkv_cli.engine.jobs.prefill", oom)
    assert cli.run(["ask", str(clip), "What?", *FAST]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: {clip}: out of device memory (tried to allocate 1.00 GiB); try a lower --budget, fewer "
                   "--frames or a lower --max-pixels\n")


def test_ctrl_c_single_input(clip, capsys, monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("hybridkv_cli.engine.jobs.prefill", interrupted)
    assert cli.run(["ask", str(clip), "What?", *FAST]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_help_explains_outputs_and_exit_codes(capsys):
    assert cli.run(["ask", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("--jsonl", "--json", "--each", "--output", "--resume", "--quiet", "read from stdin",
                   "Exit status: 0", "130 interrupted",
                   "[default: 0.1; full: always 1]"):  # a default the help states itself: shown, not read as markup
        assert needle in text, needle


def test_profile_still_runs(tmp_path, capsys):
    img = make_image(tmp_path / "a.png")
    assert cli.run(["profile", str(img), "What?", "--budgets", "0.5", "--json", "-q", *FAST]) == 0
    assert "sweep" in json.loads(capsys.readouterr().out)


# --- text prompts (--context) -------------------------------------------------------------------------
TEXT_SCHEMA = {**SCHEMA, "input": {"kind": str, "label": str, "files": list, "context_tokens": int, "text_tokens": int}}


def test_media_on_a_text_model_is_a_usage_error(clip, capsys, monkeypatch):
    from hybridkv_cli.models.loaded import LoadedModel

    text_only = LoadedModel(model=None, processor=object(), name="tiny-llama", device=torch.device("cpu"),
                            dtype=torch.float32, random_weights=False)
    monkeypatch.setattr("hybridkv_cli.models.registry.load_model", lambda name, **kw: text_only)
    assert cli.run(["ask", str(clip), "What?", *FAST]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {clip}: tiny-llama is a text model: it takes a text context (--context FILE or a " \
                  "task's 'context'), not media\n"


def test_context_file_is_a_text_prompt(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("The red box is on shelf 3. The blue box is on shelf 5.\n" * 20, encoding="utf-8")
    assert cli.run(["ask", "--context", str(notes), "Where is the blue box?", "--json", "-q", *FAST]) == 0
    record = json.loads(capsys.readouterr().out)
    check_schema(record, TEXT_SCHEMA)
    assert record["input"]["kind"] == "text" and record["input"]["context_tokens"] > 200
    assert cli.run(["ask", "--context", str(notes), "Where is the blue box?", *FAST]) == 0
    assert "context + " in capsys.readouterr().out  # the human report names the roles
    out = tmp_path / "out.jsonl"  # to a file, as any input's line (and --resume skips it)
    assert cli.run(["ask", "--context", str(notes), "Where is the blue box?", "-o", str(out), "-q", *FAST]) == 0
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["answer"] == record["answer"] and line["input"]["kind"] == "text"
    assert cli.run(["ask", "--context", str(notes), "Where is the blue box?", "-o", str(out), "--resume", "-q",
                    *FAST]) == 0
    assert len(out.read_text().splitlines()) == 1


@pytest.mark.parametrize("argv,code,reason", [
    (["--context", "{clip}", "{clip}", "q"], 2, "error: arguments: with --context give only the question"),
    (["--context", "{missing}", "q"], 1, "error: {missing}: no such file"),
    (["--context", "{binary}", "q"], 1, "error: {binary}: not UTF-8 text (byte 0)"),
    (["--context", "{dir}", "q"], 1, "error: {dir}: is a directory, not a text file"),
    (["--context", "{clip}", "q", "--each"], 2, "error: --context: --context is one text input"),
])
def test_context_errors_are_one_line(argv, code, reason, clip, tmp_path, capsys):
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00 not text")
    names = dict(clip=clip, missing=tmp_path / "gone.txt", binary=tmp_path / "binary.txt", dir=tmp_path)
    assert cli.run(["ask", *[a.format(**names) for a in argv], *FAST]) == code
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(reason.format(**names)) and err.count("\n") == 1, err


def test_context_longer_than_the_model_is_one_line(demo, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo.model.config.get_text_config(), "max_position_embeddings", 64)
    notes = tmp_path / "notes.txt"
    notes.write_text("The red box is on shelf 3. " * 20, encoding="utf-8")
    assert cli.run(["ask", "--context", str(notes), "Where is the red box?", *FAST]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: --context: the prompt needs ") and "context + " in err and "shorten the context" in err
