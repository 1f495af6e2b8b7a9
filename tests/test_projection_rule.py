"""The projection rule on committed files: its fit on the stored H200 results, its projection between GPUs and
cache states, the stored fit and the bands (the cross-GPU checks and the box report: validation/tests)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from decodebench.attribution.predict import project as projecting
from decodebench.attribution.predict import projection_rule
from decodebench.attribution.predict.prediction import load_results
from decodebench.attribution.predict.projection_rule import (
    DEVICE_FACTS,
    Case,
    DeviceModel,
    device_facts,
    fit,
    project_case,
    traffic_us,
)
from decodebench.attribution.predict.targets import load_target
from tests.conftest import REPO

BASELINES = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
NIGHTLY = BASELINES / "0005_h200-vllm-nightly-gated.json"
MLA = BASELINES / "0004_h200-vllm-mla-all-backends.json"
# small copies of measured files: an H100's TP-8 kernel set on both timers (samples and unread fields left out)
DATA = REPO / "tests" / "data" / "projection"
H100 = {timer: DATA / f"h100-{timer}.json.gz" for timer in ("kernel", "step")}


def load_cases(path, backends="vllm"):
    """The cases of one GPU's result file as the product's fit reads them (project.cases_by_gpu), and the GPU."""
    (gpu, cases), = projecting.cases_by_gpu(load_results(path)[0]).items()
    return [c for c in cases if c.backend.startswith(backends)], device_facts(gpu)


@pytest.fixture(scope="module")
def h200():
    cases, facts = load_cases(NIGHTLY)
    cases += load_cases(MLA, "vllm-triton")[0]
    return cases, facts, fit(cases, facts, "H200 (test)")


def test_fit_on_the_stored_h200_results_names_the_case_behind_each_parameter(h200):
    cases, facts, params = h200
    assert facts.name == "H200 SXM"
    assert facts.l2_bytes == 62914560
    assert params.floor_us == min(c.median_us / c.kernels for c in cases)
    assert "test_rmsnorm[" in params.sources["floor_us"]
    assert 0.7 < params.dram_fraction < 1.0  # measured, below the 4.8 TB/s datasheet
    assert 10 < params.l2_bytes_per_sm_cycle < 64
    assert "the fastest of 55 cases timed warm over 4 L2 sizes" in params.sources["dram_fraction"]
    assert params.moe_overlap == projection_rule.MOE_OVERLAP
    assert "stated default" in params.sources["moe_overlap"]
    assert {"floor_us", "dram_fraction", "l2_bytes_per_sm_cycle", "moe_overlap"} < set(params.sources)
    assert {f"sm_bytes_per_cycle.{c}" for c in params.sm_bytes_per_cycle} <= set(params.sources)


def test_a_stored_fit_is_written_beside_the_results_and_used_for_those_results_only(tmp_path, capsys):
    """``fit`` writes rule-<gpu>.json beside the results; scenarios --project-to on the same results loads it,
    and a rule file of another code version is left out, saying so."""
    from decodebench.attribution.cli import scenarios as main
    from decodebench.attribution.predict import rule_file
    results = tmp_path / "step.json.gz"
    results.write_bytes(H100["step"].read_bytes())
    assert rule_file.main([str(results)]) == 0
    stored = json.loads((tmp_path / "rule-h100-sxm.json").read_text())
    assert stored["code_version"] == rule_file.CODE_VERSION
    assert stored["bands"]
    assert "floor_us" in stored["params"]["sources"]
    assert str(results) in stored["results"]
    assert main([str(results), "--batch", "64", "--project-to", "rtx-pro-6000-x8-pcie"]) == 0
    out = capsys.readouterr()
    assert f"the stored fit {tmp_path / 'rule-h100-sxm.json'}" in out.out
    (tmp_path / "rule-h100-sxm.json").write_text(json.dumps({**stored, "code_version": "other"}))
    assert main([str(results), "--batch", "64", "--project-to", "rtx-pro-6000-x8-pcie"]) == 0
    assert "fitted by another version of the rule (other" in capsys.readouterr().err
    (tmp_path / "rule-h100-sxm.json").write_text("{}")
    assert main([str(results), "--batch", "64", "--project-to", "rtx-pro-6000-x8-pcie"]) == 2
    assert "not a rule file written by python -m decodebench fit" in capsys.readouterr().err


def test_a_case_projected_to_its_own_gpu_and_state_keeps_its_time(h200):
    cases, facts, params = h200
    model = DeviceModel(facts, params)
    assert all(project_case(c, model, model, "warm", "warm") == pytest.approx(c.median_us) for c in cases)


def test_h200_to_h100_moves_only_what_the_hbm_bounds(h200):
    cases, facts, params = h200
    here = DeviceModel(facts, params)
    there = DeviceModel(device_facts("NVIDIA H100 80GB HBM3", {"l2_bytes": facts.l2_bytes}), params)
    by_name = {c.name: c for c in cases}
    norm = by_name["test_rmsnorm[add-w7168-m1-vllm]"]  # 72 KB: in L2 on both, same die and clocks
    assert project_case(norm, here, there, "warm", "warm") == pytest.approx(norm.median_us)
    kv = by_name["test_mla_decode[uniform-h8-b256-l8192-vllm-flash_attn_mla]"]  # 2.4 GB from HBM
    ratio = project_case(kv, here, there, "warm", "warm") / kv.median_us
    assert traffic_us(kv, here, "warm", projection_rule.sm_bounded(kv, here))[1] == "dram"
    assert 1.3 < ratio <= 4.8 / 3.35 + 1e-9  # the HBM ratio at most: the floor does not scale


def test_the_decode_step_state_reads_weights_from_dram_and_beats_the_bound_only_as_it_did_here(h200):
    cases, facts, params = h200
    here, box_gpu = DeviceModel(facts, params), DeviceModel(DEVICE_FACTS["RTX PRO 6000 Blackwell"], params)
    gemm = next(c for c in cases if c.name == "test_dense_gemm[q_a-n2112-k7168-m1-vllm]")
    assert traffic_us(gemm, here, "warm")[1] == "l2"
    assert traffic_us(gemm, here, "step")[1] == "dram"
    beat = 0
    for c in cases:
        there = project_case(c, here, box_gpu, "warm", "step")
        fraction = min(1.0, (c.median_us - here.floor_us(c)) / traffic_us(c, here, "warm")[0])
        beat += fraction < 1
        assert there >= box_gpu.floor_us(c) + traffic_us(c, box_gpu, "step")[0] * fraction - 1e-9
    assert 0 < beat < len(cases) / 4  # the rates are 90th percentiles: a few cases beat them


def test_the_traffic_split_of_the_stored_cases():
    cases = {c.name: c for c in load_cases(NIGHTLY)[0]}
    moe = cases["test_moe[fused-e384-top8-g32-n512k7168-n7168k256-uniform-m1-vllm]"]
    assert moe.kernels == 6
    assert moe.state_bytes > 0.99 * moe.bytes
    assert moe.dequant_weights > 0
    assert moe.tensor_flops == 2 * 16 * moe.dequant_weights
    kv = cases["test_mla_decode[uniform-h8-b1-l1024-vllm-flash_attn_mla]"]
    assert kv.state_bytes == 1024 * 576 * 2


def test_bad_input_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match="knows no such GPU"):
        device_facts("NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="no cases"):
        fit([], DEVICE_FACTS["H200 SXM"], "empty")
    tiny = [Case("n", "rmsnorm", "vllm", {}, 2.0, "kernel", 1, 100, 100, 0, 0)]
    with pytest.raises(ValueError, match="achievable DRAM bandwidth cannot be fitted"):
        fit(tiny, DEVICE_FACTS["H200 SXM"], "tiny")


def test_the_sm_bound_holds_only_for_cases_that_did_not_beat_it(h200):
    cases, facts, params = h200
    here = DeviceModel(facts, params)
    assert {"moe", "dense_gemm", "mla_decode"} <= set(params.sm_bytes_per_cycle)
    by_name = {c.name: c for c in cases}
    long_kv = by_name["test_mla_decode[uniform-h8-b256-l8192-vllm-flash_attn_mla]"]  # ran faster than the SM bound
    assert not projection_rule.sm_bounded(long_kv, here)
    assert traffic_us(long_kv, here, "warm", sm=False)[1] == "dram"
    moe = by_name["test_moe[fused-e384-top8-g32-n512k7168-n7168k256-uniform-m64-vllm]"]
    assert projection_rule.sm_bounded(moe, here)
    h100 = DeviceModel(device_facts("NVIDIA H100 80GB HBM3"), params)  # same SMs and clock, 0.7x the HBM
    assert 1.0 <= project_case(moe, here, h100, "warm", "warm") / moe.median_us < 1.2


def test_the_overlap_form_carries_the_sm_time_and_swaps_the_memory_time():
    """``a = s + m - k min(s, m)``: the SM time read back from ``a`` on one side is kept (scaled by the SMs and
    clock), the memory time is the other side's; a time under its memory time keeps that fraction of it."""
    overlapped = projection_rule.overlapped
    for s_, m, m2, k in ((280.0, 200.0, 285.0, 0.69), (150.0, 285.0, 200.0, 0.68), (100.0, 50.0, 40.0, 0.0)):
        a = s_ + m - k * min(s_, m)
        assert overlapped(a, m, m2, k) == pytest.approx(s_ + m2 - k * min(s_, m2))
        assert overlapped(a, m, m2, k, 0.5) == pytest.approx(s_ / 2 + m2 - k * min(s_ / 2, m2))
    assert overlapped(80.0, 100.0, 50.0, 0.7) == pytest.approx(40.0)
    assert overlapped(80.0, 0.0, 50.0, 0.7, 0.5) == pytest.approx(40.0)


def test_the_fused_moe_alone_takes_the_overlap_form(h200):
    cases, facts, params = h200
    with_k = DeviceModel(facts, replace(params, moe_overlap=0.68))
    h100 = DeviceModel(device_facts("NVIDIA H100 80GB HBM3"), with_k.params)
    by_name = {c.name: c for c in cases}
    fused = by_name["test_moe[fused-e384-top8-g32-n512k7168-n7168k256-uniform-m64-vllm]"]
    alone = by_name["test_moe[gate_up-e384-top8-g32-n512k7168-uniform-m64-vllm]"]
    m_here, m_there = (traffic_us(fused, d, "warm", sm=False)[0] for d in (with_k, h100))
    assert project_case(fused, with_k, h100, "warm", "warm") == pytest.approx(
        h100.floor_us(fused) + projection_rule.overlapped(fused.median_us - with_k.floor_us(fused), m_here, m_there,
                                                          0.68))
    without = DeviceModel(facts, params)
    assert project_case(alone, with_k, h100, "warm", "warm") == project_case(
        alone, without, DeviceModel(h100.facts, params), "warm", "warm")  # a stage timed alone: the larger bound


def test_the_default_timers_results_alone_reach_the_measured_rule_and_the_box_gets_its_own_band(capsys):
    """The nightly's default ``step`` timer alone fits the rule (its L2 rate from the activation cases); to the
    SM120 box the projection prints the error measured against the box's published figures, never the Hopper
    pairs' band; to a Hopper target, the Hopper band."""
    from decodebench.attribution.cli import scenarios as main
    assert main([str(H100["step"]), "--batch", "64", "--project-to", "rtx-pro-6000-x8-pcie"]) == 0
    out = capsys.readouterr().out
    assert "rule: measured" in out
    assert "rule: datasheet" not in out
    assert "published figures of 8x RTX PRO 6000" in out
    assert "between two Hopper GPUs" not in out
    assert main([str(H100["step"]), "--batch", "64", "--project-to", "h200-x8-nvlink"]) == 0
    assert "between two Hopper GPUs" in capsys.readouterr().out


def test_a_pair_of_sm_designs_without_a_measured_band_says_so(tmp_path):
    (tmp_path / "bands.json").write_text(json.dumps({"bands": []}))
    assert projecting.band("sm90", "sm120", tmp_path / "bands.json") is None
    (tmp_path / "bad.json").write_text(json.dumps({"bands": [{"low": 0}]}))
    with pytest.raises(ValueError, match="not a bands file"):
        projecting.band("sm90", "sm120", tmp_path / "bad.json")


def test_the_rule_is_fitted_once_per_gpu_per_process(monkeypatch):
    from decodebench.attribution.predict.prediction import load_results, predict_step, step_of
    from decodebench.model import load_model_spec
    calls = []
    real = projecting.fit
    monkeypatch.setattr(projecting, "fit", lambda *a, **k: calls.append(a[1].name) or real(*a, **k))
    monkeypatch.setattr(projecting, "_FITS", {})
    results, spec = load_results(H100["step"])[0], load_model_spec("kimi-k2.5")
    target = load_target("rtx-pro-6000-x8-pcie")
    totals = {projecting.project(step_of(predict_step(results, spec, 8, m, 1024), results), spec, 8, target,
                                 results).step.total_us for m in (1, 64, 1)}
    assert calls == ["H100 SXM"]
    assert len(totals) == 2


def test_the_overlap_share_is_a_parameter_with_its_source():
    cases, facts = load_cases(H100["kernel"])
    params = fit(cases, facts, "test")
    assert params.moe_overlap == projection_rule.MOE_OVERLAP
    assert "stated default" in params.sources["moe_overlap"]
    assert fit(cases, facts, "test", moe_overlap=(0.5, "given")).sources["moe_overlap"] == "given"
    with pytest.raises(ValueError, match="overlap share 1 is outside"):
        fit(cases, facts, "test", moe_overlap=(1.0, "given"))
