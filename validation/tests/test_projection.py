"""The projection rule's evidence: the committed cross-GPU checks, the box's TPOT and the facts under the rule,
recomputed from the raw files under validation/ and compared with the tables validation/reports/projection.md shows."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

from decodebench.attribution.predict import projection_rule
from decodebench.attribution.predict.prediction import load_results, predict_step
from decodebench.attribution.predict.project import BANDS_FILE, band
from decodebench.attribution.predict.projection_rule import DEVICE_FACTS, Case, DeviceModel, fit, project_case
from decodebench.attribution.predict.rule_file import write_rules
from decodebench.attribution.predict.scenarios import answer
from decodebench.attribution.predict.targets import load_target
from decodebench.files import read_json
from decodebench.model import load_model_spec
from validation.tests.evidence import REPO, validation_script

BASELINES = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
NIGHTLY = BASELINES / "0005_h200-vllm-nightly-gated.json"
MLA = BASELINES / "0004_h200-vllm-mla-all-backends.json"
VALIDATION = REPO / "validation" / "projection"
SM_COUNTS = {gpu: sorted(VALIDATION.glob(f"sm-count-{gpu}*/sm-count.json")) for gpu in ("h100", "h200")}
H100 = REPO / "validation/tp8/h100-2026-12-05"
H100_RUNS = {timer: H100 / f"{timer}.json.gz" for timer in ("kernel", "step")}
PROFILES = (REPO / "validation/h200/attribution-L2.json", REPO / "validation/h200/attribution-L4.json")
IDLE = REPO / "validation/h200/attrib/L4u-attribution.txt"
box = validation_script("validation/projection/box.py")
crosscheck = validation_script("validation/projection/crosscheck.py")
load_cases = crosscheck.load_cases
share = validation_script("validation/projection/share.py")




def test_h200_and_h100_projected_to_each_other_from_the_committed_runs(tmp_path):
    """The committed cross-GPU check, recomputed: each direction fitted on its source only, by the product's fit
    (the one python -m decodebench fit stores), the rule's step nearer the measured step than the datasheet
    rule's at every M."""
    h100 = REPO / "validation/tp8/h100-2026-12-05"
    directions, fits = crosscheck.check([NIGHTLY], [h100 / "kernel.json.gz", h100 / "step.json.gz"],
                                        load_target("h200-x8-nvlink"),
                                        load_target(str(VALIDATION / "targets" / "h100-x8-nvlink.json")),
                                        (1, 64, 256), 1024)
    assert fits["a-H200 SXM"].moe_overlap == fits["b-H100 SXM"].moe_overlap == projection_rule.MOE_OVERLAP
    assert [(d.source, d.target) for d in directions] == [("H200 SXM", "H100 SXM"), ("H100 SXM", "H200 SXM")]
    assert directions[0].params == fits["a-H200 SXM"]
    assert directions[1].params == fits["b-H100 SXM"]
    for d in directions:
        assert d.timer == "kernel"
        assert d.kernels["rule"]["all"]["n"] == 211
        for row in d.steps:
            assert abs(row["rule"]["error"]) < abs(row["datasheet"]["error"])
    committed = json.loads((VALIDATION / "h200-vs-h100" / "crosscheck.json").read_text())
    assert [row["rule"]["us"] for d in committed for row in d["steps"]] == pytest.approx(
        [row["rule"]["us"] for d in directions for row in d.steps])
    # cuBLAS picked other kernels on the H100 for 35 dense GEMMs and one router GEMM (the profiler's names)
    assert [(d.kernels["rule"][crosscheck.SAME]["n"], d.kernels["rule"][crosscheck.OTHER]["n"])
            for d in directions] == [(175, 36), (175, 36)]


def test_two_h100s_launched_the_same_cublas_kernels_where_both_ran_cublas():
    """The docs' reading of the 36 'other kernels': cuBLAS's choice follows the GPU model, not the machine."""
    def launched(path):
        return {
            b["name"]: frozenset(b["extra_info"].get("kernels") or ())
            for b in read_json(path)["benchmarks"]
        }

    first = launched(REPO / "validation/tp8/h100-2026-12-05/kernel.json.gz")
    second = launched(REPO / "validation/tp8/h100-2026-12-05-b/kernel.json.gz")
    cublas = [name for name in first.keys() & second.keys()
              if all(k and all("nvjet" in n or "cublas" in n.lower() for n in k) for k in (first[name], second[name]))]
    assert len(cublas) > 50
    assert [name for name in cublas if first[name] != second[name]] == []


def doc_table(marker: str) -> dict[str, list[str]]:
    """The first markdown table after ``marker`` in validation/reports/projection.md, by its first cell."""
    text = (REPO / "validation" / "reports" / "projection.md").read_text()
    assert marker in text, f"validation/reports/projection.md no longer holds {marker!r}"
    lines = text[text.index(marker):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.replace("**", "").strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def percents(cell: str) -> list[float]:
    return [float(v) for v in re.findall(r"[+−-]?\d+\.\d+(?= %)", cell.replace("−", "-"))]


def test_the_box_table_of_the_docs_is_the_committed_box_json():
    rows = doc_table("**The users' box: TPOT = kernels + all-reduces + what the profile adds**")
    stored = json.loads((VALIDATION / "box-rtx-pro-6000-x8-pcie" / "box.json").read_text())["rows"]
    assert [r["batch"] for r in stored] == [1, 64, 128]
    for name, key in (("kernels", "kernels_us"), ("all-reduces", "allreduce_us"), ("GPU idle", "idle_us"),
                      ("kernels no benchmark covers", "not_benchmarked_us"), ("TPOT", "tpot_us")):
        assert [float(c) for c in rows[name][:3]] == [round(r[key] / 1e3, 2) for r in stored], name
    assert [percents(c)[0] for c in rows["residual"][:3]] == [
        round(100 * (r["tpot_us"] / (r["published"]["tpot_ms"] * 1e3) - 1), 1) for r in stored]
    assert [percents(c)[0] for c in rows["all-reduce share of the TPOT"][:3]] == [
        round(100 * r["allreduce_share"], 1) for r in stored]


def test_the_cross_gpu_table_of_the_docs_is_the_committed_crosscheck_json():
    rows = doc_table("**H200 → H100 and H100 → H200**")
    stored = json.loads((VALIDATION / "h200-vs-h100" / "crosscheck.json").read_text())
    steps = rows["step, M = 1 / 64 / 256"]
    for column, d in enumerate(stored):
        assert percents(steps[column]) == [round(100 * s["rule"]["error"], 1) for s in d["steps"]]
        assert percents(steps[column + 2]) == [round(100 * s["datasheet"]["error"], 1) for s in d["steps"]]
        for row, group in (("MoE (54)", "moe"), ("all (211)", "all"), ("same kernels (175)", crosscheck.SAME),
                           ("other kernels (36)", crosscheck.OTHER)):
            stats = d["kernels"]["rule"][group]
            assert percents(rows[row][column]) == [round(100 * stats[k], 1) for k in ("median", "p90", "worst")]


def test_the_table_of_pairs_2_to_5_is_the_committed_crosscheck_json():
    rows = doc_table("**Pairs 2–5**")
    for pair, folder in ((2, "h200-vs-h100-2026-12-06"), (3, "h200-vs-h100-2026-12-06-b"),
                         (4, "h200-vs-h100-2026-12-06-c"), (5, "h200-vs-h100-2026-12-06-d")):
        for d in json.loads((VALIDATION / folder / "crosscheck.json").read_text()):
            cells = rows[f"{pair}, {d['source'].replace(' SXM', '')} → {d['target'].replace(' SXM', '')}"]
            groups = [d["kernels"]["rule"][g] for g in ("all", crosscheck.SAME, crosscheck.OTHER, "moe")]
            for cell, stats in zip(cells, groups, strict=False):
                assert percents(cell) == [round(100 * stats[k], 1) for k in ("median", "p90", "worst")], (pair, cell)
            assert percents(cells[4]) == [round(100 * s["rule"]["error"], 1) for s in d["steps"]]




def test_a_warm_working_set_over_l2_comes_from_dram_as_the_h100s_two_timers_show():
    h100 = REPO / "validation" / "tp8" / "h100-2026-12-05"
    kernel, facts = load_cases(h100 / "kernel.json.gz")
    step = {c.name: c for c in load_cases(h100 / "step.json.gz")[0]}
    over = [step[c.name].median_us / c.median_us - 1 for c in kernel if c.bytes > facts.l2_bytes and c.name in step]
    assert len(over) == 76
    assert max(map(abs, over)) < 0.05
    assert abs(sorted(over)[len(over) // 2]) < 0.005
    assert projection_rule.warm_dram_bytes(facts.l2_bytes + 1, facts.l2_bytes) == facts.l2_bytes + 1
    assert projection_rule.warm_dram_bytes(facts.l2_bytes, facts.l2_bytes) == 0


def test_the_overlap_file_is_what_its_script_prints():
    """validation/projection/overlap.txt (the facts under the rule's fused MoE, docs/projection.md) is
    regenerated from the committed runs."""
    module = validation_script("validation/projection/overlap.py")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        module.main()
    assert out.getvalue() == (VALIDATION / "overlap.txt").read_text()


def test_the_bandwidth_share_analysis_recovers_the_p_its_points_were_made_with(tmp_path):
    """validation/projection/bandwidth_share.py --analyse: read times made from spin times with p = 4 and the
    bandwidth the reader left give back p = 4; a point whose MoE loop outlasted the reader is left out."""
    module = validation_script("validation/projection/bandwidth_share.py")
    dram = 3.0e12
    points = []
    for moe_bytes, spin_us in ((100e6, 60.0), (400e6, 190.0), (800e6, 330.0)):
        for taken in (500.0, 1000.0, 1500.0):  # GB/s the reader took
            m_full, m_left = moe_bytes / dram * 1e6, moe_bytes / (dram - taken * 1e9) * 1e6
            points.append({"moe_bytes": moe_bytes, "spin_us": spin_us, "read_during_gbs": taken,
                           "read_us": module.carried(spin_us, m_full, m_left, 4.0),
                           "spin_inside": True, "read_inside": True})
    points.append({**points[0], "read_us": 1.0, "read_inside": False})
    path = tmp_path / "bandwidth-share.json"
    path.write_text(json.dumps({"gpu": "synthetic", "points": points}))
    text = module.analyse(path, dram)
    assert "9 of 10 points" in text
    assert "4: 0.0%" in text
    assert text.endswith("-> p = 4")


def test_the_sm_count_analysis_recovers_the_p_its_points_were_made_with_and_regenerates_its_file(tmp_path):
    """validation/projection/sm_count.py --analyse: MoE times made with p = 4 from an SM time stretched by
    Marlin's waves (or by the control's slowdown) and a fixed memory time give back p = 4; the committed
    analysis of the H100's run is what the script prints from its raw file."""
    module = validation_script("validation/projection/sm_count.py")
    dram, floor = 3.0e12, 9.0
    control = {"all": 100.0, "72": 172.0, "48": 236.0, "40": 300.0, "24": 469.0}
    for by in ("waves", "control"):
        stretch = {k: (1.0 if k == "all" else (math.ceil(132 / int(k)) if by == "waves" else v / 100.0))
                   for k, v in control.items()}
        points = [{"case": f"m{m:g}", "moe_bytes": m * dram * 1e-6,
                   "us": {k: floor + ((s * r) ** 4 + m ** 4) ** 0.25 for k, r in stretch.items()}}
                  for m, s in ((110.0, 120.0), (280.0, 200.0), (390.0, 260.0))]
        path = tmp_path / f"{by}.json"
        path.write_text(json.dumps({"gpu": "synthetic", "sms": 132, "control_us": control, "points": points}))
        text = module.analyse(path, dram, floor, by)
        assert f"r(N): {by}" in text
        assert " 4: 0.0%" in text
        assert "-> p = 4\n" in text
    runs = sorted(VALIDATION.glob("sm-count-h100*/sm-count.json"))
    assert len(runs) == 8
    for raw in runs:
        printed = "".join(module.analyse(raw, 3083e9, 8.93, by) + "\n" for by in ("waves", "control"))
        printed += module.analyse_two_stage(raw, 3083e9, 8.93) + "\n"
        assert printed.replace(f"{REPO}/", "") == (raw.parent / "analysis.txt").read_text(), raw


def test_the_latency_chain_is_one_cycle_through_every_line():
    """validation/projection/dram_latency.py: following the chain from word 0 visits every line once and
    comes back, each hop lands on a line's first word, and a chain of fewer than 2 lines is refused."""
    module = validation_script("validation/projection/dram_latency.py")
    buf = module.make_chain(500, seed=7)
    word, seen = 0, []
    for _ in range(500):
        seen.append(word)
        word = int(buf[word])
    assert word == 0
    assert sorted(seen) == [line * module.WORDS_PER_LINE for line in range(500)]
    assert seen[1:] != sorted(seen[1:])  # a random order, not a stride the hardware could predict
    with pytest.raises(ValueError, match="2 or more lines"):
        module.make_chain(1, seed=0)


def test_make_sh_reproduces_every_output_committed_beside_its_raw_files(tmp_path):
    """validation/projection/make.sh run now into a folder of its own: every file it writes (the cross-checks, the
    box's TPOT, overlap.txt, the SM-count and bandwidth-share analyses, published.md) is the committed one, the
    folder's name aside."""
    env = {**os.environ, "MAKE_OUT": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", "validation/projection/make.sh", sys.executable], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    made = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(made) > 40
    for path in made:
        rel = path.relative_to(tmp_path)
        assert path.read_text().replace(str(tmp_path), "validation/projection") == (VALIDATION / rel).read_text(), rel


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


def test_the_kernel_errors_are_split_by_whether_both_gpus_launched_the_same_kernels():
    def case(name, us, kernels):
        return Case(name, "dense_gemm", "vllm", {}, us, "kernel", 1, 1, 0, 0.0, 0, frozenset(kernels))
    mine = [case("a", 11.0, {"k1"}), case("b", 12.0, {"k1"}), case("c", 13.0, {"k1"})]
    theirs = {"a": case("a", 10.0, {"k1"}), "b": case("b", 10.0, {"k2"}), "c": case("c", 10.0, ())}
    stats = crosscheck._kernel_errors(mine, {c.name: c.median_us for c in mine}, theirs)
    assert stats["all"]["n"] == 3  # c: its kernels were not recorded on one side, so in neither split
    assert stats[crosscheck.SAME] == {"n": 1, "median": 0.1, "p90": 0.1, "worst": 0.1}
    assert stats[crosscheck.OTHER] == {"n": 1, "median": 0.2, "p90": 0.2, "worst": 0.2}


def test_the_beta_scan_is_what_its_script_prints_and_beta_0_is_the_rule():
    """validation/projection/beta.py -> beta.txt (the scan that left the rule); at beta 0 its projection is the
    rule's own."""
    module = validation_script("validation/projection/beta.py")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        module.main()
    assert out.getvalue() == (VALIDATION / "beta.txt").read_text()
    cases, facts = load_cases(H100_RUNS["kernel"])
    gpu = DeviceModel(facts, fit(cases, facts, "t"))
    assert all(module.warm_to_step(c, gpu, 0.0) == pytest.approx(project_case(c, gpu, gpu, "warm", "step"))
               for c in cases)


def test_the_rule_file_fit_writes_is_the_fit_the_cross_gpu_check_applies(tmp_path):
    """The pairs' checks go through the product's fit: python -m decodebench fit on a pair's files stores the very
    parameters the committed check applied (its fitted_on aside)."""
    tp8 = REPO / "validation/tp8"
    for run, fit_file in (("h100-2026-12-06-c", "h200-vs-h100-2026-12-06-c/fit-b-h100-sxm.json"),
                          ("h200-2026-12-06-b", "h200-vs-h100-2026-12-06-d/fit-a-h200-sxm.json")):
        (rule,) = write_rules([tp8 / run / "kernel.json.gz", tp8 / run / "step.json.gz"], tmp_path / run)
        stored = {k: v for k, v in read_json(rule)["params"].items() if k != "fitted_on"}
        checked = {k: v for k, v in read_json(VALIDATION / fit_file).items() if k != "fitted_on"}
        assert stored == checked
        assert stored["moe_overlap"] == projection_rule.MOE_OVERLAP


def test_no_one_overlap_share_gives_every_pair_its_own_share_figures():
    """overlap.txt (regenerated above): per direction, the shares of the source's fit that keep its step errors
    within 0.2 points of those with the GPU's own share are narrow, and no share lies in all ten."""
    text = (VALIDATION / "overlap.txt").read_text()
    windows = [(float(lo), float(hi)) for lo, hi in re.findall(r"shares (0\.\d+)-(0\.\d+) keep every step", text)]
    assert len(windows) == 10
    assert max(lo for lo, _ in windows) > min(hi for _, hi in windows)
    assert "one share for all ten directions: none" in text


def test_each_gpu_reads_the_overlap_share_the_docs_give_from_its_own_runs():
    shares = {}
    for paths in ([H100_RUNS["kernel"], H100_RUNS["step"]], [NIGHTLY]):
        cases, facts = load_cases(paths[0])
        cases += [c for p in paths[1:] for c in load_cases(p)[0]]
        shares[facts.name] = round(share.fit_with_share(cases, facts, "t", SM_COUNTS[facts.name[:4].lower()])
                                   .moe_overlap, 3)
    assert shares == {"H100 SXM": 0.687, "H200 SXM": 0.679}
    fits = [float(k) for k in re.findall(r"own share (0\.\d+): shares", (VALIDATION / "overlap.txt").read_text())]
    assert len(fits) == 10  # the product's default: the median share the five pairs' ten fits read
    assert projection_rule.MOE_OVERLAP == round(statistics.median(fits), 2)


def test_the_shipped_bands_are_the_committed_checks():
    """The package's bands.json is what bands.py makes of the five pairs' crosscheck.json (sm90 -> sm90) and of
    the box's residuals against its published figures (sm90 -> sm120)."""
    errors = []
    pairs = sorted(p.name for p in VALIDATION.glob("h200-vs-h100*"))
    assert pairs == ["h200-vs-h100", *(f"h200-vs-h100-2026-12-06{x}" for x in ("", "-b", "-c", "-d"))]
    for pair in pairs:
        rows = json.loads((VALIDATION / pair / "crosscheck.json").read_text())
        assert [d["params"]["fitted_on"].split(":")[0] for d in rows] == ["H200 SXM", "H100 SXM"]
        assert all(d["params"]["sources"]["moe_overlap"] == projection_rule.MOE_OVERLAP_SOURCE for d in rows)
        errors += [step["rule"]["error"] for direction in rows for step in direction["steps"]]
    hopper = band("sm90", "sm90")
    assert (hopper.low, hopper.high) == (round(min(errors), 4), round(max(errors), 4)) == (-0.0169, 0.0304)
    residuals = [r["residual"] for r in json.loads((VALIDATION / "box-rtx-pro-6000-x8-pcie" / "box.json").read_text())
                 ["published"]]
    box_band = band("sm90", "sm120")
    assert (box_band.low, box_band.high) == (round(min(residuals), 4), round(max(residuals), 4))
    assert "published figures" in box_band.what
    with contextlib.redirect_stdout(io.StringIO()) as out:
        validation_script("validation/projection/bands.py").main()
    assert out.getvalue() == BANDS_FILE.read_text()


def test_the_box_and_project_to_give_the_same_step_for_the_same_inputs():
    """The box report's kernels and all-reduces are scenarios --project-to's step: one apply path."""
    spec, target = load_model_spec("kimi-k2.5"), load_target("rtx-pro-6000-x8-pcie")
    paths = [H100_RUNS["step"], MLA]
    terms = box.load_profile_terms(PROFILES, IDLE)
    rows = box.tpot_rows(paths, target, terms, (1, 64), 1024, {})
    results = [r for p in paths for r in load_results(p)[0] if r.backend.startswith("vllm") or
               r.component == "dense_gemm"]
    for row in rows:
        info = answer(predict_step(results, spec, 8, row["batch"], 1024), results, spec, 8, targets=[target])
        (projected,) = info["projections"]
        assert projected["rule"] == "measured"
        assert row["kernels_us"] + row["allreduce_us"] == pytest.approx(projected["kernel_us"], rel=1e-12)
        assert row["tpot_us"] == pytest.approx(row["kernels_us"] + row["allreduce_us"] + row["not_benchmarked_us"]
                                               + row["idle_us"])
        assert "between two Hopper GPUs" not in row["band"]
        assert "published figures" in row["band"]


def test_the_box_prints_every_like_for_like_published_figure_with_its_all_reduce():
    published = box.load_published(VALIDATION / "published.json")
    rows = box.tpot_rows([H100_RUNS["step"], MLA], load_target("rtx-pro-6000-x8-pcie"),
                         box.load_profile_terms(PROFILES, IDLE), (1, 64, 128), 1024, published["tpot"],
                         custom_ar=published["custom_allreduce"])
    got = box.residuals(rows, published)
    assert len(got) == len(box.like_for_like(published, (1, 64, 128))) > 20
    for r in got:
        row = next(x for x in rows if x["batch"] == r["concurrency"])
        ar = row["custom_allreduce_us"] if r["allreduce"] == "custom" else row["allreduce_us"]
        assert r["projected_ms"] * 1e3 == pytest.approx(row["tpot_us"] - row["allreduce_us"] + ar)
    assert {r["allreduce"] for r in got} == {"custom", "nccl"}
    for r in got:  # each figure with the band it carries: the box's, never the Hopper pairs'
        assert r["band"]["pair"] == "sm90 -> sm120"
        low, high = band("sm90", "sm120").low, band("sm90", "sm120").high
        ends = [r["projected_ms"] / (1 + high), r["projected_ms"] / (1 + low)]
        assert r["band"]["ms"] == pytest.approx(ends, abs=1e-3)
    text = (VALIDATION / "box-rtx-pro-6000-x8-pcie" / "box.txt").read_text()
    figures = text[text.index("published figures set up"):]
    assert figures.count("(sm90 -> sm120)") == len(got)
    assert "sm90 -> sm90" not in text
    assert "between two Hopper GPUs" not in text
    pairs = box.setup_pairs(rows, published)  # the published runs' own one-field changes, beside the model's
    assert {p["field"] for p in pairs} == {"allreduce", "kv_cache_dtype", "mla_backend"}
    by_run = {r["run"]: r for r in got}
    for p in pairs:
        first, second = (by_run[run] for run in p["runs"])
        assert p["published_ms"] == pytest.approx(second["published_ms"] - first["published_ms"], abs=1e-3)
        if p["field"] == "allreduce":
            assert p["model_ms"] == pytest.approx(second["terms_ms"]["allreduces"] - first["terms_ms"]["allreduces"],
                                                  abs=1e-3)
        if p["field"] == "mla_backend":
            assert p["model_ms"] is None


def test_an_fp8_cache_barely_moves_the_box_s_mla_backend_at_l_1024():
    """The report's reading of the H100 run of 2026-12-07: TRITON_MLA at an fp8 cache within 3.4 % of bf16 at
    L = 1024, M = 1, 64 and 256, though it reads half the KV bytes."""
    rows = box.kv_dtype_rows(REPO / "validation/tp8/h100-2026-12-07/step.json.gz")
    assert [(r["batch"], r["context"], r["timer"]) for r in rows] == [(1, 1024, "step"), (64, 1024, "step"),
                                                                      (256, 1024, "step")]
    assert [round(100 * (r["fp8_us"] / r["bf16_us"] - 1), 1) for r in rows] == [2.7, 0.3, -3.4]


def test_the_terms_that_could_carry_a_residual():
    """box.carriers: the KV cache's time comes off a positive residual first; a term could carry the rest alone
    where it is at least as large, needing the change printed, the largest first."""
    row = {"groups_us": {"moe": 30000.0, "mla_attention": 4000.0}, "not_benchmarked_us": 600.0, "idle_us": 300.0,
           "kv_us": 2000.0}
    got = box.carriers(row, 7000.0, 10000.0)
    assert got == {"kv_ms": 2.0, "rest_ms": 8.0, "could_carry": {"kernels moe": round(-8 / 30, 4)}}
    got = box.carriers(row, 7000.0, 5000.0)  # 3 ms left: the MoE, the all-reduces and MLA each could
    assert list(got["could_carry"]) == ["kernels moe", "allreduces", "kernels mla_attention"]
    got = box.carriers(row, 7000.0, -5000.0)  # projected under the figure: nothing comes off, a term must grow
    assert got["rest_ms"] == -5.0
    assert got["could_carry"] == {"kernels moe": round(5 / 30, 4), "allreduces": round(5 / 7, 4)}


def test_crosscheck_refuses_a_target_of_another_gpu(capsys):
    h100 = str(VALIDATION / "targets" / "h100-x8-nvlink.json")
    assert crosscheck.main([str(NIGHTLY), str(NIGHTLY), "--target-a", h100, "--target-b", "h200-x8-nvlink"]) == 2
    assert "measured on H200 SXM, but target h100-x8-nvlink is a H100 SXM" in capsys.readouterr().err


def test_the_gpu_idle_of_the_one_rank_of_tp8_profile_and_profiles_without_their_rows(tmp_path):
    terms = box.load_profile_terms(PROFILES, H100 / "profile-24-layers.json")
    assert [r["concurrency"] for r in terms.idle_rows] == [1, 64, 256]
    idle, how = terms.idle_us(1, 14000.0)  # busier than the profiled host's step: the GPU-bound load's idle
    assert idle == pytest.approx(317.7, abs=0.1)
    assert "window1, host-bound" in how
    idle, _ = terms.idle_us(1, 1000.0)  # a GPU faster than the host waits for it
    assert idle == pytest.approx(terms.idle_rows[0]["wall_us"] - 1000.0)
    bad = tmp_path / "attribution.txt"
    bad.write_text("µs/step (% busy)    c1-in8-out8\nmoe_gemm 1.0 1%\n")
    with pytest.raises(ValueError, match="attribution.txt: not a printed attribution table"):
        box.load_profile_terms(PROFILES, bad)


def test_a_result_file_the_checks_cannot_read_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="x.json is not a pytest-benchmark result"):
        load_cases(bad)
    stored = json.loads(NIGHTLY.read_text())
    stored["benchmarks"] = stored["benchmarks"][:3]
    for bench in stored["benchmarks"]:
        bench["extra_info"]["timer"] = "hourglass"
    (tmp_path / "odd.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="odd.json: timer.s. hourglass: the rule knows the cache state of kernel"):
        load_cases(tmp_path / "odd.json")
    cases, facts = load_cases(NIGHTLY)
    assert facts.l2_bytes == 62914560 == DEVICE_FACTS["H200 SXM"].l2_bytes
    assert len(cases) > 200


def test_sm_count_files_are_checked_and_read_per_gpu(tmp_path):
    raw = json.loads(SM_COUNTS["h200"][0].read_text())
    for change, error in (({"gpu": ""}, "no 'gpu' name"), ({"sms": 0}, "'sms' is not a positive integer"),
                          ({"points": [{"case": "x", "tokens": 64, "moe_bytes": 1, "us": {"all": -1}}]},
                           "point 0 .x.: 'us' needs a positive time")):
        (tmp_path / "s.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(ValueError, match=f"s.json: not an sm-count.json .*{error}"):
            share.load(tmp_path / "s.json")
    with pytest.raises(ValueError, match="measured on NVIDIA H200, not on an H100 SXM"):
        share.overlap_share(SM_COUNTS["h200"], "H100 SXM", lambda case: 9.0, 3e12)


@pytest.mark.parametrize("p", [1.5, 2.3, 4.0])
def test_the_two_stage_estimate_gives_back_the_sm_time_and_p_that_made_its_times(p):
    """share.two_stage: times made wave by wave (Marlin's 132 blocks on N SMs) give back that SM time and p."""
    m, s = 285.0, 280.0
    above = {n: share.wave_times(s, m, 132, n, p) for n in (132, 112, 72, 48, 40, 32, 24, 16)}
    got_s, got_p, scarce = share.two_stage(above, m, 132)
    assert scarce == [16, 24, 32, 40]
    assert got_s == pytest.approx(s, rel=1e-5)
    assert got_p == pytest.approx(p, rel=1e-5)
    assert share.two_stage({**above, 132: max(s, m)}, m, 132)[1] is None
    with pytest.raises(ValueError, match="no SM count with 4 or more waves"):
        share.two_stage({132: 400.0, 72: 640.0}, m, 132)
