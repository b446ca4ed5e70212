"""Synthetic visual question answering: the tasks the trained demo model learns and is tested on.

Everything is rendered with numpy from a seed, so a task set is reproducible bit for bit.

**Videos** (:func:`make_scene`): ``frames`` frames (64 by default) of ``VIDEO_SIZE`` x ``VIDEO_SIZE``
pixels, at ``VIDEO_FPS`` frames per second: 16 visual tokens (a 4 x 4 grid) per pair of frames, 512
for 64 frames. The trained demo reads frames at this size (``hybridkv_cli.models.demo.frame_pixels``;
Qwen's own video minimum would upscale them 3x). A seven-segment *scoreboard* in the top-left cell
shows a digit that changes every eighth of the clip; coloured shapes (circle, triangle, 1-3
squares, star) appear, move cell by cell on the 28-pixel token grid and disappear.

**Image sets** (:func:`make_image_set`): 2-4 images of ``IMAGE_SIZE`` pixels with one or two shapes
each (16 visual tokens per image).

Questions and their kinds (answers come from :data:`ANSWERS`, so accuracy is exact match):

=================  ==============================================  ========================
kind               question                                        answer
=================  ==============================================  ========================
``colour``         What colour is the circle?                      red / green / blue / yellow
``first``          Which shape appears first?                      circle / square / ...
``count``          How many squares appear?                        1 / 2 / 3
``digit``          What digit is shown when the star appears?      0-9
``which_image``    Which image has a red triangle?                 1-4 (image number)
``needle_colour``  What colour is the star? (star in 1-2 frames)   colour
``needle_digit``   What digit is shown when the star appears?      0-9 (star in 1-2 frames)
=================  ==============================================  ========================

Needle questions (``needle=True``) hinge on a star that is visible in one or two frames only;
``QA.evidence`` lists the frames that hold the answer's evidence. Held-out needle stars share
their cell with no other shape (:func:`star_in_the_clear`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

VIDEO_SIZE = 112  # 4 x 4 visual tokens per frame pair
VIDEO_FPS = 4.0  # with tokens_per_second=2 every temporal patch (2 frames) gets its own mRoPE time id
FRAMES = 64
IMAGE_SIZE = 112

COLOURS = {"red": (215, 40, 40), "green": (40, 165, 60), "blue": (45, 85, 220), "yellow": (230, 195, 25)}
SHAPES = ("circle", "square", "triangle", "star")
DIGITS = tuple("0123456789")
ANSWERS = frozenset([*COLOURS, *SHAPES, *DIGITS])  # image numbers and counts are digits too

BACKGROUND = (228, 228, 222)
# Everything sits on the 28-pixel grid of Qwen's merged visual tokens (patch 14 x merge 2): each
# shape and the scoreboard fill one token, so one token shows a whole object. (Shapes straddling
# tokens leave interior tokens that look alike for every shape; a tiny vision tower then learns
# shapes far too slowly for a CPU budget.)
CELL = 28
SCOREBOARD = CELL  # the digit box in the top-left corner
SEGMENTS = 8  # the scoreboard digit changes this many times per clip
STAGE_TOP = CELL  # shapes stay below the scoreboard row
SIZE_RANGE = (22, 24)  # shape sprite side in pixels, centred in its cell


@dataclass
class QA:
    """One question about a scene, its answer, and which frames hold the evidence."""

    kind: str
    question: str
    answer: str
    needle: bool = False
    evidence: tuple[int, ...] = ()  # frames (videos) or images holding the evidence; () = all
    pixel_labels: tuple[int, ...] = ()  # the pixel labels (:func:`object_label`) of the evidence


@dataclass
class Scene:
    """A video (uint8 ``(T, H, W, 3)``) or an image set (list of uint8 ``(H, W, 3)``) and its questions."""

    video: np.ndarray | None
    images: list[np.ndarray] = field(default_factory=list)
    qas: list[QA] = field(default_factory=list)
    shown: dict[str, tuple[int, ...]] = field(default_factory=dict)  # video: frames showing each shape
    # What every pixel shows (:func:`object_label`): one (T, H, W) map for a video, one (H, W) per image.
    label_maps: list[np.ndarray] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "video" if self.video is not None else "images"


# --- sprites ------------------------------------------------------------------------------------
def _shape_mask(shape: str, size: int) -> np.ndarray:
    """A boolean ``size x size`` mask of ``shape`` (computed analytically: fast and exact)."""
    c = (size - 1) / 2
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    if shape == "square":
        m = np.ones((size, size), bool)
        m[[0, -1], :] = m[:, [0, -1]] = False  # one pixel margin like the other shapes
        return m
    if shape == "circle":
        return (x - c) ** 2 + (y - c) ** 2 <= (size / 2 - 1) ** 2
    if shape == "triangle":  # apex up, base at the bottom
        t = (y - 1) / (size - 2)  # 0 at the apex, 1 at the base
        return (t >= 0) & (t <= 1) & (np.abs(x - c) <= t * (size / 2 - 1))
    if shape == "star":  # five points: radius alternates between outer and inner along the angle
        r = np.hypot(x - c, y - c)
        a = np.arctan2(x - c, -(y - c))  # 0 pointing up
        k = np.abs(((a * 5 / (2 * np.pi)) % 1.0) - 0.5) * 2  # 1 at a point, 0 between points
        outer, inner = size / 2 - 1, size * 0.2
        return r <= inner + (outer - inner) * k**2
    raise ValueError(shape)


_MASKS: dict[tuple[str, int], np.ndarray] = {}


def shape_mask(shape: str, size: int) -> np.ndarray:
    key = (shape, size)
    if key not in _MASKS:
        _MASKS[key] = _shape_mask(shape, size)
    return _MASKS[key]


# Seven-segment layout in the 28-pixel scoreboard cell: (y0, y1, x0, x1) per segment a..g.
_SEG = {
    "a": (3, 6, 8, 20), "b": (4, 14, 18, 21), "c": (14, 24, 18, 21), "d": (22, 25, 8, 20),
    "e": (14, 24, 7, 10), "f": (4, 14, 7, 10), "g": (12, 15, 8, 20),
}
_DIGIT_SEGMENTS = ("abcdef", "bc", "abged", "abgcd", "fgbc", "afgcd", "afgedc", "abc", "abcdefg", "abcdfg")


def _digit_box(digit: int) -> np.ndarray:
    box = np.full((SCOREBOARD, SCOREBOARD, 3), 25, np.uint8)
    for s in _DIGIT_SEGMENTS[digit]:
        y0, y1, x0, x1 = _SEG[s]
        box[y0:y1, x0:x1] = 245
    return box


_DIGIT_BOXES = [_digit_box(d) for d in range(10)]


#: Pixel labels: 0 background, 1-16 a (shape, colour) pair, 17-26 the scoreboard showing digit 0-9.
N_LABELS = 1 + len(SHAPES) * len(COLOURS) + 10
_COLOUR_INDEX = {c: i for i, c in enumerate(COLOURS)}


def object_label(shape: str, colour: str) -> int:
    return 1 + SHAPES.index(shape) * len(COLOURS) + _COLOUR_INDEX[colour]


def digit_label(digit: int) -> int:
    return 1 + len(SHAPES) * len(COLOURS) + digit


def paste(canvas: np.ndarray, labels: np.ndarray, shape: str, size: int, colour: str, y: int, x: int) -> None:
    """Draw ``shape`` with its top-left corner at (y, x), clipped to the canvas; mark ``labels``."""
    m = shape_mask(shape, size)
    h, w = canvas.shape[:2]
    y0, x0, y1, x1 = max(y, 0), max(x, 0), min(y + size, h), min(x + size, w)
    if y0 >= y1 or x0 >= x1:
        return
    m = m[y0 - y:y1 - y, x0 - x:x1 - x]
    canvas[y0:y1, x0:x1][m] = COLOURS[colour]
    labels[y0:y1, x0:x1][m] = object_label(shape, colour)


# --- videos -------------------------------------------------------------------------------------
@dataclass
class _Track:
    shape: str
    colour: str
    size: int
    start: int  # first visible frame
    stop: int  # one past the last visible frame
    p0: tuple[float, float]  # top-left (y, x) at start
    p1: tuple[float, float]  # ... at the last visible frame

    def at(self, t: int) -> tuple[int, int]:
        """Top-left corner at frame t: the path from p0 to p1, snapped to the cell grid."""
        a = 0.0 if self.stop - self.start <= 1 else (t - self.start) / (self.stop - self.start - 1)
        y = round((self.p0[0] + a * (self.p1[0] - self.p0[0])) / CELL) * CELL
        x = round((self.p0[1] + a * (self.p1[1] - self.p0[1])) / CELL) * CELL
        pad = (CELL - self.size) // 2
        return y + pad, x + pad


def _random_point(rng: np.random.Generator, size: int, canvas: int = VIDEO_SIZE, top: int = STAGE_TOP):
    """A random cell's top-left corner below the scoreboard row."""
    return float(CELL * rng.integers(top // CELL, canvas // CELL)), float(CELL * rng.integers(0, canvas // CELL))


def _colour_question(shape: str, track: _Track, needle: bool) -> QA:
    kind = "needle_colour" if needle else "colour"
    return QA(kind, f"What colour is the {shape}?", track.colour, needle, tuple(range(track.start, track.stop)),
              (object_label(shape, track.colour),))


def make_scene(rng: np.random.Generator, frames: int = FRAMES, *, needle: bool | None = None,
               kinds: tuple[str, ...] | None = None, size: int = VIDEO_SIZE) -> Scene:
    """A random video scene and every question it answers.

    ``frames`` must be a multiple of 16 (8 scoreboard segments of whole temporal patches).
    ``size`` (a multiple of 28, >= 112) is the frame side; shapes keep their pixel size, so a
    larger canvas is the same task with more visual tokens.
    ``needle`` forces the star to be a needle (True), a normal star (False), or leaves it to chance;
    ``kinds`` makes sure the scene can answer these question kinds (shapes are added as needed).
    """
    if frames % (2 * SEGMENTS):
        raise ValueError(f"frames must be a multiple of {2 * SEGMENTS}, got {frames}")
    kinds = kinds or ()
    groups = frames // 2  # temporal patches
    seg = frames // SEGMENTS
    digits = [int(rng.integers(10))]
    for _ in range(SEGMENTS - 1):  # consecutive segments always show different digits
        digits.append(int((digits[-1] + rng.integers(1, 10)) % 10))

    want_star = needle is not None or any(k in kinds for k in ("digit", "needle_colour", "needle_digit"))
    if needle is None and any(k.startswith("needle") for k in kinds):
        needle = True
    elif needle is None and "digit" in kinds:
        needle = False
    has_star = want_star or rng.random() < 0.6
    star_needle = bool(needle) if needle is not None else rng.random() < 0.5
    n_squares = int(rng.integers(1, 4)) if ("count" in kinds or rng.random() < 0.7) else 0
    has_circle = "colour" in kinds or rng.random() < 0.7
    has_triangle = rng.random() < 0.6

    # Onsets on distinct temporal patches, the earliest clearly first (>= 1/16 of the clip ahead),
    # so "which shape appears first" has one answer at any frame count.
    movers = [s for s, on in (("circle", has_circle), ("triangle", has_triangle)) if on]
    if n_squares:
        movers.append("square")
    if has_star:
        movers.append("star")
    for extra in ("circle", "triangle"):  # at least one shape, two when "first" is wanted
        if len(movers) < (2 if "first" in kinds else 1) and extra not in movers:
            movers.insert(0, extra)
    lead = max(1, groups // 16)
    slots = sorted(int(v) for v in rng.choice(np.arange(lead, groups * 5 // 8), len(movers), replace=False))
    onset = dict(zip((str(m) for m in rng.permutation(movers)), slots))  # temporal patch of each onset
    onset[min(onset, key=onset.get)] -= lead

    canvas = size
    tracks: list[_Track] = []
    for shape in ("circle", "triangle"):
        if shape in onset:
            size = int(rng.integers(*SIZE_RANGE, endpoint=True))
            start = 2 * onset[shape]
            stop = min(frames, start + 2 * int(rng.integers(max(2, groups // 4), groups // 2 + 1)))
            tracks.append(_Track(shape, str(rng.choice(list(COLOURS))), size, start, stop,
                                 _random_point(rng, size, canvas), _random_point(rng, size, canvas)))
    squares: list[_Track] = []
    if "square" in onset:  # static, in distinct cells of a grid below the scoreboard, visible together
        start = 2 * onset["square"]
        stop = min(frames, start + 2 * int(rng.integers(max(2, groups // 4), groups // 2 + 1)))
        colour = str(rng.choice(list(COLOURS)))
        rows, cols = (canvas - STAGE_TOP) // CELL, canvas // CELL
        for c in rng.permutation(rows * cols)[:n_squares]:  # distinct cells
            size = int(rng.integers(*SIZE_RANGE, endpoint=True))
            cy, cx = STAGE_TOP + (int(c) // cols) * CELL, (int(c) % cols) * CELL
            squares.append(_Track("square", colour, size, start, stop, (cy, cx), (cy, cx)))
    star = None
    if "star" in onset:
        size = int(rng.integers(*SIZE_RANGE, endpoint=True))
        k = min(onset["star"] * 2 // seg, SEGMENTS - 1)  # the scoreboard segment the star falls into
        if star_needle:
            length = int(rng.integers(1, 3))
            start = k * seg + int(rng.integers(0, seg - length + 1))
            stop = start + length
        else:
            start, stop = k * seg, (k + 1) * seg
        p0 = _random_point(rng, size, canvas)
        star = _Track("star", str(rng.choice(list(COLOURS))), size, start, stop, p0,
                      p0 if star_needle else _random_point(rng, size, canvas))
        onset["star"] = start // 2  # the star snaps into its segment: "first" is recomputed below

    video = np.empty((frames, canvas, canvas, 3), np.uint8)
    video[:] = BACKGROUND
    labels = np.zeros(video.shape[:3], np.uint8)
    for t in range(frames):
        video[t, :SCOREBOARD, :SCOREBOARD] = _DIGIT_BOXES[digits[t // seg]]
        labels[t, :SCOREBOARD, :SCOREBOARD] = digit_label(digits[t // seg])
    for tr in [*tracks, *squares, *([star] if star else [])]:  # the star on top: never occluded
        for t in range(tr.start, tr.stop):
            paste(video[t], labels[t], tr.shape, tr.size, tr.colour, *tr.at(t))

    qas: list[QA] = []
    for tr in tracks:
        qas.append(_colour_question(tr.shape, tr, False))
    if len(squares) == 1:
        qas.append(_colour_question("square", squares[0], False))
    if star is not None:
        qas.append(_colour_question("star", star, star_needle))
        kind = "needle_digit" if star_needle else "digit"
        digit = digits[star.start // seg]
        qas.append(QA(kind, "What digit is shown when the star appears?", str(digit), star_needle,
                      tuple(range(star.start, star.stop)), (object_label("star", star.colour),)))
    if len(onset) >= 2:
        firsts = [s for s, o in onset.items() if o == min(onset.values())]
        if len(firsts) == 1:
            colour = next(tr.colour for tr in [*tracks, *squares, *([star] if star else [])] if tr.shape == firsts[0])
            qas.append(QA("first", "Which shape appears first?", firsts[0], pixel_labels=(object_label(firsts[0], colour),)))
    if squares:
        qas.append(QA("count", "How many squares appear?", str(len(squares)),
                      evidence=tuple(range(squares[0].start, squares[0].stop)),
                      pixel_labels=(object_label("square", squares[0].colour),)))
    shown = {tr.shape: tuple(range(tr.start, tr.stop)) for tr in [*tracks, *squares, *([star] if star else [])]}
    return Scene(video=video, qas=qas, shown=shown, label_maps=[labels])


# --- image sets ---------------------------------------------------------------------------------
def make_image_set(rng: np.random.Generator, n: int | None = None) -> Scene:
    """``n`` (default: 2-4 at random) images with 1-2 shapes each; a question for every
    (colour, shape) found in one image only."""
    n = int(rng.integers(2, 5)) if n is None else n
    images, contents, maps = [], [], []
    for _ in range(n):
        img = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
        img[:] = BACKGROUND
        labels = np.zeros(img.shape[:2], np.uint8)
        items = set()
        cells = rng.permutation((IMAGE_SIZE // CELL) ** 2)[: int(rng.integers(1, 3))]  # 1-2 shapes, distinct cells
        for c in cells:
            shape, colour = str(rng.choice(SHAPES)), str(rng.choice(list(COLOURS)))
            size = int(rng.integers(*SIZE_RANGE, endpoint=True))
            pad = (CELL - size) // 2
            y, x = (int(c) // (IMAGE_SIZE // CELL)) * CELL + pad, (int(c) % (IMAGE_SIZE // CELL)) * CELL + pad
            paste(img, labels, shape, size, colour, y, x)
            items.add((colour, shape))
        images.append(img)
        maps.append(labels)
        contents.append(items)
    qas = []
    for colour in COLOURS:
        for shape in SHAPES:
            where = [i for i, items in enumerate(contents) if (colour, shape) in items]
            if len(where) == 1:
                qas.append(QA("which_image", f"Which image has a {colour} {shape}?", str(where[0] + 1),
                              evidence=(where[0],), pixel_labels=(object_label(shape, colour),)))
    return Scene(video=None, images=images, qas=qas, label_maps=maps)


def star_in_the_clear(scene: Scene) -> bool:
    """Whether no other shape shares the star's cell while the star shows. (Training scenes may
    put the star over another shape; a two-frame needle star over a shape of its own colour
    would be invisible, so held-out needle items are drawn in the clear.)"""
    labels = scene.label_maps[0]
    star = [object_label("star", c) for c in COLOURS]
    for t in scene.shown.get("star", ()):
        ys, xs = np.nonzero(np.isin(labels[t], star))
        cell = labels[t, ys.min() // CELL * CELL:][:CELL, xs.min() // CELL * CELL:][:, :CELL]
        if np.any((cell != 0) & ~np.isin(cell, star)):
            return False
    return True


# --- held-out sets ------------------------------------------------------------------------------
#: Items per kind in :func:`held_out` (200 in all, 60 of them needle items).
HELD_OUT_QUOTA = {"colour": 30, "first": 25, "count": 25, "digit": 30, "which_image": 30,
                  "needle_colour": 30, "needle_digit": 30}
HELD_OUT_SEED = 20_000  # training uses other seeds (see training/train_demo.py)


@dataclass
class Item:
    """One held-out question with its own media."""

    id: str
    scene: Scene
    qa: QA


def held_out(seed: int = HELD_OUT_SEED, quota: dict[str, int] | None = None, frames: int = FRAMES) -> list[Item]:
    """Items with one question each, ``quota[kind]`` of every kind, deterministic in ``seed``.

    Each item draws its scene from its own RNG (``seed``, kind index, item index), so a quota change
    leaves the other kinds' items unchanged.
    """
    quota = HELD_OUT_QUOTA if quota is None else quota
    items = []
    for k, (kind, count) in enumerate(quota.items()):
        for i in range(count):
            rng = np.random.default_rng([seed, k, i])
            while True:  # redraw until the scene asks this kind and a needle star is in the clear
                if kind == "which_image":
                    scene = make_image_set(rng)
                else:
                    scene = make_scene(rng, frames, kinds=(kind,))
                options = [qa for qa in scene.qas if qa.kind == kind]
                if options and (not kind.startswith("needle") or star_in_the_clear(scene)):
                    break
            qa = options[int(rng.integers(len(options)))]
            items.append(Item(f"{kind}-{i:03d}", scene, qa))
    return items


# --- files --------------------------------------------------------------------------------------
def write_mp4(path, video: np.ndarray, fps: float = VIDEO_FPS, crf: int = 12) -> None:
    """Write uint8 ``(T, H, W, 3)`` RGB as H.264 (libx264, near-lossless ``crf``; mpeg4 if absent).

    Single-threaded x264 without sync look-ahead, so the bytes are the same on every run.
    """
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=round(fps))
        stream.width, stream.height, stream.pix_fmt = video.shape[2], video.shape[1], "yuv420p"
        stream.codec_context.thread_count = 1
        if codec == "libx264":
            stream.options = {"crf": str(crf), "preset": "medium",
                              "x264-params": "threads=1:lookahead-threads=1:sync-lookahead=0"}
        else:
            stream.bit_rate = 4_000_000
        for rgb in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_item(item: Item, folder, name: str | None = None) -> str | list[str]:
    """Write ``item``'s media under ``folder``; return the path(s) relative to it (manifest form)."""
    from pathlib import Path

    from PIL import Image

    folder = Path(folder)
    name = name or item.id
    if item.scene.video is not None:
        rel = f"videos/{name}.mp4"
        (folder / "videos").mkdir(parents=True, exist_ok=True)
        write_mp4(folder / rel, item.scene.video)
        return rel
    (folder / "images" / name).mkdir(parents=True, exist_ok=True)
    rels = [f"images/{name}/{i + 1}.png" for i in range(len(item.scene.images))]
    for rel, img in zip(rels, item.scene.images):
        Image.fromarray(img).save(folder / rel, optimize=True)
    return rels
