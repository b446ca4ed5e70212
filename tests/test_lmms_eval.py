"""The lmms-eval model ``hybridkv``, driven with lmms-eval's own request objects, offline.

Runs where lmms-eval is installed (``pip install 'hybridkv[eval]'``, in an environment of its own:
docs/evaluate.md) and is skipped elsewhere. Requests are lmms-eval ``Instance`` objects over a
toy task held in ``task_dict`` (no dataset download): an image set handed over as PIL images,
a video handed over as a path, and a text-only question. Each answer must equal the CLI's
(``hybridkv ask ... --json``) for the same files, question and method. The command block of
docs/evaluate.md marked as tested runs as written: lmms-eval's own CLI on a local task.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("lmms_eval")

from lmms_eval.api.instance import GenerationResult, Instance  # noqa: E402

from hybridkv_cli import cli  # noqa: E402
from hybridkv_cli.io.errors import UsageError  # noqa: E402
from hybridkv_cli.lmms_eval_model import HybridKV, stop_at  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import make_noise_video  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QUESTION = "What happens in the clip?"
NEW_TOKENS = 5
ARGS = "pretrained={model},method=snapkv,budget=0.3,window=8,device=cpu,frames=8,max_new_tokens=20,kv_log={log}"


def _blocky(seed: int, w: int, h: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8).repeat(16, 0).repeat(16, 1))


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """A toy task: doc 0 two PIL images, doc 1 a video path, doc 2 no visual (text only), doc 3 the
    64-frame sample clip (4 fps: read at 64 frames its time steps run past the prompt's text)."""
    root = tmp_path_factory.mktemp("lmms_docs")
    video = make_noise_video(root / "clip.mp4", n=16, w=112, h=84)
    return [{"images": [_blocky(0, 224, 168), _blocky(1, 168, 224)]}, {"images": [str(video)]}, {"images": []},
            {"images": [str(REPO / "sample_media" / "needle.mp4")]}]


def request(index: int, until=None) -> Instance:
    kwargs = {"max_new_tokens": NEW_TOKENS, "temperature": 0, **({"until": until} if until is not None else {})}
    return Instance(request_type="generate_until", idx=0,
                    arguments=(QUESTION, kwargs, lambda doc: doc["images"], index, "toy", "test"),
                    metadata={"task": "toy", "doc_id": index, "repeats": 1})


def make_model(name: str, docs, log: Path) -> HybridKV:
    model = HybridKV.create_from_arg_string(ARGS.format(model=name, log=log))
    model.task_dict = {"toy": {"test": docs}}
    return model


def cli_answer(paths: list[str], name: str, capsys, folder: Path) -> str:
    """The CLI's answer for ``paths`` (none: a text prompt with an empty context file)."""
    empty = folder / "empty.txt"
    empty.write_text("")
    media = paths if paths else ["--context", str(empty)]
    argv = ["ask", *media, QUESTION, "--model", name, "--method", "snapkv", "--budget", "0.3", "--window", "8",
            "--device", "cpu", "--frames", "8", "--max-new-tokens", str(NEW_TOKENS), "--json", "--quiet"]
    capsys.readouterr()
    assert cli.run(argv) == 0
    return json.loads(capsys.readouterr().out)["answer"]


def test_registered_in_lmms_eval_as_hybridkv():
    from lmms_eval.models import get_model

    assert get_model("hybridkv") is HybridKV


def test_model_args_reach_the_policy_and_bad_ones_are_refused(tmp_path, docs):
    model = make_model("demo", docs, tmp_path / "kv.jsonl")
    assert model.session.policy.name == "snapkv" and model.session.policy.budget == 0.3
    assert model.session.policy.window == 8
    with pytest.raises(UsageError):
        HybridKV.create_from_arg_string("pretrained=demo,method=snapkv,theta=0.5,device=cpu")
    with pytest.raises(UsageError):
        HybridKV.create_from_arg_string("pretrained=demo,device=cpu,batch_size=4")


@pytest.mark.parametrize("name", ["demo", "demo-random"])
def test_generate_until_answers_as_the_cli_and_logs_kv(tmp_path, docs, capsys, name):
    log = tmp_path / "kv.jsonl"
    model = make_model(name, docs, log)
    results = model.generate_until([request(i) for i in range(3)])
    assert all(isinstance(r, GenerationResult) for r in results)
    # The same files the model read: the PIL images as lossless PNGs, the video's own path.
    pngs = []
    for i, image in enumerate(docs[0]["images"]):
        pngs.append(str(tmp_path / f"image{i}.png"))
        image.save(pngs[-1])
    expected = [cli_answer(paths, name, capsys, tmp_path) for paths in (pngs, docs[1]["images"], [])]
    assert [r.text for r in results] == expected
    assert any(expected)  # the demo says something (an all-empty match would prove little)
    # Per sample: KV bytes, ms/token, lmms-eval's token counts; the same entries in the JSONL log.
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["doc_id"] for s in model.samples] == [0, 1, 2] == [s["doc_id"] for s in lines]
    for sample, result in zip(model.samples, results):
        assert sample["method"] == "snapkv" and sample["kv"]["device_bytes"] > 0
        kv = sample["kv"]
        assert kv["host_bytes"] == 0 and kv["full_bytes"] > kv["device_bytes_after_prefill"]
        assert sample["decode"]["tokens"] == result.token_counts.output_tokens <= NEW_TOKENS
        assert result.token_counts.input_tokens > 0
    assert all(s["decode"]["ms_per_token_mean"] > 0 for s in model.samples if s["decode"]["tokens"] > 1)
    assert model.samples[0]["input"]["kind"] == "images" and model.samples[1]["input"]["kind"] == "video"


def test_stop_strings_cut_the_answer(tmp_path, docs):
    model = make_model("demo-random", docs, tmp_path / "kv.jsonl")
    full = model.generate_until([request(0)])[0].text
    assert len(full) > 2
    cut = model.generate_until([request(0, until=[full[2:4]])])[0].text
    assert cut == full.split(full[2:4])[0]
    assert stop_at("a. b", ".") == "a" and stop_at("a. b", ["", "b"]) == "a. " and stop_at("ab", None) == "ab"



def loglikelihood_request(index: int, continuation: str) -> Instance:
    return Instance(request_type="loglikelihood", idx=0,
                    arguments=(QUESTION, continuation, lambda doc: doc["images"], index, "toy", "test"),
                    metadata={"task": "toy", "doc_id": index, "repeats": 1})


def reference_loglikelihood(model: HybridKV, index: int, continuation: str, docs) -> float:
    """Stock transformers: one forward over prompt + continuation, no cache of ours."""
    import torch

    from hybridkv_cli.models.prompt import question_ids

    inputs = dict(model.prepare(QUESTION, docs[index]["images"]).prompt.inputs)
    ids = question_ids(model.loaded.tokenizer, continuation)
    n = inputs["input_ids"].shape[1]
    for key, value in list(inputs.items()):  # the per-token tensors go on with the continuation
        if torch.is_tensor(value) and value.shape == (1, n) and not value.is_floating_point():
            fill = int(key == "attention_mask")  # token types: 0, text
            tail = torch.tensor([ids]) if key == "input_ids" else torch.full((1, len(ids)), fill)
            inputs[key] = torch.cat([value, tail.to(value.dtype)], dim=1)
    with torch.inference_mode():
        logp = model.loaded.model(**inputs).logits[0].float().log_softmax(-1)
    return sum(float(logp[n - 1 + i, token]) for i, token in enumerate(ids))


def test_loglikelihood_through_the_compressed_cache(tmp_path, docs):
    full = HybridKV.create_from_arg_string("pretrained=demo,method=full,device=cpu,frames=8")
    one = HybridKV.create_from_arg_string("pretrained=demo,method=snapkv,budget=1.0,device=cpu,frames=8")
    low = make_model("demo", docs, tmp_path / "kv.jsonl")
    for model in (full, one):
        model.task_dict = {"toy": {"test": docs}}
    requests = [loglikelihood_request(0, " a red box"), loglikelihood_request(1, " nothing at all")]
    scores = full.loglikelihood(requests)
    for (score, _), index, continuation in zip(scores, (0, 1), (" a red box", " nothing at all")):
        assert score == pytest.approx(reference_loglikelihood(full, index, continuation, docs), abs=1e-3)
    at_one = one.loglikelihood(requests)  # b = 1: nothing evicted
    assert [s for s, _ in at_one] == pytest.approx([s for s, _ in scores], abs=1e-4)
    assert [g for _, g in at_one] == [g for _, g in scores]
    assert all(s < 0 for s, _ in low.loglikelihood(requests))
    # The greedy answer's own tokens are greedy; the same text scored after a wrong prefix is not.
    answer = full.generate_until([request(0)])[0].text
    assert answer and full.loglikelihood([loglikelihood_request(0, answer)])[0][1] is True
    assert full.loglikelihood([loglikelihood_request(0, "zzz " + answer)])[0][1] is False
    # A continuation after a video whose time steps run past the prompt's text: still the model's own pass.
    long = HybridKV.create_from_arg_string("pretrained=demo,method=full,device=cpu,frames=64")
    long.task_dict = {"toy": {"test": docs}}
    [(score, _)] = long.loglikelihood([loglikelihood_request(3, " a red box")])
    assert score == pytest.approx(reference_loglikelihood(long, 3, " a red box", docs), abs=1e-3)


def test_documented_cli_run_on_an_offline_task(tmp_path):
    """docs/evaluate.md's tested block, run by bash beside a ``sample_media`` folder: lmms-eval's
    own CLI (``--model hybridkv``, hybridkv at 0.1 on the trained demo) over a local task."""
    text = (REPO / "docs" / "evaluate.md").read_text()
    block = re.search(r"<!-- tested: tests/test_lmms_eval.py -->\n```bash\n(.*?)```", text, re.S).group(1)
    (tmp_path / "sample_media").symlink_to(REPO / "sample_media")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HOME": str(tmp_path / "hf")}  # lmms-eval from this environment; the dataset cache in tmp
    done = subprocess.run(["bash", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    # lmms-eval exits 0 after a failed evaluation too: its results file is the evidence.
    results = list((tmp_path / "logs" / "toy").glob("*/*_results.json"))
    assert len(results) == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads(results[0].read_text())["results"]["hybridkv_toy"]["exact_match,none"] == 1.0
    kv = [json.loads(line) for line in (tmp_path / "logs" / "toy.kv.jsonl").read_text().splitlines()]
    assert [(s["task"], s["doc_id"], s["answer"]) for s in kv] == [("hybridkv_toy", 0, "green"),
                                                                   ("hybridkv_toy", 1, "red")]
    for sample in kv:
        assert (sample["method"], sample["budget"]) == ("hybridkv", 0.1)
        assert sample["kv"]["over_budget_bytes"] == 0 and 0 < sample["kv"]["prompt_ratio"] <= 0.1
