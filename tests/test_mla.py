"""MLA decode cases: paged reference against dense attention, inputs, traffic and the grid
rule at the Kimi shape, wrong kernels failing, the CPU vLLM op, the Triton binding, and
the benchmark module end to end."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from decodebench.errors import BackendUnavailable, KernelMismatch, ShapeError
from decodebench.kernels import mla_select, mla_vllm
from decodebench.kernels.base import check_case
from decodebench.kernels.binding import VllmApiMismatch
from decodebench.kernels.mla import (
    MAX_KV_CACHE_BYTES,
    MLADecodeCase,
    for_backend,
    mixed_context_lengths,
    mla_cases,
)
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, KVCacheDtype, sweep_for, yarn_mscale
from tests.conftest import CPU, REPO, assert_benchmark_run, kimi_shapes


def smoke_cases():
    return mla_cases(kimi_shapes(), sweep_for("smoke"))


def kimi_case(*seq_lens):
    return dataclasses.replace(smoke_cases()[0], seq_lens=seq_lens)


def tiny_case(seq_lens=(5, 9, 1, 16)):
    return MLADecodeCase(seq_lens=seq_lens, heads=2, kv_lora_rank=8, rope_dim=4, page_size=4, scale=0.3,
                         nope_dim=4, v_head_dim=4)


# --- reference and inputs ------------------------------------------------------------------


def test_paged_reference_equals_dense_attention():
    case = tiny_case()
    inputs = case.make_inputs(CPU, seed=0)
    paged = case.reference(inputs)
    cache, table = inputs["kv_cache"].double(), inputs["block_table"]
    for b, length in enumerate(case.seq_lens):
        # token t of request b sits in slot t % page of page table[b, t // page]
        rows = torch.stack([cache[table[b, t // case.page_size], t % case.page_size] for t in range(length)])
        keys = rows.expand(case.heads, length, case.head_dim)
        values = rows[:, : case.kv_lora_rank].expand(case.heads, length, case.kv_lora_rank)
        dense = F.scaled_dot_product_attention(inputs["q"][b].double()[:, None], keys, values, scale=case.scale)
        torch.testing.assert_close(paged[b], dense[:, 0], rtol=1e-12, atol=1e-12)


def test_block_table_deals_a_random_permutation_of_the_pages():
    case = tiny_case()
    table = case.make_inputs(CPU, seed=1)["block_table"]
    assert table.dtype == torch.int32
    assert table.shape == (4, 4)
    used = torch.cat([table[b, :n] for b, n in enumerate(case.pages_per_request)])
    assert sorted(used.tolist()) == list(range(case.num_pages))  # every page once
    assert used.tolist() != sorted(used.tolist())  # not in order
    assert int(table.min()) >= 0  # unused slots hold real pages too
    assert int(table.max()) < case.num_pages
    assert not torch.equal(table, case.make_inputs(CPU, seed=2)["block_table"])


def test_inputs_are_random_and_the_output_is_poisoned():
    inputs = tiny_case().make_inputs(CPU, seed=3)
    for name in ("q", "kv_cache"):
        assert inputs[name].dtype == torch.bfloat16
        assert inputs[name].float().std() > 0.5
    assert inputs["seq_lens"].tolist() == [5, 9, 1, 16]
    assert inputs["seq_lens"].dtype == torch.int32
    assert inputs["out"].isnan().all()


def test_case_rejects_empty_requests():
    with pytest.raises(ShapeError, match="context >= 1"):
        tiny_case(seq_lens=(4, 0))
    with pytest.raises(ShapeError):
        tiny_case(seq_lens=())


# --- shapes, scale, traffic, grid ---------------------------------------------------------------


def test_softmax_scale_carries_yarn_mscale():
    mscale = 0.1 * math.log(64.0) + 1.0  # Kimi: yarn factor 64, mscale_all_dim 1
    assert kimi_shapes().mla.softmax_scale == pytest.approx((128 + 64) ** -0.5 * mscale**2)
    assert kimi_shapes().mla.softmax_scale == pytest.approx(0.144680, rel=1e-5)


@pytest.mark.parametrize("rope_scaling", [None, {"type": "linear", "factor": 4.0},
                                          {"type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0},
                                          {"rope_type": "yarn", "factor": 40.0}])
def test_yarn_mscale_is_one_without_a_yarn_correction(rope_scaling):
    assert yarn_mscale(rope_scaling) == 1.0


def test_traffic_at_kimi_shape():
    traffic = kimi_case(1024).traffic()
    assert traffic.bytes_read == 1024 * 576 * 2 + 8 * 576 * 2 == 1_188_864  # cache + queries
    assert traffic.bytes_written == 8 * 512 * 2 == 8_192
    assert traffic.flops == 2 * 8 * 1024 * (576 + 512) == 17_825_792


def test_mixed_traffic_sums_the_contexts():
    assert kimi_case(1, 16, 17).traffic().bytes_read == 34 * 576 * 2 + 3 * 8 * 576 * 2 == 66_816


def test_smoke_cases():
    cases = smoke_cases()
    assert [c.id for c in cases] == ["uniform-h8-b1-l256", "uniform-h8-b8-l256", "mixed-h8-b8-l1to256"]
    assert {(c.heads, c.head_dim, c.kv_lora_rank, c.page_size) for c in cases} == {(8, 576, 512, 16)}
    assert cases[2].seq_lens == (1, 2, 5, 11, 24, 53, 116, 256)
    assert cases[2].shape()["seq_lens"] == [1, 2, 5, 11, 24, 53, 116, 256]


def test_nightly_grid_leaves_out_caches_over_the_budget():
    cases = mla_cases(kimi_shapes(), sweep_for("nightly"))
    ids = {c.id for c in cases}
    assert MAX_KV_CACHE_BYTES == 4 * 2**30
    assert {"uniform-h8-b256-l8192", "uniform-h8-b64-l32768", "uniform-h8-b16-l131072"} <= ids
    assert not {"uniform-h8-b128-l32768", "uniform-h8-b32-l131072"} & ids  # 4.5 GiB each
    assert all(sum(c.seq_lens) * 576 * 2 <= MAX_KV_CACHE_BYTES for c in cases)
    assert len(cases) == 9 + 9 + 7 + 5 + 1
    mixed = cases[-1]
    assert mixed.id == "mixed-h8-b256-l1to131072"
    assert sum(mixed.seq_lens) * 576 * 2 < MAX_KV_CACHE_BYTES


def test_mixed_context_lengths():
    assert mixed_context_lengths(8, 256) == (1, 2, 5, 11, 24, 53, 116, 256)
    assert mixed_context_lengths(1, 100) == (100,)
    lengths = mixed_context_lengths(256, 131072)
    assert (lengths[0], lengths[-1]) == (1, 131072)
    assert list(lengths) == sorted(lengths)


# --- correctness of the backends ----------------------------------------------------------------


@pytest.mark.parametrize("case", smoke_cases() + [tiny_case()], ids=lambda c: c.id)
def test_torch_backend_passes_the_check(case):
    assert check_case(case, case.kernel("torch", CPU), CPU, seed=5).error < case.tolerance


def without_yarn_mscale(case):
    return dataclasses.replace(case, scale=case.scale / yarn_mscale(kimi_shapes().spec.rope_scaling) ** 2).kernel(
        "torch", CPU)


def reads_whole_pages(case):
    pages = dataclasses.replace(case, seq_lens=tuple(n * case.page_size for n in case.pages_per_request))
    return pages.kernel("torch", CPU)


def ignores_rope(case):
    kernel = case.kernel("torch", CPU)

    def run(inp):
        q = inp["q"].clone()
        q[..., case.kv_lora_rank:] = 0
        return kernel({**inp, "q": q})
    return run


def ignores_block_table(case):
    kernel = case.kernel("torch", CPU)

    def run(inp):
        in_order = torch.arange(inp["block_table"].numel(), dtype=torch.int32) % case.num_pages
        return kernel({**inp, "block_table": in_order.view_as(inp["block_table"])})
    return run


@pytest.mark.parametrize("wrong", [without_yarn_mscale, reads_whole_pages, ignores_rope, ignores_block_table])
def test_wrong_kernels_fail_the_check(wrong):
    case = smoke_cases()[-1]  # mixed lengths: partial pages and tiny contexts
    with pytest.raises(KernelMismatch, match="not timed"):
        check_case(case, wrong(case), CPU, seed=9)


@pytest.mark.parametrize("case", smoke_cases(), ids=lambda c: c.id)
def test_vllm_cpu_op_matches_reference(case):
    try:
        kernel = case.kernel("vllm-cpu_mla", CPU)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    assert check_case(case, kernel, CPU, seed=6).error < case.tolerance


def test_amx_backend_pages_by_32_and_matches_the_reference(monkeypatch):
    case = for_backend(smoke_cases()[-1], "vllm-amx_mla")  # mixed lengths: partial pages
    assert case.page_size == 32
    if not torch.cpu._is_amx_tile_supported():
        with pytest.raises(BackendUnavailable, match="AMX_MLA needs a CPU with AMX tiles"):
            case.kernel("vllm-amx_mla", CPU)
        # vLLM never runs it without AMX, but its kernel has a vector path: check the call on it
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    try:
        kernel = case.kernel("vllm-amx_mla", CPU)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    assert check_case(case, kernel, CPU, seed=8).error < case.tolerance


def test_vllm_cpu_op_refuses_other_page_sizes():
    with pytest.raises(BackendUnavailable):
        dataclasses.replace(smoke_cases()[0], page_size=32).kernel("vllm-cpu_mla", CPU)


# --- the Triton binding (checked without a GPU) ---------------------------------------------------


def test_decode_binding_names_what_is_missing(monkeypatch):
    def oldest(q, k_buffer, v_buffer, o, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale):
        raise AssertionError("never called")

    monkeypatch.setattr(mla_vllm, "import_decode_attention", lambda: oldest)
    with pytest.raises(VllmApiMismatch, match="no parameter 'page_size'.*Installed signature: decode_attention_fwd"):
        mla_vllm._triton(smoke_cases()[0], CPU)


def test_decode_binding_accepts_the_installed_vllm():
    try:
        decode = mla_vllm.import_decode_attention()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    binding = mla_vllm.Binding.of(decode, offers=mla_vllm._TRITON_OFFERS, needs=mla_vllm._TRITON_NEEDS)
    assert {"lse", "is_mla", "k_scale"} <= binding.accepted


def emulated_decode(seen):
    """A CPU stand-in for Triton ``decode_attention_fwd`` (0.32 signature): it reads its
    arguments as the kernel does (pages through ``req_to_token``, one KV head, values a
    view of the keys) and records them."""

    def decode(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale,
               page_size=1, logit_cap=0.0, k_scale=None, v_scale=None, is_mla=False):
        seen.update(k_shape=tuple(k_buffer.shape), v_shape=tuple(v_buffer.shape), logits=tuple(attn_logits.shape),
                    splits=num_kv_splits, scale=sm_scale, page_size=page_size, is_mla=is_mla,
                    shares_storage=v_buffer.data_ptr() == k_buffer.data_ptr(), lse=tuple(lse.shape))
        for b, length in enumerate(b_seq_len.tolist()):
            slot = torch.arange(length)
            pages = req_to_token[b, slot // page_size].long()
            keys = k_buffer[pages, slot % page_size, 0].float()
            values = v_buffer[pages, slot % page_size, 0].float()
            o[b] = ((q[b].float() @ keys.T * sm_scale).softmax(-1) @ values).to(o.dtype)
    return decode


@pytest.fixture
def four_sm_device(monkeypatch):
    """What the Triton adapter asks of the GPU, answered on the CPU: 4 SMs, vLLM's split rule."""
    monkeypatch.setattr(mla_vllm, "num_kv_splits", mla_vllm.split_heuristic)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"multi_processor_count": 4}))


@pytest.mark.usefixtures("four_sm_device")
def test_triton_adapter_passes_the_arguments_triton_mla_passes(monkeypatch):
    seen = {}
    monkeypatch.setattr(mla_vllm, "import_decode_attention", lambda: emulated_decode(seen))
    case = smoke_cases()[-1]
    assert check_case(case, mla_vllm._triton(case, CPU), CPU, seed=4).error < case.tolerance
    pages = case.num_pages
    assert seen == {"k_shape": (pages, 16, 1, 576), "v_shape": (pages, 16, 1, 512), "logits": (8, 8, 1, 513),
                    "splits": 1, "scale": case.scale, "page_size": 16, "is_mla": True, "shares_storage": True,
                    "lse": (8, 8)}


@pytest.mark.usefixtures("four_sm_device")
def test_triton_adapter_binds_the_signature_before_lse(monkeypatch):
    seen = {}
    current = emulated_decode(seen)

    def before_lse(q, k_buffer, v_buffer, o, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale,
                   page_size=1, logit_cap=0.0):
        current(q, k_buffer, v_buffer, o, torch.empty(0), req_to_token, b_seq_len, attn_logits, num_kv_splits,
                sm_scale, page_size, logit_cap)

    monkeypatch.setattr(mla_vllm, "import_decode_attention", lambda: before_lse)
    case = smoke_cases()[1]
    assert check_case(case, mla_vllm._triton(case, CPU), CPU, seed=4).error < case.tolerance
    assert seen["page_size"] == 16


@pytest.mark.parametrize(("max_len", "sms", "splits"), [(1, 132, 1), (1024, 132, 2), (1500, 132, 2),
                                                        (131072, 132, 256), (131072, 60, 120)])
def test_kv_split_heuristic(max_len, sms, splits):
    assert mla_vllm.split_heuristic(max_len, sms) == splits


# --- backend ids, page sizes, guards ------------------------------------------------------------


def test_backend_ids_follow_vllm_names():
    assert [b.id for b in mla_vllm.MLA_BACKENDS] == [
        "vllm-flash_attn_mla", "vllm-flashmla", "vllm-flashinfer_mla", "vllm-triton_mla", "vllm-cpu_mla",
        "vllm-amx_mla"]


def test_flashmla_gets_pages_of_64_and_torch_keeps_the_case():
    case = kimi_case(100)
    assert for_backend(case, "torch") is case
    paged = for_backend(case, "vllm-flashmla")
    assert paged.page_size == 64
    assert paged.pages_per_request == (2,)
    assert paged.shape()["page_size"] == 64


def test_unknown_backend_is_a_skip_naming_the_known_ones():
    assert for_backend(kimi_case(16), "vllm-cutlass_mla").page_size == 16  # not adapted: kernel() skips
    with pytest.raises(BackendUnavailable, match="no backend 'vllm-cutlass_mla'.*vllm-triton_mla"):
        kimi_case(16).kernel("vllm-cutlass_mla", CPU)


@pytest.mark.parametrize("backend", ["vllm-flash_attn_mla", "vllm-flashmla", "vllm-flashinfer_mla", "vllm-triton_mla"])
def test_cuda_backends_skip_on_the_cpu(backend):
    with pytest.raises(BackendUnavailable, match="runs on cuda, the benchmark device is cpu"):
        kimi_case(16).kernel(backend, CPU)


def test_a_backend_that_fails_when_built_or_called_fails_the_case_and_is_no_skip(monkeypatch):
    def refusing_build(case, device):
        raise RuntimeError("no kernel image for this device")

    def refusing_call(case, device):
        def run(inp):
            raise RuntimeError("no kernel image for this device")
        return run

    monkeypatch.setattr(mla_vllm, "require_vllm_ops", lambda device: None)
    case = smoke_cases()[0]
    monkeypatch.setitem(mla_vllm._BUILDERS, "CPU_MLA", refusing_build)
    with pytest.raises(RuntimeError, match="no kernel image") as built:
        case.kernel("vllm-cpu_mla", CPU)
    assert not isinstance(built.value, BackendUnavailable)
    monkeypatch.setitem(mla_vllm._BUILDERS, "CPU_MLA", refusing_call)
    kernel = case.kernel("vllm-cpu_mla", CPU)
    with pytest.raises(RuntimeError, match="no kernel image") as called:
        check_case(case, kernel, CPU, seed=1)
    assert not isinstance(called.value, BackendUnavailable)


def test_a_renamed_cpu_mla_wrapper_fails_naming_the_adapter(monkeypatch):
    ops = pytest.importorskip("vllm._custom_ops")
    monkeypatch.delattr(ops, "mla_decode_kvcache_cpu")  # the Python wrapper every build has: drift
    with pytest.raises(VllmApiMismatch, match="no attribute 'mla_decode_kvcache_cpu'.*kernels/mla_vllm.py"):
        mla_vllm._cpu(smoke_cases()[0], CPU)


def test_shape_names_the_model_value_width_and_the_latent_output():
    shape = kimi_case(16).shape()
    assert (shape["v_head_dim"], shape["out_dim"], shape["nope_dim"], shape["kv_lora_rank"]) == (128, 512, 128, 512)


# --- vLLM's selector and the selection ------------------------------------------------------------


class StandInPlatform:
    """A CUDA platform as vLLM 0.26 shapes it: the chosen class path, and candidates with reasons."""

    device_type = "cuda"

    def get_attn_backend_cls(self, selected, attn_selector_config, num_heads=None):
        self.asked = (selected, attn_selector_config, num_heads)
        return "vllm.v1.attention.backends.mla.flashattn_mla.FlashAttnMLABackend"

    def get_device_capability(self):
        return (9, 0)

    @classmethod
    def get_valid_backends(cls, device_capability, attn_selector_config, num_heads=None):
        member = lambda name: type("Enum", (), {"name": name})  # noqa: E731
        candidate = lambda name, p: type("C", (), {"backend": member(name), "priority": p})  # noqa: E731
        valid = [candidate("TRITON_MLA", 3), candidate("FLASH_ATTN_MLA", 0), candidate("FLASHMLA", 1)]
        return valid, {member("FLASHINFER_MLA"): (2, ["compute capability not supported"])}


@pytest.fixture
def stand_in_vllm(monkeypatch):
    import types

    platform = StandInPlatform()

    def selector_config(head_size, dtype, kv_cache_dtype, block_size, use_mla=False, has_sink=False):
        return {"head_size": head_size, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
                "block_size": block_size, "use_mla": use_mla}

    class Enum:
        FLASH_ATTN_MLA = types.SimpleNamespace(
            name="FLASH_ATTN_MLA", get_path=lambda: "vllm.v1.attention.backends.mla.flashattn_mla.FlashAttnMLABackend")

        def __iter__(self):
            return iter([self.FLASH_ATTN_MLA])

    modules = {"vllm.platforms": types.SimpleNamespace(current_platform=platform),
               "vllm.v1.attention.selector": types.SimpleNamespace(AttentionSelectorConfig=selector_config),
               "vllm.v1.attention.backends.registry": types.SimpleNamespace(AttentionBackendEnum=Enum())}
    monkeypatch.setattr(mla_select, "require_vllm_module", modules.__getitem__)
    return platform


def test_selector_wrapper_asks_the_platform_as_an_mla_layer_does(stand_in_vllm):
    dispatch = mla_select.ask_vllm_dispatch(576, 8, torch.device("cuda"))
    assert dispatch.backend == "FLASH_ATTN_MLA"
    assert dispatch.id == "vllm-flash_attn_mla"
    assert dispatch.candidates == ("FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA")
    assert "StandInPlatform.get_attn_backend_cls chose FLASH_ATTN_MLA out of FLASH_ATTN_MLA" in dispatch.reason
    assert "rejected: FLASHINFER_MLA (compute capability not supported)" in dispatch.reason
    selected, config, heads = stand_in_vllm.asked
    assert (selected, heads) == (None, 8)
    assert config == {"head_size": 576, "dtype": torch.bfloat16, "kv_cache_dtype": "auto", "block_size": None,
                      "use_mla": True}


def test_selector_wrapper_asks_at_the_deployments_cache_dtype(stand_in_vllm):
    mla_select.ask_vllm_dispatch(576, 8, torch.device("cuda"), "fp8")
    assert stand_in_vllm.asked[1]["kv_cache_dtype"] == "fp8"


def test_selector_wrapper_says_why_it_could_not_ask(stand_in_vllm):
    dispatch = mla_select.ask_vllm_dispatch(576, 8, CPU)
    assert dispatch.backend is None
    assert dispatch.id is None
    assert dispatch.reason == "could not ask vLLM: this vLLM build runs on 'cuda', the device is 'cpu'"


def test_selector_wrapper_reports_a_failing_selector(stand_in_vllm, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("No valid attention backend found for cuda")

    monkeypatch.setattr(stand_in_vllm, "get_attn_backend_cls", refuse)
    dispatch = mla_select.ask_vllm_dispatch(576, 8, torch.device("cuda"))
    assert dispatch.reason == "vLLM's selector failed: ValueError: No valid attention backend found for cuda"


def test_selector_config_drift_is_named(stand_in_vllm, monkeypatch):
    import types

    def renamed(head_dim, dtype, kv_cache_dtype, block_size, use_mla=False):
        raise AssertionError("never called")

    monkeypatch.setattr(mla_select, "require_vllm_module", {
        "vllm.platforms": types.SimpleNamespace(current_platform=stand_in_vllm),
        "vllm.v1.attention.selector": types.SimpleNamespace(AttentionSelectorConfig=renamed)}.__getitem__)
    with pytest.raises(VllmApiMismatch) as raised:  # drift fails; it used to become "run every backend"
        mla_select.ask_vllm_dispatch(576, 8, torch.device("cuda"))
    reason = str(raised.value)
    assert reason.startswith("AttentionSelectorConfig in the installed vLLM")
    assert "no parameter 'head_size'" in reason
    assert "requires 'head_dim'" in reason


def test_a_selector_that_fails_otherwise_is_not_taken_for_no_answer(stand_in_vllm, monkeypatch):
    def broken(*args, **kwargs):
        raise AttributeError("'CudaPlatform' object has no attribute 'get_device_capability'")

    monkeypatch.setattr(stand_in_vllm, "get_attn_backend_cls", broken)
    with pytest.raises(AttributeError, match="get_device_capability"):
        mla_select.ask_vllm_dispatch(576, 8, torch.device("cuda"))


def test_installed_vllm_cpu_dispatches_a_cpu_backend():
    dispatch = mla_select.ask_vllm_dispatch(576, 8, CPU)
    if dispatch.backend is None:
        pytest.skip(dispatch.reason)
    assert dispatch.backend in ("CPU_MLA", "AMX_MLA")
    assert dispatch.reason.startswith("vLLM ")


def test_dispatch_extra_info_marks_only_the_dispatched_backend():
    dispatch = mla_select.Dispatch("TRITON_MLA", "asked")
    assert dispatch.facts("vllm-triton_mla") == {"dispatched": True, "mla_backend": "TRITON_MLA",
                                                      "vllm_dispatch": "TRITON_MLA", "vllm_dispatch_reason": "asked"}
    assert dispatch.facts("torch")["dispatched"] is False
    assert dispatch.facts("torch")["mla_backend"] == "torch"


ALL = ["torch", "vllm-flash_attn_mla", "vllm-flashmla", "vllm-flashinfer_mla", "vllm-triton_mla", "vllm-cpu_mla",
       "vllm-amx_mla"]


@pytest.mark.parametrize(("option", "full", "expected"), [
    ("auto", False, ["torch", "vllm-triton_mla"]),
    ("auto", True, ALL),
    ("dispatched", True, ["torch", "vllm-triton_mla"]),
    ("all", False, ALL),
    ("vllm-flashmla,torch", False, ["torch", "vllm-flashmla"]),
])
def test_selection(option, full, expected):
    assert mla_select.select_backends(option, full, lambda: mla_select.Dispatch("TRITON_MLA", "asked")) == expected


def test_selection_without_an_answer_runs_every_backend():
    unknown = mla_select.Dispatch(None, "could not ask vLLM: vLLM is not installed")
    assert mla_select.select_backends("dispatched", False, lambda: unknown) == ALL


def test_bad_selection_names_the_choices():
    with pytest.raises(ValueError, match="unknown MLA backend.*vllm-flashmlaa.*use auto, dispatched, all"):
        mla_select.parse_mla_backends("torch,vllm-flashmlaa")


# --- end to end ---------------------------------------------------------------------------------


def test_benchmark_module_runs_its_smoke_cases(pytester, tmp_path):
    import json

    out = tmp_path / "out.json"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_mla.py"), "--rootdir", str(REPO), "--device", "cpu",
        "--benchmark-storage", str(tmp_path), "--budget-ms", "50", "--benchmark-json", str(out),
        "--junitxml", str(tmp_path / "junit.xml"))
    assert_benchmark_run(result, tmp_path / "junit.xml")  # each skip one tests/expected_skips.txt lists
    infos = {b["name"]: b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]}
    torch_info = infos["test_mla_decode[uniform-h8-b1-l256-torch]"]
    assert torch_info["dispatched"] is False
    assert torch_info["shape"]["v_head_dim"] == 128
    dispatched = [name for name, info in infos.items() if info["dispatched"]]
    if torch_info["vllm_dispatch"] is not None:  # vLLM answered: its backend is the one marked, on every case
        assert len(dispatched) == 3
        assert {infos[n]["mla_backend"] for n in dispatched} == {torch_info["vllm_dispatch"]}


def test_benchmark_module_rejects_an_unknown_backend(pytester):
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_mla.py"), "--rootdir", str(REPO), "--device", "cpu", "--mla-backends", "cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "unknown MLA backend(s) cuda" in result.stderr.str()


# --- the deployment's KV-cache dtype ------------------------------------------------------------


@pytest.mark.parametrize("bad", ["fp4", "auto,auto", ",", "int8"])
def test_the_kv_cache_dtype_option_takes_vllms_spellings_and_names_a_bad_one(bad):
    import argparse

    from decodebench.plugin import _kv_cache_dtypes

    assert _kv_cache_dtypes("auto, fp8") == ("auto", "fp8")
    with pytest.raises(argparse.ArgumentTypeError, match=f"--kv-cache-dtype '{bad}': .* vLLM spells them"):
        _kv_cache_dtypes(bad)


def fp8(case, spelling="fp8"):
    return dataclasses.replace(case, kv_cache_dtype=KVCacheDtype(spelling))


def test_cases_run_at_each_cache_dtype_and_auto_keeps_the_stored_ids():
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8, kv_cache_dtypes=("auto", "fp8"))
    ids = [c.id for c in mla_cases(shapes, sweep_for("smoke"))]
    assert ids == [c.id for c in smoke_cases()] + [c.id + "-kvfp8" for c in smoke_cases()]
    assert "kv_cache_dtype" not in smoke_cases()[0].shape()


def test_an_fp8_case_stores_e4m3_reads_a_byte_a_value_and_says_its_tolerance():
    case = fp8(smoke_cases()[0])
    inputs = case.make_inputs(CPU, seed=1)
    assert inputs["kv_cache"].dtype == torch.float8_e4m3fn
    assert 1.5 <= inputs["k_scale"].item() < 3.0  # off 1, so a kernel that ignores it fails
    assert case.shape()["kv_dtype"] == "float8_e4m3fn"
    assert case.shape()["kv_cache_dtype"] == "fp8"
    bf16 = smoke_cases()[0]
    assert bf16.traffic().bytes_read - case.traffic().bytes_read == sum(bf16.seq_lens) * bf16.head_dim
    assert (bf16.tolerance, case.tolerance, fp8(bf16, "fp8_e5m2").tolerance) == (1e-2, 2**-4, 2**-3)
    assert "dequantized float8_e4m3fn cache" in case.metric
    assert "0.0625" in case.metric


@pytest.mark.parametrize("case", [fp8(c) for c in smoke_cases()] + [fp8(tiny_case(), "fp8_e5m2")], ids=lambda c: c.id)
def test_torch_backend_passes_the_check_on_an_fp8_cache(case):
    assert check_case(case, case.kernel("torch", CPU), CPU, seed=5).error < 1e-2  # well inside 2^-4


def test_an_fp8_kernel_that_ignores_the_scale_fails():
    case = fp8(smoke_cases()[-1])
    kernel = case.kernel("torch", CPU)
    with pytest.raises(KernelMismatch, match="not timed"):
        check_case(case, lambda inp: kernel({**inp, "k_scale": torch.ones(())}), CPU, seed=9)


@pytest.mark.parametrize("backend", ["vllm-cpu_mla", "vllm-amx_mla"])
def test_cpu_backends_skip_an_fp8_cache_with_vllms_list(backend):
    pytest.importorskip("vllm")
    case = for_backend(fp8(smoke_cases()[0]), backend)
    with pytest.raises(BackendUnavailable, match=r"does not take --kv-cache-dtype fp8 \(its supported_kv_cache_dtypes"):
        case.kernel(backend, CPU)


def test_a_worker_rebuilds_an_fp8_case_from_the_sessions_cache_dtypes():
    from decodebench.runner.case_worker import _find_case

    session = {"model": "kimi-k2.5", "tp": 8, "sweep": "smoke", "kv_cache_dtypes": ["auto", "fp8"]}
    case = _find_case(session, {"factory": "decodebench.kernels.mla:mla_cases", "case_id": "uniform-h8-b1-l256-kvfp8"})
    assert case.kv_cache_dtype == KVCacheDtype("fp8")
    with pytest.raises(LookupError, match="no case 'uniform-h8-b1-l256-kvfp8'"):  # a session of bf16 only
        _find_case({**session, "kv_cache_dtypes": ["auto"]},
                   {"factory": "decodebench.kernels.mla:mla_cases", "case_id": "uniform-h8-b1-l256-kvfp8"})


@pytest.mark.parametrize(("missing", "raised"), [("flashinfer", BackendUnavailable), ("vllm.v1.gone", VllmApiMismatch)])
def test_a_backend_class_whose_module_cannot_import_is_named(monkeypatch, missing, raised):
    """vLLM's FlashInfer MLA class imports flashinfer: where it is not installed the fp8 case skips
    naming it (seen on an H100 without FlashInfer); a vLLM module gone is drift, not a skip."""
    from types import SimpleNamespace

    def get_class():
        raise ModuleNotFoundError(f"No module named '{missing}'", name=missing)

    registry = SimpleNamespace(AttentionBackendEnum={"FLASHINFER_MLA": SimpleNamespace(get_class=get_class)})
    monkeypatch.setattr(mla_vllm, "require_vllm_module", lambda name: registry)
    with pytest.raises(raised, match=missing):
        mla_vllm._require_kv_cache_dtype(mla_vllm.backend_of("vllm-flashinfer_mla"), "fp8")
