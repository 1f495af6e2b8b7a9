"""The gate examples of the README and docs/gate.md, regenerated from the committed files and compared line by line."""

import subprocess
import sys

from validation.tests.evidence import REPO

SCRIPT = REPO / "validation" / "readme_examples.py"
PAGES = (REPO / "README.md", REPO / "docs" / "gate.md")


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)


def test_every_gate_line_of_the_pages_is_what_the_committed_files_print_today():
    done = run("--check", *PAGES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].endswith("every gate line regenerated from committed files")


def stale_pages(tmp_path, old, new):
    """Copies of the pages with every ``old`` replaced by ``new``."""
    copies, replaced = [], False
    for page in PAGES:
        text = page.read_text()
        if old in text:
            text, replaced = text.replace(old, new), True
        copy = tmp_path / page.name
        copy.write_text(text)
        copies.append(copy)
    assert replaced, old
    return copies


def test_a_stale_figure_is_named(tmp_path):
    done = run("--check", *stale_pages(tmp_path, "; 161 undecided,", "; 94 undecided,"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the pages show a line no committed file produces: gate FAILED: 1 of 180 cases" in done.stdout
    assert "94 undecided" in done.stdout
    assert "the pages lack the regression example's line" in done.stdout


def test_a_stale_nightly_line_of_the_readme_is_named(tmp_path):
    done = run("--check", *stale_pages(tmp_path, "10 undecided\n", "9 undecided\n"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the pages show a line no committed file produces: gate passed: 0 of 211 cases" in done.stdout


def test_a_stale_inline_example_is_named(tmp_path):
    done = run("--check", *stale_pages(tmp_path, "…; 180 undecided,", "…; 179 undecided,"))
    assert done.returncode == 1
    assert "inline example says `gate passed: 0 of 180 cases …; 179 undecided, 180 of them too noisy" in done.stdout


def test_the_examples_print_the_commands_they_ran():
    done = run()
    assert done.returncode == 0, done.stderr
    heads = [line for line in done.stdout.splitlines() if line.startswith("## ")]
    assert [h.split(":")[0] for h in heads] == ["## regression", "## sessions", "## nightly", "## qa"]


def test_a_stale_q_a_range_is_named(tmp_path):
    done = run("--check", *stale_pages(tmp_path, "12.5–14.5 %", "11–14 %"))
    assert done.returncode == 1
    assert "the pages lack the q_a figure '12.5–14.5 %'" in done.stdout
