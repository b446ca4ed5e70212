"""The step model: device profiles (presets, files, the probe's fallback), each method's bytes per
tier, the index ``--landmark auto`` takes, and ``hybridkv model-step``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridkv_cli.cli import run
from hybridkv_cli.compression.index_choice import choose_index, every_head_dynamic
from hybridkv_cli.costs import profiles
from hybridkv_cli.costs.profiles import PRESETS, DeviceProfile, profile_from_file, resolve_profile
from hybridkv_cli.costs.step_model import QWEN25_VL_7B, method_traffic, roofline_ms, run_estimate, step_ms
from hybridkv_cli.io.errors import UsageError

H200 = PRESETS["h200-pcie5"]
G = QWEN25_VL_7B


def test_presets_are_valid_and_named():
    assert {"h200-pcie5", "gh200", "l40s-pcie4", "a100-pcie4", "cpu"} <= set(PRESETS)
    assert PRESETS["gh200"].link_gbps > 5 * H200.link_gbps  # NVLink-C2C against PCIe 5


@pytest.mark.parametrize("field,value", [("hbm_gbps", 0), ("link_gbps", -1), ("link_scattered_gbps", math.nan),
                                         ("launch_us", math.inf), ("hbm_gbps", 1e9), ("link_gbps", True),
                                         ("hbm_gbps", "fast")])
def test_a_bad_bandwidth_is_a_usage_error(field, value):
    fields = dict(name="x", hbm_gbps=1000, link_gbps=20, link_scattered_gbps=10, launch_us=3)
    with pytest.raises(UsageError, match=field):
        DeviceProfile(**{**fields, field: value})


def _profile_file(tmp_path, **fields):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(fields))
    return path


def test_a_profile_file_is_read_and_checked(tmp_path):
    good = dict(hbm_gbps=3000, link_gbps=60, link_scattered_gbps=25, launch_us=2.5)
    profile = profile_from_file(_profile_file(tmp_path, **good))
    assert profile.name == "gpu" and profile.hbm_gbps == 3000 and profile.source.endswith("gpu.json")
    with pytest.raises(UsageError, match="missing link_scattered_gbps"):
        profile_from_file(_profile_file(tmp_path, hbm_gbps=3000, link_gbps=60, launch_us=2))
    with pytest.raises(UsageError, match="unknown turbo"):
        profile_from_file(_profile_file(tmp_path, **good, turbo=1))
    with pytest.raises(UsageError, match="hbm_gbps must be"):
        profile_from_file(_profile_file(tmp_path, **{**good, "hbm_gbps": -5}))
    with pytest.raises(UsageError, match="directory"):
        profile_from_file(tmp_path)


def test_an_unknown_profile_name_lists_the_presets():
    with pytest.raises(UsageError, match="h200-pcie5"):
        resolve_profile("h300")


def test_the_probe_falls_back_to_the_preset_without_cuda_and_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(profiles, "_NOTED", set())
    assert resolve_profile("measured") is PRESETS["h200-pcie5"]
    assert resolve_profile("measured") is PRESETS["h200-pcie5"]
    assert capsys.readouterr().err.count("no CUDA device to measure") == 1


def test_the_full_cache_reads_its_kv_and_the_weights_from_hbm():
    tokens = 32768
    kv = 2 * 28 * 4 * 128 * 2 * tokens  # bf16 keys and values
    traffic = method_traffic("full", G, tokens, 1.0, miss_share=0.1)
    assert traffic.hbm == kv and traffic.link == traffic.scattered == 0
    expected = 1e3 * (G.weight_bytes + kv) / 4.8e12 + 28 * 3 * 3e-3
    assert step_ms(H200, G, traffic) == pytest.approx(expected)


def test_host_keys_read_every_code_over_the_link_and_device_keys_from_hbm():
    tokens, b = 32768, 0.1
    host = method_traffic("host-keys", G, tokens, b, miss_share=0.0)
    device = method_traffic("keys", G, tokens, b, miss_share=0.0)
    assert host.link == 28 * 4 * tokens * 128 / 4  # 2 bits a channel
    assert device.link == 0 and device.hbm == host.hbm == pytest.approx(b * G.kv_bytes(tokens))
    assert step_ms(H200, G, host) > step_ms(H200, G, method_traffic("full", G, tokens, 1, miss_share=0))
    assert step_ms(H200, G, device) < step_ms(H200, G, host)


def test_swaps_cost_scattered_link_bytes_in_proportion():
    a = method_traffic("keys", G, 32768, 0.1, miss_share=0.01)
    b = method_traffic("keys", G, 32768, 0.1, miss_share=0.02)
    assert b.scattered == pytest.approx(2 * a.scattered) and a.scattered > 0


def test_the_roofline_is_the_weights_and_the_budgets_kv():
    assert roofline_ms(H200, G, 32768, 0.1, batch=16) == pytest.approx(
        1e3 * (G.weight_bytes + 16 * 0.1 * G.kv_bytes(32768)) / 4.8e12)


@pytest.mark.parametrize("size,budget,index,dynamic", [
    (2, 0.2, "keys", False), (2, 0.125, "keys", False), (2, 0.1, "host-keys", True), (2, 0.05, "host-keys", True),
    (4, 0.1, "keys", False), (4, 0.05, "host-keys", True), (4, 0.03, "host-keys", True),
])
def test_auto_takes_the_fastest_index_that_keeps_the_answers(size, budget, index, dynamic):
    for profile in (H200, PRESETS["gh200"], PRESETS["cpu"]):
        chosen, reason = choose_index(budget, 32768, 4, 128, size, profile)
        assert chosen == index and f"budget {budget:g}" in reason
    assert every_head_dynamic(budget, size) == dynamic


def test_run_estimate_prices_the_runs_counters():
    est = run_estimate(H200, layers=28, weight_bytes=15.2e9, device_kv_bytes=0.1 * G.kv_bytes(32768),
                       h2d_bytes_per_step=1e6, index="keys")
    expected = 1e3 * (15.2e9 + 0.1 * G.kv_bytes(32768)) / 4.8e12 + 1e3 * 1e6 / 20e9 + 28 * 7 * 3e-3
    assert est["ms_per_token"] == pytest.approx(expected, abs=1e-4) and est["profile"] == "h200-pcie5"


def test_a_records_estimate_prices_the_language_models_weights_counted_once():
    """The weights a decode step reads: every parameter outside the vision tower, counted once per
    model (a server prices every answer's record with it)."""
    from hybridkv_cli.models.demo import build_demo
    from hybridkv_cli.runs.record import modelled_step

    loaded = build_demo()
    params = dict(loaded.model.named_parameters())
    language = sum(p.numel() * p.element_size() for name, p in params.items() if "visual" not in name)
    assert 0 < loaded.language_weight_bytes == language < sum(p.numel() * p.element_size() for p in params.values())
    assert "language_weight_bytes" in vars(loaded)  # counted once, then kept
    est = modelled_step(loaded, device_kv_bytes=1 << 20, h2d_per_step=0.0, heads=None)
    assert est == run_estimate(profiles.device_profile(loaded.device), layers=loaded.num_layers,
                               weight_bytes=language, device_kv_bytes=1 << 20, h2d_bytes_per_step=0.0, index=None)


def test_model_step_prints_every_method_with_its_ratio(capsys):
    assert run(["model-step", "--device-profile", "h200-pcie5", "--tokens", "8k,32k", "--batch", "1,16",
                "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert len(rows) == 2 * 2 * 10 and out["profile"]["name"] == "h200-pcie5"
    full = [r for r in rows if r["method"] == "full"]
    assert all(r["speedup_vs_full"] == 1.0 for r in full)
    assert {r["method"] for r in rows} >= {"hybridkv host-keys", "hybridkv (default: host-keys)", "quest"}


@pytest.mark.parametrize("argv,flag", [
    (["--device-profile", "nope"], "--device-profile"), (["--tokens", "0"], "--tokens"),
    (["--batch", "x"], "--batch"), (["--budget", "0"], "--budget"), (["--miss-share", "2"], "--miss-share"),
])
def test_model_step_refuses_bad_values_in_one_line(argv, flag, capsys):
    assert run(["model-step", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "\n" not in err and "Traceback" not in err


def test_a_bad_profile_file_is_exit_2_naming_it(tmp_path, capsys):
    path = _profile_file(tmp_path, hbm_gbps=0, link_gbps=1, link_scattered_gbps=1, launch_us=1)
    assert run(["model-step", "--device-profile", str(path)]) == 2
    assert str(path) in capsys.readouterr().err


def test_the_environment_overrides_the_profile_a_run_is_priced_with(monkeypatch, tmp_path):
    from hybridkv_cli.costs.profiles import device_profile

    assert device_profile(torch.device("cpu")) is PRESETS["cpu"]
    monkeypatch.setenv("HYBRIDKV_DEVICE_PROFILE", "gh200")
    assert device_profile(torch.device("cpu")) is PRESETS["gh200"]
    monkeypatch.setenv("HYBRIDKV_DEVICE_PROFILE", "nope")
    with pytest.raises(UsageError, match="unknown device profile"):
        device_profile(torch.device("cpu"))
