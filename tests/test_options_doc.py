"""docs/options.md is the decodebench group of ``pytest --help``, regenerated and compared line by line."""

import subprocess
import sys

from tests.conftest import REPO

SCRIPT = REPO / "docs" / "options.py"
PAGE = REPO / "docs" / "options.md"


def check(page):
    return subprocess.run([sys.executable, str(SCRIPT), "--check", str(page)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_the_options_page_is_what_pytest_help_prints_today():
    done = check(PAGE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].endswith("the options of pytest --help, every one")


def test_a_stale_or_missing_option_is_named(tmp_path):
    text = PAGE.read_text()
    stale = tmp_path / "options.md"
    stale.write_text(text.replace("| `--tp=N` | Tensor-parallel size the per-rank shapes are derived for. | 8 |",
                                  "| `--tp=N` | Tensor-parallel size the per-rank shapes are derived for. | 4 |", 1)
                     .replace("| `--gate-allow-empty` |", "| `--gate-allow-nothing` |", 1))
    assert stale.read_text().count("| 4 |") == text.count("| 4 |") + 1
    assert "--gate-allow-nothing" in stale.read_text()
    done = check(stale)
    assert done.returncode == 1
    assert "-| `--tp=N` | Tensor-parallel size the per-rank shapes are derived for. | 4 |" in done.stdout
    assert "+| `--tp=N` | Tensor-parallel size the per-rank shapes are derived for. | 8 |" in done.stdout
    assert "+| `--gate-allow-empty` |" in done.stdout
    assert done.stdout.splitlines()[-1].endswith("stale; regenerate it with `python docs/options.py > " f"{stale}`")


def test_every_option_of_the_group_has_a_row():
    rows = [line.split("`")[1].split("=")[0] for line in PAGE.read_text().splitlines() if line.startswith("| `--")]
    for name in ("--model", "--tp", "--gate", "--ab-python", "--breakdown", "--what-if", "--vllm-url", "--spec"):
        assert name in rows
    assert len(rows) == len(set(rows)) > 50
