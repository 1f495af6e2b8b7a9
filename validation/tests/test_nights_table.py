"""validation/gate/nights_table.py: the per-night table of validation/gate/nights.sh from its logs and JSON."""

from __future__ import annotations

import gzip
import json

from validation.tests.evidence import validation_script


def _table_module():
    return validation_script("validation/gate/nights_table.py")


def _night(out, night, stored, what, conclusion, status, verdicts=(), injected=False):
    (out / f"night-{night}.log").write_text(
        f"nights.sh: night {night}: {stored} stored results; {what}\n...\n{conclusion}\n"
        f"nights.sh: night {night} exit {status} after 60 s\n")
    if verdicts:
        benches = [{"name": f"case{i}", "extra_info": {"gate": {"verdict": v}, **({"injected_slowdown": 0.05}
                                                                                  if injected else {})}}
                   for i, v in enumerate(verdicts)]
        (out / f"night-{night}.json").write_text(json.dumps({"benchmarks": benches}))


def test_each_night_is_a_row_with_its_verdicts_and_the_injected_night_its_power(tmp_path, capsys):
    _night(tmp_path, 1, 0, "--gate 5% --benchmark-autosave",
           "gate FAILED: nothing was compared (no stored result in s); --gate-allow-empty passes such a run", 1)
    _night(tmp_path, 2, 1, "--gate 5% --benchmark-autosave", "gate passed: 0 of 3 cases significantly slower", 0,
           ("same", "undecided", "faster"))
    _night(tmp_path, 6, 5, "--gate 3% --inject-slowdown 5%", "gate FAILED: 2 of 3 cases significantly slower by "
           "more than 3.0% (95% confidence for the session)", 1, ("slower", "slower", "undecided"), injected=True)
    assert _table_module().main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| night | stored runs | gate |")
    assert len(lines) == 5
    assert lines[2].startswith("| 1 | 0 | 5% | no result | 0 | 0 | 0 | 0 | - | gate FAILED: nothing was compared")
    assert lines[3].startswith("| 2 | 1 | 5% | 3 | 0 | 1 | 1 | 1 | - | gate passed")
    assert lines[3].endswith("| 0 |")
    assert lines[4].startswith("| 6 | 5 | 3% | 3 | 2 | 0 | 1 | 0 | 2 of 3 (66.7%) | gate FAILED")
    assert lines[4].endswith("| 1 |")


def test_a_result_committed_gzipped_is_read_as_the_raw_one(tmp_path, capsys):
    _night(tmp_path, 2, 1, "--gate 5% --benchmark-autosave", "gate passed: 0 of 2 cases significantly slower", 0,
           ("same", "undecided"))
    raw = tmp_path / "night-2.json"
    (tmp_path / "night-2.json.gz").write_bytes(gzip.compress(raw.read_bytes()))
    raw.unlink()
    assert _table_module().main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("| 2 | 1 | 5% | 2 | 0 | 0 | 1 | 1 | - | gate passed")


def test_a_folder_that_is_not_there_is_named(tmp_path, capsys):
    assert _table_module().main([str(tmp_path / "missing")]) == 2
    assert "nights_table.py OUTDIR" in capsys.readouterr().err
