"""Video read chunk by chunk (media.frame_stream): counts known up front, bounded memory, lying
containers, argument checks, and the eager loader unchanged. CPU only, small synthetic clips."""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch

from hybridkv_cli import media
from hybridkv_cli.io.errors import MediaError, MediaWarning, UsageError
from hybridkv_cli.media import decoders, frame_stream, load_media, pixel_bounds, target_size
from hybridkv_cli.media.frame_stream import (STREAM_REFERENCE_FRAMES, FrameMemory, check_chunk_frames, check_fps,
                                             check_frames, check_max_frames, check_stream_args, frame_memory,
                                             open_video_stream)

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import frame_value, make_noise_video, make_video, set_mkv_duration  # noqa: E402

SMALL = 28 * 28 * 6
REPO = Path(__file__).resolve().parent.parent
NEEDLE = REPO / "sample_media" / "needle.mp4"


@pytest.fixture(scope="module")
def vids(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    return {
        "v100": make_video(d / "v100.mp4", n=100),  # 10 s at 10 fps
        "v31": make_video(d / "v31.mp4", n=31),
        "v1": make_video(d / "v1.mp4", n=1),
        "mkv": make_video(d / "v100.mkv", n=100),
        "r90": make_video(d / "r90.mp4", n=10, rotation=90, marker=True),
        "dir": d,
    }


def only(monkeypatch, name: str):
    """Read with one decoder only (both the stream's and the eager loader's list)."""
    chosen = tuple(d for d in decoders.DECODERS if d[0] == name)
    monkeypatch.setattr(decoders, "DECODERS", chosen)
    monkeypatch.setattr(media.video, "DECODERS", chosen)


def levels(video: torch.Tensor) -> list[float]:
    return video.float().mean(dim=(1, 2, 3)).tolist()


def assert_one_line(e, shown: str):
    s = str(e.value)
    assert "\n" not in s and s.startswith(shown + ": ") and e.value.source == shown, s
    return s


# --- what a stream knows up front ---------------------------------------------------------------------
@pytest.fixture
def no_decoding(monkeypatch):
    """Any frame read fails the test: what the stream reports must come before decoding."""

    def refuse(self, indices):
        raise AssertionError("a frame was decoded")

    monkeypatch.setattr(decoders.DecordSource, "read", refuse)
    monkeypatch.setattr(decoders.PyAVSource, "read", refuse)


@pytest.mark.parametrize("kw,count", [({"frames": 8}, 8), ({"frames": 7}, 6), ({"frames": 64}, 64),
                                      ({"frames": 1}, 2), ({"fps": 2.0}, 20), ({"fps": 0.35}, 4),
                                      ({"fps": 100.0}, 100), ({"fps": 10.0, "max_frames": 6}, 6),
                                      ({"fps": 10.0, "max_frames": 7}, 6), ({"frames": 50, "max_frames": 10}, 10),
                                      ({"fps": 3.0, "max_frames": "all"}, 30)])
def test_count_indices_and_timestamps_before_decoding(vids, no_decoding, kw, count):
    s = open_video_stream(vids["v100"], max_pixels=SMALL, **kw)
    assert s.count == count and s.count % 2 == 0
    assert list(s.indices) == torch.linspace(0, 99, count).round().long().tolist()  # spread over the whole video
    assert s.timestamps == pytest.approx([i / 10.0 for i in s.indices])
    assert (s.frames_total, s.duration, s.source_fps, s.rotation, s.decoder) == (100, pytest.approx(10.0), 10.0, 0,
                                                                                 "decord")
    h, w = s.size
    assert h % 28 == 0 and w % 28 == 0 and h * w <= SMALL


def test_short_and_one_frame_videos(vids, no_decoding):
    assert open_video_stream(vids["v31"], frames=64).count == 30
    s = open_video_stream(vids["v1"], fps=1.0)
    assert (s.count, s.indices, s.frames_total) == (2, (0, 0), 1)


def test_fps_is_not_capped_at_qwen_max_frames(vids, monkeypatch, no_decoding):
    monkeypatch.setattr(media.video, "FPS_MAX_FRAMES", 10)  # the eager loader's cap
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert open_video_stream(vids["v100"], fps=5.0).count == 50


def test_long_stream_keeps_a_64_frame_clips_resolution(vids, monkeypatch, no_decoding):
    # a total-pixel budget that Qwen would spread thin over 100 frames (bound shrinks above 16 frames)
    monkeypatch.setattr(media.geometry, "VIDEO_TOTAL_PIXELS", media.geometry.VIDEO_MAX_PIXELS * 8)
    s = open_video_stream(vids["v100"], fps=10.0)
    assert s.count == 100
    reference = target_size(48, 64, *pixel_bounds("video", STREAM_REFERENCE_FRAMES))
    shrunk = target_size(48, 64, *pixel_bounds("video", 100))
    assert s.size == reference and shrunk[0] * shrunk[1] < reference[0] * reference[1]
    assert open_video_stream(vids["v100"], frames=8).size == target_size(48, 64, *pixel_bounds("video", 8))


# --- chunks -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("decoder", ["decord", "pyav"])
@pytest.mark.parametrize("key,kw,k", [("v100", {"frames": 64}, 6), ("v100", {"fps": 10.0}, 16), ("v31", {"frames": 64}, 4),
                                      ("v1", {"frames": 64}, 2), ("r90", {"frames": 64}, 4), ("needle", {"frames": 64}, 10)])
def test_chunks_concatenated_equal_the_eager_frames(vids, monkeypatch, decoder, key, kw, k):
    only(monkeypatch, decoder)
    path = NEEDLE if key == "needle" else vids[key]
    frames = kw.get("frames", 64 if "fps" not in kw else None)
    s = open_video_stream(path, max_pixels=SMALL, **kw)
    chunks = list(s.chunks(k))
    assert all(c.shape[0] == k for c in chunks[:-1]) and 0 < chunks[-1].shape[0] <= k and chunks[-1].shape[0] % 2 == 0
    assert all(c.dtype == torch.uint8 and tuple(c.shape[1:]) == (3, *s.size) for c in chunks)
    video = torch.cat(chunks)
    assert video.shape[0] == s.count and s.decoder == decoder
    m = load_media([path], frames=frames or 64, fps=kw.get("fps"), max_pixels=SMALL)
    assert torch.equal(video, m.video)
    assert (m.frame_indices, m.frames_total, m.decoder, m.rotation) == (s.indices, s.frames_total, decoder, s.rotation)
    assert torch.equal(torch.cat(list(s.chunks(k))), video)  # a stream reads again from the start
    if key in ("v100", "v31"):
        for level, i in zip(levels(video), s.indices):
            assert abs(level - frame_value(i)) < 8


def test_chunks_read_only_the_current_chunk(vids, monkeypatch):
    reads: list[list[int]] = []
    real = decoders.DecordSource.read

    def spy(self, indices):
        reads.append(list(indices))
        return real(self, indices)

    monkeypatch.setattr(decoders.DecordSource, "read", spy)
    s = open_video_stream(vids["v100"], fps=10.0, max_pixels=SMALL)
    assert reads == []
    k, alive = 6, []
    for n, chunk in enumerate(s.chunks(k)):
        got = [i for r in reads for i in r]
        assert got == list(s.indices[:n * k + chunk.shape[0]])  # decoded exactly this chunk, nothing ahead
        assert max(len(r) for r in reads) <= decoders.DECODE_CHUNK
        alive.append(weakref.ref(chunk))
        del chunk
        assert sum(r() is not None for r in alive[:-1]) == 0  # nor does it keep the chunks it gave out
    assert len(alive) == math.ceil(100 / k)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_peak_memory_is_one_chunk_not_the_video(tmp_path, monkeypatch):
    only(monkeypatch, "pyav")  # decord buffers decoded frames of its own (bounded, but noisy)
    path = make_video(tmp_path / "long.mp4", n=600, w=640, h=360, fps=30)

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc: freed memory back to the system

    def rss() -> int:  # what is alive, not what the allocator keeps of freed decoder buffers
        if trim is not None:
            trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    s = open_video_stream(path, fps=30.0)
    est = s.memory(8)
    assert s.count == 600 and est.video == 600 * est.frame and est.video > 350 * 2**20
    start = peak = 0
    for n, chunk in enumerate(s.chunks(8)):  # the allocator settles in the first chunks; the video would add 2/3
        assert chunk.shape[0] <= 8
        if n == 25:
            start = peak = rss()
        peak = max(peak, rss())
    assert peak - start < est.video / 4, (peak - start, est)


# --- lying containers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("claimed", [3600.0, 1.0])
def test_container_lying_about_its_duration(vids, claimed):
    liar = set_mkv_duration(vids["mkv"], claimed, vids["dir"] / f"liar{claimed:g}.mkv")
    with pytest.warns(MediaWarning, match=r"container says .* 100 frames over 10\.0 s"):
        s = open_video_stream(liar, fps=2.0, max_pixels=SMALL)
    assert (s.frames_total, s.count, s.duration) == (100, 20, pytest.approx(10.0))
    assert s.timestamps[-1] == pytest.approx(9.9)
    video = torch.cat(list(s.chunks(8)))
    for level, i in zip(levels(video), s.indices):
        assert abs(level - frame_value(i)) < 8


def test_truncated_file_refused_before_decoding(tmp_path, no_decoding):
    data = make_noise_video(tmp_path / "full.mp4").read_bytes()  # header first: it promises 40 frames
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaError) as e:
        open_video_stream(cut, frames=8)
    assert "truncated or corrupt video: only" in assert_one_line(e, str(cut)) and "of 40 frames" in str(e.value)


@pytest.mark.parametrize("decoder", ["decord", "pyav"])
def test_stream_ending_early_while_chunking_is_a_media_error(vids, monkeypatch, decoder):
    only(monkeypatch, decoder)
    real = frame_stream.frame_table
    monkeypatch.setattr(frame_stream, "frame_table",  # a count that escaped every check: 60 of 31
                        lambda path, probe, shown: real(path, probe, shown)._replace(count=60, times=None))
    shown = str(vids["v31"])
    if decoder == "decord":  # decord sees too few frames: no decoder is left
        with pytest.raises(MediaError, match="no decoder can read the video .decord sees 31 frames of 60") as e:
            open_video_stream(vids["v31"], fps=10.0, max_pixels=SMALL)
        assert_one_line(e, shown)
        return
    s = open_video_stream(vids["v31"], frames=60, max_pixels=SMALL)
    assert s.count == 60
    got = []
    with pytest.raises(MediaError, match=r"truncated or corrupt video: only 31 of 60 frames could be decoded") as e:
        for chunk in s.chunks(8):
            got.append(chunk.shape[0])
    assert_one_line(e, shown)
    assert got and all(n == 8 for n in got)  # full chunks, then the error: no short chunk


def test_last_frame_or_two_missing_repeats_the_last_with_a_warning(vids, monkeypatch):
    only(monkeypatch, "pyav")
    real = frame_stream.frame_table
    monkeypatch.setattr(frame_stream, "frame_table",
                        lambda path, probe, shown: real(path, probe, shown)._replace(count=32, times=None))
    s = open_video_stream(vids["v31"], frames=32, max_pixels=SMALL)
    with pytest.warns(MediaWarning, match="ends after 31 of 32 frames; frame 31 repeats frame 30"):
        video = torch.cat(list(s.chunks(8)))
    assert video.shape[0] == 32 and torch.equal(video[-1], video[-2])


def test_decord_failing_midway_hands_the_rest_to_pyav(vids, monkeypatch):
    ref = open_video_stream(vids["v100"], frames=64, max_pixels=SMALL).read_all()
    real, calls = decoders.DecordSource.read, []

    def flaky(self, indices):
        calls.append(1)
        if len(calls) > 2:
            raise decoders.DecodeFailed("simulated decord failure")
        return real(self, indices)

    monkeypatch.setattr(decoders.DecordSource, "read", flaky)
    s = open_video_stream(vids["v100"], frames=64, max_pixels=SMALL)
    names, chunks = [], []
    for chunk in s.chunks(8):
        names.append(s.decoder)
        chunks.append(chunk)
    assert names[0] == "decord" and names[-1] == "pyav"
    assert (torch.cat(chunks).float() - ref.float()).abs().max() <= 2


# --- argument checks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,flag,match", [
    ({"fps": 0}, "--fps", "positive"), ({"fps": -1.0}, "--fps", "positive"), ({"fps": float("nan")}, "--fps", "positive"),
    ({"fps": float("inf")}, "--fps", "positive"), ({"fps": "fast"}, "--fps", "must be a number"),
    ({"frames": 8, "max_frames": -1}, "--max-frames", "at least 2"), ({"frames": 8, "max_frames": 0}, "--max-frames", "at least 2"),
    ({"frames": 8, "max_frames": 1}, "--max-frames", "at least 2"), ({"frames": 8, "max_frames": 2.5}, "--max-frames", "whole"),
    ({"frames": 8, "max_frames": "many"}, "--max-frames", "whole"),
    ({"frames": 0}, "--frames", "positive"), ({"frames": -3}, "--frames", "positive"), ({"frames": 2.5}, "--frames", "whole"),
    ({}, "--frames/--fps", "give --frames N"),
    ({"frames": 8, "max_pixels": 100}, "--max-pixels", "at least 784"),
    ({"frames": 8, "max_pixels": 1000, "min_pixels": 5000}, "--min-pixels", "must not exceed"),
    ({"frames": 8, "min_pixels": -1}, "--min-pixels", "positive"),
])
def test_bad_arguments_are_usage_errors_naming_the_flag(vids, kw, flag, match):
    for call in (lambda: check_stream_args(**kw), lambda: open_video_stream(vids["v31"], **kw)):
        with pytest.raises(UsageError, match=match) as e:
            call()
        assert e.value.exit_code == 2 and e.value.source == flag and "\n" not in str(e.value)


def test_checks_normalise_good_values(vids):
    assert check_max_frames(None) is None and check_max_frames("all") is None and check_max_frames("16") == 16
    assert check_max_frames(8.0) == 8 and check_fps(2) == 2.0 and check_frames(5.0) == 5
    assert check_chunk_frames(16) == 16
    assert check_stream_args(frames=64, fps=1.0) == (None, 1.0, None, None, None)  # fps wins, as for the eager loader
    for bad in (0, 3, -2, 2.5, True):
        with pytest.raises(UsageError) as e:
            check_chunk_frames(bad)
        assert e.value.source == "--chunk-frames"
    s = open_video_stream(vids["v31"], frames=8)
    with pytest.raises(UsageError, match="multiple of 2"):
        s.chunks(3)


def test_frame_memory():
    m = frame_memory((56, 84), 100, 8)
    assert m == FrameMemory(3 * 56 * 84, 8 * 3 * 56 * 84, 100 * 3 * 56 * 84)
    assert frame_memory((56, 84), 4, 8).chunk == 4 * 3 * 56 * 84  # a chunk never holds more than the video
    with_source = frame_memory((56, 84), 100, 32, source_size=(360, 640))
    assert with_source.chunk == 32 * 3 * 56 * 84 + 2 * decoders.DECODE_CHUNK * 3 * 360 * 640
    one_hour = frame_memory((364, 644), 3600, 64)  # 1 fps for an hour at a 64-frame clip's size
    assert one_hour.video == 3600 * 3 * 364 * 644 and one_hour.chunk < one_hour.video / 50


def test_resize_a_few_frames_at_a_time_is_the_whole_chunks_resize(monkeypatch):
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    frames = torch.randint(0, 256, (7, 3, 90, 120), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    whole = TF.resize(frames, [56, 84], interpolation=InterpolationMode.BICUBIC, antialias=True)
    monkeypatch.setattr(decoders, "RESIZE_BYTES", 2 * 4 * 3 * 90 * 120)  # two frames' float pixels a call
    calls = []
    real = TF.resize
    monkeypatch.setattr(TF, "resize", lambda x, *a, **k: calls.append(len(x)) or real(x, *a, **k))
    out = decoders.resize_chunk(frames, (56, 84))
    assert calls == [2, 2, 2, 1]
    assert out.dtype == torch.uint8 and torch.equal(out, whole)  # each frame's pixels as in one call
    assert decoders.resize_chunk(frames, (90, 120)).data_ptr() == frames.data_ptr()  # its size already: as it is


# --- the eager loader: the same frames as before the stream ----------------------------------------------
#: sha256 (first 16 hex) of ``load_media(...).video`` from the loader before the stream refactor (commit
#: a4a27f5), with PyAV 18.1.0, decord 0.6.0 and torch 2.14: identical frames, indices and counts since.
BEFORE = {
    ("needle", "decord", ()): ("c5adee9a46d6e235", (64, 3, 336, 336), 64, 4.0),
    ("needle", "pyav", ()): ("c5adee9a46d6e235", (64, 3, 336, 336), 64, 4.0),
    ("needle", "decord", (("fps", 2.0),)): ("f34765b061633ea1", (32, 3, 336, 336), 64, 2.0),
    ("v100", "decord", (("frames", 8),)): ("75b928618e126c52", (8, 3, 280, 392), 100, 0.8),
    ("v100", "pyav", (("frames", 8),)): ("75b928618e126c52", (8, 3, 280, 392), 100, 0.8),
    ("r90", "decord", ()): ("b6591e51e6066b88", (10, 3, 392, 280), 10, 10.0),
    ("r90", "pyav", ()): ("610e43974d266257", (10, 3, 392, 280), 10, 10.0),
}


@pytest.mark.parametrize("key", list(BEFORE))
def test_eager_frames_unchanged_by_the_stream(tmp_path, monkeypatch, key):
    import av
    import decord

    if (av.__version__, decord.__version__, torch.__version__[:4]) != ("18.1.0", "0.6.0", "2.14"):
        pytest.skip("digests recorded with PyAV 18.1.0, decord 0.6.0, torch 2.14")
    name, decoder, kw = key
    digest, shape, total, sample_fps = BEFORE[key]
    if name == "needle":
        path = NEEDLE
    elif name == "v100":
        path = make_video(tmp_path / "v100.mp4", n=100)
    else:
        path = make_video(tmp_path / "r90.mp4", n=10, rotation=90, marker=True)
    only(monkeypatch, decoder)
    m = load_media([path], **dict(kw))
    assert hashlib.sha256(m.video.numpy().tobytes()).hexdigest()[:16] == digest
    assert (tuple(m.video.shape), m.frames_total, m.decoder) == (shape, total, decoder)
    assert list(m.frame_indices) == torch.linspace(0, total - 1, shape[0]).round().long().tolist()
    assert m.sample_fps == pytest.approx(sample_fps, rel=1e-6)
