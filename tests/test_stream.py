"""Streamed prefill: a prompt read in chunks, each layer keeping a bounded working set on the
device, then compressed; a long video decoded chunk by chunk while it is read (--max-frames).

At b = 1 with a working window that holds everything, a streamed prefill gives the one-pass
prefill's tokens (positions, visual tokens and attention carry across chunks); a small window
bounds the device KV while reading; chunks never cut an image or a video's 2-frame group; every
method compresses a streamed prompt; bad flags are one-line usage errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hybridkv_cli import cli
from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.engine import generate, prefill
from hybridkv_cli.engine.stream import Streaming, positions
from hybridkv_cli.media import load_media, load_media_stream
from hybridkv_cli.models.chunks import chunk_bounds, chunk_inputs, visual_units
from hybridkv_cli.models.prompt import build_prompt

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import cached_demo, demo  # noqa: E402,F401 - fixtures
from media_fixtures import make_video  # noqa: E402
from method_options import needed  # noqa: E402

NEEDLE = Path(__file__).resolve().parents[1] / "sample_media" / "needle.mp4"
QUESTION = "What colour is the needle?"
EVERYTHING = Streaming("on", chunk=128, window=1 << 20)  # chunks of 128 tokens, nothing evicted while reading
NEW = 8


@pytest.fixture(scope="module")
def prompt(demo):
    """The needle clip at 64 frames: 512 visual tokens in 32 temporal groups, 554 tokens in all."""
    media = load_media([NEEDLE], frames=64, max_pixels=28 * 28 * 16)
    return build_prompt(demo.processor, media, QUESTION)


CASES = (("full", 1.0), ("hybridkv", 1.0), ("hybridkv", 0.1), ("snapkv", 0.1))


@pytest.fixture(scope="module")
def one_pass(demo, prompt):
    """Tokens of a one-pass prefill, the question read with the media and after compression."""
    return {(m, b, defer): generate(demo.model, prompt, make_policy(m, budget=b, **needed(m)), NEW,
                                    defer_question=defer).tokens for m, b in CASES for defer in (False, True)}


@pytest.mark.parametrize("method, budget", CASES)
def test_streamed_with_everything_in_the_window_gives_the_one_pass_tokens(demo, prompt, one_pass, method, budget):
    """A streamed prompt's question is read after compression: at b = 1 that is the one-pass
    answer itself, below it the one-pass answer to the deferred question."""
    streamed = generate(demo.model, prompt, make_policy(method, budget=budget, **needed(method)), NEW,
                        streaming=EVERYTHING)
    assert streamed.tokens == one_pass[method, budget, True]
    if budget == 1.0:
        assert streamed.tokens == one_pass[method, budget, False]


def test_streamed_logits_and_positions_equal_one_pass(demo, prompt):
    """The mRoPE positions of every chunk are the whole prompt's, and the last logits agree."""
    policy = make_policy("full")
    once = prefill(demo.model, prompt, policy)
    streamed = prefill(demo.model, prompt, policy, streaming=EVERYTHING)
    torch.testing.assert_close(streamed.logits, once.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(streamed.rope_deltas, once.rope_deltas)
    assert {k: streamed.cache.streamed[k] for k in ("chunks", "chunk_tokens", "window")} == {
        "chunks": 5, "chunk_tokens": 128, "window": 1 << 20}
    assert once.cache.streamed is None
    pos, _ = positions(demo.model, prompt.inputs)
    video = prompt.visual.nonzero().flatten()
    assert pos.shape == (3, 1, prompt.length) and int(pos[0, 0, video[-1]]) > int(pos[0, 0, video[0]])  # time runs


def test_chunks_never_cut_a_temporal_group(demo, prompt):
    units = visual_units(demo.model.config, prompt.inputs)
    assert len(units) == 32 and all(u.end - u.start == 16 for u in units)
    for tokens in (1, 20, 128, 10_000):
        bounds = chunk_bounds(units, prompt.length, tokens)
        assert bounds[0][0] == 0 and bounds[-1][1] == prompt.length
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        for start, end in bounds:
            assert not any(u.start < start < u.end or u.start < end < u.end for u in units)
            assert end - start <= max(tokens, 16)
    rows = sum(chunk_inputs(prompt.inputs, units, s, e).get("pixel_values_videos", torch.empty(0, 1)).shape[0]
               for s, e in chunk_bounds(units, prompt.length, 100))
    assert rows == prompt.inputs["pixel_values_videos"].shape[0]  # every pixel row read exactly once


def test_a_small_window_bounds_the_device_kv_while_reading(demo, prompt):
    """Device KV while reading stays near layers x (window + chunk) tokens, not the prompt's."""
    config = demo.model.config.text_config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size //
                                                                              config.num_attention_heads) * 4
    once = prefill(demo.model, prompt, make_policy("hybridkv", budget=0.1))
    streamed = prefill(demo.model, prompt, make_policy("hybridkv", budget=0.1), streaming=Streaming("on", 64, 96))
    assert once.prefill_peak_bytes >= prompt.length * per_token // config.num_hidden_layers
    assert streamed.cache.streamed["read_peak_bytes"] <= (96 + 64 + 64) * per_token  # window + chunk (+ text kept)
    assert streamed.cache.streamed["read_peak_bytes"] < prompt.length * per_token / 2


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_compresses_a_streamed_prompt(demo, prompt, method):
    policy = make_policy(method, budget=0.1, **needed(method)) if method != "full" else make_policy("full")
    prefix = prefill(demo.model, prompt, policy, streaming=Streaming("on", 128, 256))
    assert prefix.seen == prompt.length and prefix.cache.streamed["chunks"] == 5
    assert all(layer.seen == prompt.length for layer in prefix.cache.layers)
    generation = generate(demo.model, prompt, policy, 4, streaming=Streaming("on", 128, 256))
    assert len(generation.tokens) == 4


def test_auto_streams_only_long_media():
    assert not Streaming().applies(65536) and Streaming().applies(65537)
    assert Streaming("on").applies(10) and not Streaming("off").applies(10 ** 6)


@pytest.mark.parametrize("flags, named", [(["--stream", "sometimes"], "--stream"),
                                          (["--stream-chunk", "0"], "--stream-chunk"),
                                          (["--stream-window", "-5"], "--stream-window")])
def test_bad_stream_flags_are_one_line_usage_errors(capsys, flags, named):
    code = cli.run(["ask", str(NEEDLE), QUESTION, "--model", "demo", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and named in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_the_cli_streams_and_says_so(capsys):
    code = cli.run(["ask", str(NEEDLE), QUESTION, "--model", "demo", "--max-pixels", str(28 * 28 * 16),
                    "--stream", "on", "--stream-chunk", "128", "--max-new-tokens", "2", "--json"])
    import json

    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["streamed"]["chunks"] == 5 and record["streamed"]["window"] == 16384
    assert record["defer_question"]  # a streamed prompt's question is read after compression
    assert 0 < record["streamed"]["read_peak_bytes"] <= record["kv"]["prefill_peak_bytes"]
    cli.run(["ask", str(NEEDLE), QUESTION, "--model", "demo", "--max-pixels", str(28 * 28 * 16), "--stream", "on",
             "--stream-chunk", "128", "--stream-kv-tokens", "32", "--max-new-tokens", "2"])
    report = capsys.readouterr().out
    assert "5 chunks of ~128 tokens" in report and "capped at 32 tokens a head" in report


def test_a_video_read_while_prefilling_gives_the_eager_prompt_and_tokens(demo, prompt):
    """Decoded chunk by chunk, the needle clip is token for token, row for row the eager prompt,
    and answers the same."""
    media = load_media_stream([NEEDLE], frames=64, max_pixels=28 * 28 * 16)
    lazy = build_prompt(demo.processor, media, QUESTION)
    assert lazy.read_while_prefilling and not prompt.read_while_prefilling and media.video is None
    for key, value in prompt.inputs.items():
        if key != "pixel_values_videos":
            assert torch.equal(lazy.inputs[key], value), key
    units = visual_units(demo.model.config, lazy.inputs)
    rows = [chunk_inputs(lazy.inputs, units, s, e).get("pixel_values_videos") for s, e in
            chunk_bounds(units, lazy.length, 100)]
    assert torch.equal(torch.cat([r for r in rows if r is not None]), prompt.inputs["pixel_values_videos"])
    policy = make_policy("hybridkv", budget=0.1)
    assert generate(demo.model, lazy, policy, NEW).tokens == generate(demo.model, prompt, policy, NEW,
                                                                       streaming=Streaming("on")).tokens


@pytest.fixture(scope="module")
def long_video(tmp_path_factory):
    return make_video(tmp_path_factory.mktemp("long") / "long.mp4", n=600, fps=10)


def test_max_frames_reads_a_long_video_in_chunks(capsys, long_video):
    code = cli.run(["ask", str(long_video), "What happens?", "--model", "demo", "--max-frames", "400",
                    "--stream-chunk", "512", "--stream-window", "256", "--max-new-tokens", "2", "--json"])
    import json

    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["input"]["frames_used"] == 400 and record["input"]["frames_total"] == 600
    assert record["streamed"]["chunks"] >= 4 and record["input"]["visual_tokens"] % 200 == 0
    frame_kv = record["kv"]["full_bytes"] // record["input"]["visual_tokens"]
    assert record["streamed"]["read_peak_bytes"] <= (256 + 512 + 64) * frame_kv  # window + chunk + text, not all 3000


@pytest.mark.parametrize("flags, named", [(["--max-frames", "-1"], "--max-frames"),
                                          (["--max-frames", "1"], "--max-frames"),
                                          (["--max-frames", "all", "--fps", "0"], "--fps"),
                                          (["--max-frames", "100", "--stream", "off"], "--max-frames")])
def test_bad_long_video_flags_are_refused_before_the_model_loads(capsys, long_video, monkeypatch, flags, named):
    monkeypatch.setattr("hybridkv_cli.models.registry.load_model", lambda *a, **k: pytest.fail("model loaded"))
    code = cli.run(["ask", str(long_video), "What happens?", "--model", "demo", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and named in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_video_the_host_cannot_hold_is_refused_before_decoding(capsys, long_video, monkeypatch):
    monkeypatch.setattr("hybridkv_cli.runs.guards.host_memory_available", lambda: 1 << 20)
    monkeypatch.setattr("hybridkv_cli.models.streamed_video.FramePixels.__getitem__",
                        lambda *a: pytest.fail("a frame was decoded"))
    code = cli.run(["ask", str(long_video), "What happens?", "--model", "demo", "--max-frames", "all"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and str(long_video) in err and "600 frames need" in err and "--max-frames" in err


def test_a_streamed_video_compressed_once_answers_as_a_deferred_streamed_run(capsys, long_video, tmp_path):
    import json

    flags = ["--model", "demo", "--max-frames", "300", "--stream-chunk", "512", "--stream-window", "256"]
    hkv = tmp_path / "long.hkv"
    assert cli.run(["compress", str(long_video), "-o", str(hkv), *flags, "--quiet"]) == 0
    capsys.readouterr()
    assert cli.run(["ask", str(hkv), "What happens?", "--max-new-tokens", "4", "--json"]) == 0
    cached = json.loads(capsys.readouterr().out)
    assert cli.run(["ask", str(long_video), "What happens?", *flags, "--defer-question", "--max-new-tokens", "4",
                    "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert cached["answer"] == direct["answer"] and cached["input"]["frames_used"] == 300
    assert direct["streamed"]["chunks"] >= 3


def test_a_token_cap_keeps_device_kv_flat_as_the_video_grows(demo):
    """--stream-kv-tokens: the same device KV after compression at 32 and 64 frames (b = 0.5 would
    keep twice as much at 64), and the record says which budget the cap left."""
    kept = {}
    for frames in (32, 64):
        media = load_media([NEEDLE], frames=frames, max_pixels=28 * 28 * 16)
        p = build_prompt(demo.processor, media, QUESTION)
        prefix = prefill(demo.model, p, make_policy("snapkv", budget=0.5), p.question_start,
                         streaming=Streaming("on", 128, 64, kv_tokens=64))
        kept[frames] = prefix.device_bytes
        assert prefix.cache.streamed["budget"] == pytest.approx(64 / p.question_start)
    assert kept[32] == pytest.approx(kept[64], rel=0.05)
    uncapped = prefill(demo.model, p, make_policy("snapkv", budget=0.5), p.question_start, streaming=Streaming("on"))
    assert uncapped.device_bytes > 3 * kept[64]


def test_full_refuses_a_token_cap(capsys):
    code = cli.run(["ask", str(NEEDLE), QUESTION, "--model", "demo", "--method", "full", "--stream-kv-tokens", "64"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--stream-kv-tokens" in err and len(err.splitlines()) == 1


def test_an_image_set_streams_one_image_a_unit(demo):
    """Images are units too: a chunk holds whole images, and at b = 1 the streamed set answers as
    one pass does (with the question read after compression)."""
    media = load_media([NEEDLE.parent / "images"])
    prompt = build_prompt(demo.processor, media, "Which picture shows a circle?")
    units = visual_units(demo.model.config, prompt.inputs)
    assert [u.kind for u in units] == ["image"] * 3
    policy = make_policy("hybridkv", budget=1.0)
    streamed = generate(demo.model, prompt, policy, NEW, streaming=Streaming("on", 64, 1 << 20))
    assert streamed.cache.streamed["chunks"] >= 3
    assert streamed.tokens == generate(demo.model, prompt, policy, NEW, defer_question=True).tokens
