"""The one entry point: ``python -m decodebench VERB`` (the ``decodebench`` script) reaches every command."""

import importlib
import json
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


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_answers_help_with_its_usage(verb, capsys):
    with pytest.raises(SystemExit) as stop:
        main([verb, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(("usage: python -m decodebench", "usage: python -m decodebench.gate"))


def test_kernel_rules_names_a_file_it_cannot_read(tmp_path, capsys):
    assert main(["kernel-rules", str(tmp_path / "none.json")]) == 2
    assert f"kernel-rules: {tmp_path / 'none.json'}: " in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert main(["kernel-rules", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not JSON of pytest-benchmark results" in capsys.readouterr().err


@pytest.mark.parametrize(("document", "why"), [
    ({}, "no 'benchmarks' list"),
    ({"benchmarks": None}, "no 'benchmarks' list"),
    ({"benchmarks": [3]}, "entry 0: not a result with an extra_info object"),
    ({"benchmarks": [{"name": "t", "extra_info": "x"}]}, "entry 0: not a result"),
    ({"benchmarks": [{"name": "t", "extra_info": {"kernels": "nvjet_sm90"}}]}, "entry 0 (t): extra_info.kernels"),
    ({"benchmarks": [{"name": "t", "extra_info": {"kernels": [1, 2]}}]}, "entry 0 (t): extra_info.kernels"),
])
def test_kernel_rules_refuses_a_misshapen_result_file_naming_the_entry(tmp_path, capsys, document, why):
    (tmp_path / "odd.json").write_text(json.dumps(document))
    assert main(["kernel-rules", str(tmp_path / "odd.json")]) == 2
    assert why in capsys.readouterr().err


def test_kernel_rules_says_which_components_it_has_no_rules_for(tmp_path, capsys):
    document = {"benchmarks": [{"name": "t", "extra_info": {"component": "rmsnrom", "kernels": {"nvjet_sm90": {}}}}]}
    (tmp_path / "typo.json").write_text(json.dumps(document))
    assert main(["kernel-rules", str(tmp_path / "typo.json")]) == 0
    assert "not checked: the kernels of rmsnrom (no component rules" in capsys.readouterr().err
