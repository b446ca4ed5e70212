"""The two-stage label index (``--landmark labels``): its ranking, its bytes, its label files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridkv_cli import cli
from hybridkv_cli.compression import make_policy
from hybridkv_cli.compression.base import PrefillLayer
from hybridkv_cli.compression.labels import channel_weights, choose_labels
from hybridkv_cli.compression.landmarks import HostKeys, LabelKeys, QuantKeys
from hybridkv_cli.io.errors import UsageError
from demo_fixtures import cached_demo, demo  # noqa: F401

CLIP = Path(__file__).resolve().parents[1] / "sample_media" / "needle.mp4"


def layer(n: int = 400, heads: int = 2, dim: int = 64, index: int = 0, dtype=torch.float32) -> PrefillLayer:
    g = torch.Generator().manual_seed(index)
    keys = torch.randn(heads, n, dim, generator=g)
    keys[:, :, 5] *= 8  # one loud channel per head
    visual = torch.zeros(n, dtype=torch.bool)
    visual[4: n - 20] = True
    return PrefillLayer(index=index, num_layers=1, query=torch.randn(heads, 3, n, dim, generator=g).to(dtype),
                        keys=keys.to(dtype), values=torch.randn(heads, n, dim, generator=g).to(dtype), visual=visual,
                        scale=dim**-0.5)


def test_with_every_token_a_candidate_the_labels_rank_as_2bit_keys():
    """Stage 2 reads every channel at 2 bits: when stage 1 passes every token on, the pair picks
    exactly what 2-bit keys pick."""
    torch.manual_seed(0)
    keys = torch.randn(3, 40, 1, 32)
    channels = choose_labels(torch.rand(3, 32), 8)
    q = torch.randn(3, 4, 32)
    pair = LabelKeys.build(keys, channels).top(q, 10)  # 4 x 10 candidates >= 40 tokens
    assert torch.equal(pair, QuantKeys.build(keys).top(q, 10))


def test_the_label_channels_are_the_heaviest_products():
    prefill = layer()
    labels = choose_labels(channel_weights(prefill), 16)
    assert labels.shape == (2, 16) and (labels == 5).any(dim=1).all()  # the loud channel is a label
    assert torch.equal(labels, labels.sort(dim=1).values)


def test_the_device_index_is_a_sixty_fourth_of_the_bf16_kv():
    prefill = layer(n=2000, dtype=torch.bfloat16)
    kv = make_policy("hybridkv", budget=0.05, theta=1.0, landmark="labels").compress(prefill).kv
    marks = kv.dynamic.landmarks
    tokens = marks.codes.shape[-1]
    per_token = marks.codes.numel() / (marks.codes.shape[0] * tokens)
    assert per_token / (2 * 64 * 2) == 1 / 64  # bytes a token and head over its bf16 key and value
    assert marks.host_codes.device.type == "cpu" and kv.host_bytes() > kv.dynamic.host_k.nbytes * 2


def test_a_step_counts_the_host_codes_it_reads():
    prefill = layer()
    kv = make_policy("hybridkv", budget=0.2, theta=1.0, landmark="labels").compress(prefill).kv
    slots = kv.dynamic.resident.shape[1]
    kv.attend(torch.randn(2, 3, 64), 0.125)
    moved = kv.transferred_bytes()
    kv.attend(torch.randn(2, 3, 64), 0.125)
    assert kv.transferred_bytes() - moved >= 2 * min(400, 4 * slots) * 64 // 4


def test_at_budget_one_labels_keep_the_full_cache_answer(demo, capsys):  # noqa: F811
    args = ["ask", str(CLIP), "What colour is the star?", "--model", "demo", "--max-new-tokens", "4", "--json"]
    assert cli.run(args + ["--method", "full"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert cli.run(args + ["--method", "hybridkv", "--landmark", "labels", "--budget", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["answer"] == full["answer"]


def test_calibrate_writes_a_label_file_that_ask_reads(tmp_path, capsys):
    tasks = tmp_path / "dev.jsonl"
    tasks.write_text("\n".join(json.dumps({"id": f"t{i}", "media": str(CLIP), "question": q})
                               for i, q in enumerate(["What colour is the star?", "What shape is it?"])))
    labels = tmp_path / "labels.json"
    assert cli.run(["calibrate", "--tasks", str(tasks), "--model", "demo", "-o", str(labels), "-q"]) == 0
    content = json.loads(labels.read_text())
    assert content["rows"] == 2 and content["model"] == "demo" and len(content["weights"]) == 4
    capsys.readouterr()
    args = ["ask", str(CLIP), "What colour is the star?", "--model", "demo", "--max-new-tokens", "3", "--json",
            "--budget", "0.1", "--landmark", "labels"]
    assert cli.run(args + ["--index-file", str(labels)]) == 0
    assert json.loads(capsys.readouterr().out)["heads"]["label_channels"] == f"file {labels}"
    assert cli.run(args) == 0
    assert json.loads(capsys.readouterr().out)["heads"]["label_channels"].startswith("from the prompt")


@pytest.mark.parametrize("content,message", [
    ("not json", "not JSON"),
    (json.dumps({"format": "other"}), "is not a label file"),
    (json.dumps({"format": "hybridkv-labels", "version": 9, "weights": []}), "version 9"),
    (json.dumps({"format": "hybridkv-labels", "version": 1, "weights": [[[1, -1]]]}), "layer 0: weights"),
])
def test_bad_label_files_are_one_line_usage_errors(tmp_path, content, message):
    path = tmp_path / "labels.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        make_policy("hybridkv", landmark="labels", index_file=str(path))


def test_a_label_file_of_another_geometry_is_refused(tmp_path):
    path = tmp_path / "labels.json"
    path.write_text(json.dumps({"format": "hybridkv-labels", "version": 1, "weights": [[[1.0] * 32] * 2]}))
    policy = make_policy("hybridkv", budget=0.1, theta=1.0, landmark="labels", index_file=str(path))
    with pytest.raises(UsageError, match="layer 0 has weights for 2 heads of 32 channels, the model has 2 of 64"):
        policy.compress(layer())


@pytest.mark.parametrize("dtype,budget,expected", [
    (torch.float32, 0.1, "keys"), (torch.float32, 0.05, "host-keys"),  # fp32 keys: 1/32 of the KV
    (torch.bfloat16, 0.2, "keys"), (torch.bfloat16, 0.1, "host-keys"),  # bf16 keys: 1/16
    (torch.bfloat16, 1.0, "keys"),  # b = 1 keeps the full cache: nothing to rank
])
def test_auto_keeps_the_keys_on_the_device_while_they_cost_at_most_half_the_budget(dtype, budget, expected):
    prefill = layer(n=1200, dtype=dtype)
    policy = make_policy("hybridkv", budget=budget, theta=1.0)
    compressed = policy.compress(prefill)
    summary = policy.summary([compressed.report])
    assert summary["landmark"] == expected and summary["landmark_reason"]
    if budget < 1:
        marks = compressed.kv.dynamic.landmarks
        assert type(marks) is {"keys": QuantKeys, "host-keys": HostKeys}[expected]
        assert (marks.host_bytes() > 0) == (expected == "host-keys")  # the codes' bytes, in host memory
        codes = marks.codes  # rows on whole 128-byte lines, the padding counted where the codes live
        assert codes.stride(1) % 128 == 0 and codes.stride(1) >= codes.shape[2]
        padded = codes.shape[0] * codes.shape[1] * codes.stride(1)
        assert (marks.host_bytes() if expected == "host-keys" else marks.device_bytes() - marks.bounds.nbytes) == padded


def test_with_the_keys_on_the_host_the_window_takes_at_most_a_quarter_of_a_head():
    prefill = layer(n=1200, dtype=torch.bfloat16)
    policy = make_policy("hybridkv", budget=0.05, theta=1.0)
    record = policy.compress(prefill).report
    assert record.landmark == "host-keys" and record.window <= record.plan.entries.max() // 4 < 16


@pytest.mark.parametrize("landmark", ["auto", "host-keys", "labels"])  # keys alone overrun b = 0.05
@pytest.mark.parametrize("budget,dynamic", [(0.05, 2), (0.5, 0)])
def test_one_rule_makes_every_head_dynamic_where_the_keys_would_cost_over_half_the_budget(landmark, budget, dynamic):
    """θ = 0 would make every head static; where 2-bit keys would cost over half the budget (a
    one-shot selection keeps too little), every head is dynamic whatever the landmark."""
    prefill = layer(n=1200, dtype=torch.bfloat16)
    policy = make_policy("hybridkv", budget=budget, theta=0.0, refresh="none", landmark=landmark)
    report = policy.compress(prefill).report
    assert int((~report.plan.static).sum()) == dynamic


@pytest.mark.parametrize("landmark", ["host-keys", "keys"])
def test_dynamic_slots_are_filled_at_prefill_with_the_last_querys_best_tokens(landmark):
    """Every slot holds, right after compression, a token the last prompt query's exact logits rank
    first (max over the group), its key and value in the store rows: the first decode step then
    copies only what its own ranking changes."""
    prefill = layer(n=1200, dtype=torch.float32)
    kv = make_policy("hybridkv", budget=0.05, landmark=landmark).compress(prefill).kv
    dyn, store = kv.dynamic, kv.store
    n = dyn.resident.shape[1]
    assert n > 0 and bool((dyn.resident >= 0).all())
    for i, head in enumerate(dyn.heads.tolist()):
        span = dyn.host_k.shape[1]
        logits = (prefill.query[head, :, -1] @ prefill.keys[head, :span].T).amax(dim=0)
        assert dyn.resident[i].tolist() == sorted(logits.topk(n).indices.tolist())
        rows = dyn.slot_base[i] + torch.arange(n)
        assert torch.equal(store.keys[rows], prefill.keys[head, dyn.resident[i]])
        assert torch.equal(store.values[rows], prefill.values[head, dyn.resident[i]])
