"""validation/projection/published.json (the box's published figures) and published.py, its page."""

from __future__ import annotations

import copy
import json

import pytest

from validation.tests.evidence import REPO, validation_script

HERE = REPO / "validation" / "projection"


def _box():
    return validation_script("validation/projection/box.py")


def _published():
    return validation_script("validation/projection/published.py")


def test_the_committed_page_is_what_the_script_makes_of_the_json():
    assert (HERE / "published.md").read_text() == _published().render(_published().load())


def test_box_reads_the_file_and_its_headline_is_a_cell_of_its_run():
    data = _box().load_published(HERE / "published.json")
    run = next(r for r in data["runs"] if r["id"] == data["tpot"]["1"]["run"])
    cell = next(f for f in run["figures"] if f["context"] == "0" and f["concurrency"] == 1)
    assert (cell["tok_s"], run["dcp"], run["mtp"], run["allreduce"]) == (88.5, 1, False, "pcie_custom")
    assert data["tpot"]["1"]["tpot_ms"] == pytest.approx(1e3 / cell["tok_s"], abs=0.05)


def _broken(tmp_path, edit):
    data = copy.deepcopy(json.loads((HERE / "published.json").read_text()))
    edit(data)
    path = tmp_path / "published.json"
    path.write_text(json.dumps(data))
    return path


def test_a_tpot_that_is_not_concurrency_over_tok_s_and_names_no_source_is_refused(tmp_path):
    def edit(data):
        data["runs"][0]["figures"][0]["tpot_ms"] += 1
    with pytest.raises(ValueError, match=r"run 'k26-0424-no-marlin-fp8-dcp1-mtp': tpot_ms is not concurrency / tok_s"):
        _published().load(_broken(tmp_path, edit))


def test_a_run_without_its_source_commit_is_refused(tmp_path):
    def edit(data):
        del data["runs"][3]["source"]["commit"]
    with pytest.raises(ValueError, match=r"run 'k26-0424-no-marlin-fp8-dcp4-nomtp': no commit"):
        _published().load(_broken(tmp_path, edit))


def test_a_headline_that_is_not_in_its_run_is_refused(tmp_path):
    def edit(data):
        data["tpot"]["64"]["tok_s"] = 1300.0
    with pytest.raises(ValueError, match=r"tpot\['64'\] is not context 0, concurrency 64 of run"):
        _published().load(_broken(tmp_path, edit))
