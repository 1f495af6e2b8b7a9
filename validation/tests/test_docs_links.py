"""The pages link to what exists: relative links and the repository paths they name resolve."""

import re

import pytest

from validation.tests.evidence import REPO

PAGES = sorted([REPO / "README.md", REPO / "validation" / "README.md", *(REPO / "docs").glob("*.md"),
                *(REPO / "validation" / "reports").glob("*.md")])
# a repository path in backticks: `validation/h200/gate/offline-power.md`, `ci/env.sh`
PATH = re.compile(r"`((?:docs|validation|ci|tests|decodebench|benchmarks|fixtures|baselines)/[^`\s*…<>{}|\[]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def named_paths(text: str) -> list[str]:
    """Backticked repository paths of a page, without a test id's ``::`` part.

    >>> named_paths("see `ci/env.sh`, `tests/test_x.py::test_y` and `validation/h200/`")
    ['ci/env.sh', 'tests/test_x.py', 'validation/h200']
    """
    return [m.split("::")[0].rstrip("/.,:") for m in PATH.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_named_path_of_a_page_exists(page):
    text = page.read_text()
    links = [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))]
    assert [t for t in links if not (page.parent / t).exists()] == []
    assert [p for p in named_paths(text) if not (REPO / p).exists()] == []


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 250
    heads = [line for line in lines if line.startswith("## ")]
    assert heads[-1] == "## Read on"
    for page in ("options", "gate", "benchmarks", "development"):
        assert f"(docs/{page}.md)" in "\n".join(lines), page
