"""What-if, Amdahl, projection to another box, targets and the scenario chart, with literal numbers;
the projection of the committed H200 baselines to the users' 8x RTX PRO 6000 PCIe box; the
offline command and its one-line errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from decodebench.attribution.cli import scenarios as main
from decodebench.attribution.predict.chart import chart_bars, write_scenarios_chart
from decodebench.attribution.predict.prediction import load_results, predict_step, step_of
from decodebench.attribution.predict.project import ProjectionRule, band, project
from decodebench.attribution.predict.scenarios import Profiled, answer, answer_lines, check_what_ifs
from decodebench.attribution.predict.step import KernelResult, Prediction, Step, Term, WhatIfError
from decodebench.attribution.predict.targets import fit_link, link_table, load_target
from decodebench.attribution.predict.whatif import ChangeKind, amdahl, apply_what_if, parse_what_if
from decodebench.model import load_model_spec
from tests.conftest import REPO

KIMI = load_model_spec("kimi-k2.5")
TINY = load_model_spec("tiny-kimi")  # 2 layers, the first dense
H200_BW, H200_FLOPS = 4.8e12, 989e12
BASELINES = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"


def result(name, component, shape, median_s, backend="vllm", **info):
    return KernelResult(name, component, backend, shape, median_s, info)


def on_h200(name, component, shape, median_s, nbytes, flops=0, backend="vllm", **info):
    """A result as measured on an H200: fractions of peak from its bytes and FLOPs, as roofline.py stores them."""
    gbps, tflops = nbytes / median_s, flops / median_s
    return result(name, component, shape, median_s, backend, bytes_read=nbytes, bytes_written=0, flops=flops,
                  frac_peak_bw=gbps / H200_BW, frac_peak_flops=tflops / H200_FLOPS, peaks_source="H200", **info)


# --- what-if --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "kind", "value"), [
    ("allreduce=0.5x", ChangeKind.FACTOR, 0.5),
    ("moe=2x", ChangeKind.FACTOR, 2.0),
    ("dense_gemm=roofline", ChangeKind.ROOFLINE, None),
    ("mla_attention=vllm-triton_mla", ChangeKind.BACKEND, "vllm-triton_mla"),
    ("moe=my_fused_moe@stored.json", ChangeKind.BACKEND, "my_fused_moe"),
])
def test_what_if_values_parse(text, kind, value):
    (change,) = parse_what_if(text).changes
    assert change.kind is kind
    assert (change.factor if kind is ChangeKind.FACTOR else change.backend) == value
    assert parse_what_if(text).label == text


@pytest.mark.parametrize(("text", "message"), [
    ("moe_gemm=0.5x", "unknown component 'moe_gemm'"),
    ("allreduce", "is not COMPONENT=VALUE"),
    ("allreduce=0.5", "'0.5' is no factor: write 0.5x"),
    ("moe=a b", "neither a factor"),
    ("moe=0.5x,moe=2x", "named twice"),
    ("moe=-1x", "'-1x': a factor is a time multiplier of 0 or more"),
])
def test_bad_what_ifs_are_one_line_errors_naming_the_value(text, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_what_if(text)
    assert text in str(err.value)
    assert "\n" not in str(err.value)


NORM = {"tokens": 1, "role": "hidden", "fused_add": True, "width": 7168}
MLA = {"batch": 1, "heads": 8, "mixed": False, "context_max": 1024}
POOL = [
    on_h200("norm-m1", "rmsnorm", NORM, 2e-6, 43_008),
    on_h200("mla-fa-b1", "mla_decode", MLA, 10e-6, 1_200_000, backend="vllm-flash_attn_mla", dispatched=True),
    on_h200("mla-tri-b1", "mla_decode", MLA, 50e-6, 1_200_000, backend="vllm-triton_mla", dispatched=False),
    on_h200("mla-tri-b64", "mla_decode", {**MLA, "batch": 64}, 70e-6, 9_000_000, backend="vllm-triton_mla"),
    on_h200("mla-tri-mixed", "mla_decode", {**MLA, "mixed": True}, 1e-3, 9_000_000, backend="vllm-triton_mla"),
    result("ar-m1", "allreduce", {"tokens": 1}, 20e-6, "torch", world_size=8, message_bytes=14336),
]


def today_step() -> Step:
    return step_of(predict_step(POOL, KIMI, tp=8, batch=1, context=1024), POOL)


def test_today_takes_the_dispatched_mla_backend_and_joins_every_term_to_its_result():
    step = today_step()
    groups = step.groups_us()
    assert groups["mla_attention"] == pytest.approx(61 * 10.0)  # FlashAttention MLA (dispatched), not Triton
    assert groups["allreduce"] == pytest.approx(123 * 20.0)  # 1 + 2 x 61 layers at TP 8
    assert groups["rmsnorm"] == pytest.approx(122 * 2.0)  # only the fused-add norm was benchmarked
    assert all(p.result is not None for p in step.parts)


def test_a_factor_scales_its_group_only():
    step = apply_what_if(today_step(), parse_what_if("allreduce=0.5x"), POOL)
    assert step.groups_us()["allreduce"] == pytest.approx(123 * 10.0)
    assert step.groups_us()["mla_attention"] == pytest.approx(61 * 10.0)
    assert step.label == "allreduce=0.5x"


def test_a_backend_what_if_takes_the_same_benchmark_of_that_backend_at_the_nearest_point():
    step = apply_what_if(today_step(), parse_what_if("mla_attention=vllm-triton_mla"), POOL)
    (mla,) = [p for p in step.parts if p.group == "mla_attention"]
    assert mla.benchmark == "mla-tri-b1"  # batch 1 nearest, not the b64 point, never the mixed-length benchmark
    assert mla.us == pytest.approx(61 * 50.0)
    assert step.total_us - today_step().total_us == pytest.approx(61 * 40.0)


def test_roofline_is_the_larger_of_the_memory_and_compute_bounds():
    step = apply_what_if(today_step(), parse_what_if("rmsnorm=roofline"), POOL)
    (norm,) = [p for p in step.parts if p.group == "rmsnorm"]
    assert norm.per_call_us == pytest.approx(43_008 / H200_BW * 1e6)


def test_a_backend_without_results_and_a_component_without_a_roofline_are_errors_naming_the_value():
    with pytest.raises(WhatIfError, match=r"mla_attention=vllm-nope: no mla_attention results of backend 'vllm-nope' "
                                          r"\(have: vllm-flash_attn_mla, vllm-triton_mla\)"):
        apply_what_if(today_step(), parse_what_if("mla_attention=vllm-nope"), POOL)
    with pytest.raises(WhatIfError, match="allreduce=roofline: ar-m1 carries no roofline"):
        apply_what_if(today_step(), parse_what_if("allreduce=roofline"), POOL)
    with pytest.raises(WhatIfError, match="no moe results of backend 'mine'"):
        check_what_ifs([parse_what_if("moe=mine")], POOL)


def test_a_backend_from_a_stored_file(tmp_path):
    stored = tmp_path / "other.json"
    stored.write_text(json.dumps({"benchmarks": [{"name": "mla-other", "stats": {"median": 30e-6}, "extra_info": {
        "component": "mla_decode", "backend": "my_mla", "shape": MLA}}]}))
    step = apply_what_if(today_step(), parse_what_if(f"mla_attention=my_mla@{stored}"), POOL)
    assert step.groups_us()["mla_attention"] == pytest.approx(61 * 30.0)


def test_amdahl_gives_the_step_with_a_group_at_zero_and_at_its_roofline():
    step = today_step()
    bounds = amdahl(step)
    total = step.total_us
    assert bounds["mla_attention"]["zero_us"] == pytest.approx(total - 610.0)
    roof = 61 * 1_200_000 / H200_BW * 1e6
    assert bounds["mla_attention"]["roofline_us"] == pytest.approx(total - 610.0 + roof)
    assert bounds["allreduce"]["roofline_us"] is None  # a collective stores no bytes/FLOPs fractions


def test_a_what_if_moves_the_profiled_step_and_tpot_by_its_change():
    pred = predict_step(POOL, KIMI, tp=8, batch=1, context=1024)
    info = answer(pred, POOL, KIMI, 8, what_ifs=[parse_what_if("mla_attention=vllm-triton_mla")],
                  profiled=Profiled(step_us=20_000.0, tpot_us=21_000.0, idle_us=5_000.0, not_benchmarked_us=500.0))
    (what_if,) = info["what_if"]
    assert what_if["change_us"] == pytest.approx(61 * 40.0)
    assert what_if["step_us"] == pytest.approx(20_000.0 + 61 * 40.0)
    assert what_if["tpot_us"] == pytest.approx(21_000.0 + 61 * 40.0)
    assert any("GPU idle and the kernels no benchmark covers stay as profiled" in a for a in what_if["assumptions"])
    zero = info["today"]["amdahl"]["allreduce"]["step_zero_us"]
    assert zero == pytest.approx(20_000.0 - 123 * 20.0)
    text = "\n".join(answer_lines("c1", info))
    assert "mla_attention=vllm-triton_mla" in text
    assert "the most one component can give" in text


# --- projection -------------------------------------------------------------------------------


def test_link_model_is_alpha_plus_bytes_over_the_algorithm_bandwidth():
    link = link_table()["pcie5-switch"]
    assert link.beta_bytes_per_s(8) == pytest.approx(41.1e9 * 8 / 14)
    assert link.allreduce_us(3_670_016, 8) == pytest.approx(24.1 + 3_670_016 / (41.1e9 * 8 / 14) * 1e6)
    assert all(entry.source for entry in link_table().values())


def test_link_fit_recovers_alpha_and_beta_prefers_graph_figures_and_needs_two_sizes():
    def ar(size, us, timer):
        return result(f"ar{size}-{timer}", "allreduce", {"tokens": 1}, us * 1e-6, "torch", world_size=8,
                      message_bytes=size, timer=timer)
    points = [ar(b, 30 + b / 2e4, "graph") for b in (16_384, 1 << 20, 4 << 20)] + [ar(1 << 20, 999.0, "events")]
    fit = fit_link(points, 8)
    assert (fit.alpha_us, fit.beta_bytes_per_s) == (pytest.approx(30.0), pytest.approx(2e10))
    assert fit.worst_error == pytest.approx(0.0, abs=1e-9)
    assert fit_link(points[:1], 8) is None
    assert fit_link(points, 4) is None  # other ranks


def test_memory_bound_kernels_scale_with_bandwidth_and_compute_bound_ones_with_flops(tmp_path):
    # a memory-bound GEMV at 50 % of the H200's bandwidth; a compute-bound GEMM at 40 % of its FLOP/s
    gemv = on_h200("gemv", "dense_gemm", {"op": "lm_head", "M": 1}, 20e-6, int(0.5 * H200_BW * 20e-6))
    gemm = on_h200("gemm", "dense_gemm", {"op": "q_a", "M": 1}, 100e-6, 1_000_000, int(0.4 * H200_FLOPS * 100e-6))
    pool = [gemv, gemm]
    step = step_of(predict_step(pool, TINY, tp=1, batch=1, context=64), pool)
    target = load_target("h200-x1")
    same = project(step, TINY, 1, target, pool).step
    assert same.total_us == pytest.approx(step.total_us)  # to the machine measured: the prediction itself
    rtx = tmp_path / "rtx-tp1.json"
    rtx.write_text(json.dumps({"device": "RTX PRO 6000 Blackwell", "gpus": 1, "tp": 1}))
    there = project(step, TINY, 1, load_target(str(rtx)), pool, ProjectionRule.DATASHEET)
    assert there.rule is ProjectionRule.DATASHEET
    by_name = {p.benchmark: p for p in there.step.parts}
    assert by_name["gemv"].per_call_us == pytest.approx(20.0 * 4.8e12 / 1.792e12)
    assert by_name["gemm"].per_call_us == pytest.approx(100.0 * 989e12 / 503.8e12)
    # if what lies above the roofline is latency that stays: roofline there + (time - roofline) here
    gemv_low = 0.5 * 20.0 * 4.8e12 / 1.792e12 + 10.0
    gemm_low = 40.0 * 989 / 503.8 + 60.0
    assert there.low_us["dense_gemm"] == pytest.approx(gemv_low + 2 * gemm_low)  # lm_head once, q_a a layer
    # two results cannot fit the measured rule: the projection says so and uses the datasheet rule
    fallback = project(step, TINY, 1, load_target(str(rtx)), pool)
    assert fallback.rule is ProjectionRule.DATASHEET
    assert fallback.step.total_us == pytest.approx(there.step.total_us)
    assert any(a.startswith("rule: datasheet, because the measured rule cannot be fitted") for a in
               fallback.step.assumptions)


def test_projection_counts_the_targets_allreduces_and_runs_its_backends():
    target = load_target("rtx-pro-6000-x8-pcie")
    there = project(today_step(), KIMI, 8, target, POOL)
    (ar,) = [p for p in there.step.parts if p.group == "allreduce"]
    assert ar.calls == 123
    assert ar.per_call_us == pytest.approx(24.1 + 14_336 / (41.1e9 * 8 / 14) * 1e6)
    (mla,) = [p for p in there.step.parts if p.group == "mla_attention"]
    assert mla.benchmark == "mla-tri-b1"  # SM120 runs Triton MLA: the H200's Triton result, scaled
    assert mla.per_call_us == pytest.approx(50.0 * 4.8e12 / 1.792e12)
    text = " ".join(there.step.assumptions)
    assert "vllm-triton_mla" in text
    assert "pcie5-switch" in text
    assert "vllm_pynccl" in text
    assert "fits" in text


def test_allreduce_results_measured_on_the_target_replace_the_link_table(tmp_path):
    measured = [{"name": f"ar{b}", "stats": {"median": (25 + b / 3e4) * 1e-6}, "extra_info": {
        "component": "allreduce", "backend": "torch", "shape": {"tokens": 1}, "world_size": 8, "message_bytes": b}}
        for b in (14_336, 917_504, 3_670_016)]
    (tmp_path / "ar.json").write_text(json.dumps({"benchmarks": measured}))
    target = tmp_path / "box.json"
    target.write_text(json.dumps({"device": "RTX PRO 6000 Blackwell", "gpus": 8, "tp": 8, "link": "pcie5-switch",
                                  "allreduce_results": ["ar.json"]}))
    there = project(today_step(), KIMI, 8, load_target(str(target)), POOL)
    (ar,) = [p for p in there.step.parts if p.group == "allreduce"]
    assert ar.per_call_us == pytest.approx(25 + 14_336 / 3e4)
    assert any("fitted to 3 all-reduce results measured on the target" in a for a in there.step.assumptions)


def test_a_target_of_another_tp_is_refused_naming_both():
    with pytest.raises(WhatIfError, match="h200-x1: it runs TP 1, the kernel results are per-rank shapes at TP 8"):
        project(today_step(), KIMI, 8, load_target("h200-x1"), POOL)


@pytest.mark.parametrize(("content", "message"), [
    ({"device": "H200", "gpus": 8, "tp": 8}, "has no 'link' (TP 8 all-reduces over one)"),
    ({"device": "H200", "gpus": 8, "tp": 8, "link": "carrier-pigeon"}, "unknown link 'carrier-pigeon'"),
    ({"device": "H200", "gpus": 8, "tp": 8, "link": {"alpha_us": 5}}, "a link needs alpha_us, busbw_gbps and source"),
    ({"device": "Voodoo2", "gpus": 1, "tp": 1}, "device 'Voodoo2' is not in the device table"),
    ({"device": "H200", "gpus": 1, "tp": 2, "link": "pcie5-host"}, "tp 2 must be between 1 and its 1 GPUs"),
    ({"device": "H200", "gpus": 1, "tp": 1, "backends": {"moe_gemm": {"backend": "x"}}}, "backends entry 'moe_gemm'"),
    ({"device": "H200", "gpus": 1, "tp": 1, "memory_gib": "lots"}, "memory_gib 'lots' must be a GPU's memory in GiB"),
    ({"device": "H200", "gpus": 1, "tp": 1, "memory_gib": -1}, "memory_gib -1 must be a GPU's memory in GiB"),
    ("not json", "not a readable JSON target file"),
])
def test_bad_target_files_are_one_line_errors_naming_the_file(tmp_path, content, message):
    path = tmp_path / "box.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(WhatIfError, match=re.escape(message)) as err:
        load_target(str(path))
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(WhatIfError, match="no such target file, nor a shipped target"):
        load_target("no-such-box")


def test_projection_keeps_idle_and_unbenchmarked_kernels_as_labelled_assumptions():
    pred = predict_step(POOL, KIMI, tp=8, batch=1, context=1024)
    info = answer(pred, POOL, KIMI, 8, targets=[load_target("h200-x8-nvlink")],
                  what_ifs=[parse_what_if("allreduce=0.5x")],
                  profiled=Profiled(step_us=9_000.0, tpot_us=9_100.0, idle_us=2_000.0, not_benchmarked_us=300.0))
    (p,) = info["projections"]
    assert p["step_us"] == pytest.approx(p["kernel_us"] + 2_300.0)
    assert "carried over from the profile" in p["carried"]["gpu_idle"]["how"]
    assert sum(p["shares"].values()) + 2_300.0 / p["step_us"] == pytest.approx(1.0)
    assert p["allreduce_share"] == pytest.approx(p["groups_us"]["allreduce"] / p["step_us"])
    (w,) = p["what_if"]
    assert w["change_us"] == pytest.approx(-p["groups_us"]["allreduce"] / 2)


def test_the_h200_baselines_project_to_the_users_pcie_box_at_full_depth():
    results = [r for name in ("0002_h200-vllm-nightly.json", "0004_h200-vllm-mla-all-backends.json")
               for r in load_results(BASELINES / name)[0]]
    target = load_target("rtx-pro-6000-x8-pcie")
    for batch in (1, 64, 256):
        info = answer(predict_step(results, KIMI, 8, batch, 1024), results, KIMI, 8, targets=[target])
        (p,) = info["projections"]
        ar = next(part for part in p["parts"] if part["group"] == "allreduce")
        assert ar["calls"] == 123  # 1 + 2 x 61 layers at TP 8
        assert ar["per_call_us"] == pytest.approx(24.1 + batch * 14_336 / (41.1e9 * 8 / 14) * 1e6)
        assert sum(p["shares"].values()) == pytest.approx(1.0)
        box = band("sm90", "sm120")  # to the SM120 box: the error against its published figures, not Hopper's
        assert p["rule"] == "measured"
        assert box.what in p["bracket"]
        assert "Hopper GPUs" not in p["bracket"]
        lo, hi = box.low, box.high
        kernels = p["kernel_us"] - p["groups_us"]["allreduce"]
        assert p["low_kernel_us"] - p["groups_us"]["allreduce"] == pytest.approx(kernels / (1 + hi))
        assert p["high_kernel_us"] - p["groups_us"]["allreduce"] == pytest.approx(kernels / (1 + lo))
        mla = {part["benchmark"] for part in p["parts"] if part["group"] == "mla_attention"}
        assert mla == {f"test_mla_decode[uniform-h8-b{batch}-l1024-vllm-triton_mla]"}
        # the 1-GPU all-reduce code-path checks are not TP 8's all-reduce: today has none, and says so
        assert any(m.startswith("allreduce: no allreduce result") and "measured over 1 rank(s)" in m
                   for m in info["missing"])


# --- chart ------------------------------------------------------------------------------------


def scenario_runs():
    pred = predict_step(POOL, KIMI, tp=8, batch=1, context=1024)
    info = answer(pred, POOL, KIMI, 8, what_ifs=[parse_what_if("allreduce=0.5x")],
                  targets=[load_target("rtx-pro-6000-x8-pcie")],
                  profiled=Profiled(step_us=9_000.0, tpot_us=9_100.0, idle_us=2_000.0, not_benchmarked_us=300.0))
    return [("c1", info)]


def test_the_chart_has_one_bar_per_scenario_and_one_series_per_component(tmp_path):
    runs = scenario_runs()
    labels, series = chart_bars(runs)
    assert labels == ["c1 today", "c1 allreduce=0.5x", "c1 -> rtx-pro-6000-x8-pcie"]
    assert series["allreduce"][1] == pytest.approx(series["allreduce"][0] / 2)
    assert series["gpu_idle"] == [2_000.0, 2_000.0, 2_000.0]
    pytest.importorskip("pygal")
    svg = write_scenarios_chart(runs, tmp_path / "s.svg")
    root = ET.parse(svg).getroot()  # well-formed XML, an SVG
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    groups = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if "serie-" in (g.get("class") or "")
              and list(g.iter("{http://www.w3.org/2000/svg}rect"))]
    assert len(groups) == len(series)
    assert all(len(list(g.iter("{http://www.w3.org/2000/svg}rect"))) == len(labels) for g in groups)
    text = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert all(name in text for name in series)
    assert "c1 -> rtx-pro-6000-x8-pcie" in text
    scripts = list(root.iter("{http://www.w3.org/2000/svg}script"))
    assert not any(s.get("{http://www.w3.org/1999/xlink}href") or s.get("src") for s in scripts)  # nothing fetched


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium installed (apt-get install chromium)")
def test_the_chart_renders_in_a_headless_browser(tmp_path):
    svg = write_scenarios_chart(scenario_runs(), tmp_path / "s.svg")
    shot = tmp_path / "s.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=900,650", svg.as_uri()], check=True, capture_output=True, timeout=120)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(set(png[100:])) > 50  # drawn, not a blank page


# --- the offline command -------------------------------------------------------------------------


def stored(tmp_path) -> Path:
    benches = [{"name": r.name, "stats": {"median": r.median_s},
                "extra_info": {"component": r.component, "backend": r.backend, "shape": r.shape, **r.info}}
               for r in POOL]
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"machine_info": {"decodebench": {"model": "kimi-k2.5", "tp": 8}},
                                "benchmarks": benches}))
    return path


def test_the_offline_command_prints_and_writes_the_answer(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(stored(tmp_path)), "--batch", "1", "--what-if", "mla_attention=vllm-triton_mla",
                 "--project-to", "rtx-pro-6000-x8-pcie", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "m1-l1024 (M=1, L=1024): what a change would buy" in text
    assert "projected to rtx-pro-6000-x8-pcie" in text
    assert "assumption: allreduce: link table pcie5-switch" in text
    saved = json.loads((out / "scenarios.json").read_text())["m1-l1024"]
    assert saved["what_if"][0]["change_us"] == pytest.approx(61 * 40.0)
    assert (out / "scenarios.svg").is_file()
    assert (out / "scenarios.txt").read_text() == text.split("table, JSON")[0]


@pytest.mark.parametrize(("args", "message"), [
    (["--what-if", "moe_gemm=0.5x"], "argument --what-if: moe_gemm=0.5x: unknown component 'moe_gemm'"),
    (["--what-if", "mla_attention=vllm-nope"], "--what-if mla_attention=vllm-nope: no mla_attention results"),
    (["--project-to", "h200-x1"], "--project-to h200-x1: it runs TP 1"),
    (["--project-to", "nowhere"], "argument --project-to: nowhere: no such target file"),
    (["--what-if", "ep=1000"], "--what-if moe=ep1000: EP 1000 is more ranks than kimi-k2.5's 384 routed experts"),
    (["--what-if", "moe=ep7:a2a"], "--what-if moe=ep7:a2a: EP 7 runs TP-7 attention, which kimi-k2.5 cannot"),
    (["--context", "300000"], "--context 300000: kimi-k2.5 takes at most 262144 positions"),
])
def test_the_offline_commands_bad_values_are_one_line_errors(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "decodebench", "scenarios", str(stored(tmp_path)), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_prediction_term_is_joined_to_its_own_result_when_files_repeat_a_name():
    a, b = (result("norm", "rmsnorm", NORM, s, frac_peak_bw=f) for s, f in ((2e-6, 0.1), (3e-6, 0.2)))
    step = step_of(Prediction(1, 64, (Term("rmsnorm", "norm", 3e-6 * 1e6, 2),), ()), [a, b])
    assert step.parts[0].roofline_per_call_us == pytest.approx(3.0 * 0.2)


def test_written_files_get_the_mode_a_plain_write_gets(tmp_path):
    import os

    from decodebench.files import write_atomic

    mask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.json", b"{}")
    finally:
        os.umask(mask)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


# --- the trace offline command -----------------------------------------------------------------


def test_the_trace_offline_command_answers_what_ifs_and_projections(tmp_path, capsys):
    from decodebench.attribution import cli
    from tests.test_attribution import two_windows

    traces = two_windows(tmp_path)  # synthetic H200-like traces, 3 decode steps of batch 2 each
    results = stored(tmp_path)  # POOL: TP 8 shapes of Kimi-K2.5
    args = [str(traces), "--model", "kimi-k2.5", "--tp", "8", "--predict-from", str(results), "--context", "1024"]
    assert cli.breakdown([*args, "--what-if", "mla_attention=vllm-triton_mla", "--project-to", "rtx-pro-6000-x8-pcie",
                     "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "window1 (M=2, L=1024): what a change would buy" in out
    assert "projected to rtx-pro-6000-x8-pcie" in out
    saved = json.loads((tmp_path / "out" / "attribution.json").read_text())["window1"]["scenarios"]
    assert saved["what_if"][0]["change_us"] == pytest.approx(61 * 40.0)
    assert ET.parse(tmp_path / "out" / "attribution-scenarios.svg").getroot().tag.endswith("svg")
    assert cli.breakdown([*args, "--what-if", "moe=mine"]) == 2
    assert "--what-if moe=mine: no moe results of backend 'mine'" in capsys.readouterr().err
    assert cli.breakdown([*args, "--project-to", "h200-x1"]) == 2
    assert "--project-to h200-x1: it runs TP 1" in capsys.readouterr().err


def test_one_point_measured_with_two_timers_is_taken_once_and_the_choice_is_named(tmp_path, capsys):
    # whatif.sh passes the kernel-timer results and the MLA cases again with L2 flushed (--timer cold)
    kernels = stored(tmp_path)
    data = json.loads(kernels.read_text())
    for bench in data["benchmarks"]:
        bench["extra_info"]["timer"] = "kernel"
    kernels.write_text(json.dumps(data))
    (fa,) = [b for b in data["benchmarks"] if b["name"] == "mla-fa-b1"]
    cold = tmp_path / "mla-cold.json"
    cold.write_text(json.dumps({"benchmarks": [{**fa, "name": "mla-fa-b1-cold", "stats": {"median": 14e-6},
                                                "extra_info": {**fa["extra_info"], "timer": "cold"}}]}))
    mla_us = {}
    for how in ([], ["--prefer-timer", "cold"], ["--prefer-timer", "kernel"]):
        out = tmp_path / f"out{len(mla_us)}"
        assert main([str(kernels), str(cold), "--batch", "1", "--out", str(out), *how]) == 0
        today = json.loads((out / "scenarios.json").read_text())["m1-l1024"]["today"]
        mla_us[" ".join(how)] = today["groups_us"]["mla_attention"]
        text = capsys.readouterr().out
        named = "mla_decode: 1 point(s) measured with timers cold and kernel; took kernel (the first given"
        assert (named in " ".join(today["assumptions"])) == (not how), today["assumptions"]
        assert (named in text) == (not how)
    assert mla_us == pytest.approx({"": 61 * 10.0, "--prefer-timer cold": 61 * 14.0,
                                    "--prefer-timer kernel": 61 * 10.0})
    from decodebench.attribution import cli
    from tests.test_attribution import two_windows

    traces, out = two_windows(tmp_path), tmp_path / "traced"
    assert cli.breakdown([str(traces), "--model", "kimi-k2.5", "--tp", "8", "--context", "1024", "--predict-from",
                     str(kernels), "--predict-from", str(cold), "--prefer-timer", "cold", "--out", str(out)]) == 0
    window = json.loads((out / "attribution.json").read_text())["window1"]
    assert window["prediction"]["groups_us"]["mla_attention"] == pytest.approx(61 * 14.0)
    with pytest.raises(SystemExit) as bad:
        cli.breakdown([str(traces), "--model", "kimi-k2.5", "--tp", "8", "--prefer-timer", "warm"])
    assert bad.value.code == 2
    assert "argument --prefer-timer: unknown timer 'warm'; choose one of" in capsys.readouterr().err


# --- the offline commands refuse what the model cannot have, and name what they carry over ------------


@pytest.mark.parametrize(("bad", "named"), [
    (["--tp", "3"], "--tp 3: num_attention_heads = 64 is not divisible by tp = 3"),
    (["--tp", "8", "--server-layers", "1000"], "--server-layers 1000: kimi-k2.5 has 61 decoder layers"),
    (["--tp", "8", "--server-layers", "1"], "--server-layers 1: kimi-k2.5 has 61 decoder layers; give 2..61 (its "
                                            "first 1 are dense"),
])
def test_the_offline_commands_refuse_a_tp_or_depth_the_model_cannot_have(tmp_path, capsys, bad, named):
    from decodebench.attribution import cli
    from tests.test_attribution import two_windows

    assert cli.breakdown([str(two_windows(tmp_path)), "--model", "kimi-k2.5", *bad]) == 2
    assert named in capsys.readouterr().err
    assert main([str(stored(tmp_path)), "--batch", "1", *bad]) == 2
    assert named in capsys.readouterr().err


def test_a_what_if_on_windows_without_a_context_is_refused_naming_the_option(tmp_path, capsys):
    from decodebench.attribution import cli
    from tests.test_attribution import two_windows

    traces = two_windows(tmp_path)  # captured by hand: no manifest, so no context
    args = [str(traces), "--model", "kimi-k2.5", "--tp", "8", "--predict-from", str(stored(tmp_path))]
    assert cli.breakdown([*args, "--what-if", "allreduce=0.5x"]) == 2
    assert "window1, window2: add --context TOKENS" in capsys.readouterr().err
    assert cli.breakdown([*args, "--project-to", "rtx-pro-6000-x8-pcie"]) == 2
    assert cli.breakdown([*args, "--what-if", "allreduce=0.5x", "--context", "1024"]) == 0


def test_a_batch_no_result_was_measured_at_is_named_with_the_nearest_measured_point(tmp_path, capsys):
    # POOL measured RMSNorm and the all-reduce at M = 1 only, MLA at batch 1 and 64
    assert main([str(stored(tmp_path)), "--batch", "1,64"]) == 0
    at_1, at_64 = capsys.readouterr().out.split("m64-l1024 (M=64")
    assert "EXTRAPOLATED" not in at_1
    (note,) = [line for line in at_64.splitlines() if "EXTRAPOLATED" in line]
    assert note.strip() == ("EXTRAPOLATED: no result at M=64 for rmsnorm, allreduce: each read from its nearest "
                            "measured point (rmsnorm M=1, allreduce M=1)")


def test_the_trace_command_breaks_down_one_rank_of_tp_n_as_the_session_does(tmp_path, capsys):
    from decodebench.attribution import cli
    from tests.test_attribution import two_windows

    traces = two_windows(tmp_path)
    args = [str(traces), "--model", "kimi-k2.5", "--server-rank-of", "8", "--server-layers", "4", "--predict-from",
            str(stored(tmp_path)), "--context", "1024"]
    with pytest.raises(SystemExit):
        cli.breakdown([*args, "--tp", "4"])
    assert "--tp 4 contradicts it" in capsys.readouterr().err
    assert cli.breakdown([*args, "--out", str(tmp_path / "out")]) == 0  # at TP 8, its all-reduces named apart
    saved = json.loads((tmp_path / "out" / "attribution.json").read_text())["window1"]
    assert saved["collectives"]["calls"] == 9  # 1 + 2 x 4 served layers, none in the profile
    assert saved["collectives"]["us"] == pytest.approx(9 * 20.0)  # from the all-reduce result, named apart
    assert saved["prediction"]["groups"]["allreduce"]["predicted_us"] == 0.0


def test_every_what_if_kind_is_read_through_the_one_registry():
    from decodebench.attribution.options import what_if_option
    from decodebench.attribution.predict.whatif import KINDS, what_if_syntax

    texts = {"speculative decoding": "spec=ngram:4:0.6", "expert parallelism": "moe=ep8:a2a",
             "roofline": "dense_gemm=roofline", "factor": "allreduce=0.5x", "backend": "moe=mine@stored.json"}
    assert [k.name for k in KINDS] == list(texts)
    for kind in KINDS:  # the parser and the option's help both come from the registry
        assert what_if_option(texts[kind.name]).label == texts[kind.name]
        assert kind.syntax in what_if_syntax()
    with pytest.raises(ValueError, match="is a scenario of its own"):
        parse_what_if("allreduce=0.5x,spec=ngram:4:0.6")
