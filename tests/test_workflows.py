"""Every GitHub workflow file parses, has runnable jobs, and names only scripts that exist."""

import re
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import REPO

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.y*ml"))
# a path into the repository a step runs: ci/..., scripts/..., or python -m decodebench.<module>
SCRIPT = re.compile(r"(?<![\w/.$-])((?:ci|scripts|tools)/[\w./-]+)")
MODULE = re.compile(r"python3? -m (decodebench(?:\.\w+)*)")


def _steps(workflow):
    for name, job in workflow["jobs"].items():
        for step in job.get("steps", []):
            yield name, step


def _load(path):
    workflow = yaml.safe_load(path.read_text())
    assert isinstance(workflow, dict), f"{path.name} is not a mapping"
    return workflow


def test_there_are_workflows():
    assert any(p.name == "nightly-gpu.yml" for p in WORKFLOWS)


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_workflow_is_well_formed(path):
    workflow = _load(path)
    assert workflow.get(True) or workflow.get("on"), f"{path.name}: no 'on:' trigger"  # YAML 1.1 reads on as True
    assert workflow.get("jobs"), f"{path.name}: no jobs"
    for name, job in workflow["jobs"].items():
        assert job.get("runs-on"), f"{path.name}: job {name} has no runs-on"
        for step in job.get("steps", []):
            assert ("run" in step) != ("uses" in step), f"{path.name}: job {name}: a step needs one of run/uses: {step}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_workflow_steps_name_scripts_that_exist(path):
    missing = []
    for name, step in _steps(_load(path)):
        run = step.get("run", "")
        for script in SCRIPT.findall(run):
            if not (REPO / script.rstrip("/")).exists() and not _made_by_the_run(script, run):
                missing.append(f"job {name}: {script}")
        for module in MODULE.findall(run):
            path = REPO / module.replace(".", "/")
            if not (path.with_suffix(".py").exists() or (path / "__main__.py").exists()):
                missing.append(f"job {name}: python -m {module}")
        uses = step.get("uses", "")
        if uses.startswith("./") and not (REPO / uses).exists():
            missing.append(f"job {name}: {uses}")
    assert not missing, f"{path.name} names what the repository does not have: {missing}"


def _made_by_the_run(script: str, run: str) -> bool:
    """Output paths the step writes itself (``mkdir -p artifacts/x``) are not scripts."""
    return script.startswith(("artifacts/",)) or f"mkdir -p {script}" in run


def test_the_scripts_named_are_found_by_the_pattern():
    assert SCRIPT.findall("ci/nightly --gate 5%; python -m decodebench history baselines/x artifacts/h") == [
        "ci/nightly"]
    assert MODULE.findall("python -m decodebench history a b") == ["decodebench"]


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint is not installed (not on PyPI as a wheel)")
def test_actionlint_is_clean():
    result = subprocess.run(["actionlint", *map(str, WORKFLOWS)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
