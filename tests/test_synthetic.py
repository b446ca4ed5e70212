"""training/synthetic.py: the generator behind the trained demo model and its held-out task set."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridkv_cli.models.demo import build_demo_tokenizer
from training import synthetic as S


def _scenes(n=40, frames=32):
    return [S.make_scene(np.random.default_rng([1, i]), frames) for i in range(n)]


def test_scene_is_deterministic_in_the_seed():
    a, b = (S.make_scene(np.random.default_rng(7), 32) for _ in range(2))
    assert np.array_equal(a.video, b.video) and a.qas == b.qas
    c = S.make_scene(np.random.default_rng(8), 32)
    assert not np.array_equal(a.video, c.video)
    i1, i2 = (S.make_image_set(np.random.default_rng(3)) for _ in range(2))
    assert all(np.array_equal(x, y) for x, y in zip(i1.images, i2.images)) and i1.qas == i2.qas


def test_video_geometry_matches_what_load_media_gives():
    from hybridkv_cli.media import pixel_bounds, target_size
    from hybridkv_cli.models.demo import TRAINED_MAX_PIXELS as demo

    scene = S.make_scene(np.random.default_rng(0))
    assert scene.video.shape == (S.FRAMES, S.VIDEO_SIZE, S.VIDEO_SIZE, 3) and scene.video.dtype == np.uint8
    # at the trained demo's frame size load_media leaves the generated frames and images as they are
    assert target_size(S.VIDEO_SIZE, S.VIDEO_SIZE, *pixel_bounds("video", S.FRAMES, max_pixels=demo)) == (112, 112)
    assert target_size(S.IMAGE_SIZE, S.IMAGE_SIZE, *pixel_bounds("images", max_pixels=demo)) == (112, 112)
    # 16 visual tokens per frame pair (a 4 x 4 grid of 28-pixel tokens), 512 per clip
    assert (S.VIDEO_SIZE // S.CELL) ** 2 * S.FRAMES // 2 == 512
    with pytest.raises(ValueError):
        S.make_scene(np.random.default_rng(0), 24)


def test_answers_come_from_the_closed_vocabulary_and_tokenize_short():
    tok = build_demo_tokenizer()
    qas = [qa for sc in _scenes() for qa in sc.qas]
    qas += [qa for i in range(20) for qa in S.make_image_set(np.random.default_rng([2, i])).qas]
    assert {qa.kind for qa in qas} == set(S.HELD_OUT_QUOTA)
    assert all(qa.answer in S.ANSWERS for qa in qas)
    assert max(len(tok(a, add_special_tokens=False)["input_ids"]) for a in S.ANSWERS) <= 4
    # one question per kind and subject in a scene: no scene asks the same thing twice
    for sc in _scenes(10):
        assert len({qa.question for qa in sc.qas}) == len(sc.qas)


def test_needle_answers_sit_in_at_most_two_frames():
    scenes = [S.make_scene(np.random.default_rng([4, i]), needle=True) for i in range(20)]
    for sc in scenes:
        needles = [qa for qa in sc.qas if qa.needle]
        assert {qa.kind for qa in needles} == {"needle_colour", "needle_digit"}
        frames = sc.shown["star"]
        assert 1 <= len(frames) <= 2 and all(qa.evidence == frames for qa in needles)
        # the star's pixels (its colour, drawn on top of everything) are in those frames only
        colour = next(qa.answer for qa in needles if qa.kind == "needle_colour")
        label = S.object_label("star", colour)
        per_frame = (sc.label_maps[0] == label).sum(axis=(1, 2))
        assert set(np.nonzero(per_frame)[0]) == set(frames) and per_frame.min() == 0
        assert per_frame[list(frames)].min() >= 0.2 * S.SIZE_RANGE[0] ** 2  # a five-pointed star fills ~27%
        assert all(np.all(sc.video[f][sc.label_maps[0][f] == label] == S.COLOURS[colour]) for f in frames)


def test_held_out_needle_stars_share_their_cell_with_nothing():
    # a two-frame star drawn over a shape of its own colour would be invisible
    items = S.held_out(quota={"needle_colour": 8, "needle_digit": 8})
    assert all(S.star_in_the_clear(it.scene) for it in items)
    crowded = [S.make_scene(np.random.default_rng([7, i]), needle=True) for i in range(60)]
    assert not all(S.star_in_the_clear(sc) for sc in crowded)  # the check can fail


def test_digit_answer_is_the_scoreboard_digit_while_the_star_shows():
    for i in range(10):
        sc = S.make_scene(np.random.default_rng([5, i]), 32, needle=False)
        qa = next(q for q in sc.qas if q.kind == "digit")
        frame = sc.video[qa.evidence[0]]
        box = frame[: S.SCOREBOARD, : S.SCOREBOARD]
        matches = [d for d in range(10) if np.array_equal(box, S._DIGIT_BOXES[d])]
        assert matches == [int(qa.answer)]


def test_first_and_count_answers_agree_with_the_timeline():
    for sc in _scenes(30):
        onsets = {shape: frames[0] // 2 for shape, frames in sc.shown.items()}
        for qa in sc.qas:
            if qa.kind == "first":
                assert onsets[qa.answer] < min(v for k, v in onsets.items() if k != qa.answer)
            if qa.kind == "count":
                assert "square" in sc.shown and qa.answer in "123"


def test_image_set_questions_have_one_right_image():
    for i in range(20):
        sc = S.make_image_set(np.random.default_rng([6, i]))
        assert 2 <= len(sc.images) <= 4
        for qa in sc.qas:
            colour = qa.question.split()[-2]
            hits = [k for k, img in enumerate(sc.images) if np.all(img == S.COLOURS[colour], axis=-1).any()]
            assert int(qa.answer) - 1 in hits


def test_held_out_set_quota_and_determinism():
    quota = {"colour": 2, "needle_digit": 2, "which_image": 1}
    a, b = S.held_out(quota=quota, frames=16), S.held_out(quota=quota, frames=16)
    assert [i.id for i in a] == ["colour-000", "colour-001", "needle_digit-000", "needle_digit-001", "which_image-000"]
    assert [(i.qa.question, i.qa.answer) for i in a] == [(i.qa.question, i.qa.answer) for i in b]
    assert [i.qa.needle for i in a] == [False, False, True, True, False]
    assert sum(S.HELD_OUT_QUOTA.values()) == 200
    assert S.HELD_OUT_QUOTA["needle_colour"] + S.HELD_OUT_QUOTA["needle_digit"] >= 50


def test_make_video_tasks_writes_files_and_manifest(tmp_path, monkeypatch):
    from hybridkv_cli.media import load_media

    monkeypatch.setattr(S, "HELD_OUT_QUOTA", {"needle_colour": 1, "which_image": 1})
    from training import make_video_tasks

    assert make_video_tasks.main([str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["needle_colour", "which_image"]
    assert set(rows[0]) == {"id", "media", "question", "answer", "needle", "kind"}
    needle = [json.loads(line) for line in (tmp_path / "needle.jsonl").read_text().splitlines()]
    assert needle == rows[:1]
    video = load_media(str(tmp_path / rows[0]["media"]), max_pixels=S.VIDEO_SIZE ** 2)  # the trained demo's size
    assert video.frames_used == S.FRAMES and video.size == (S.VIDEO_SIZE, S.VIDEO_SIZE)
    assert abs(video.sample_fps - S.VIDEO_FPS) < 0.1
    images = load_media([str(tmp_path / p) for p in rows[1]["media"]])
    assert images.kind == "images" and images.size == (S.IMAGE_SIZE, S.IMAGE_SIZE)
