"""Dense bf16 GEMM cases: per-rank shapes from the config, the bf16 filter from the quantization
config, inputs, traffic, the check catching wrong kernels, vLLM's unquantized linear on the CPU
build, and the benchmark module end to end."""

import dataclasses

import pytest
import torch

from decodebench.errors import BackendUnavailable, KernelMismatch, ShapeError
from decodebench.kernels import dense
from decodebench.kernels.base import check_case
from decodebench.kernels.binding import VllmApiMismatch
from decodebench.kernels.dense import DenseGemmCase, dense_cases
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, sweep_for
from tests.conftest import CPU, REPO, assert_benchmark_run


def shapes(model="kimi-k2.5", tp=8):
    return DecodeShapes.for_deployment(load_model_spec(model), tp)


def small(op="q_b", tokens=3, n=48, k=32, batch=1):
    return DenseGemmCase(op=op, tokens=tokens, n=n, k=k, per_step=2, batch=batch)


def test_kimi_tp8_dense_shapes():
    gemms = {g.op: (g.n, g.k, g.per_step, g.batch) for g in shapes().dense_gemms}
    assert gemms == {
        "q_a": (1536 + 512 + 64, 7168, 61, 1),  # fused_qkv_a_proj, replicated
        "q_b": (8 * 192, 1536, 61, 1),
        "o_proj": (7168, 8 * 128, 61, 1),
        "uk": (512, 128, 61, 8),
        "uv": (128, 512, 61, 8),
        "shared_gate_up": (2 * 2048 // 8, 7168, 60, 1),
        "shared_down": (7168, 256, 60, 1),
        "dense_gate_up": (2 * 18432 // 8, 7168, 1, 1),
        "dense_down": (7168, 2304, 1, 1),
        "lm_head": (163840 // 8, 7168, 1, 1),
    }


def test_tp1_keeps_whole_heads_and_q_a_is_not_split():
    gemms = {g.op: g for g in shapes(tp=1).dense_gemms}
    assert (gemms["q_b"].n, gemms["o_proj"].k, gemms["uk"].batch) == (64 * 192, 64 * 128, 64)
    assert gemms["q_a"].n == 2112
    assert gemms["lm_head"].n == 163840


def test_kimi_quantization_keeps_every_dense_op_in_bf16():
    ops = {c.op for c in dense_cases(shapes(), sweep_for("smoke"))}
    assert ops == {"q_a", "q_b", "o_proj", "uk", "uv", "shared_gate_up", "shared_down", "dense_gate_up",
                   "dense_down", "lm_head"}


def test_fp8_checkpoint_leaves_only_the_always_bf16_ops():
    ids = [c.id for c in dense_cases(shapes("deepseek-v3"), sweep_for("smoke"))]
    assert ids == ["uk-h16-n512-k128-m1", "uk-h16-n512-k128-m8", "uv-h16-n128-k512-m1", "uv-h16-n128-k512-m8",
                   "lm_head-n16160-k7168-m1", "lm_head-n16160-k7168-m8"]


def test_nightly_visits_every_token_count():
    cases = dense_cases(shapes(), sweep_for("nightly"))
    assert len(cases) == 10 * 9
    assert sorted({c.tokens for c in cases}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_shape_carries_what_the_step_prediction_reads():
    case = dense_cases(shapes(), sweep_for("smoke"))[-1]
    assert case.shape() == {"op": "lm_head", "M": 8, "N": 20480, "K": 7168, "batch": 1, "per_step": 1,
                            "dtype": "bfloat16"}


def test_traffic():
    t = DenseGemmCase(op="o_proj", tokens=4, n=7168, k=1024, per_step=61).traffic()
    assert (t.bytes_read, t.bytes_written, t.flops) == ((4 * 1024 + 7168 * 1024) * 2, 4 * 7168 * 2,
                                                        2 * 4 * 7168 * 1024)
    assert small("uk", tokens=2, n=512, k=128, batch=8).traffic().flops == 8 * 2 * 2 * 512 * 128


def test_bad_shape_is_named():
    with pytest.raises(ShapeError, match="dense GEMM q_b: M, N, K and batch must be positive"):
        small(tokens=0)


def test_inputs_are_random_bf16_in_the_layouts_vllm_keeps():
    linear = small().make_inputs(CPU, seed=1)
    assert linear["x"].shape == (3, 32)
    assert linear["weight"].shape == (48, 32)  # [N, K], a Linear's weight
    bmm = small("uk", n=512, k=128, batch=4).make_inputs(CPU, seed=1)
    assert bmm["weight"].shape == (4, 128, 512)  # W_UK_T: [heads, K, N]
    assert bmm["x"].shape == (4, 3, 128)
    for tensor in (*linear.values(), *bmm.values()):
        assert tensor.dtype == torch.bfloat16
        assert tensor.float().std() > 0.01
    assert not torch.equal(linear["x"], small().make_inputs(CPU, seed=2)["x"])


@pytest.mark.parametrize("case", [small(), small("uv", n=128, k=512, batch=4)], ids=lambda c: c.id)
def test_torch_backend_passes_the_check(case):
    assert check_case(case, case.kernel("torch", CPU), CPU, seed=3).error < 1e-2


def transposed_weight(inp):
    return inp["x"] @ inp["weight"].reshape(inp["weight"].shape[::-1])


def dropped_last_column(inp):
    out = torch.nn.functional.linear(inp["x"], inp["weight"])
    out[:, -1] = 0
    return out


@pytest.mark.parametrize("wrong", [transposed_weight, dropped_last_column])
def test_wrong_kernels_fail_the_check(wrong):
    with pytest.raises(KernelMismatch, match="not timed"):
        check_case(small(n=32), wrong, CPU, seed=4)


def test_vllm_batched_ops_are_a_skip_naming_the_call():
    with pytest.raises(BackendUnavailable, match="torch.bmm"):
        small("uk", batch=2).kernel("vllm", CPU)


def test_vllm_unquantized_linear_matches_the_reference():
    case = DenseGemmCase(op="q_b", tokens=4, n=256, k=128, per_step=2)
    try:
        kernel = case.kernel("vllm", CPU)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    assert check_case(case, kernel, CPU, seed=5).error < 1e-2
    inputs = case.make_inputs(CPU, seed=6)
    kernel(inputs)
    assert torch.equal(kernel(inputs), kernel(inputs))  # the prepared layer is reused for one weight


def test_vllm_linear_api_drift_is_named(monkeypatch):
    import types

    class Renamed:
        def process_weights_after_loading(self, module):
            raise AssertionError("never called")

        def apply(self, layer, x, bias=None):
            raise AssertionError("never called")

    monkeypatch.setattr(dense, "require_vllm_ops", lambda device: None)
    monkeypatch.setattr(dense, "require_vllm_module",
                        lambda name: types.SimpleNamespace(UnquantizedLinearMethod=Renamed))
    with pytest.raises(VllmApiMismatch, match="no parameter 'layer'.*requires 'module'.*kernels/dense.py"):
        small().kernel("vllm", CPU)  # a failure of the case, not a skip


def test_vllm_linear_renamed_away_is_a_failure_naming_it(monkeypatch):
    import types

    monkeypatch.setattr(dense, "require_vllm_ops", lambda device: None)
    monkeypatch.setattr(dense, "require_vllm_module", lambda name: types.SimpleNamespace(__name__=name))
    with pytest.raises(
        VllmApiMismatch, match="vllm.model_executor.layers.linear .*no attribute 'UnquantizedLinearMethod'"
    ):
        small().kernel("vllm", CPU)


def test_unknown_backend():
    with pytest.raises(BackendUnavailable, match="no backend 'cutlass'"):
        dataclasses.replace(small()).kernel("cutlass", CPU)


def test_benchmark_module_runs_on_the_tiny_model(pytester, tmp_path):
    out = tmp_path / "out.json"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_dense.py"), "--rootdir", str(REPO), "--device", "cpu",
        "--model", "tiny-kimi", "--tp", "1", "--benchmark-storage", str(tmp_path), "--budget-ms", "20",
        "--benchmark-json", str(out), "--junitxml", str(tmp_path / "junit.xml"))
    # every case passed, or skipped as tests/expected_skips.txt lists (on CI: vllm's uk/uv only)
    judgment = assert_benchmark_run(result, tmp_path / "junit.xml")
    assert not [s for s in judgment.skips if s.test.endswith("-torch]")]  # the reference path never skips
    import json

    infos = [b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]]
    assert {i["component"] for i in infos} == {"dense_gemm"}
    assert {i["shape"]["op"] for i in infos} >= {"q_a", "uk", "lm_head"}
    assert all({"M", "N", "K", "per_step"} <= set(i["shape"]) for i in infos)
