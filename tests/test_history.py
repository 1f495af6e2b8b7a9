import json

import pytest

from decodebench.baselines import write_json_atomically
from decodebench.history import main, plot_history


def _store(folder, number, median_s, key="cpu-x", invalid=None):
    entry = {"fullname": "benchmarks/test_rmsnorm.py::test_rmsnorm[add-w7168-m1-torch]",
             "stats": {"data": [median_s * f for f in (0.99, 1.0, 1.01)]}, "extra_info": {}}
    if invalid:
        entry["extra_info"]["invalid"] = invalid
    document = {"machine_info": {"decodebench": {"fingerprint": {"key": key}}}, "benchmarks": [entry]}
    write_json_atomically(folder / f"{number:04d}_run.json", document)


def test_one_svg_per_benchmark_with_a_point_per_stored_result(tmp_path):
    folder = tmp_path / "cpu-x"
    _store(folder, 1, 10e-6)
    _store(folder, 2, 12e-6)
    _store(folder, 3, 1e-9, invalid="collapsed TPOT")  # never plotted as a level
    (folder / "0004_damaged.json").write_text("{")
    (svg,) = plot_history(folder, tmp_path / "plots")
    assert svg.name == "benchmarks_test_rmsnorm.py_test_rmsnorm_add-w7168-m1-torch.svg"
    text = svg.read_text()
    assert text.startswith("<?xml")
    assert ">0001<" in text
    assert ">0002<" in text
    assert ">0003<" not in text


def test_cli_refuses_a_folder_of_mixed_fingerprints(tmp_path, capsys):
    folder = tmp_path / "mixed"
    _store(folder, 1, 10e-6)
    _store(folder, 2, 10e-6, key="gpu-y")
    with pytest.raises(SystemExit) as exc:
        main([str(folder), str(tmp_path / "plots")])
    assert exc.value.code == 2
    assert "mixes fingerprints ['cpu-x', 'gpu-y']" in capsys.readouterr().err


def test_cli_writes_the_plots(tmp_path, capsys):
    folder = tmp_path / "cpu-x"
    _store(folder, 1, 10e-6)
    assert main([str(folder), str(tmp_path / "plots")]) == 0
    assert "1 plots in" in capsys.readouterr().out
    assert json.loads((folder / "0001_run.json").read_text())["benchmarks"]


def test_benchmarks_whose_names_would_share_a_file_get_one_plot_each(tmp_path):
    folder = tmp_path / "cpu-x"
    names = ["t[a/b]", "t[a_b]", "t[a b]", "t[a:b]", "t[" + "x" * 300 + "]"]
    entries = [{"fullname": n, "stats": {"data": [1e-5, 1e-5, 1e-5]}, "extra_info": {}} for n in names]
    write_json_atomically(folder / "0001_run.json", {"machine_info": {"decodebench": {"fingerprint": {"key": "cpu-x"}}},
                                                    "benchmarks": entries})
    written = plot_history(folder, tmp_path / "plots")
    assert len(written) == len(set(written)) == 5
    assert all(path.is_file() and len(path.name) < 200 for path in written)


def test_a_folder_with_nothing_to_plot_or_an_output_that_cannot_be_written_is_refused(tmp_path, capsys):
    folder = tmp_path / "cpu-x"
    _store(folder, 1, 10e-6, invalid="collapsed TPOT")
    with pytest.raises(SystemExit) as exc:
        main([str(folder), str(tmp_path / "plots")])
    assert exc.value.code == 2 and "no stored result with a usable entry to plot" in capsys.readouterr().err
    _store(folder, 2, 10e-6)
    with pytest.raises(SystemExit) as exc:
        main([str(folder), "/dev/null/plots"])
    assert exc.value.code == 2 and "/dev/null is not a directory" in capsys.readouterr().err
