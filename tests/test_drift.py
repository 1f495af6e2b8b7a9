"""vLLM drift fails: an absent optional op skips only where the build is known to lack it, MLA selection
lets an API mismatch through, a vLLM without its TPOT histogram fails the e2e figure by name, and a
value of ours standing in for vLLM's is on the result's notes."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from decodebench.errors import BackendUnavailable, ServerError
from decodebench.harness import RunContext, measure_prepared, prepare_kernel_case
from decodebench.kernels import base, fallbacks, marlin, mla_vllm
from decodebench.kernels.base import EVERY_CPU_LIBRARY, KernelCase, cpu_kernel_library, require_cpu_op
from decodebench.kernels.binding import VllmApiMismatch
from decodebench.roofline import Traffic
from decodebench.serving.client import DecodeLoad, measure_decode
from decodebench.timing import Budget, TimerMode
from tests.conftest import needs_vllm

ABSENT = "decodebench_no_such_op"  # an op no build registers: absent wherever it is looked up
BF16_CPU = frozenset({"avx2", "avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16"})


# --- an absent op: a skip only where the CPU flags say vLLM loads a library without it ---------------------


@pytest.fixture
def cpu(monkeypatch):
    """``cpu(machine, flags)``: what the op lookup takes this machine's CPU to be."""
    def make(machine: str, flags: frozenset[str]) -> None:
        monkeypatch.setattr("platform.machine", lambda: machine)
        monkeypatch.setattr(base, "cpu_flags", lambda: flags)
    return make


@needs_vllm
def test_an_op_of_the_bf16_library_absent_on_a_cpu_that_loads_it_is_drift(cpu):
    cpu("x86_64", BF16_CPU)
    with pytest.raises(VllmApiMismatch, match=rf"has no op torch.ops._C.{ABSENT}, which its _C library, which this "
                                              "CPU loads, should register: renamed or removed"):
        require_cpu_op(ABSENT)


@needs_vllm
def test_an_op_of_the_bf16_library_absent_on_a_cpu_without_avx512_bf16_is_a_skip_naming_the_flags(cpu):
    cpu("x86_64", BF16_CPU - {"avx512_bf16"})
    message = (r"this CPU lacks avx512_bf16 \(/proc/cpuinfo flags\), so vLLM loads its _C_AVX512 library, which "
               r"does not build it \(built into _C only\)")
    with pytest.raises(BackendUnavailable, match=message):
        require_cpu_op(ABSENT)
    cpu("x86_64", frozenset({"avx2"}))
    with pytest.raises(BackendUnavailable, match="lacks avx512vl, avx512bw, avx512dq, avx512_bf16 .* its _C_AVX2"):
        require_cpu_op(ABSENT)


@needs_vllm
def test_an_op_every_library_builds_is_drift_on_any_x86_cpu(cpu):
    cpu("x86_64", frozenset({"avx2"}))
    with pytest.raises(VllmApiMismatch, match="its _C_AVX2 library, which this CPU loads, should register"):
        require_cpu_op(ABSENT, EVERY_CPU_LIBRARY)


@needs_vllm
def test_where_the_library_is_not_known_an_absent_op_is_drift(cpu):
    cpu("aarch64", frozenset())
    with pytest.raises(VllmApiMismatch, match="which a aarch64 CPU build should register"):
        require_cpu_op(ABSENT)


def test_the_library_follows_vllms_choice():
    assert cpu_kernel_library("x86_64", BF16_CPU) == "_C"
    assert cpu_kernel_library("AMD64", BF16_CPU - {"avx512_bf16"}) == "_C_AVX512"
    assert cpu_kernel_library("x86_64", frozenset({"avx2", "avx512f"})) == "_C_AVX2"  # vl/bw/dq missing
    assert cpu_kernel_library("ppc64le", BF16_CPU) is None


@needs_vllm
def test_the_three_optional_ops_are_looked_up_by_their_library():
    # the ops this machine's build registers are found; the lookup itself never skips them here
    loaded = cpu_kernel_library()
    for name, libraries in (("biased_topk_cpu", ("_C",)), ("decode_attention_cpu", ("_C",)),
                            ("mla_decode_kvcache", EVERY_CPU_LIBRARY)):
        import vllm._custom_ops  # noqa: F401  (loads the build's ops)

        if loaded in libraries:
            assert require_cpu_op(name, libraries) is not None
        else:
            with pytest.raises(BackendUnavailable, match=f"so vLLM loads its {loaded} library"):
                require_cpu_op(name, libraries)


# --- the e2e figure of record: vLLM's TPOT histogram, or a failure naming it -------------------------------


def test_a_vllm_without_its_tpot_histogram_fails_naming_it(fake):
    handle = fake("--fake-no-tpot")
    with pytest.raises(ServerError, match="vLLM's /metrics has no vllm:request_time_per_output_token_seconds "
                                          r"histogram \(renamed or removed\?\)"):
        measure_decode(handle, DecodeLoad(concurrency=1, input_len=8, output_len=4))


def test_with_the_histogram_the_figure_is_the_servers(fake):
    run = measure_decode(fake(), DecodeLoad(concurrency=1, input_len=8, output_len=4))
    assert run.tpot_source == "server"


# --- fallbacks to values of ours: on the result's notes ------------------------------------------------------


@dataclass(frozen=True)
class FallingBack(KernelCase):
    """A tiny case whose kernel is built with a value of ours standing in for vLLM's."""

    component: ClassVar[str] = "fallback_probe"
    activation_inputs: ClassVar[tuple[str, ...]] = ("x",)
    width: int = 64

    @property
    def id(self) -> str:
        return f"w{self.width}"

    def shape(self):
        return {"width": self.width}

    def traffic(self):
        return Traffic(self.width * 4, self.width * 4)

    def make_inputs(self, device, seed):
        return {"x": torch.rand(self.width, generator=torch.Generator().manual_seed(seed)) + 1}

    def reference(self, inputs):
        return inputs["x"] * 2

    def kernel(self, backend, device):
        fallbacks.note("probe constant: 2, decodebench's value")
        return lambda inputs: inputs["x"] * 2


def test_a_fallback_noted_while_a_case_is_built_is_on_its_result_notes():
    ctx = RunContext(torch.device("cpu"), TimerMode.WALL, Budget(warmup_ms=1, budget_ms=5, sample_ms=0.5), None)
    prepared = prepare_kernel_case(FallingBack(), "torch", ctx)
    _, extra = measure_prepared(prepared, FallingBack().traffic(), ctx)
    assert "fallback: probe constant: 2, decodebench's value" in extra["notes"]
    assert "fallbacks" not in extra  # stored once, as a note


def test_each_vllm_fallback_notes_itself(monkeypatch):
    def unavailable(name):
        raise BackendUnavailable(f"{name} is gone")

    monkeypatch.setattr(mla_vllm, "require_vllm_module", unavailable)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.mla.triton_mla", None)  # import fails
    with fallbacks.recording() as noted:
        assert mla_vllm.vllm_page_size("vllm-flashmla") == 64
        assert mla_vllm.num_kv_splits(131072, 132) == 256
        assert mla_vllm._fa_graph_splits() == 0
    assert noted[0].startswith("MLA page size of vllm-flashmla: 64, decodebench's table (vLLM's get_preferred_block"
                               "_size could not be asked: BackendUnavailable: vllm.v1.attention.backends.registry")
    assert noted[1].startswith("Triton MLA KV splits: 256, decodebench's copy of vLLM's heuristic")
    assert noted[2].startswith("FlashAttention MLA splits: 0 (FA3's own heuristic, as in eager decode)")


def test_the_marlin_constant_of_ours_is_noted_when_the_workspace_is_made(monkeypatch):
    from vllm.model_executor.layers.quantization.utils import marlin_utils

    api = marlin.MarlinApi(*(lambda **kwargs: kwargs,) * 4, quant_type_id=0)
    monkeypatch.setattr(marlin_utils, "MARLIN_MAX_BLOCKS_PER_SM", 3, raising=False)
    with fallbacks.recording() as noted:
        assert api.workspace("cpu") == {"device": "cpu", "max_blocks_per_sm": 3}
    assert noted == []
    monkeypatch.delattr(marlin_utils, "MARLIN_MAX_BLOCKS_PER_SM")
    with fallbacks.recording() as noted:
        assert api.workspace("cpu") == {"device": "cpu", "max_blocks_per_sm": 4}
    assert noted == ["Marlin workspace: MARLIN_MAX_BLOCKS_PER_SM = 4, decodebench's value (vLLM's marlin_utils has "
                     "no such constant)"]
