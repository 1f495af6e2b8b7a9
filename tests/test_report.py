from decodebench.compare import Comparison, Verdict
from decodebench.report import markdown_summary, write_summary


def _comparisons():
    return [
        Comparison("t[same]", Verdict.SAME, 1.01, 0.4, "within ±5.0%", (1, 1)),
        Comparison("t[a]", Verdict.SLOWER, 1.10, 1e-5, "+10.0%, p=1e-05", (2, 2)),
        Comparison("t[b]", Verdict.SLOWER, 1.30, 2e-7, "+30.0%, p=2e-07", (2, 2)),
        Comparison("t[und]", Verdict.UNDECIDED, 1.08, 0.2, "runs overlap | drift?", (1, 3)),
        Comparison("t[fast]", Verdict.FASTER, 0.7, 1e-6, "-30.0%", (1, 2)),
    ]


def test_slower_rows_come_first_largest_first_then_counts():
    text = markdown_summary(_comparisons(), "gate FAILED: 2 of 5 significantly slower by more than 5.0%",
                            ["artifacts/kernels.json", "artifacts/history/"])
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("| **")]
    assert rows == [
        "| **SLOWER** | `t[b]` | 1.300x | +30.0% | 2e-07 | +30.0%, p=2e-07 |",
        "| **SLOWER** | `t[a]` | 1.100x | +10.0% | 1e-05 | +10.0%, p=1e-05 |",
        "| **UNDECIDED** | `t[und]` | 1.080x | +8.0% | 0.2 | runs overlap \\| drift? |",
    ]
    assert "SLOWER: 2 · UNDECIDED: 1 · INCOMPARABLE: 0 · FASTER: 1 · SAME: 1" in lines
    assert "**gate FAILED: 2 of 5 significantly slower by more than 5.0%**" in lines
    assert lines[-2:] == ["- `artifacts/kernels.json`", "- `artifacts/history/`"]


def test_summary_is_appended_never_replaced(tmp_path):
    target = tmp_path / "step_summary.md"
    target.write_text("earlier step\n")
    write_summary(target, _comparisons()[:1], "gate passed: 0 of 1", [])
    text = target.read_text()
    assert text.startswith("earlier step\n## decodebench verdicts")
    assert "SAME: 1" in text
