"""The projection rule on committed files: its fit on the stored H200 results, its projection
between GPUs and cache states, the cross-GPU check and the box's TPOT, and their errors."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from decodebench.attribution.predict import box, crosscheck, projection_rule, sm_count
from decodebench.attribution.predict.projection_rule import (
    DEVICE_FACTS,
    Case,
    DeviceModel,
    device_facts,
    fit,
    load_cases,
    load_params,
    project_case,
    traffic_us,
)
from decodebench.attribution.predict.targets import load_target
from tests.conftest import REPO

BASELINES = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
NIGHTLY = BASELINES / "0005_h200-vllm-nightly-gated.json"
MLA = BASELINES / "0004_h200-vllm-mla-all-backends.json"
# small copies of measured files: an H100's TP-8 kernel set on both timers (samples and unread fields left out),
# its 24-layer profile, an H200's 2- and 4-layer profiles, SM-count runs (the first H100 one times M = 16 only)
DATA = REPO / "tests" / "data" / "projection"
H100 = {timer: DATA / f"h100-{timer}.json.gz" for timer in ("kernel", "step")}
SM_COUNTS = {gpu: [DATA / "sm-count" / f"sm-count-{gpu}{x}.json" for x in ("", "-b", "-c")[:3 if gpu == "h200" else 2]]
             for gpu in ("h100", "h200")}
PROFILES = (DATA / "attribution-L2.json", DATA / "attribution-L4.json")
IDLE = DATA / "L4u-attribution.txt"


@pytest.fixture(scope="module")
def h200():
    cases, facts = load_cases(NIGHTLY)
    cases += load_cases(MLA, "vllm-triton")[0]
    return cases, facts, fit(cases, facts, "H200 (test)")


def test_fit_on_the_stored_h200_results_names_the_case_behind_each_parameter(h200, tmp_path):
    cases, facts, params = h200
    assert facts.name == "H200 SXM"
    assert facts.l2_bytes == 62914560
    assert params.floor_us == min(c.median_us / c.kernels for c in cases)
    assert "test_rmsnorm[" in params.sources["floor_us"]
    assert 0.7 < params.dram_fraction < 1.0  # measured, below the 4.8 TB/s datasheet
    assert 10 < params.l2_bytes_per_sm_cycle < 64
    assert params.beta == 0.0
    assert "no cases timed both warm and in the step state" in params.sources["beta"]
    assert "the fastest of 55 cases timed warm over 4 L2 sizes" in params.sources["dram_fraction"]
    assert params.moe_overlap is None
    assert "not measured" in params.sources["moe_overlap"]
    assert {"floor_us", "dram_fraction", "l2_bytes_per_sm_cycle", "beta", "moe_overlap"} < set(params.sources)
    assert {f"sm_bytes_per_cycle.{c}" for c in params.sm_bytes_per_cycle} <= set(params.sources)
    (tmp_path / "fit.json").write_text(params.to_json())
    assert load_params(tmp_path / "fit.json") == params


def test_a_case_projected_to_its_own_gpu_and_state_keeps_its_time(h200):
    cases, facts, params = h200
    here = DeviceModel(facts, params)
    for beta in (0.0, 0.5, 1.0):
        model = DeviceModel(facts, replace(params, beta=beta))
        assert all(project_case(c, model, model, "warm", "warm") == pytest.approx(c.median_us) for c in cases)
    assert here.facts is facts


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


def test_beta_stays_0_and_two_cache_states_say_what_they_would_pick(h200):
    cases, facts, params = h200
    params = replace(params, sm_bytes_per_cycle={})  # where no SM bound hides the traffic that beta scales
    true = DeviceModel(facts, replace(params, beta=1.0))
    step = [replace(c, timer="step", median_us=project_case(c, true, true, "warm", "step")) for c in cases]
    how = projection_rule._beta(cases + step, facts, params)  # given the other parameters: exact
    assert how.startswith("0: ")
    assert "would pick 1 (median miss of the warm -> step projection on this GPU 0.0%" in how
    fitted = fit(cases + step, facts, "synthetic")
    assert fitted.beta == 0.0
    assert "would pick" in fitted.sources["beta"]


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
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="x.json is not a pytest-benchmark result"):
        load_cases(bad)
    with pytest.raises(ValueError, match="no cases"):
        fit([], DEVICE_FACTS["H200 SXM"], "empty")
    stored = json.loads(NIGHTLY.read_text())
    stored["benchmarks"] = stored["benchmarks"][:3]
    for bench in stored["benchmarks"]:
        bench["extra_info"]["timer"] = "hourglass"
    (tmp_path / "odd.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="odd.json: timer.s. hourglass: the rule knows the cache state of kernel"):
        load_cases(tmp_path / "odd.json")
    tiny = [Case("n", "rmsnorm", "vllm", {}, 2.0, "kernel", 1, 100, 100, 0, 0)]
    with pytest.raises(ValueError, match="achievable DRAM bandwidth cannot be fitted"):
        fit(tiny, DEVICE_FACTS["H200 SXM"], "tiny")


@pytest.mark.parametrize(("option", "text", "error"), [
    ("--crosscheck", "[1, 2", "x.json is not valid JSON"),
    ("--crosscheck", "[" * 100_000 + "]" * 100_000, "x.json nests its JSON deeper than it can be read"),
    ("--crosscheck", "{}", "x.json: not a crosscheck.json written by python -m decodebench crosscheck --out"),
    ("--crosscheck", '[{"steps": [{"rule": {}}]}]', "x.json: not a crosscheck.json .* no 'error' in it"),
    ("--published", "[]", "x.json: not a published-figures file"),
    ("--published", '{"tpot": {"1": {"tpot_ms": 11.3}}}', "x.json: not a published-figures file.* no 'what' in it"),
    ("--published", '{"tpot": {}, "custom_allreduce": {"points": [[8, 9.2]], "source": "s"}}',
     "custom_allreduce needs two or more"),
])
def test_the_box_names_a_bad_crosscheck_or_published_file(tmp_path, capsys, option, text, error):
    (tmp_path / "x.json").write_text(text)
    assert box.main([str(NIGHTLY), "--layer-profiles", *map(str, PROFILES), "--idle-profile", str(IDLE),
                     option, str(tmp_path / "x.json")]) == 2
    assert re.search(error, capsys.readouterr().err)


@pytest.mark.parametrize("command", [box.main, crosscheck.main])
@pytest.mark.parametrize(("option", "value", "error"), [
    ("--batch", "1,0", "argument --batch: '1,0': '0' must be at least 1"),
    ("--out", "/dev/null/out", "argument --out: '/dev/null/out': /dev/null is not a directory"),
])
def test_a_bad_batch_or_output_directory_is_refused_before_any_work(capsys, command, option, value, error):
    args = ["--layer-profiles", *map(str, PROFILES), "--idle-profile", str(IDLE)] if command is box.main else \
        [str(NIGHTLY), "--target-a", "h200-x8-nvlink", "--target-b", "h200-x8-nvlink"]
    with pytest.raises(SystemExit) as stop:
        command([str(NIGHTLY), *args, option, value])
    assert stop.value.code == 2
    assert error in capsys.readouterr().err


def test_crosscheck_of_a_run_against_itself_has_no_error(tmp_path, capsys):
    assert crosscheck.main([str(NIGHTLY), str(NIGHTLY), "--target-a", "h200-x8-nvlink", "--target-b",
                            "h200-x8-nvlink", "--batch", "1,64", "--out", str(tmp_path)]) == 0
    directions = json.loads((tmp_path / "crosscheck.json").read_text())
    assert len(directions) == 2
    for d in directions:
        assert d["kernels"]["rule"]["all"]["worst"] == 0
        assert d["kernels"]["rule"]["all"]["n"] == 211
        assert d["kernels"]["rule"][crosscheck.SAME]["n"] == 211
        assert crosscheck.OTHER not in d["kernels"]["rule"]
        assert [row["batch"] for row in d["steps"]] == [1, 64]
        assert all(abs(row["rule"]["error"]) < 1e-12 for row in d["steps"])
    assert (tmp_path / "fit-a-h200-sxm.json").is_file()
    assert (tmp_path / "fit-b-h200-sxm.json").is_file()
    assert "H200 SXM -> H200 SXM" in capsys.readouterr().out


def test_crosscheck_refuses_a_target_of_another_gpu(capsys):
    h100 = DATA / "h100-x8-nvlink.json"
    assert crosscheck.main([str(NIGHTLY), str(NIGHTLY), "--target-a", str(h100), "--target-b",
                            "h200-x8-nvlink"]) == 2
    assert "measured on H200 SXM, but target h100-x8-nvlink is a H100 SXM" in capsys.readouterr().err


def test_the_box_tpot_is_the_sum_of_its_terms_with_triton_mla():
    terms = box.load_profile_terms(PROFILES, IDLE)
    published = json.loads((DATA / "published.json").read_text())
    target = load_target("rtx-pro-6000-x8-pcie")
    fake_check = [{"steps": [{"rule": {"error": -0.04}}, {"rule": {"error": 0.03}}]}]
    rows, fits = box.tpot_rows([NIGHTLY, MLA], target, terms, (1, 64), 1024, fake_check, published["tpot"],
                               custom_ar=published["custom_allreduce"])
    assert list(fits) == ["H200 SXM"]
    assert fits["H200 SXM"].fitted_on.startswith("H200 SXM")
    for row in rows:
        total = row["kernels_us"] + row["allreduce_us"] + row["not_benchmarked_us"] + row["idle_us"]
        assert row["tpot_us"] == pytest.approx(total)
        assert row["allreduce_us"] == pytest.approx(123 * target.link.allreduce_us(14336 * row["batch"], 8))
        low, high = row["tpot_bracket_us"]
        rest = row["tpot_us"] - row["kernels_us"]
        assert low == pytest.approx(rest + row["kernels_us"] / 1.03)
        assert high == pytest.approx(
            rest + row["kernels_us"] / 0.96)
        assert row["published"]["tpot_ms"] > 0
        assert row["kernels_at_bound_us"] < row["kernels_us"]
    assert rows[0]["custom_allreduce_us"] < rows[0]["allreduce_us"]  # 14 KB: the custom all-reduce wins
    assert "vllm_pynccl" in rows[0]["allreduce_how"]
    assert "GPU-bound" in rows[0]["idle_how"]


def test_the_box_takes_the_mla_backend_vllm_runs_on_sm120():
    results = box.load_results(MLA)[0]
    kept = box._target_backends(results, load_target("rtx-pro-6000-x8-pcie"))
    assert {r.backend for r in kept if r.component == "mla_decode"} == {"vllm-triton_mla"}


def test_the_box_fits_each_gpu_on_its_own_results():
    fits = box.fit_per_gpu([H100["step"], MLA, H100["kernel"], NIGHTLY])
    assert sorted(fits) == ["H100 SXM", "H200 SXM"]
    assert "h100-kernel.json" in fits["H100 SXM"].fitted_on
    assert "0005_" not in fits["H100 SXM"].fitted_on
    assert "would pick" in fits["H100 SXM"].sources["beta"]  # two cache states: what they would pick, named
    assert "no cases timed both" in fits["H200 SXM"].sources["beta"]
    assert fits["H100 SXM"].moe_overlap is None  # no SM-count run given
    fits = box.fit_per_gpu([H100["kernel"], H100["step"], NIGHTLY], SM_COUNTS["h100"] + SM_COUNTS["h200"])
    assert all(0 < p.moe_overlap < 1 for p in fits.values())  # each GPU read its own runs
    assert fits["H100 SXM"].moe_overlap != fits["H200 SXM"].moe_overlap
    with pytest.raises(ValueError, match="sm-count-h100.json: measured on H100 SXM, and no results of that GPU are"):
        box.fit_per_gpu([NIGHTLY], SM_COUNTS["h100"][:1])


def test_the_gpu_idle_of_the_one_rank_of_tp8_profile():
    terms = box.load_profile_terms(PROFILES, DATA / "profile-24-layers.json")
    assert [r["concurrency"] for r in terms.idle_rows] == [1, 64, 256]
    idle, how = terms.idle_us(1, 14000.0)  # busier than the profiled host's step: the GPU-bound load's idle
    assert idle == pytest.approx(317.7, abs=0.1)
    assert "window2" in how
    assert "window1, host-bound" in how
    idle, _ = terms.idle_us(1, 1000.0)  # a GPU faster than the host waits for it
    assert idle == pytest.approx(terms.idle_rows[0]["wall_us"] - 1000.0)


def test_profile_files_without_their_rows_are_named(tmp_path):
    bad = tmp_path / "attribution.txt"
    bad.write_text("µs/step (% busy)    c1-in8-out8\nmoe_gemm 1.0 1%\n")
    with pytest.raises(ValueError, match="attribution.txt: not a printed attribution table"):
        box.load_profile_terms(PROFILES, bad)
    (tmp_path / "idle.json").write_text('{"window1": {"busy_us": 1.0}}')
    with pytest.raises(ValueError, match="idle.json: not an attribution JSON with batch, busy_us"):
        box.load_profile_terms(PROFILES, tmp_path / "idle.json")


def test_the_kernel_errors_are_split_by_whether_both_gpus_launched_the_same_kernels():
    def case(name, us, kernels):
        return Case(name, "dense_gemm", "vllm", {}, us, "kernel", 1, 1, 0, 0.0, 0, frozenset(kernels))
    mine = [case("a", 11.0, {"k1"}), case("b", 12.0, {"k1"}), case("c", 13.0, {"k1"})]
    theirs = {"a": case("a", 10.0, {"k1"}), "b": case("b", 10.0, {"k2"}), "c": case("c", 10.0, ())}
    stats = crosscheck._kernel_errors(mine, {c.name: c.median_us for c in mine}, theirs)
    assert stats["all"]["n"] == 3  # c: its kernels were not recorded on one side, so in neither split
    assert stats[crosscheck.SAME] == {"n": 1, "median": 0.1, "p90": 0.1, "worst": 0.1}
    assert stats[crosscheck.OTHER] == {"n": 1, "median": 0.2, "p90": 0.2, "worst": 0.2}


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


def test_sm_count_files_are_checked_and_read_per_gpu(tmp_path, capsys):
    raw = json.loads(SM_COUNTS["h200"][0].read_text())
    for change, error in (({"gpu": ""}, "no 'gpu' name"), ({"sms": 0}, "'sms' is not a positive integer"),
                          ({"points": [{"case": "x", "tokens": 64, "moe_bytes": 1, "us": {"all": -1}}]},
                           "point 0 .x.: 'us' needs a positive time"),
                          ({"points": [{"case": "x", "tokens": 64, "moe_bytes": 1, "us": {"all": 1, "999": 2}}]},
                           "'us' keys must be 'all' or SM counts up to 132")):
        (tmp_path / "s.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(ValueError, match=f"s.json: not an sm-count.json .*{error}"):
            sm_count.load(tmp_path / "s.json")
    (tmp_path / "s.json").write_text(json.dumps({**raw, "gpu": "NVIDIA A100-SXM4-80GB"}))
    with pytest.raises(ValueError, match="s.json: measured on a GPU the device table does not know"):
        sm_count.by_gpu([tmp_path / "s.json"])
    with pytest.raises(ValueError, match="measured on NVIDIA H200, not on an H100 SXM"):
        sm_count.overlap_share(SM_COUNTS["h200"], "H100 SXM", lambda case: 9.0, 3e12)
    with pytest.raises(ValueError, match="no fused MoE case at M >= 64"):
        sm_count.overlap_share(SM_COUNTS["h100"][:1], "H100 SXM", lambda case: 9.0, 3e12)  # M = 16 only
    assert crosscheck.main([str(NIGHTLY), str(NIGHTLY), "--target-a", "h200-x8-nvlink", "--target-b",
                            "h200-x8-nvlink", "--sm-count", str(SM_COUNTS["h100"][1])]) == 2
    assert "measured on H100 SXM, which neither side of the check ran on" in capsys.readouterr().err


@pytest.mark.parametrize("p", [1.5, 2.3, 4.0])
def test_the_two_stage_estimate_gives_back_the_sm_time_and_p_that_made_its_times(p):
    """decodebench's sm_count.two_stage: times made wave by wave (Marlin's 132 blocks on N SMs, each wave's blocks
    taking an SM time combined by p with their share of the memory time) give back that SM time and that p; a
    whole GPU no slower than the larger of the two gives None, one as slow as their sum gives 1."""
    module = sm_count
    m, s = 285.0, 280.0
    above = {n: module.wave_times(s, m, 132, n, p) for n in (132, 112, 72, 48, 40, 32, 24, 16)}
    got_s, got_p, scarce = module.two_stage(above, m, 132)
    assert scarce == [16, 24, 32, 40]
    assert got_s == pytest.approx(s, rel=1e-5)
    assert got_p == pytest.approx(p, rel=1e-5)
    assert module.two_stage({**above, 132: max(s, m)}, m, 132)[1] is None
    assert module.two_stage({**above, 132: s + m}, m, 132)[1] == 1.0
    with pytest.raises(ValueError, match="no SM count with 4 or more waves"):
        module.two_stage({132: 400.0, 72: 640.0}, m, 132)
    with pytest.raises(ValueError, match="do not fit the wave model"):  # faster on 16 SMs than its memory time
        module.two_stage({**above, 16: m / 2}, m, 132)


def test_scenarios_read_the_sm_count_runs_only_for_a_projection(capsys):
    """``--sm-count`` gives ``--project-to``'s rule the fused MoE's overlap share; without it the projection
    says the fused MoE took the larger bound; it is refused without ``--project-to`` and for a GPU whose
    results are not there."""
    from decodebench.attribution.cli import scenarios as main
    base = [str(NIGHTLY), str(MLA), "--batch", "64"]
    runs = [arg for path in SM_COUNTS["h200"] for arg in ("--sm-count", str(path))]
    assert main([*base, *runs]) == 2
    assert "--sm-count is read by the projection rule only: add --project-to TARGET" in capsys.readouterr().err
    assert main([*base, "--project-to", "rtx-pro-6000-x8-pcie", *runs]) == 0
    out = capsys.readouterr().out
    assert "fused MoE overlap share 0.68" in out
    assert "without an sm_count.py run" not in out
    assert main([*base, "--project-to", "rtx-pro-6000-x8-pcie"]) == 0
    assert (
        "without an sm_count.py run of H200 SXM (--sm-count) its fused MoE takes the larger" in capsys.readouterr().out
    )
    assert main([*base, "--project-to", "rtx-pro-6000-x8-pcie", "--sm-count", str(SM_COUNTS["h100"][1])]) == 2
    assert "measured on H100 SXM, and no kernel result here was" in capsys.readouterr().err
