"""The one entry point: ``python -m decodebench VERB`` (the ``decodebench`` script) reaches every command."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import tomllib

from decodebench.__main__ import VERBS, main
from tests.conftest import REPO


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_names_a_command_that_exists(verb):
    module, _, function = VERBS[verb][0].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_no_verb_lists_the_verbs_and_a_wrong_one_is_named(capsys):
    assert main([]) == 2
    listed = capsys.readouterr().out
    assert all(f"  {verb} " in listed for verb in VERBS)
    with pytest.raises(SystemExit) as stop:
        main(["nightly"])
    assert stop.value.code == 2
    assert "unknown verb 'nightly'" in capsys.readouterr().err


def test_the_installed_script_is_the_entry_point():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"decodebench": "decodebench.__main__:main"}


def test_a_verb_runs_in_its_own_process_with_its_own_help():
    done = subprocess.run([sys.executable, "-m", "decodebench", "steps", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m decodebench steps")


# a Python without the optional libraries, as the system python3 of a new machine: importing them fails
WITHOUT = """
import runpy, sys
class Without:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"prometheus_client", "pygal", "httpx", "psutil", "pynvml", "torch", "vllm"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Without())
sys.argv[0] = "decodebench"
runpy.run_module("decodebench", run_name="__main__", alter_sys=True)
"""


def _without_libraries(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("verb", ["breakdown", "scenarios", "steps", "fit", "history"])
def test_help_works_without_the_optional_libraries(verb):
    done = _without_libraries(verb, "--help")  # they died with a prometheus_client (or pygal) traceback
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m decodebench {verb}")


def test_a_missing_library_is_one_line_naming_it_and_the_command_that_sets_the_environment_up(tmp_path):
    folder = tmp_path / "cpu-x"
    entry = {"fullname": "t[a]", "stats": {"data": [1e-5, 1e-5, 1e-5]}, "extra_info": {}}
    (folder).mkdir()
    (folder / "0001_run.json").write_text(json.dumps({
        "machine_info": {"decodebench": {"fingerprint": {"key": "cpu-x"}}}, "benchmarks": [entry]}))
    done = _without_libraries("history", str(folder), str(tmp_path / "plots"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"python -m decodebench history: needs the Python module 'pygal', which {sys.executable} does not have; "
        "run it in the suite's environment: ci/decodebench history ... (ci/env.sh sets it up, as ci/bench and "
        "ci/test do)"]
    assert not list(tmp_path.glob("plots/*.svg"))


def test_the_readme_says_how_to_run_the_verbs():
    readme = (REPO / "README.md").read_text()
    assert "ci/decodebench VERB" in readme
    assert (REPO / "ci" / "decodebench").stat().st_mode & 0o111


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_answers_help_with_its_usage(verb, capsys):
    with pytest.raises(SystemExit) as stop:
        main([verb, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(("usage: python -m decodebench", "usage: python -m decodebench.gate"))


def test_kernel_rules_names_a_file_it_cannot_read(tmp_path, capsys):
    assert main(["kernel-rules", str(tmp_path / "none.json")]) == 2
    assert f"kernel-rules: cannot read {tmp_path / 'none.json'}: " in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert main(["kernel-rules", str(tmp_path / "bad.json")]) == 2
    assert "bad.json is not valid JSON" in capsys.readouterr().err


TIMED = {"name": "t", "stats": {"median": 1e-6}}


@pytest.mark.parametrize(("document", "why"), [
    ({}, "odd.json is not a pytest-benchmark result (no 'benchmarks' list)"),
    ({"benchmarks": None}, "no 'benchmarks' list"),
    ({"benchmarks": []}, "odd.json: no kernel results"),
    ({"benchmarks": [3]}, "odd.json: entry 1: is 3, not a benchmark record"),
    ({"benchmarks": [{**TIMED, "extra_info": "x"}]}, "odd.json: case t: extra_info is 'x', not an object"),
    ({"benchmarks": [{**TIMED, "extra_info": {"kernels": "nvjet_sm90"}}]}, "case t: kernels is 'nvjet_sm90'"),
    ({"benchmarks": [{**TIMED, "extra_info": {"kernels": [1, 2]}}]}, "case t: kernels is [1, 2], not an object"),
])
def test_kernel_rules_refuses_a_misshapen_result_file_naming_the_entry(tmp_path, capsys, document, why):
    (tmp_path / "odd.json").write_text(json.dumps(document))
    assert main(["kernel-rules", str(tmp_path / "odd.json")]) == 2
    assert why in capsys.readouterr().err


def test_kernel_rules_says_which_components_it_has_no_rules_for(tmp_path, capsys):
    document = {"benchmarks": [{**TIMED, "extra_info": {"component": "rmsnrom", "shape": {},
                                                        "kernels": {"nvjet_sm90": {}}}}]}
    (tmp_path / "typo.json").write_text(json.dumps(document))
    assert main(["kernel-rules", str(tmp_path / "typo.json")]) == 0
    assert "not checked: the kernels of rmsnrom (no component rules" in capsys.readouterr().err
