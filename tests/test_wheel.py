"""The package as a user installs it: a wheel built from the repository holds every data file the package reads
(the bundled model configs, the projection targets and the link table), and the offline verbs run from it
outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO

H200 = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
NIGHTLY, MLA = H200 / "0005_h200-vllm-nightly-gated.json", H200 / "0004_h200-vllm-mla-all-backends.json"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from a copy of the package's sources (the build writes beside them) and installed,
    without its dependencies (this interpreter has them), into a folder of its own: (wheel, site folder)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO / "decodebench", source / "decodebench", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, f"the wheel did not build (setuptools is a test dependency): {built.stderr}"
    (wheel,) = (root / "dist").glob("decodebench-*.whl")
    done = subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(root / "site"),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return wheel, root / "site"


def run_installed(site, *args):
    """``decodebench ARGS`` of the installed copy, started in its own folder, the checkout on no path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    return subprocess.run([str(site / "bin" / "decodebench"), *map(str, args)], cwd=site, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_wheel_holds_every_data_file_the_package_reads(installed):
    wheel, _ = installed
    shipped = set(zipfile.ZipFile(wheel).namelist())
    read = {p.relative_to(REPO).as_posix() for p in (REPO / "decodebench").rglob("*")
            if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts}
    assert read, "the package reads no data file?"
    assert sorted(read - shipped) == []
    assert "decodebench/attribution/predict/targets/rtx-pro-6000-x8-pcie.json" in shipped
    assert "decodebench/models/kimi-k2.5/config.json" in shipped


def test_the_installed_package_is_the_one_that_runs(installed):
    _, site = installed
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", "import decodebench; print(decodebench.__file__)"], cwd=site,
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().startswith(str(site))


def test_scenarios_project_to_the_box_from_the_installed_package(installed):
    _, site = installed
    done = run_installed(site, "scenarios", NIGHTLY, MLA, "--batch", "64", "--project-to", "rtx-pro-6000-x8-pcie")
    assert done.returncode == 0, done.stderr
    assert "rtx-pro-6000-x8-pcie" in done.stdout


def test_fit_then_scenarios_use_the_stored_fit_from_the_installed_package(installed, tmp_path):
    _, site = installed
    results = tmp_path / NIGHTLY.name
    shutil.copy(NIGHTLY, results)
    done = run_installed(site, "fit", results)
    assert done.returncode == 0, done.stderr
    rule = tmp_path / "rule-h200-sxm.json"
    assert done.stdout.strip() == f"rule: {rule}"
    done = run_installed(site, "scenarios", results, "--batch", "64", "--project-to", "rtx-pro-6000-x8-pcie")
    assert done.returncode == 0, done.stderr
    assert f"{rule}: the stored fit of H200 SXM" in done.stderr
    assert f"the stored fit {rule}" in done.stdout  # the projection's rule line: it was used
    assert "rtx-pro-6000-x8-pcie" in done.stdout
