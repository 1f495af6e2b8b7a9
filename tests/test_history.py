import json
import os
import re
import signal
import subprocess
import sys

import pytest

from decodebench.baselines import write_json_atomically
from decodebench.history import main, plot_history
from decodebench.svg import LABEL_CHARS, digest
from tests.conftest import REPO


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
    (svg,) = plot_history(folder, tmp_path / "plots").written
    assert svg.name == "benchmarks_test_rmsnorm.py_test_rmsnorm_add-w7168-m1-torch.svg"
    text = svg.read_text()
    assert text.startswith("<?xml")
    assert ">0001<" in text
    assert ">0002<" in text
    assert ">0003<" not in text
    (folder / "0004_damaged.json").write_text("{")  # refused, naming it: not skipped unseen
    with pytest.raises(ValueError, match="0004_damaged.json is not valid JSON"):
        plot_history(folder, tmp_path / "plots")


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
    written = plot_history(folder, tmp_path / "plots").written
    assert len(written) == len(set(written)) == 5
    assert all(path.is_file() and len(path.name) < 200 for path in written)


def test_a_folder_with_nothing_to_plot_or_an_output_that_cannot_be_written_is_refused(tmp_path, capsys):
    folder = tmp_path / "cpu-x"
    _store(folder, 1, 10e-6, invalid="collapsed TPOT")
    with pytest.raises(SystemExit) as exc:
        main([str(folder), str(tmp_path / "plots")])
    assert exc.value.code == 2
    assert "no stored result with a usable entry to plot" in capsys.readouterr().err
    _store(folder, 2, 10e-6)
    with pytest.raises(SystemExit) as exc:
        main([str(folder), "/dev/null/plots"])
    assert exc.value.code == 2
    assert "/dev/null is not a directory" in capsys.readouterr().err


def _store_names(folder, names):
    entries = [{"fullname": n, "stats": {"data": [1e-5, 1e-5, 1e-5]}, "extra_info": {}} for n in names]
    write_json_atomically(folder / "0001_run.json", {"machine_info": {"decodebench": {"fingerprint": {"key": "cpu-x"}}},
                                                    "benchmarks": entries})


@pytest.mark.timeout(120)  # pygal looped forever on such a title (23.5 GB in 600 s)
def test_a_test_id_of_1500_characters_is_plotted_under_a_short_title_and_named_whole_in_the_table(tmp_path, capsys):
    name = "benchmarks/test_moe.py::test_moe[" + "-".join(["w7168"] * 300) + "]"
    assert len(name) > 1500
    _store_names(tmp_path / "cpu-x", [name])
    assert main([str(tmp_path / "cpu-x"), str(tmp_path / "plots")]) == 0
    (svg,) = (tmp_path / "plots").glob("*.svg")
    titles = re.findall(r'<text[^>]*class="title[^"]*"[^>]*>([^<]*)</text>', svg.read_text())
    title = "".join(t for t in titles if t not in ("stored result", "median (µs)"))  # its lines, not the axes'
    assert title.endswith(f"…{digest(name)}"), titles
    assert len(title) <= LABEL_CHARS
    index = (tmp_path / "plots" / "index.md").read_text()
    assert f"| {svg.name} | `{name}` | 1 |" in index
    assert "the table: " in capsys.readouterr().out


FAKE_PYGAL = """
import os, sys, time

class Line:
    def __init__(self, title="", **options):
        self.title = title
    def add(self, name, values):
        pass
    def render(self):
        if "HANG" in self.title:
            with open(os.environ["FAKE_PYGAL_PIDS"], "a") as f:
                f.write(f"{os.getpid()}\\n")
            time.sleep(3600)
        return b"<svg/>"
"""


@pytest.mark.timeout(120)
def test_a_renderer_that_does_not_return_is_stopped_naming_the_plot_and_the_others_are_written(tmp_path):
    (tmp_path / "lib" / "pygal").mkdir(parents=True)
    (tmp_path / "lib" / "pygal" / "__init__.py").write_text(FAKE_PYGAL)  # a pygal that never returns on one chart
    _store_names(tmp_path / "cpu-x", ["t[HANG]", "t[a]", "t[b]"])
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'lib'}{os.pathsep}{REPO}", "FAKE_PYGAL_PIDS": str(pids)}
    done = subprocess.run([sys.executable, "-m", "decodebench", "history", str(tmp_path / "cpu-x"),
                           str(tmp_path / "plots"), "--plot-timeout-s", "2"], capture_output=True, text=True,
                          env=env, timeout=100)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == ["decodebench.history: not drawn: the plot t_HANG.svg: the renderer (pygal) did "
                                        "not return within 2 s and was stopped"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["index.md", "t_a.svg", "t_b.svg"]
    assert "| t_HANG.svg (not drawn) | `t[HANG]` | 1 |" in (tmp_path / "plots" / "index.md").read_text()
    assert "2 plots in" in done.stdout
    assert "1 not drawn" in done.stdout
    (pid,) = map(int, pids.read_text().split())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, signal.SIG_DFL)  # the stopped renderer is gone, not left behind
