"""Configs and loads the machine cannot take: refused by name before anything is allocated or started.

A config's fields are checked when it is read (ranges and contradictions), what the shapes cannot
build is a usage error at collection (exit 4, never a collection traceback), and a case or a model
too large for the device's memory is refused before its first tensor."""

import json
import resource
import subprocess
import sys

import pytest
import torch

from decodebench import limits
from decodebench.errors import ConfigError
from decodebench.limits import MemoryLimit, file_limit, memory_limit, oversized
from decodebench.model import load_model_spec, resolve_model_path
from decodebench.serving.client import DecodeLoad, load_limit_problem, measure_decode
from decodebench.shapes import DecodeShapes
from tests.conftest import IN_PROCESS, REPO

# every benchmark module whose collection runs without importing vLLM (test_mla asks vLLM's selector, and
# an in-process session that imports vLLM leaks it at exit)
BENCHMARKS = [str(REPO / "benchmarks" / f"test_{name}.py")
              for name in ("rmsnorm", "dense", "routing", "moe", "dispatch")]
COLLECT = ("--collect-only", "-q", "-p", "no:cacheprovider", "--benchmark-disable")


def kimi_config(tmp_path, **fields):
    """The bundled Kimi-K2.5 config with ``fields`` of its text config replaced, as a model directory."""
    raw = json.loads(resolve_model_path("kimi-k2.5").read_text())
    raw["text_config"].update(fields)
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(raw))
    return str(tmp_path / "model")


def collect(pytester, model, *args):
    return pytester.runpytest_inprocess(*BENCHMARKS, *IN_PROCESS, "--model", model, *COLLECT, *args)


# --- a config's ranges, checked as it is read ---------------------------------------------------------


@pytest.mark.parametrize(("fields", "message"), [
    ({"n_group": 5, "topk_group": 1}, "'n_routed_experts' = 384 is not divisible by 'n_group' = 5"),
    ({"n_group": 96, "topk_group": 1}, "'num_experts_per_tok' = 8 is more than the 4 experts"),
    ({"first_k_dense_replace": 100}, "'first_k_dense_replace' = 100 is larger than 'num_hidden_layers' = 61"),
    ({"qk_rope_head_dim": 63}, "'qk_rope_head_dim' = 63 is odd"),
    ({"rms_norm_eps": 0}, "'rms_norm_eps' = 0 lies outside (0, 1)"),
    ({"routed_scaling_factor": 0}, "'routed_scaling_factor' = 0 is not positive"),
    ({"scoring_func": "tanh"}, "'scoring_func' = 'tanh' is not supported (sigmoid, softmax)"),
    ({"topk_method": "best"}, "'topk_method' = 'best' is not supported"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_field_out_of_range_is_named_when_the_config_is_read(tmp_path, fields, message):
    with pytest.raises(ConfigError) as raised:
        load_model_spec(kimi_config(tmp_path, **fields))
    assert message in str(raised.value)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("group_size", 0, "'group_size' = 0 is not positive"),
    ("num_bits", 0, "'num_bits' = 0 lies outside 1..16"),
])
def test_a_quantization_field_out_of_range_is_named(tmp_path, key, value, message):
    raw = json.loads(resolve_model_path("kimi-k2.5").read_text())
    raw["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"][key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=message):
        load_model_spec(tmp_path / "config.json")


# --- collection: exit 4 naming the field, never a traceback -------------------------------------------


def test_a_small_expert_count_collects_and_skips_what_does_not_apply(pytester, tmp_path):
    # 7 experts: too few for the skewed routing's hot set, and not divisible by the TP size the EP
    # messages are sized for without --ep; both were tracebacks at collection, even with -k rmsnorm
    model = kimi_config(tmp_path, n_routed_experts=7, num_experts_per_tok=4)
    result = collect(pytester, model, "--ep", "1", "-k", "rmsnorm")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    result.stdout.no_fnmatch_line("*Error*")
    every = collect(pytester, model, "--ep", "1", "-k", "skewed or not-applicable", "-rs", "--co")
    assert every.ret == pytest.ExitCode.OK, every.stdout.str()[-3000:]
    every.stdout.fnmatch_lines(["*test_moe.py::test_moe[[]skewed-*",
                                "*test_dispatch.py::test_dispatch[[]not-applicable-*"])


def test_the_cases_that_do_not_apply_skip_with_their_reason(pytester, tmp_path):
    model = kimi_config(tmp_path, n_routed_experts=7, num_experts_per_tok=4)
    result = pytester.runpytest_inprocess(*BENCHMARKS, *IN_PROCESS, "--model", model, "--ep", "1", "-p",
                                          "no:cacheprovider", "--benchmark-disable", "-rs", "-k",
                                          "test_moe and skewed and torch or test_dispatch")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*skewed routing does not apply: skewed routing needs at least 9 experts for "
                                 "top_k = 4, the layout has 7*",
                                 "*EP message sizes for ep = tp = 8 (no --ep given): ep = 8 ranks cannot each hold "
                                 "a whole expert of n_routed_experts = 7*"])


@pytest.mark.parametrize(("fields", "message"), [
    ({"n_group": 5}, "*field 'n_routed_experts' = 384 is not divisible by 'n_group' = 5*"),
    ({"scoring_func": "tanh"}, "*field 'scoring_func' = 'tanh' is not supported*"),
    ({"first_k_dense_replace": 100}, "*field 'first_k_dense_replace' = 100 is larger than*"),
], ids=["n_group", "scoring_func", "first_k_dense_replace"])
def test_a_bad_config_is_a_usage_error_at_collection_even_when_deselected(pytester, tmp_path, fields, message):
    result = collect(pytester, kimi_config(tmp_path, **fields), "-k", "rmsnorm")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --model*{message}"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


FACTORY_MODULE = """
import pytest
from decodebench.errors import ShapeError

def refusing(shapes, sweep):
    raise ShapeError("heads/tp = 3 is not a multiple of the kernel's 2")

@pytest.mark.cases(factory=refusing)
def test_refused(case):
    pass

def test_other():
    pass
"""


def test_a_factory_that_refuses_the_shapes_is_a_usage_error_not_a_collection_traceback(pytester):
    pytester.makeconftest("pytest_plugins = ['decodebench.plugin']")
    pytester.makepyfile(test_factory=FACTORY_MODULE)
    result = pytester.runpytest_subprocess("--model", "tiny-kimi", "--tp", "1", "-k", "other", *COLLECT)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --model tiny-kimi --tp 1 --ep 1: test_factory.py::test_refused: "
                                 "heads/tp = 3 is not a multiple of the kernel's 2"])
    result.stdout.no_fnmatch_line("*Traceback*")


# --- the device's memory, before any tensor -------------------------------------------------------------


def test_a_model_too_large_for_the_device_is_refused_naming_its_fields(pytester, tmp_path):
    model = kimi_config(tmp_path, hidden_size=10**9)
    result = collect(pytester, model, "-k", "moe or rmsnorm")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --model * on cpu: the routed experts of one rank: n_routed_experts x 3 x "
                                 "hidden_size x moe_intermediate_size/tp = 384 x 3 x 1000000000 x 256 takes 165.9 TB, "
                                 "more than the * of memory available on this host"])
    # a session that benchmarks no MoE is not refused for the experts, but for its own largest case
    norms = collect(pytester, model, "-k", "rmsnorm")
    assert norms.ret == pytest.ExitCode.USAGE_ERROR
    norms.stderr.fnmatch_lines(["ERROR: *test_rmsnorm.py::test_rmsnorm[[]add-w1000000000-m8-*: its inputs and "
                                "outputs take at least 66.0 GB (shape {*'width': 1000000000*}; width = 1000000000 is "
                                "the config's hidden_size), more than the * of memory available on this host*"])


def test_a_model_whose_experts_do_not_fit_still_runs_the_benchmarks_that_do_not_hold_them(pytester, tmp_path):
    # a thousand times the experts: 1.2 TB a rank, refused for the MoE benchmark only
    model = kimi_config(tmp_path, n_routed_experts=384 * 1000)
    assert collect(pytester, model, "--tp", "8", "-k", "rmsnorm").ret == pytest.ExitCode.OK
    refused = collect(pytester, model, "--tp", "8", "-k", "moe")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*the routed experts of one rank*= 384000 x 3 x 7168 x 256 takes 1.2 TB*"])


def test_the_largest_tensor_is_compared_with_the_limit():
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    assert oversized(shapes, MemoryLimit(2 * 10**9, "2 GB")) is None
    assert "1.2 GB, more than 1.1 GB" in oversized(shapes, MemoryLimit(11 * 10**8, "1.1 GB"))
    assert oversized(shapes, MemoryLimit(11 * 10**8, "1.1 GB"), frozenset({"rmsnorm"})) is None
    assert memory_limit(torch.device("cpu")).bytes > 0


HUGE_CASE_MODULE = """
import pytest
from dataclasses import dataclass
from decodebench.roofline import Traffic

@dataclass(frozen=True)
class Huge:
    id = "huge"
    def shape(self):
        return {"width": 10**15}
    def traffic(self):
        return Traffic(10**15, 10**15)

def huge(shapes, sweep):
    return [Huge()]

@pytest.mark.cases(factory=huge)
def test_huge(case):
    raise AssertionError("must not run")
"""


def test_a_selected_case_larger_than_the_memory_is_refused_before_it_runs(pytester):
    pytester.makeconftest("pytest_plugins = ['decodebench.plugin']")
    pytester.makepyfile(test_huge=HUGE_CASE_MODULE)
    result = pytester.runpytest_subprocess("--model", "tiny-kimi", "--tp", "1", "-p", "no:cacheprovider",
                                           "--benchmark-disable")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: test_huge.py::test_huge[[]huge[]]: its inputs and outputs take at least "
                                 "2000.0 TB (shape {'width': 1000000000000000}), more than the * of memory "
                                 "available on this host*"])
    deselected = pytester.runpytest_subprocess("--model", "tiny-kimi", "--tp", "1", "-p", "no:cacheprovider",
                                               "--benchmark-disable", "-k", "not huge")
    assert deselected.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_the_open_file_limit_is_read():
    soft, hard = file_limit()
    assert 0 < soft <= hard


# --- a load beyond the machine's limits, refused before it starts ----------------------------------------


def test_a_load_beyond_the_open_file_limit_is_refused_before_any_server_starts():
    # a fresh process under a hard limit of 1024 open files: 2000 streams cannot be held
    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    done = subprocess.run([sys.executable, "-m", "pytest", str(REPO / "benchmarks" / "test_decode.py"), *IN_PROCESS,
                           "--concurrency", "2000:2000", *COLLECT], cwd=REPO, capture_output=True, text=True,
                          timeout=300, preexec_fn=low_limit)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout[-2000:] + done.stderr[-2000:]
    assert ("ERROR: --concurrency: c2000-in128-out64-n2000: one load-generator process holds 2000 connections and "
            "the server started here as many, needing about 2256 open files, beyond this machine's open-file limit "
            "(ulimit -n: soft 1024, hard 1024)") in done.stderr
    assert "Traceback" not in done.stdout + done.stderr


@pytest.fixture
def roomy(monkeypatch):
    """Limits that any test load fits, each test then lowering one."""
    monkeypatch.setattr(limits, "file_limit", lambda: (1 << 20, 1 << 20))
    monkeypatch.setattr(limits, "local_ports", lambda: 28232)
    monkeypatch.setattr(limits, "memory_limit", lambda device: MemoryLimit(64 * 10**9, "the 64.0 GB available"))
    return monkeypatch


def test_more_connections_than_local_ports_are_refused(roomy):
    problem = load_limit_problem(DecodeLoad(30000, 128, 64, 30000))
    assert problem == ("c30000-in128-out64-n30000: 30000 connections to one server need 30000 local ports, beyond "
                       "the 28232 of net.ipv4.ip_local_port_range")


def test_prompts_beyond_the_memory_are_refused(roomy):
    roomy.setattr(limits, "memory_limit", lambda device: MemoryLimit(10**9, "the 1.0 GB available"))
    problem = load_limit_problem(DecodeLoad(256, 8192, 64, 4096), rounds=3)
    assert problem.startswith("c256-in8192-out64-n4096: its 16641 prompts of 8192 tokens (3 rounds) take about ")
    assert problem.endswith("GB in the client, more than the 1.0 GB available")
    assert load_limit_problem(DecodeLoad(4, 128, 64)) is None


def test_measure_decode_refuses_such_a_load_before_sending_anything(roomy):
    roomy.setattr(limits, "local_ports", lambda: 100)
    with pytest.raises(ValueError, match="need 200 local ports"):
        measure_decode(handle=None, load=DecodeLoad(200, 128, 64))
