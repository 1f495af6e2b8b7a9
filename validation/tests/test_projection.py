"""The projection rule's evidence: the committed cross-GPU checks, the box's TPOT and the facts under the rule,
recomputed from the raw files under validation/ and compared with the tables validation/reports/projection.md shows."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys

import pytest

from decodebench.attribution.predict import box, crosscheck, projection_rule
from decodebench.attribution.predict.projection_rule import load_cases
from decodebench.attribution.predict.targets import load_target
from decodebench.files import read_json
from validation.tests.evidence import REPO, validation_script

BASELINES = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
NIGHTLY = BASELINES / "0005_h200-vllm-nightly-gated.json"
MLA = BASELINES / "0004_h200-vllm-mla-all-backends.json"
VALIDATION = REPO / "validation" / "projection"
SM_COUNTS = {gpu: sorted(VALIDATION.glob(f"sm-count-{gpu}*/sm-count.json")) for gpu in ("h100", "h200")}
H100 = REPO / "validation/tp8/h100-2026-12-05"


def test_the_box_fits_each_gpu_on_the_committed_runs_with_the_overlap_the_docs_give():
    fits = box.fit_per_gpu(
        [H100 / "kernel.json.gz", H100 / "step.json.gz", NIGHTLY], SM_COUNTS["h100"] + SM_COUNTS["h200"]
    )
    assert {n: round(p.moe_overlap, 3) for n, p in fits.items()} == {"H100 SXM": 0.687, "H200 SXM": 0.679}


def test_h200_and_h100_projected_to_each_other_from_the_committed_runs(tmp_path):
    """The committed cross-GPU check, recomputed: each direction fitted on its source only (its results and
    its SM-count runs), the rule's step nearer the measured step than the datasheet rule's at every M."""
    h100 = REPO / "validation/tp8/h100-2026-12-05"
    directions, fits = crosscheck.check([NIGHTLY], [h100 / "kernel.json.gz", h100 / "step.json.gz"],
                                        load_target("h200-x8-nvlink"),
                                        load_target(str(VALIDATION / "targets" / "h100-x8-nvlink.json")),
                                        (1, 64, 256), 1024, sm_counts=SM_COUNTS["h200"] + SM_COUNTS["h100"])
    assert fits["a-H200 SXM"].moe_overlap == pytest.approx(0.679, abs=5e-4)
    assert fits["b-H100 SXM"].moe_overlap == pytest.approx(0.687, abs=5e-4)
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


def test_the_shipped_bracket_is_the_committed_cross_gpu_step_error():
    errors = []
    pairs = sorted(p.name for p in VALIDATION.glob("h200-vs-h100*"))
    assert pairs == ["h200-vs-h100", *(f"h200-vs-h100-2026-12-06{x}" for x in ("", "-b", "-c", "-d"))]
    for pair in pairs:
        rows = json.loads((VALIDATION / pair / "crosscheck.json").read_text())
        assert [d["params"]["fitted_on"].split(":")[0] for d in rows] == ["H200 SXM", "H100 SXM"]
        assert all(d["params"]["moe_overlap"] is not None for d in rows)  # each side read its SM-count runs
        errors += [step["rule"]["error"] for direction in rows for step in direction["steps"]]
    assert projection_rule.MEASURED_STEP_ERROR == (round(min(errors), 4), round(max(errors), 4))


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

