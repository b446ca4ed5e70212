"""Fixtures of the tests that answer about the sample clip with the demo model, loaded once per module.

Import them into a test module (``from demo_fixtures import cached_demo, demo, video``); the
autouse ``cached_demo`` then serves every model load of that module from the one demo.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv_cli.media import load_media

SAMPLE = Path(__file__).resolve().parents[1] / "sample_media" / "shapes.mp4"


@pytest.fixture(scope="module")
def demo():
    from hybridkv_cli.models.demo import build_demo

    return build_demo()


@pytest.fixture(scope="module")
def video():
    return load_media([SAMPLE], frames=16)


@pytest.fixture(autouse=True)
def cached_demo(demo, monkeypatch):
    monkeypatch.setattr("hybridkv_cli.models.registry.load_model", lambda name, **kw: demo)
