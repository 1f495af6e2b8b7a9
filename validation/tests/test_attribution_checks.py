"""The attribution's own checks (``python -m validation.attribution.X``): the 2- vs 4-layer depth check and a what-if
against the run it predicts, on literal numbers."""

import json

import pytest


def test_the_depth_check_sets_two_depths_full_estimates_side_by_side(tmp_path, capsys):
    # validation/attribution/depth_agreement.py: the 2- vs 4-layer check of the full-depth estimate
    from validation.attribution.depth_agreement import _print_depth_agreement, depth_agreement

    four = {"layers": 4, "full_depth_components_us": {"moe_gemm": 100.0, "rmsnorm": 0.0}}
    two = {"layers": 2, "full_depth_components_us": {"moe_gemm": 95.0, "rmsnorm": 3.0}}
    assert depth_agreement(four, two) == {"moe_gemm": (100.0, 95.0, 0.05), "rmsnorm": (0.0, 3.0, None)}
    paths = [tmp_path / "l4.json", tmp_path / "l2.json"]
    for path, info in zip(paths, (four, two), strict=True):
        path.write_text(json.dumps({"c1": info}))
    _print_depth_agreement(*map(str, paths))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "c1: full-depth estimate from 4 vs 2 layers (µs/step)"
    assert out[1].split() == ["moe_gemm", "100.0", "95.0", "+5.0%"]
    assert out[2].split() == ["rmsnorm", "0.0", "3.0", "n/a"]


def attribution(busy, mla, what_if=None):
    info = {"busy_us": busy, "components_us": {"mla_attention": mla, "dense_gemm": busy - mla}}
    if what_if is not None:
        info["scenarios"] = {"what_if": [{"label": "mla_attention=vllm-triton_mla", "change_us": what_if,
                                          "kernel_us": busy + what_if}]}
    return info


def test_verify_sets_the_predicted_change_against_the_measured_one(tmp_path, capsys):
    from validation.attribution.verify import compare, main

    before = {"c1": attribution(1500.0, 80.0, what_if=150.0), "c64": attribution(2800.0, 210.0, what_if=120.0)}
    after = {"c1": attribution(1640.0, 220.0), "c64": attribution(3000.0, 300.0)}
    rows = compare(before, after, "mla_attention=vllm-triton_mla")
    assert rows["c1"]["busy_change_us"] == pytest.approx(140.0)
    assert rows["c1"]["busy_error"] == pytest.approx(150 / 140 - 1)
    assert rows["c1"]["busy_within"]
    assert rows["c64"]["group_change_us"] == pytest.approx(90.0)
    assert not rows["c64"]["busy_within"]  # 120 predicted vs 200 measured: -40 %
    with pytest.raises(ValueError, match="the first session has no --what-if mla_attention=torch"):
        compare(before, after, "mla_attention=torch")
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (before, after), strict=False):
        path.write_text(json.dumps(data))
    assert main([*map(str, paths), "mla_attention=vllm-triton_mla"]) == 0
    out = capsys.readouterr().out
    assert "c1: predicted change +150.0" in out
    assert "(within 25%)" in out
    assert "(NOT within 25%)" in out
    assert main([str(paths[0]), str(tmp_path / "none.json"), "mla_attention=x"]) == 2
