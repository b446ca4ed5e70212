""".hkv files: every method's answer from a saved-and-reloaded cache equals the in-process one
(and at b = 1 full's deferred answer); bad files are one line, exit 1, and a batch goes on;
``compress --each`` writes one cache per input and resumes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from hybridkv_cli import cli
from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.engine import hkv
from hybridkv_cli.media import load_media
from hybridkv_cli.models.registry import max_pixels_for
from hybridkv_cli.models.prompt import QuestionTemplate, build_prompt

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import SAMPLE, cached_demo, demo, video  # noqa: E402,F401 - fixtures
from media_fixtures import make_video  # noqa: E402
from method_options import needed  # noqa: E402
from shared_prefix import TEMPLATE_QUESTION, answer, compress_prefix  # noqa: E402

QUESTIONS = ["What happens in the video?", "What colour is the square?"]
NEW = 8
FAST = ["--frames", "4", "--max-pixels", str(28 * 28 * 6), "--max-new-tokens", "3"]


def make_prefix(demo, video, method, **options):
    p = build_prompt(demo.processor, video, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(demo.processor.tokenizer, p, TEMPLATE_QUESTION)
    return compress_prefix(demo.model, p, make_policy(method, **needed(method), **options), template)


def tokens(demo, prefix, question):
    suffix = prefix.template.suffix(demo.processor.tokenizer, question)
    return answer(demo.model, prefix, suffix, max_new_tokens=NEW).tokens


@pytest.mark.parametrize("method", sorted(METHODS))
def test_saved_and_reloaded_cache_answers_the_same(demo, video, method, tmp_path):
    prefix = make_prefix(demo, video, method)
    path = tmp_path / f"{method}.hkv"
    size = hkv.save(path, prefix, demo)
    assert size == path.stat().st_size and not list(tmp_path.glob(".*.tmp"))  # renamed into place
    loaded = hkv.load(path, demo)
    assert loaded.policy == prefix.policy and loaded.seen == prefix.seen
    assert torch.equal(loaded.visual, prefix.visual)
    assert all(torch.equal(loaded.tokens[k], v) for k, v in prefix.tokens.items())
    if prefix.rope_deltas is not None:
        assert torch.equal(loaded.rope_deltas, prefix.rope_deltas)
    for q in QUESTIONS:
        assert tokens(demo, loaded, q) == tokens(demo, prefix, q), (method, q)


@pytest.mark.parametrize("landmark,kind,host_codes", [("labels", "LabelKeys", "host_codes"),
                                                     ("host-keys", "HostKeys", "codes")])
def test_host_resident_indexes_save_and_reload(demo, video, tmp_path, landmark, kind, host_codes):
    """An index with codes in host memory (the label index; the 2-bit keys on the host) round-trips
    with its codes still in host memory, and answers the same."""
    prefix = make_prefix(demo, video, "hybridkv", budget=0.05, theta=1.0, landmark=landmark)
    path = tmp_path / "index.hkv"
    hkv.save(path, prefix, demo)
    loaded = hkv.load(path, demo)
    marks = loaded.state[0][0].dynamic.landmarks
    assert type(marks).__name__ == kind and getattr(marks, host_codes).device.type == "cpu"
    assert tokens(demo, loaded, QUESTIONS[0]) == tokens(demo, prefix, QUESTIONS[0])


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"full"}))
def test_reloaded_at_budget_one_equals_full(demo, video, method, tmp_path):
    full = make_prefix(demo, video, "full")
    path = tmp_path / "b1.hkv"
    hkv.save(path, make_prefix(demo, video, method, budget=1.0), demo)
    assert tokens(demo, hkv.load(path, demo), QUESTIONS[0]) == tokens(demo, full, QUESTIONS[0])


def test_file_size_is_the_compressed_bytes(demo, tmp_path):
    """The file holds the device + host bytes the report gives, and little else: within 5 % at 64
    frames of the sample video (~1.6k tokens at the demo's frame size)."""
    media = load_media([SAMPLE], frames=64)
    for method in ("hybridkv", "full"):
        prefix = make_prefix(demo, media, method)
        size = hkv.save(tmp_path / "c.hkv", prefix, demo)
        kv = prefix.device_bytes + prefix.host_bytes
        assert kv <= size <= 1.05 * kv, (method, size, kv)


def test_small_cache_file_is_the_compressed_bytes_and_a_small_header(demo, tmp_path):
    """snapkv at 0.1 on needle.mp4 (~0.5k tokens, 110 kB of KV): the ids, mask and token types of the
    media tokens are one value each, kept once, so the file is the KV and a few kB of header."""
    media = load_media([SAMPLE.with_name("needle.mp4")], frames=64, max_pixels=max_pixels_for("demo", None))
    prefix = make_prefix(demo, media, "snapkv")
    size = hkv.save(tmp_path / "c.hkv", prefix, demo)
    kv = prefix.device_bytes + prefix.host_bytes
    assert kv <= size <= kv + 8 * 1024 and size <= 1.07 * kv, (size, kv)
    loaded = hkv.load(tmp_path / "c.hkv", demo)
    assert loaded.tokens.keys() == prefix.tokens.keys()
    assert all(torch.equal(loaded.tokens[k], v) for k, v in prefix.tokens.items())


# --- bad files -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory, demo, video):
    path = tmp_path_factory.mktemp("good") / "good.hkv"
    hkv.save(path, make_prefix(demo, video, "hybridkv"), demo)
    return path


def rewrite_header(src: Path, dst: Path, **changes) -> Path:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src), framework="pt") as f:
        header = json.loads(f.metadata()["hybridkv"])
    header.update(changes)
    tensors = load_file(str(src))
    header["sha256"] = hkv._digest(tensors, header)  # anyone can recompute a checksum
    save_file(tensors, str(dst), metadata={"hybridkv": json.dumps(header)})
    return dst


def bad_files(good: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    data = good.read_bytes()
    (tmp / "truncated.hkv").write_bytes(data[: len(data) * 2 // 3])
    (tmp / "tiny.hkv").write_bytes(data[:5])
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    (tmp / "corrupt.hkv").write_bytes(bytes(flipped))
    (tmp / "text.hkv").write_text("hello, not a cache\n")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3)}, str(tmp / "foreign.hkv"))
    return {
        "truncated": (tmp / "truncated.hkv", "not a hybridkv cache file, or truncated"),
        "tiny": (tmp / "tiny.hkv", "not a hybridkv cache file, or truncated"),
        "corrupt": (tmp / "corrupt.hkv", "corrupt cache file (checksum mismatch)"),
        "text": (tmp / "text.hkv", "not a hybridkv cache file, or truncated"),
        "foreign": (tmp / "foreign.hkv", "not a hybridkv cache file (a safetensors file without hybridkv metadata)"),
        "missing": (tmp / "missing.hkv", "no such file"),
        "version": (rewrite_header(good, tmp / "version.hkv", library_version="0.0.1"),
                    f"written by hybridkv 0.0.1, this is {hkv.library_version()}; compress the media again"),
        "format": (rewrite_header(good, tmp / "format.hkv", format_version=1),
                   f"the cache format changed: this file is format 1, this hybridkv reads format {hkv.FORMAT_VERSION}; "
                   "compress the media again"),
        "header": (header_edited(good, tmp / "header.hkv"), "corrupt cache file (checksum mismatch)"),
        "model": (rewrite_header(good, tmp / "model.hkv", model={"name": "other-model", "config_sha256": "0"}),
                  "compressed with model other-model, not demo; pass --model other-model or compress again"),
        "config": (rewrite_header(good, tmp / "config.hkv", model={"name": "demo", "config_sha256": "0"}),
                   "compressed with another configuration of demo, not demo"),
        "dtype": (rewrite_header(good, tmp / "dtype.hkv", dtype="bfloat16"),
                  "compressed in bfloat16, the model runs in float32; pass --dtype bfloat16"),
        "tree": (rewrite_header(good, tmp / "tree.hkv", tree={"O": "os:system", "id": 0, "s": {}}),
                 "corrupt cache file (unknown kind of state 'os:system')"),
    }


def header_edited(src: Path, dst: Path) -> Path:
    """``src`` with a header value changed and the checksum left as it was."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src), framework="pt") as f:
        header = json.loads(f.metadata()["hybridkv"])
    header["seen"] += 1
    save_file(load_file(str(src)), str(dst), metadata={"hybridkv": json.dumps(header)})
    return dst


@pytest.mark.parametrize("kind", ["truncated", "tiny", "corrupt", "text", "foreign", "missing", "version", "format",
                                  "header", "model", "config", "dtype", "tree"])
def test_bad_file_is_one_line_exit_1(kind, good, tmp_path, capsys):
    path, message = bad_files(good, tmp_path)[kind]
    code = cli.run(["ask", str(path), "What?", "--model", "demo", "--dtype", "float32", *FAST])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"error: {path}: {message}"), err
    assert err.count("\n") == 1 or (err.count("\n") == 3 and "done:" in err), err  # error, progress, summary


def test_other_method_or_option_is_refused(good, capsys):
    assert cli.run(["ask", str(good), "What?", "--method", "snapkv", "--model", "demo", *FAST]) == 1
    assert ("compressed with method hybridkv, not snapkv; drop --method (the file's method answers) or compress again"
            in capsys.readouterr().err)
    assert cli.run(["ask", str(good), "What?", "--budget", "0.5", "--model", "demo", *FAST]) == 1
    assert "compressed with --budget 0.1, not 0.5; drop --budget or compress again" in capsys.readouterr().err
    assert cli.run(["ask", str(good), "What?", "--method", "hybridkv", "--budget", "0.1", "--json", *FAST]) == 0


def test_batch_goes_on_past_bad_files(good, tmp_path, capsys):
    bad = bad_files(good, tmp_path)
    argv = [str(good), str(bad["truncated"][0]), str(bad["model"][0]), str(good)]
    assert cli.run(["ask", *argv, "-Q", QUESTIONS[0], "-Q", QUESTIONS[1], "--jsonl", "--quiet", *FAST]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["input"] if "error" in r else r["input"]["label"] for r in records] == [
        str(good), str(good), str(bad["truncated"][0]), str(bad["model"][0]), str(good), str(good)]
    assert [r["error"]["type"] for r in records if "error" in r] == ["CacheFileError", "CacheFileError"]
    answers = [r["answer"] for r in records if "error" not in r]
    assert answers[:2] == answers[2:]


def test_cli_compress_then_ask_equals_in_process(demo, tmp_path, capsys):
    clip = make_video(tmp_path / "clip.mp4", n=8)
    out = tmp_path / "clip.hkv"
    assert cli.run(["compress", str(clip), "-o", str(out), "--model", "demo", "--quiet", *FAST[:4]]) == 0
    assert capsys.readouterr().out == "" and out.exists()
    assert oct(out.stat().st_mode & 0o777) != "0o600"
    assert cli.run(["ask", str(out), QUESTIONS[0], "--json", "--quiet", "--max-new-tokens", "3"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert cli.run(["ask", str(clip), QUESTIONS[0], "--defer-question", "--model", "demo", "--json", "--quiet",
                    *FAST]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert from_file["answer"] == direct["answer"] and from_file["model"] == "demo"
    assert from_file["input"]["label"] == str(out) and from_file["input"]["media_label"] == str(clip)
    assert from_file["shared"]["from_cache_file"] == str(out)
    assert from_file["kv"]["device_bytes_after_prefill"] == direct["kv"]["device_bytes_after_prefill"]


def test_cli_compress_each_folder_resume_and_ask_all(tmp_path, capsys):
    media = tmp_path / "media"
    media.mkdir()
    for name in ("a", "b"):
        make_video(media / f"{name}.mp4", n=6)
    (media / "broken.mp4").write_bytes(b"not a video")
    out = tmp_path / "caches"
    argv = ["compress", str(media), "--each", "-o", str(out), "--model", "demo", *FAST[:4]]
    assert cli.run(argv) == 1  # the broken input fails, the others are written
    err = capsys.readouterr().err
    assert "broken.mp4" in err and "done: 2 compressed, 1 failed" in err
    files = sorted(p.name for p in out.iterdir())
    assert files == ["a.mp4.hkv", "b.mp4.hkv"]
    stamp = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    (media / "broken.mp4").unlink()
    assert cli.run([*argv, "--resume"]) == 0
    assert "done: 0 compressed, 0 failed, 2 skipped (already compressed)" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps({"question": q}) for q in QUESTIONS) + "\n")
    caches = sorted(str(p) for p in out.iterdir())
    assert cli.run(["ask", *caches, "--questions", str(qfile), "--jsonl", "--quiet", "--max-new-tokens", "3"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["input"]["label"], r["question"]) for r in records] == [(c, q) for c in caches for q in QUESTIONS]


def test_cli_compress_resume_redoes_a_cache_of_other_settings(tmp_path, capsys):
    (tmp_path / "media").mkdir()
    make_video(tmp_path / "media" / "a.mp4", n=6)
    out = tmp_path / "caches"
    argv = ["compress", str(tmp_path / "media"), "--each", "-o", str(out), "--model", "demo", *FAST[:4]]
    target = out / "a.mp4.hkv"
    for extra, done in [([], "done: 1 compressed, 0 failed"),
                        (["--resume", "--method", "snapkv"], "done: 1 compressed (1 replacing a cache of another "
                         "model, method, options or system prompt), 0 failed"),
                        (["--resume", "--method", "snapkv", "--budget", "0.2"], "done: 1 compressed (1 replacing"),
                        (["--resume", "--method", "snapkv", "--budget", "0.2"], "done: 0 compressed, 0 failed, "
                         "1 skipped (already compressed)"),
                        (["--resume", "--method", "snapkv", "--budget", "0.2", "--system", "Be brief."],
                         "done: 1 compressed (1 replacing"),
                        (["--resume", "--method", "snapkv", "--budget", "0.2", "--system", "Be brief."],
                         "1 skipped (already compressed)")]:
        stamp = target.stat().st_mtime_ns if target.exists() else None
        assert cli.run([*argv, *extra]) == 0
        assert done in capsys.readouterr().err, extra
        assert (target.stat().st_mtime_ns == stamp) == ("skipped" in done)
    header = hkv.read_header(target)
    assert header["method"] == "snapkv" and header["options"]["budget"] == 0.2
    assert header["input"]["system"] == "Be brief."  # rendered before the media: in the file
    assert cli.run(["ask", str(target), "-Q", "What?", "--system", "Be long."]) == 2
    assert "--system" in capsys.readouterr().err
    assert cli.run(["ask", str(target), "-Q", "What?", "--json", "--quiet", "--max-new-tokens", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["input"]["system"] == "Be brief."


def test_mixing_caches_and_media_is_a_usage_error(good, capsys):
    assert cli.run(["ask", str(good), str(SAMPLE), "What?"]) == 2
    assert "give either .hkv cache files or media, not both" in capsys.readouterr().err


def test_atomic_write_leaves_no_partial_file(demo, video, tmp_path, monkeypatch):
    prefix = make_prefix(demo, video, "snapkv")
    target = tmp_path / "x.hkv"

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", fail)
    with pytest.raises(OSError):
        hkv.save(target, prefix, demo)
    assert list(tmp_path.iterdir()) == []


def test_cli_compress_jsonl_and_folder_target(tmp_path, capsys):
    clip = make_video(tmp_path / "clip.mp4", n=6)
    folder = tmp_path / "out"
    folder.mkdir()
    assert cli.run(["compress", str(clip), "-o", str(folder), "--method", "snapkv", "--budget", "0.2", "--jsonl",
                    "--quiet", "--model", "demo", *FAST[:4]]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    target = folder / "clip.mp4.hkv"
    assert line["cache"] == str(target) and line["file_bytes"] == target.stat().st_size
    assert line["method"] == "snapkv" and line["budget"] == 0.2
    header = hkv.read_header(target)
    assert header["method"] == "snapkv" and header["options"]["budget"] == 0.2 and header["model"]["name"] == "demo"
    assert header["library_version"] == hkv.library_version() and header["format_version"] == hkv.FORMAT_VERSION
