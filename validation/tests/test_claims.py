"""The figures the issue of the evidence named, each regenerated from its raw files by its script and compared with
every page that quotes it; and the rules the reference pages keep (short, no machine's history, no machine paths)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from decodebench.files import read_json
from validation.tests.evidence import REPO, VALIDATION, validation_script

REPORTS = VALIDATION / "reports"
NIGHTS = {seq: VALIDATION / "gate" / f"h100-2026-12-06-step-{seq}" for seq in "abc"}
TP8 = VALIDATION / "tp8"


def plain(text: str) -> str:
    """A figure as the scripts print it: ASCII minus, no space before %, no bold, whitespace collapsed."""
    return " ".join(text.replace("−", "-").replace(" %", "%").replace("**", "").split())


def run_script(script: str, *args) -> str:
    """What ``python validation/SCRIPT ARGS`` prints, from the repository root."""
    done = subprocess.run([sys.executable, str(VALIDATION / script), *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env={"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def table_rows(text: str, head: str) -> list[list[str]]:
    """The body rows of the first table whose header starts with ``head``."""
    lines = text[text.index(head):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


# --- the nights of one H100 from an empty storage -------------------------------------------------


@pytest.mark.parametrize("seq", "abc")
def test_each_nights_table_is_what_its_logs_and_results_hold(seq):
    out = run_script("gate/nights_table.py", NIGHTS[seq].relative_to(REPO))
    committed = NIGHTS[seq] / "nights.md"
    if committed.exists():
        assert out == committed.read_text()
    script = {row[0]: row for row in table_rows(out, "| night |")}
    report = REPORTS.joinpath("gate-first-nights-h100.md").read_text()
    shown = [row for row in table_rows(report, "| sequence | night |") if row[0] == seq]
    assert shown, f"the report shows no night of sequence {seq}"
    for row in shown:
        night = row[1].split(":")[0]
        stored, gate, slower, faster, undecided, same = row[2:8]
        mine = script[night]
        assert (stored, gate) == (mine[1], mine[2]), row
        if slower == "-":  # night 1: nothing compared
            assert mine[3] in ("0", "no result"), row
            assert "nothing was compared" in mine[9], row
            continue
        caught = re.match(r"(\d+) of (\d+) \(([\d.]+) %\)", slower.replace("**", ""))
        if caught:
            assert mine[8] == f"{caught.group(1)} of {caught.group(2)} ({caught.group(3)}%)", row
            slower = caught.group(1)
        assert [slower, faster, undecided, same] == mine[4:8], row


def test_the_offline_arrangements_and_the_power_of_the_h100_nights_are_the_simulations():
    raw = read_json(VALIDATION / "gate" / "h100-step" / "short-history.json.gz")["nights"]
    unchanged = {gate: [r for r in raw if not r["injected"] and r["gate"] == gate] for gate in (0.05, 0.03)}
    assert len(unchanged[0.05]) == len(unchanged[0.03])
    total, failed = len(unchanged[0.05]), sum(r["slower"] > 0 for rs in unchanged.values() for r in rs)
    five = [r for r in raw if r["injected"] and r["stored"] == 5]
    caught, trials = sum(r["slower"] for r in five), sum(r["cases"] for r in five)
    power = f"{100 * caught / trials:.1f}"
    report = plain(REPORTS.joinpath("gate-first-nights-h100.md").read_text())
    assert f"{failed} of {total} arrangements of the unchanged build failed, at 5% and at 3%" in report
    assert f"Power against five stored runs is {power}% ({caught} of {trials} trials)" in report
    index = plain((REPO / "docs" / "validation.md").read_text())
    assert f"offline {failed} of {total} failed, power {power}%" in index


# --- one rank of TP 8 ------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["h100-2026-12-05", "h100-2026-12-05-b", "h100-2026-12-05-c", "h100-2026-12-07",
                                    "h100-2026-12-07-b"])
def test_each_tp8_table_is_what_table_py_prints(folder):
    assert run_script("tp8/table.py", (TP8 / folder).relative_to(REPO)) == (TP8 / folder / "table.md").read_text()


def test_the_rules_only_table_is_what_table_py_prints_without_the_generic_kernels_read_from_code():
    folder = (TP8 / "h100-2026-12-07-b").relative_to(REPO)
    assert run_script("tp8/table.py", folder, "--rules-only") == (TP8 / folder.name / "table-rules-only.md").read_text()


def test_the_tp8_report_and_the_timers_page_quote_the_table_of_their_run():
    rows = table_rows((TP8 / "h100-2026-12-05-c" / "table.md").read_text(), "| C | group |")
    made = {(r[0], plain(re.sub(r" of busy\)", ")", r[1]))): [plain(c) for c in r[2:]] for r in rows}
    shown = table_rows(REPORTS.joinpath("tp8.md").read_text(), "| C | group (share of busy) |")
    assert len(shown) == len([k for k in made if not k[1].startswith(("routing", "not predicted"))])
    for row in shown:
        assert [plain(c) for c in row[2:]] == made[(row[0], plain(row[1]))], row
    totals = {c: cells for (c, group), cells in made.items() if group == "benchmarked total"}
    step = ", ".join(totals[c][2] for c in ("1", "64", "256"))  # +2.6%, -1.6%, -1.7%
    kernel = [totals[c][4].lstrip("-").rstrip("%") for c in ("1", "64", "256")]
    page = plain((REPO / "docs" / "benchmarks.md").read_text())
    assert f"({step.replace('%', '')}%)" in page
    assert f"`kernel` is {kernel[0]}, {kernel[1]} and {kernel[2]}% low" in page


def test_the_coverage_report_quotes_the_tables_of_its_run():
    """The rotary, KV-cache and MoE-buffer rows and the totals of each timer, from h100-2026-12-07-b's table.md;
    the rules-only totals from its table-rules-only.md."""
    report = plain(REPORTS.joinpath("coverage.md").read_text()).replace("%", " %").replace("  ", " ")
    totals = {}
    for name in ("table.md", "table-rules-only.md"):
        rows = table_rows((TP8 / "h100-2026-12-07-b" / name).read_text(), "| C | group |")
        made = {(r[0], re.sub(r" \(.*", "", plain(r[1]))): [plain(c) for c in r[2:]] for r in rows}
        totals[name] = " / ".join(made[(c, "benchmarked total")][2].rstrip("%") for c in ("1", "64", "256"))
        if name == "table.md":
            shown = table_rows(REPORTS.joinpath("coverage.md").read_text(), "| C | rotary profiled")
            assert [row[0] for row in shown] == ["1", "64", "256"]
            for c, rotary, write, buffers, step, kernel in shown:
                assert plain(rotary) == " / ".join(made[(c, "rotary")][:2])
                for cell, group in ((write, "kv_cache_write"), (buffers, "moe_buffers")):
                    profiled, predicted, error = made[(c, group)][:3]
                    assert plain(cell) == f"{profiled} / {predicted} ({error})"
                total = made[(c, "benchmarked total")]
                assert (plain(step), plain(kernel)) == (total[2], total[4])
    assert (f"Prediction from the step timer: {totals['table.md']} % with those two kernels in their parts, "
            f"{totals['table-rules-only.md']} % by the rules alone") in report


@pytest.mark.parametrize("folder", ["h100-2026-12-05", "h100-2026-12-05-b"])
def test_each_step_kernel_ratio_table_is_what_ratios_py_prints(folder):
    assert run_script("tp8/ratios.py", (TP8 / folder).relative_to(REPO)) == (TP8 / folder / "ratios.md").read_text()


def test_the_timers_page_quotes_the_step_kernel_ratios_of_its_run():
    rows = {r[0]: r[2] for r in table_rows((TP8 / "h100-2026-12-05-b" / "ratios.md").read_text(), "| component |")}
    names = {"dense_gemm": "dense GEMMs", "router_gemm": "router GEMM", "rmsnorm": "RMSNorm",
             "routing_topk": "routing top-k", "moe": "MoE", "mla_decode": "MLA"}
    order = sorted(rows, key=lambda c: (-float(rows[c]), list(names).index(c)))
    sentence = ", ".join(f"{names[c]} {rows[c]}" for c in order)
    assert sentence in plain((REPO / "docs" / "benchmarks.md").read_text())


COVERAGE = re.compile(r"\(([\d.]+) µs\): ([\d.]+)% without the KV-cache write, the rotary embedding and the MoE "
                      r"buffers, ([\d.]+)% with them\n.*\(read from the generated code\): ([\d.]+)%")
FROM_CODE = ("--from-code", "triton_red_fused_3=rmsnorm", "--from-code", "triton_poi_fused_2=rotary")


def test_the_coverage_report_is_what_coverage_py_prints_of_the_runs_traces(tmp_path):
    """Each load's covered shares: before the two components, with them, and with the generic kernels
    the run's README reads from its generated code; the figures in the raw coverage.txt too."""
    run = TP8 / "h100-2026-12-07-b"
    subprocess.run(["tar", "xzf", str(run / "traces.tgz"), "-C", str(tmp_path)], check=True, timeout=120)
    printed = run_script("tp8/coverage.py", tmp_path / "traces", *FROM_CODE)
    assert printed == (run / "coverage.txt").read_text()
    made = [m.groups()[1:] for m in COVERAGE.finditer(printed)]
    shown = table_rows(REPORTS.joinpath("coverage.md").read_text(), "| load |")
    assert len(shown) == len(made) == 3
    for row, figures in zip(shown, made, strict=True):
        assert [plain(cell) for cell in row[3:6]] == [f"{f}%" for f in figures], row[0]


# --- what the reference pages keep to ------------------------------------------------------------------

HISTORY = re.compile(r"\blease|\bserial|GPU-[0-9a-f]{8}|\bcommit [0-9a-f]{7}|\bat `?[0-9a-f]{7,40}\b", re.I)


@pytest.mark.parametrize("page", ["attribution.md", "validation.md", "projection.md"])
def test_a_reference_page_is_short_and_holds_no_machine_history(page):
    text = (REPO / "docs" / page).read_text()
    assert len(text.splitlines()) < 500
    assert [m.group(0) for m in HISTORY.finditer(text)] == []


def test_every_report_says_what_on_what_with_which_command_its_raw_files_result_and_limits():
    for report in sorted(REPORTS.glob("*.md")):
        head = [row[0] for row in table_rows(report.read_text(), "| | |")]
        assert head == ["what", "on", "command", "raw files", "result", "limits"], report.name
        assert f"validation/reports/{report.name}" in (REPO / "docs" / "validation.md").read_text().replace(
            "../validation/", "validation/"), f"docs/validation.md does not list {report.name}"


def test_no_tracked_file_names_a_path_of_a_machine():
    """Every tracked file, baselines/ and the raw outputs of runs included, and every member of a .gz or .tgz (a .gz
    inside a .tgz too): the home (root's, or a user's under home) or the checkout (under work) of the machine a file
    was written on is ``~`` or ``<checkout>`` (``python validation/machine_paths.py --rewrite``)."""
    machine_paths = validation_script("validation/machine_paths.py")
    found = machine_paths.scan(REPO)
    assert [str(f) for f in found] == [], "python validation/machine_paths.py --rewrite replaces them"


def test_the_index_quotes_the_coverage_of_its_run():
    """docs/validation.md's coverage row: the rules' shares at each C and the C = 1 share with the generic
    kernels read from code, as coverage.txt of h100-2026-12-07-b prints them."""
    made = [m.groups()[1:] for m in COVERAGE.finditer((TP8 / "h100-2026-12-07-b" / "coverage.txt").read_text())]
    row = next(r for r in table_rows((REPO / "docs" / "validation.md").read_text(), "| claim")
               if "cover a served TP-8 rank" in r[0])
    rules = [m[1] for m in made]
    assert plain(row[1]) == (f"{rules[0]}% at C = 1, {rules[1]}% at 64, {rules[2]}% at 256 by the rules; "
                             f"{made[0][2]}% at C = 1 with two generic kernels read from the generated code")
