"""Backend plug-ins: the registry with stand-in entry points, and the example plug-in package
(tests/plugin_example) collected, checked, timed and recorded by the MoE benchmark."""

import json
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from moe_helpers import tiny

from decodebench.errors import BackendUnavailable, KernelMismatch
from decodebench.kernels import backends
from decodebench.kernels.backends import BrokenPlugin, PluginBackend, backends_for, kernel_for
from decodebench.kernels.base import check_case
from decodebench.kernels.moe import MoEStage
from tests.conftest import CPU, REPO

EXAMPLE = REPO / "tests" / "plugin_example"


def negate_factory(case, device):
    return lambda inputs: -case.kernel("torch", device)(inputs)


NEGATED = PluginBackend("moe", "negated", negate_factory)
RAISING = PluginBackend("moe", "raising", lambda case, device: 1 / 0)
NOT_CALLABLE = PluginBackend("moe", "not_callable", lambda case, device: "kernel")
UNAVAILABLE = PluginBackend("moe", "unavailable", lambda case, device: (_ for _ in ()).throw(
    BackendUnavailable("needs SM120")))


@pytest.fixture
def registered(monkeypatch):
    """Make ``backends`` see the given entry points (name -> 'module:attr') instead of the installed ones."""
    def install(**points):
        eps = [EntryPoint(name, value, backends.ENTRY_POINT_GROUP) for name, value in points.items()]
        monkeypatch.setattr(backends, "entry_points", lambda group: eps if group == backends.ENTRY_POINT_GROUP else [])
        backends.plugin_backends.cache_clear()

    yield install
    backends.plugin_backends.cache_clear()


def test_plugins_add_backend_ids_to_their_component_only(registered):
    registered(neg=f"{__name__}:NEGATED")
    assert backends_for("moe") == ("torch", "vllm", "negated")
    assert backends_for("rmsnorm") == ("torch", "vllm")
    (plugin,) = backends.plugin_backends()
    assert "entry point 'neg'" in plugin.origin


def test_a_plugin_kernel_is_checked_against_the_same_reference(registered):
    registered(neg=f"{__name__}:NEGATED")
    case = tiny()
    with pytest.raises(KernelMismatch, match="differs from the reference"):
        check_case(case, kernel_for(case, "negated", CPU), CPU, seed=1)


@pytest.mark.parametrize(("value", "problem"), [
    ("no_such_module_xyz:BACKEND", "does not load: ModuleNotFoundError"),
    ("decodebench.kernels.base:BACKENDS", "is a tuple, not a decodebench.kernels.backends.PluginBackend"),
])
def test_a_plugin_that_does_not_load_is_an_error_naming_its_entry_point(registered, value, problem):
    registered(broken=value)
    with pytest.raises(BrokenPlugin, match=rf"entry point 'broken' = '{value}' in 'decodebench.backends'.*{problem}"):
        backends_for("moe")


def test_a_plugin_may_not_take_a_builtin_id_or_register_twice(registered, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "AS_TORCH", PluginBackend("moe", "torch", negate_factory),
                        raising=False)
    registered(shadow=f"{__name__}:AS_TORCH")
    with pytest.raises(BrokenPlugin, match="backend id 'torch' must be .* not a built-in"):
        backends.plugin_backends()
    registered(one=f"{__name__}:NEGATED", two=f"{__name__}:NEGATED")
    with pytest.raises(BrokenPlugin, match="two plug-ins register backend 'negated' for moe"):
        backends.plugin_backends()


@pytest.mark.parametrize(("plugin", "problem"), [
    ("RAISING", r"failed to build a kernel for moe .*ZeroDivisionError"),
    ("NOT_CALLABLE", "its factory returned str, not a callable"),
])
def test_a_bad_factory_is_an_error_naming_the_plugin(registered, plugin, problem):
    registered(bad=f"{__name__}:{plugin}")
    backend = backends_for("moe")[-1]
    with pytest.raises(BrokenPlugin, match=rf"backend '{backend}' \(entry point 'bad'.*{problem}"):
        kernel_for(tiny(), backend, CPU)


def test_a_factory_that_cannot_run_here_is_a_skip_with_its_reason(registered):
    registered(later=f"{__name__}:UNAVAILABLE")
    with pytest.raises(BackendUnavailable, match="needs SM120"):
        kernel_for(tiny(), "unavailable", CPU)


def test_an_unknown_backend_names_the_entry_point_group():
    with pytest.raises(BackendUnavailable, match="no backend 'nope'.*decodebench.backends"):
        kernel_for(tiny(), "nope", CPU)


# --- the example plug-in package, end to end --------------------------------------------------


def example_entry_points() -> tuple[str, dict]:
    """entry_points.txt as pip writes it, from the example's own pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    lines = [f"[{group}]" + "".join(f"\n{name} = {value}" for name, value in points.items())
             for group, points in project["entry-points"].items()]
    return "\n\n".join(lines) + "\n", project


@pytest.fixture
def example_installed(tmp_path, monkeypatch):
    """The example made importable with its entry point visible, as `pip install` would leave it
    (a dist-info beside the package on the path), without network or a build."""
    text, project = example_entry_points()
    site = tmp_path / "site"
    dist_info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                        f"Version: {project['version']}\n")
    (dist_info / "entry_points.txt").write_text(text)
    path = [str(site), str(EXAMPLE / "src"), str(REPO)]
    monkeypatch.setenv("PYTHONPATH", ":".join(path + [p for p in sys.path if p]))
    return tmp_path


# A small INT4 model (Kimi's format and routing at toy width) so the CPU run is quick.
def small_int4_model(tmp_path) -> Path:
    config = json.loads((REPO / "decodebench" / "models" / "kimi-k2.5" / "config.json").read_text())
    text = config.get("text_config", config)
    text.update(hidden_size=256, moe_intermediate_size=128, n_routed_experts=32, num_attention_heads=8,
                num_key_value_heads=8, intermediate_size=512, vocab_size=1024)
    path = tmp_path / "small-int4" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


def run_moe_benchmark(pytester, tmp_path, *args):
    return pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_moe.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", "--budget-ms", "30", "--device", "cpu",
        "--sweep", "smoke", "--model", str(small_int4_model(tmp_path)), "--tp", "1", *args)


def test_the_example_plugin_is_collected_checked_timed_and_recorded(pytester, example_installed):
    report = example_installed / "run.json"
    result = run_moe_benchmark(pytester, example_installed, "-k", "m1 and example_fused_moe", "-rs",
                               f"--benchmark-json={report}")
    result.assert_outcomes(passed=2, skipped=4)  # fused x 2 routings; gate_up/down skip
    result.stdout.fnmatch_lines(["*example_fused_moe: the example plug-in runs the fused layer only*"])
    benches = {b["name"]: b for b in json.loads(report.read_text())["benchmarks"]}
    assert len(benches) == 2
    for name, bench in benches.items():
        assert name.startswith("test_moe[fused-")
        assert name.endswith("-m1-example_fused_moe]")
        info = bench["extra_info"]
        assert info["backend"] == "example_fused_moe"
        assert info["reference_error"] < info["tolerance"]
        assert info["timer"] == "wall"
        assert len(bench["stats"]["data"]) == info["samples"]


def test_a_broken_plugin_fails_the_collection_naming_its_entry_point(pytester, example_installed):
    dist_info = next((example_installed / "site").glob("*.dist-info"))
    (dist_info / "entry_points.txt").write_text("[decodebench.backends]\nbroken_moe = not_a_module_xyz:BACKEND\n")
    result = run_moe_benchmark(pytester, example_installed, "--collect-only", "-q")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*BrokenPlugin: entry point 'broken_moe' = 'not_a_module_xyz:BACKEND'*"])


def test_the_example_checks_the_fused_layer_against_the_reference():
    sys.path.insert(0, str(EXAMPLE / "src"))
    try:
        from decodebench_example_fused_moe import BACKEND
    finally:
        sys.path.remove(str(EXAMPLE / "src"))
    case = tiny()
    assert check_case(case, BACKEND.factory(case, CPU), CPU, seed=3).error < case.tolerance
    with pytest.raises(BackendUnavailable, match="fused layer only"):
        BACKEND.factory(tiny(MoEStage.DOWN), CPU)


def test_a_case_s_own_backend_ids_are_built_ins_not_plug_ins():
    # MLA lists one id per vLLM backend; they must reach the case, not the plug-in lookup
    from decodebench.kernels.mla import MLADecodeCase

    assert "vllm-triton_mla" in MLADecodeCase.builtin_backends
    calls = []

    class Probe:
        component = "mla_decode"
        id = "probe"
        builtin_backends = ("vllm-triton_mla",)

        def kernel(self, backend, device):
            calls.append(backend)
            return lambda inputs: None

    kernel_for(Probe(), "vllm-triton_mla", CPU)
    assert calls == ["vllm-triton_mla"]
