"""The README's gate examples are regenerated from the committed files and compared line by line."""

import subprocess
import sys

from tests.conftest import REPO

SCRIPT = REPO / "validation" / "readme_examples.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)


def test_every_gate_line_of_the_readme_is_what_the_committed_files_print_today():
    done = run("--check", REPO / "README.md")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].endswith("every gate line regenerated from committed files")


def test_a_stale_figure_is_named(tmp_path):
    readme = (REPO / "README.md").read_text()
    stale = tmp_path / "README.md"
    stale.write_text(readme.replace("; 18 undecided\n", "; 94 undecided\n", 1))
    assert stale.read_text() != readme
    done = run("--check", stale)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "README shows a line no committed file produces: gate FAILED: 1 of 180 cases" in done.stdout
    assert "94 undecided" in done.stdout and "README lacks the regression example's line" in done.stdout


def test_a_stale_inline_example_is_named(tmp_path):
    readme = (REPO / "README.md").read_text()
    stale = tmp_path / "README.md"
    stale.write_text(readme.replace("…; 180 undecided`", "…; 179 undecided`", 1))
    assert stale.read_text() != readme
    done = run("--check", stale)
    assert done.returncode == 1
    assert "inline example says `gate passed: 0 of 180 cases …; 179 undecided`" in done.stdout


def test_the_examples_print_the_commands_they_ran():
    done = run()
    assert done.returncode == 0, done.stderr
    heads = [line for line in done.stdout.splitlines() if line.startswith("## ")]
    assert [h.split(":")[0] for h in heads] == ["## regression", "## sessions", "## nightly", "## qa"]


def test_a_stale_q_a_range_is_named(tmp_path):
    readme = (REPO / "README.md").read_text()
    stale = tmp_path / "README.md"
    stale.write_text(readme.replace("12.5–14.5 %", "11–14 %"))
    assert stale.read_text() != readme
    done = run("--check", stale)
    assert done.returncode == 1
    assert "README lacks the q_a figure '12.5–14.5 %'" in done.stdout
