import types
from pathlib import Path

from decodebench.gate import CaseVerdict, Verdict
from decodebench.gate.summary import artifact_links, format_verdicts, markdown_summary, summary_target, write_summary


def _verdicts():
    return [
        CaseVerdict("t[same]", Verdict.SAME, "within ±5.0%", ratio=1.01, low=0.99, high=1.03, runs=(1, 1)),
        CaseVerdict("t[a]", Verdict.SLOWER, "+10.0%", ratio=1.10, low=1.06, high=1.14, runs=(2, 2),
                    cost_us=61.0, step_share=0.0031),
        CaseVerdict("t[b]", Verdict.SLOWER, "+30.0%", ratio=1.30, low=1.2, high=1.4, runs=(2, 2)),
        CaseVerdict("t[und]", Verdict.UNDECIDED, "runs overlap | more runs decide", ratio=1.08, runs=(1, 3),
                    detectable=0.081),
        CaseVerdict("t[fast]", Verdict.FASTER, "-30.0%", ratio=0.7, runs=(1, 2)),
    ]


def test_slower_rows_come_first_largest_first_then_counts():
    text = markdown_summary(_verdicts(), "gate FAILED: 2 of 5 cases significantly slower by more than 5.0%",
                            ["artifacts/kernels.json", "artifacts/history/"])
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("| **")]
    assert rows == [
        "| **SLOWER** | `t[b]` | 1.300x | 1.200–1.400x |  | - | - | +30.0% |",
        "| **SLOWER** | `t[a]` | 1.100x | 1.060–1.140x |  | +61.00 | +0.31% | +10.0% |",
        "| **UNDECIDED** | `t[und]` | 1.080x | - | +8.1% | - | - | runs overlap \\| more runs decide |",
    ]
    assert "SLOWER: 2 · UNDECIDED: 1 · INCOMPARABLE: 0 · FASTER: 1 · SAME: 1" in lines
    assert "**gate FAILED: 2 of 5 cases significantly slower by more than 5.0%**" in lines
    assert lines[-2:] == ["- `artifacts/kernels.json`", "- `artifacts/history/`"]


def test_the_summary_names_each_undecided_cases_smallest_detectable_slowdown_and_the_conclusion_counts_them():
    from decodebench.gate import Policy
    from decodebench.gate.session import conclude

    verdicts = [*_verdicts(), CaseVerdict("t[tight]", Verdict.UNDECIDED, "+4.9%", ratio=1.049, runs=(3, 3),
                                          detectable=0.05)]
    line = conclude(verdicts, [], Policy(threshold=0.05), gate=0.05, allow_empty=False, nothing_why="").line
    # t[und] could call nothing below +8.1 %: too noisy at 5 %; t[tight] could, its estimate fell short
    assert line.endswith("; 2 undecided, 1 of them too noisy to gate at 5.0%")
    rows = [r for r in markdown_summary(verdicts, line).splitlines() if r.startswith("| **UNDECIDED")]
    assert [r.split(" | ")[4] for r in rows] == ["+8.1%", "+5.0%"]


def test_every_verdict_line_carries_its_cost_per_decode_step():
    lines = format_verdicts(_verdicts())
    assert lines[1].startswith("SLOWER         1.100x  +61.00 µs/step (+0.31% of step)  t[a]  (+10.0%)")
    assert lines[0].startswith("SLOWER         1.300x  -  t[b]")  # no shapes known: no cost, said as '-'


def test_summary_is_appended_never_replaced(tmp_path):
    target = tmp_path / "step_summary.md"
    target.write_text("earlier step\n")
    write_summary(target, markdown_summary(_verdicts()[:1], "gate passed: 0 of 1"))
    text = target.read_text()
    assert text.startswith("earlier step\n## decodebench verdicts")
    assert "SAME: 1" in text


def test_the_summary_goes_beside_the_json_report_wherever_that_is(tmp_path, monkeypatch):
    # pytest-benchmark 5 gives --benchmark-json as a Path: its .name is the file's name alone, and the
    # summary of --benchmark-json=/elsewhere/current.json landed in the working directory
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    report = tmp_path / "out" / "current.json"
    options = {"summary_md": None, "benchmark_json": report}
    config = types.SimpleNamespace(getoption=lambda name, default=None: options.get(name, default))
    assert summary_target(config) == tmp_path / "out" / "current.summary.md"
    assert artifact_links(config)[0] == str(report)
    report.parent.mkdir()
    with open(report, "wb") as opened:  # an older pytest-benchmark: an open file
        options["benchmark_json"] = opened
        assert summary_target(config) == Path(opened.name).with_name("current.summary.md")
