"""The plugin end to end: the RMSNorm benchmarks through pytest-benchmark, baselines keyed by
fingerprint, the comparison table, the gate, and option errors (all on CPU)."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RMSNORM = str(REPO / "benchmarks" / "test_rmsnorm.py")
QUICK = ("--budget-ms", "30", "-p", "no:cacheprovider")


def run_bench(pytester, store, *args):
    return pytester.runpytest_subprocess(
        RMSNORM, "--rootdir", str(REPO), f"--benchmark-storage=file://{store}", *QUICK, *args
    )


def saved_files(store):
    return sorted(store.glob("*/*.json"))


def test_smoke_run_stores_device_samples_under_the_fingerprint(pytester, tmp_path):
    store = tmp_path / "store"
    result = run_bench(pytester, store, "--benchmark-autosave")
    result.assert_outcomes(passed=16)
    (saved,) = saved_files(store)
    document = json.loads(saved.read_text())
    fingerprint = document["machine_info"]["decodebench"]["fingerprint"]
    assert saved.parent.name == fingerprint["key"]
    assert fingerprint["key"].startswith("cpu-")
    assert fingerprint["software"]["torch"].startswith("2.")
    assert document["machine_info"]["decodebench"]["model"] == "kimi-k2.5"
    names = {b["name"] for b in document["benchmarks"]}
    assert "test_rmsnorm[add-w7168-m1-torch]" in names
    assert "test_rmsnorm[plain-w512-m8-vllm]" in names
    bench = next(b for b in document["benchmarks"] if b["name"] == "test_rmsnorm[add-w7168-m8-torch]")
    info = bench["extra_info"]
    assert (info["component"], info["backend"], info["timer"]) == ("rmsnorm", "torch", "wall")
    assert info["shape"] == {"tokens": 8, "width": 7168, "fused_add": True, "eps": 1e-5,
                             "role": "hidden", "dtype": "bfloat16"}
    assert info["bytes_read"] == 2 * 8 * 7168 * 2 + 7168 * 2
    assert info["bytes_written"] == 2 * 8 * 7168 * 2
    assert info["achieved_gbps"] > 0
    assert 0 < info["frac_peak_bw"]
    assert info["reference_error"] < info["tolerance"]
    assert info["stop_reason"] in {"converged", "budget", "max_samples"}
    assert bench["options"]["timer"] == "device_clock"
    assert len(bench["stats"]["data"]) == bench["stats"]["rounds"] >= 10
    assert bench["group"] == "rmsnorm"


def test_second_run_compares_against_the_first(pytester, tmp_path):
    store = tmp_path / "store"
    run_bench(pytester, store, "-k", "plain-w512-m1 and torch", "--benchmark-autosave").assert_outcomes(passed=1)
    result = run_bench(pytester, store, "-k", "plain-w512-m1 and torch", "--benchmark-compare")
    result.assert_outcomes(passed=1)
    for row in ("*plain-w512-m1-torch] (0001_*", "*plain-w512-m1-torch] (NOW)*"):  # table order follows speed
        result.stdout.fnmatch_lines([row])
    result.stdout.fnmatch_lines(["*decodebench verdicts against the baseline*", "* gate off *"])
    assert result.ret == 0


# A baseline no CPU run can match: every run now is a clear regression against it.
IMPOSSIBLY_FAST = [1e-9 * (1 + 0.01 * i) for i in range(20)]


def _doctor_baseline(store, data=IMPOSSIBLY_FAST, fingerprint=None):
    (saved,) = saved_files(store)
    document = json.loads(saved.read_text())
    for bench in document["benchmarks"]:
        bench["stats"]["data"] = data
    if fingerprint:
        document["machine_info"]["decodebench"]["fingerprint"]["key"] = fingerprint
    saved.write_text(json.dumps(document))
    return saved


def test_gate_fails_a_clear_slowdown(pytester, tmp_path):
    store = tmp_path / "store"
    select = ("-k", "add-w7168-m8 and torch")
    run_bench(pytester, store, *select, "--benchmark-autosave").assert_outcomes(passed=1)
    _doctor_baseline(store)
    result = run_bench(pytester, store, *select, "--benchmark-compare", "--gate", "5%")
    result.stdout.fnmatch_lines(["SLOWER *test_rmsnorm*add-w7168-m8-torch*", "gate FAILED*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_baseline_from_other_hardware_is_reported_and_not_gated(pytester, tmp_path):
    store = tmp_path / "store"
    select = ("-k", "plain-w512-m1 and torch")
    run_bench(pytester, store, *select, "--benchmark-autosave").assert_outcomes(passed=1)
    saved = _doctor_baseline(store, fingerprint="nvidia-rtx-pro-6000-blackwell-x8-pcie")
    result = run_bench(pytester, store, *select, f"--benchmark-compare={saved}",
                       "--benchmark-compare-fail=median:1%", "--gate", "1%")
    result.stdout.fnmatch_lines([
        "*NOT GATED: baseline measured on nvidia-rtx-pro-6000-blackwell-x8-pcie, this run is cpu-*",
        "INCOMPARABLE *plain-w512-m1-torch*",
    ])
    assert result.ret == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--timer", "bogus"), "*unknown timer 'bogus'*"),
        (("--sweep", "weekly"), "*unknown sweep level 'weekly'*"),
        (("--tp", "0"), "*'0' must be at least 1*"),
        (("--tp", "3"), "*num_attention_heads = 64 is not divisible by tp = 3*"),
        (("--model", "/no/such/config.json"), "*is neither a config.json*"),
        (("--timer", "kernel", "--device", "cpu"), "*--timer kernel needs a CUDA device*"),
        (("--gate", "lots"), "*threshold 'lots' is not a number*"),
    ],
)
def test_bad_options_are_named(pytester, tmp_path, args, message):
    result = run_bench(pytester, tmp_path / "store", "--collect-only", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
