"""The checkout stays small: every user and every CI job carries it. Outside baselines/ (the stored results a
user commits by design) the tracked tree is at most 30 MB and no tracked file is over 2 MB; large raw JSON is
stored as .json.gz, which the readers take (decodebench.files.read_json)."""

from __future__ import annotations

import subprocess

from tests.conftest import REPO

TREE_BUDGET_BYTES = 30 * 2**20
FILE_BUDGET_BYTES = 2 * 2**20


def tracked_sizes() -> dict[str, int]:
    """Size on disk of every tracked file outside baselines/ (a file deleted in the work tree counts 0)."""
    done = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, timeout=60)
    assert done.returncode == 0, f"git ls-files failed in {REPO}: {done.stderr.decode(errors='replace')}"
    names = [n for n in done.stdout.decode().split("\0") if n and not n.startswith("baselines/")]
    return {n: (REPO / n).stat().st_size if (REPO / n).is_file() else 0 for n in names}


def test_the_tracked_tree_outside_baselines_is_at_most_30_mb():
    sizes = tracked_sizes()
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    assert total <= TREE_BUDGET_BYTES, (f"{total / 2**20:.1f} MB tracked outside baselines/, over the 30 MB "
                                        f"budget; the largest: {largest}")


def test_no_tracked_file_outside_baselines_is_over_2_mb():
    over = {n: s for n, s in tracked_sizes().items() if s > FILE_BUDGET_BYTES}
    assert over == {}, f"over the 2 MB budget (store raw JSON as .json.gz, or leave it to git's history): {over}"
