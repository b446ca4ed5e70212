"""Media layer: sampling, sizing, image modes, directories, errors. CPU only, small fixtures."""

from __future__ import annotations

import io
import os
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hybridkv_cli import media
from hybridkv_cli.io.errors import MediaError, UsageError
from hybridkv_cli.media import MediaInput, MediaWarning, load_media, pixel_bounds, target_size

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import frame_value, make_audio_only, make_image, make_noise_video, make_video  # noqa: E402

SMALL = 28 * 28 * 6  # max_pixels that keeps test frames tiny (e.g. 56x84)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vids(tmp_path_factory):
    d = tmp_path_factory.mktemp("vids")
    return {
        "v100": make_video(d / "v100.mp4", n=100),
        "v30": make_video(d / "v30.mp4", n=30),
        "v31": make_video(d / "v31.mp4", n=31),
        "v1": make_video(d / "v1.mp4", n=1),
        "dir": d,
    }


def assert_video_ok(m: MediaInput, max_pixels: int | None = None):
    assert m.kind == "video" and m.images == () and m.video is not None
    t, c, h, w = m.video.shape
    assert m.video.dtype == torch.uint8 and c == 3
    assert t == m.frames_used and t >= 2 and t % 2 == 0
    assert h % 28 == 0 and w % 28 == 0 and h >= 28 and w >= 28
    if max_pixels is not None:
        assert h * w <= max_pixels


def assert_images_ok(m: MediaInput, max_pixels: int | None = None):
    assert m.kind == "images" and m.video is None and m.frames_total is None and m.sample_fps is None
    assert m.frames_used == len(m.images) == len(m.sources)
    for im in m.images:
        assert im.mode == "RGB"
        w, h = im.size
        assert h % 28 == 0 and w % 28 == 0
        if max_pixels is not None:
            assert h * w <= max_pixels


def frame_levels(m: MediaInput) -> list[float]:
    return m.video.float().mean(dim=(1, 2, 3)).tolist()


# --- video sampling -----------------------------------------------------------------------------
def test_default_samples_64_uniform_frames_from_longer_video(vids):
    m = load_media([vids["v100"]], max_pixels=SMALL)
    assert_video_ok(m, SMALL)
    assert (m.frames_used, m.frames_total) == (64, 100)
    expected = torch.linspace(0, 99, 64).round().long().tolist()
    assert list(m.frame_indices) == expected
    # the decoded frames are the ones asked for (each frame is a distinct flat grey)
    got = frame_levels(m)
    for level, idx in zip(got, expected):
        assert abs(level - frame_value(idx)) < 8, (idx, level)
    assert m.sample_fps == pytest.approx(64 / 10.0, rel=0.02)
    assert m.decoder == "decord"
    assert m.label == str(vids["v100"]) and m.sources == (Path(vids["v100"]),)


def test_all_frames_of_a_shorter_video(vids):
    m = load_media([vids["v30"]], frames=64, max_pixels=SMALL)
    assert (m.frames_used, m.frames_total) == (30, 30)
    assert list(m.frame_indices) == list(range(30))
    assert m.sample_fps == pytest.approx(10.0, rel=0.02)


@pytest.mark.parametrize("key,frames,expected", [("v31", 64, 30), ("v100", 7, 6), ("v100", 3, 2),
                                                  ("v100", 1, 2), ("v100", 2, 2)])
def test_frame_count_rounded_down_to_even(vids, key, frames, expected):
    m = load_media([vids[key]], frames=frames, max_pixels=SMALL)
    assert_video_ok(m)
    assert m.frames_used == expected
    assert m.frame_indices[0] == 0 and m.frame_indices[-1] == m.frames_total - 1  # spans the whole video


def test_one_frame_video_is_duplicated(vids):
    m = load_media([vids["v1"]], max_pixels=SMALL)
    assert_video_ok(m)
    assert (m.frames_total, m.frames_used) == (1, 2)
    assert torch.equal(m.video[0], m.video[1])


@pytest.mark.parametrize("fps,expected", [(2.0, 20), (1.0, 10), (0.1, 2), (0.35, 4), (100.0, 100), (3.3, 32)])
def test_fps_mode(vids, fps, expected):
    m = load_media([vids["v100"]], fps=fps, max_pixels=SMALL)  # 100 frames at 10 fps = 10 s
    assert_video_ok(m)
    assert m.frames_used == expected
    assert m.sample_fps == pytest.approx(expected / 10.0, rel=0.02)


def test_fps_mode_caps_at_qwen_max_frames(vids, monkeypatch):
    monkeypatch.setattr(media.video, "FPS_MAX_FRAMES", 10)
    with pytest.warns(MediaWarning, match="capped at 10"):
        m = load_media([vids["v100"]], fps=5.0, max_pixels=SMALL)
    assert m.frames_used == 10


def test_video_default_size_follows_qwen_and_max_pixels_overrides(vids):
    m = load_media([vids["v30"]], frames=4)
    assert_video_ok(m)
    lo, hi = pixel_bounds("video", 4)
    assert (lo, hi) == (media.geometry.VIDEO_MIN_PIXELS, media.geometry.VIDEO_MAX_PIXELS)
    h, w = m.video.shape[-2:]
    assert (h, w) == target_size(48, 64, lo, hi) and h * w >= lo  # 64x48 is upscaled to Qwen's minimum
    for mp in (784, 5000, 20000):
        m = load_media([vids["v30"]], frames=4, max_pixels=mp)
        assert_video_ok(m, mp)
    m = load_media([vids["v30"]], frames=4, max_pixels=200_000, min_pixels=150_000)
    h, w = m.video.shape[-2:]
    assert 150_000 <= h * w <= 200_000
    m = load_media([vids["v30"]], frames=2, min_pixels=700_000)  # above the default max: max follows
    h, w = m.video.shape[-2:]
    assert media.geometry.VIDEO_MAX_PIXELS < h * w <= 700_000


def test_video_per_frame_budget_shrinks_with_frame_count():
    few = pixel_bounds("video", 64)[1]
    many = pixel_bounds("video", 2000)[1]
    assert few == media.geometry.VIDEO_MAX_PIXELS and many < few
    assert many >= int(media.geometry.VIDEO_MIN_PIXELS * 1.05)
    assert pixel_bounds("images") == (media.geometry.IMAGE_MIN_PIXELS, media.geometry.IMAGE_MAX_PIXELS)
    assert pixel_bounds("images", max_pixels=1000) == (1000, 1000)  # min follows a small max


def test_pyav_fallback_when_decord_fails(vids, monkeypatch):
    ref = load_media([vids["v100"]], frames=8, max_pixels=SMALL)
    import decord

    def broken(*a, **k):
        raise RuntimeError("simulated decord failure")

    monkeypatch.setattr(decord, "VideoReader", broken)
    m = load_media([vids["v100"]], frames=8, max_pixels=SMALL)
    assert m.decoder == "pyav"
    assert_video_ok(m, SMALL)
    assert (m.frames_used, m.frames_total, m.frame_indices) == (8, 100, ref.frame_indices)
    assert m.video.shape == ref.video.shape
    assert (m.video.float() - ref.video.float()).abs().max() <= 2
    assert m.sample_fps == pytest.approx(ref.sample_fps, rel=0.02)


def test_pyav_fallback_when_decord_missing(vids, monkeypatch):
    monkeypatch.setitem(sys.modules, "decord", None)  # import decord -> ImportError
    m = load_media([vids["v1"]], max_pixels=SMALL)
    assert m.decoder == "pyav" and (m.frames_total, m.frames_used) == (1, 2)


@pytest.mark.parametrize("name,codec", [("clip.avi", "mpeg4"), ("clip.mkv", "libx264"), ("clip.mov", "libx264"),
                                        ("clip.webm", "libvpx-vp9")])
def test_video_containers(tmp_path, name, codec):
    import av

    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not in this ffmpeg")
    p = make_video(tmp_path / name, n=12, codec=codec)
    m = load_media([p], frames=4, max_pixels=SMALL)
    assert_video_ok(m, SMALL)
    assert (m.frames_total, m.frames_used) == (12, 4)


def test_unicode_and_spaces_in_paths(tmp_path):
    d = tmp_path / "dossier à espaces ü"
    d.mkdir()
    v = make_video(d / "vidéo clip ö.mp4", n=6)
    m = load_media([str(v)], max_pixels=SMALL)
    assert m.frames_used == 6 and m.decoder == "decord"
    make_image(d / "ìmage 1.png")
    make_image(d / "ìmage 2.jpg")
    with pytest.warns(MediaWarning, match="vidéo clip ö.mp4"):
        m = load_media([str(d)])
    assert [p.name for p in m.sources] == ["ìmage 1.png", "ìmage 2.jpg"]


# --- images -------------------------------------------------------------------------------------
def test_image_set_keeps_given_order(tmp_path):
    colors = {"c.png": (255, 0, 0), "a.jpg": (0, 255, 0), "b.webp": (0, 0, 255)}
    paths = [make_image(tmp_path / n, color=c, quality=95) if n.endswith(".jpg") else make_image(tmp_path / n, color=c)
             for n, c in colors.items()]
    m = load_media([str(p) for p in paths])
    assert_images_ok(m)
    assert [p.name for p in m.sources] == ["c.png", "a.jpg", "b.webp"]
    for im, c in zip(m.images, colors.values()):
        px = np.asarray(im)[im.size[1] // 2, im.size[0] // 2]
        assert np.abs(px.astype(int) - c).max() < 20
    assert m.label == f"{paths[0]} + 2 more"
    assert load_media([paths[1]]).label == str(paths[1])


def test_directory_natural_sort_and_skipped_files(tmp_path):
    d = tmp_path / "frames"
    d.mkdir()
    for n in ["img10.png", "img2.png", "img1.png", "IMG3.png"]:
        make_image(d / n)
    (d / "notes.txt").write_text("hello")
    make_video(d / "clip.mp4", n=2)
    (d / "sub").mkdir()
    (d / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")  # hidden: ignored silently
    with pytest.warns(MediaWarning) as rec:
        m = load_media([str(d) + os.sep])
    assert [p.name for p in m.sources] == ["img1.png", "img2.png", "IMG3.png", "img10.png"]
    assert_images_ok(m)
    assert m.label == str(d) + os.sep
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1 and "notes.txt" in msgs[0] and "clip.mp4" in msgs[0] and "sub/" in msgs[0]
    assert ".DS_Store" not in msgs[0] and msgs[0].startswith(str(d))


def test_directory_without_images(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(MediaError, match="no image files") as e:
        load_media([d])
    assert str(e.value).startswith(f"{d}: ")
    make_video(d / "clip.mp4", n=2)
    with pytest.raises(MediaError, match="it holds 1 video file: pass a video file directly"):
        load_media([d])


def _jpeg_with_orientation(path: Path, orientation: int) -> Path:
    img = Image.new("RGB", (120, 60), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 60, 60))  # left half red
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.save(path, exif=exif, quality=95)
    return path


def test_exif_orientation_applied(tmp_path):
    m = load_media([_jpeg_with_orientation(tmp_path / "rot.jpg", 6)])
    assert_images_ok(m)
    w, h = m.images[0].size
    assert h > w  # 120x60 stored, displayed rotated 90 degrees clockwise
    arr = np.asarray(m.images[0]).astype(int)
    assert arr[h // 4, w // 2, 0] > 200 and arr[h // 4, w // 2, 2] < 60  # left (red) went to the top
    assert arr[3 * h // 4, w // 2, 2] > 200
    m = load_media([_jpeg_with_orientation(tmp_path / "up.jpg", 1)])
    assert m.images[0].size[0] > m.images[0].size[1]


def _png_16bit(path: Path, value: int) -> Path:
    Image.fromarray(np.full((30, 40), value, dtype=np.uint16)).save(path)
    return path


@pytest.mark.parametrize("case", ["cmyk", "i16", "i32", "palette", "palette_transparent", "la", "rgba", "gray",
                                  "bilevel", "gif_anim", "tiff16", "bmp"])
def test_image_modes_to_rgb(tmp_path, case):
    expect = None
    if case == "cmyk":
        p = tmp_path / "cmyk.jpg"
        Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(p)  # red
        expect = (255, 0, 0)
    elif case == "i16":
        p = _png_16bit(tmp_path / "deep.png", 32768)
        with Image.open(p) as im:
            assert im.mode.startswith("I")
        expect = (128, 128, 128)
    elif case == "i32":
        p = tmp_path / "int.tif"
        Image.fromarray(np.full((30, 40), 65535, dtype=np.int32), mode="I").save(p)
        expect = (255, 255, 255)
    elif case == "palette":
        p = make_image(tmp_path / "pal.png", color=(0, 0, 255), mode="P")
        expect = (0, 0, 255)
    elif case == "palette_transparent":
        im = Image.new("P", (40, 30), 0)
        im.putpalette([0, 0, 0] + [255, 0, 0] * 255)
        p = tmp_path / "paltr.gif"
        im.save(p, transparency=0)  # every pixel transparent -> white
        expect = (255, 255, 255)
    elif case == "la":
        p = tmp_path / "la.png"
        Image.new("LA", (40, 30), (0, 0)).save(p)  # transparent black -> white
        expect = (255, 255, 255)
    elif case == "rgba":
        p = tmp_path / "rgba.png"
        im = Image.new("RGBA", (40, 30), (255, 0, 0, 0))
        im.paste((0, 0, 255, 255), (0, 0, 20, 30))
        im.save(p)
        m = load_media([p])
        arr = np.asarray(m.images[0]).astype(int)
        assert (np.abs(arr[arr.shape[0] // 2, 2] - (0, 0, 255)).max() < 10
                and np.abs(arr[arr.shape[0] // 2, -3] - (255, 255, 255)).max() < 10)
        return
    elif case == "gray":
        p = make_image(tmp_path / "gray.png", color=(100, 100, 100), mode="L")
        expect = (100, 100, 100)
    elif case == "bilevel":
        p = make_image(tmp_path / "bw.bmp", color=(255, 255, 255), mode="1")
        expect = (255, 255, 255)
    elif case == "gif_anim":
        frames = [Image.new("RGB", (40, 30), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
        p = tmp_path / "anim.gif"
        frames[0].save(p, save_all=True, append_images=frames[1:], duration=100, loop=0)
        expect = (255, 0, 0)  # in an image set, an animation gives its first frame (alone: a video)
    elif case == "tiff16":
        p = tmp_path / "deep.tif"
        Image.fromarray(np.full((30, 40), 65535, dtype=np.uint16)).save(p)
        expect = (255, 255, 255)
    elif case == "bmp":
        p = make_image(tmp_path / "x.bmp", color=(10, 200, 30))
        expect = (10, 200, 30)
    if case == "gif_anim":
        with pytest.warns(MediaWarning, match="only its first frame is used"):
            m = load_media([p, make_image(tmp_path / "other.png")])
    else:
        m = load_media([p])
    assert_images_ok(m)
    im = m.images[0]
    px = np.asarray(im)[im.size[1] // 2, im.size[0] // 2].astype(int)
    assert np.abs(px - expect).max() <= 12, (case, px)


@pytest.mark.parametrize("size", [(1, 1), (3, 500), (500, 3), (2, 2), (28, 28)])
def test_tiny_and_thin_images(tmp_path, size):
    p = make_image(tmp_path / "tiny.png", w=size[0], h=size[1])
    m = load_media([p])
    assert_images_ok(m)
    w, h = m.images[0].size
    assert w * h >= 28 * 28


def test_extreme_aspect_ratio_is_a_clear_error(tmp_path):
    p = make_image(tmp_path / "line.png", w=1000, h=2)
    with pytest.raises(MediaError, match="aspect ratio") as e:
        load_media([p])
    assert str(e.value).startswith(f"{p}: ") and "\n" not in str(e.value)


def test_image_max_pixels_respected(tmp_path):
    p = make_image(tmp_path / "big.png", w=900, h=700)
    for mp in (784, 10_000, 100_000):
        m = load_media([p], max_pixels=mp)
        assert_images_ok(m, mp)
    m = load_media([p], min_pixels=1_000_000, max_pixels=2_000_000)
    w, h = m.images[0].size
    assert 1_000_000 <= w * h <= 2_000_000


def _huge_png(path: Path, side: int = 20000) -> Path:
    """A valid 1-bit side x side PNG written without allocating the image (a few tens of KB)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\0" * (1 + (side + 7) // 8)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row * 1000) for _ in range(side // 1000)) + comp.flush()
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    path.write_bytes(data)
    return path


def test_huge_png_refused_without_decoding(tmp_path, monkeypatch):
    p = _huge_png(tmp_path / "huge.png")
    assert p.stat().st_size < 1_000_000
    from PIL import ImageFile

    def no_decode(self):
        raise AssertionError("pixel data must not be decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    t0 = time.perf_counter()
    with pytest.raises(MediaError, match="too large.*20000x20000.*megapixels") as e:
        load_media([p])
    assert time.perf_counter() - t0 < 2.0
    assert str(e.value).startswith(f"{p}: ")
    assert Image.MAX_IMAGE_PIXELS is not None  # Pillow's global guard restored


def test_large_jpeg_decoded_with_draft(tmp_path, monkeypatch):
    big = Image.new("RGB", (2400, 1800), (0, 0, 255))
    big.paste((255, 0, 0), (0, 0, 1200, 1800))  # left half red
    jpg, png = tmp_path / "big.jpg", tmp_path / "big.png"
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    big.save(jpg, quality=80, exif=exif)
    big.save(png, compress_level=1)
    monkeypatch.setattr(media.images, "MAX_SOURCE_PIXELS", 1_000_000)
    m = load_media([jpg], max_pixels=50_000)  # 4.3 MP on disk, decoded at 1/8 scale
    assert_images_ok(m, 50_000)
    w, h = m.images[0].size
    assert h > w  # orientation still applied after the reduced decode
    arr = np.asarray(m.images[0]).astype(int)
    assert arr[h // 4, w // 2, 0] > 200 and arr[3 * h // 4, w // 2, 2] > 200
    with pytest.raises(MediaError, match="too large"):
        load_media([png], max_pixels=50_000)  # PNG has no reduced decode


def test_a_video_of_huge_frames_is_refused_before_it_is_decoded(monkeypatch):
    """A small file of huge frames (a video bomb) is refused from its header, as a huge image is."""
    needle = REPO / "sample_media" / "needle.mp4"
    monkeypatch.setattr(media.images, "MAX_SOURCE_PIXELS", 100 * 100)  # the clip's frames are 112x112
    with pytest.raises(MediaError) as e:
        load_media([needle], frames=8)
    assert "video too large: 112x112" in _assert_one_line_error(e, str(needle))


# --- errors -------------------------------------------------------------------------------------
def _assert_one_line_error(exc_info, shown: str, cls=MediaError):
    err = exc_info.value
    assert type(err) is cls
    s = str(err)
    assert s.startswith(f"{shown}: ") and "\n" not in s and len(s) < 300, s
    assert err.source == shown
    return s


def _corrupt_cases(tmp_path: Path, vids) -> dict[str, tuple[str, str]]:
    """name -> (path as typed, expected reason regex)"""
    d = tmp_path
    cases = {}
    cases["missing"] = (str(d / "nope.mp4"), "no such file")
    os.symlink(d / "gone.png", d / "dangling.png")
    cases["dangling"] = (str(d / "dangling.png"), "dangling symbolic link")
    (d / "zero.mp4").write_bytes(b"")
    cases["zero_video"] = (str(d / "zero.mp4"), r"empty file \(0 bytes\)")
    (d / "zero.png").write_bytes(b"")
    cases["zero_image"] = (str(d / "zero.png"), r"empty file")
    cases["audio_only"] = (str(make_audio_only(d / "song.mp4")), r"no video stream \(audio-only container\)")
    data = vids["v100"].read_bytes()
    (d / "cut.mp4").write_bytes(data[: len(data) // 2])  # moov atom at the end: lost
    cases["truncated_header"] = (str(d / "cut.mp4"), "invalid data")
    noise = make_noise_video(d / "noise_full.mp4").read_bytes()  # moov first ("faststart")
    (d / "noise.mp4").write_bytes(noise[: len(noise) // 2])
    cases["truncated_body"] = (str(d / "noise.mp4"), r"truncated or corrupt video: only \d+ of 40 frames")
    z = bytearray(make_video(d / "z_src.mp4", n=10).read_bytes())
    i = z.find(b"mdat")
    size = int.from_bytes(z[i - 4:i], "big")
    z[i + 4:i - 4 + size] = bytes(size - 8)
    (d / "zeroed.mp4").write_bytes(bytes(z))
    cases["no_decodable_frames"] = (str(d / "zeroed.mp4"), "no decodable video frames")
    (d / "text.mp4").write_text("this is not a video\n")
    cases["text_as_video"] = (str(d / "text.mp4"), "file content is text, not a video")
    make_image(d / "pic.mp4", format="PNG")
    cases["png_as_video"] = (str(d / "pic.mp4"), r"is a PNG image, not a video \(wrong extension\?\)")
    (d / "clip.jpg").write_bytes(vids["v30"].read_bytes())
    cases["video_as_image"] = (str(d / "clip.jpg"), r"is an MP4/MOV video, not an image \(wrong extension\?\)")
    (d / "junk.png").write_bytes(bytes(range(256)) * 4)
    cases["junk_image"] = (str(d / "junk.png"), "not a recognised image file")
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 80, 3), dtype=np.uint8)).save(buf, "PNG")
    (d / "half.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    cases["truncated_png"] = (str(d / "half.png"), "corrupt or truncated image")
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 80, 3), dtype=np.uint8)).save(buf, "JPEG")
    (d / "half.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    cases["truncated_jpeg"] = (str(d / "half.jpg"), "corrupt or truncated image")
    for fmt, ext in (("GIF", "gif"), ("PNG", "png")):  # an animation cut short (APNG: an animated .png)
        frames = [Image.fromarray(np.random.default_rng(i).integers(0, 255, (60, 80, 3), dtype=np.uint8))
                  for i in range(8)]
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=100)
        (d / f"cut_anim.{ext}").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 6 // 10])
        cases[f"truncated_{'apng' if ext == 'png' else ext}"] = (str(d / f"cut_anim.{ext}"),
                                                                 "corrupt or truncated animation")
    (d / "data.xyz").write_text("x")
    cases["unsupported"] = (str(d / "data.xyz"), r"unsupported file type '\.xyz' \(supported: \.apng, \.avi, \.bmp")
    (d / "README").write_text("x")
    cases["no_extension"] = (str(d / "README"), "no extension")
    (d / "song.m4a").write_bytes(b"x")
    cases["audio_extension"] = (str(d / "song.m4a"), r"unsupported file type '\.m4a'")
    (d / "folder.png").mkdir()
    cases["dir_named_png"] = (str(d / "folder.png"), "no image files in directory")
    return cases


CORRUPT = ["missing", "dangling", "zero_video", "zero_image", "audio_only", "truncated_header", "truncated_body",
           "no_decodable_frames", "text_as_video", "png_as_video", "video_as_image", "junk_image", "truncated_png",
           "truncated_jpeg", "truncated_gif", "truncated_apng", "unsupported", "no_extension", "audio_extension", "dir_named_png"]


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory, vids):
    return _corrupt_cases(tmp_path_factory.mktemp("bad"), vids)


@pytest.mark.parametrize("case", CORRUPT)
def test_bad_media_gives_one_line_media_error(corrupt, case):
    shown, reason = corrupt[case]
    with pytest.raises(MediaError) as e:
        load_media([shown], max_pixels=SMALL)
    s = _assert_one_line_error(e, shown)
    import re

    assert re.search(reason, s), s


def test_bad_file_inside_an_image_set_is_named(tmp_path, corrupt):
    good = make_image(tmp_path / "ok.png")
    shown = corrupt["truncated_png"][0]
    with pytest.raises(MediaError) as e:
        load_media([good, shown])
    _assert_one_line_error(e, shown)


def test_permission_denied(tmp_path, monkeypatch):
    p = make_image(tmp_path / "secret.png")
    if os.geteuid() != 0:  # a real unreadable file (root reads anything)
        p.chmod(0)
        try:
            with pytest.raises(MediaError, match="permission denied") as e:
                load_media([str(p)])
            _assert_one_line_error(e, str(p))
        finally:
            p.chmod(0o644)

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(media.sniff, "_open_binary", denied)
    for q in (p, make_video(tmp_path / "secret.mp4", n=2)):
        with pytest.raises(MediaError, match="permission denied") as e:
            load_media([str(q)])
        _assert_one_line_error(e, str(q))


@pytest.mark.parametrize("kwargs,match", [
    ({"frames": 0}, "frames must be positive"),
    ({"frames": -3}, "frames must be positive"),
    ({"frames": 2.5}, "whole number"),
    ({"fps": 0}, "fps must be positive"),
    ({"fps": -1.0}, "fps must be positive"),
    ({"fps": float("nan")}, "fps must be positive"),
    ({"max_pixels": 100}, "max_pixels must be at least 784"),
    ({"max_pixels": 1000, "min_pixels": 5000}, "must not exceed"),
    ({"min_pixels": -1}, "positive"),
])
def test_bad_arguments_are_usage_errors(vids, kwargs, match):
    with pytest.raises(UsageError, match=match) as e:
        load_media([vids["v30"]], **kwargs)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_one_video_per_prompt(vids, tmp_path):
    img = make_image(tmp_path / "a.png")
    for paths in ([vids["v30"], vids["v100"]], [vids["v30"], img], [img, vids["v30"]]):
        with pytest.raises(UsageError, match="one video per prompt") as e:
            load_media([str(p) for p in paths])
        assert e.value.exit_code == 2 and "\n" not in str(e.value)
    with pytest.raises(UsageError, match="no media input"):
        load_media([])


def test_errors_have_cli_exit_codes(corrupt):
    with pytest.raises(MediaError) as e:
        load_media([corrupt["missing"][0]])
    assert e.value.exit_code == 1


# --- sample media -------------------------------------------------------------------------------
def test_sample_media_present_and_loadable():
    root = REPO / "sample_media"
    if not (root / "shapes.mp4").exists():
        pytest.skip("run scripts/make_sample_media.py")
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert total < 3 * 1024 * 1024
    m = load_media([root / "shapes.mp4"], frames=16, max_pixels=SMALL)
    assert (m.frames_total, m.frames_used) == (128, 16)
    assert m.sample_fps == pytest.approx(2.0, rel=0.02)
    m = load_media([root / "images"])
    assert [p.name for p in m.sources] == ["blue_square.jpg", "green_triangle.webp", "red_circle.png"]
    assert_images_ok(m)
