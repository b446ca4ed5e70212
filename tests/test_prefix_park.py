"""A kept prefix parked in host memory (the server's host tier) answers, once copied back, exactly
what it answered before; on CUDA parking frees its device bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hybridkv_cli.compression import METHODS, make_policy
from hybridkv_cli.models.prompt import QuestionTemplate, build_prompt

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import demo, video  # noqa: E402,F401 - fixtures
from method_options import needed  # noqa: E402
from shared_prefix import TEMPLATE_QUESTION, answer, compress_prefix  # noqa: E402

QUESTIONS = ["What happens in the video?", "What colour is the square?"]


def prefix_and_tokens(loaded, video, method):
    p = build_prompt(loaded.processor, video, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(loaded.processor.tokenizer, p, TEMPLATE_QUESTION)
    prefix = compress_prefix(loaded.model, p, make_policy(method, **needed(method)), template)

    def tokens(of):
        return [answer(loaded.model, of, of.template.suffix(loaded.processor.tokenizer, q), max_new_tokens=6).tokens
                for q in QUESTIONS]
    return prefix, tokens


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_parked_prefix_answers_the_same_once_unparked(demo, video, method):
    prefix, tokens = prefix_and_tokens(demo, video, method)
    before = tokens(prefix)
    parked = prefix.park()
    assert parked.parked and not prefix.parked
    with pytest.raises(RuntimeError, match="unparked before"):
        parked.take(torch.device("cpu"))
    back = parked.unpark()
    assert not back.parked and back.device_bytes == prefix.device_bytes and back.host_bytes == prefix.host_bytes
    assert tokens(back) == before and tokens(back.park().unpark()) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parking_frees_the_device_bytes_and_copies_them_back(video):
    from hybridkv_cli.models.demo import build_demo

    loaded = build_demo(device="cuda")
    prefix, tokens = prefix_and_tokens(loaded, video, "hybridkv")
    before = tokens(prefix)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    parked = prefix.park()
    del prefix
    torch.cuda.synchronize()
    assert parked.device_bytes > 0 and held - torch.cuda.memory_allocated() >= parked.device_bytes
    host, info, _ = parked._flat
    assert all(not t.is_cuda and (t.is_pinned() or not t.numel()) for k, t in host.items() if info[k]["device"] != "cpu")
    assert tokens(parked.unpark()) == before
