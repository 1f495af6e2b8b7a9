"""MLA decode cases: paged reference against dense attention, inputs, traffic and the grid
rule at the Kimi shape, wrong kernels failing, the CPU vLLM op, the Triton binding, and
the benchmark module end to end."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from decodebench.errors import BackendUnavailable, KernelMismatch, ShapeError
from decodebench.kernels import mla
from decodebench.kernels.base import check_case
from decodebench.kernels.mla import (
    MAX_KV_CACHE_BYTES,
    MLADecodeCase,
    mixed_context_lengths,
    mla_cases,
)
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, sweep_for, yarn_mscale

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def kimi_shapes():
    return DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8)


def smoke_cases():
    return mla_cases(kimi_shapes(), sweep_for("smoke"))


def kimi_case(*seq_lens):
    return dataclasses.replace(smoke_cases()[0], seq_lens=seq_lens)


def tiny_case(seq_lens=(5, 9, 1, 16)):
    return MLADecodeCase(seq_lens=seq_lens, heads=2, kv_lora_rank=8, rope_dim=4, page_size=4, scale=0.3)


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
        kernel = case.kernel("vllm", CPU)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    assert check_case(case, kernel, CPU, seed=6).error < case.tolerance


def test_vllm_cpu_op_refuses_other_page_sizes():
    with pytest.raises(BackendUnavailable):
        dataclasses.replace(smoke_cases()[0], page_size=32).kernel("vllm", CPU)


# --- the Triton binding (checked without a GPU) ---------------------------------------------------


def test_decode_binding_names_what_is_missing():
    def oldest(q, k_buffer, v_buffer, o, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale):
        raise AssertionError("never called")

    with pytest.raises(BackendUnavailable, match="lacks page_size"):
        mla._decode_parameters(oldest)


def test_decode_binding_accepts_the_installed_vllm():
    try:
        decode = mla._import_decode_attention()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    params = mla._decode_parameters(decode)
    assert {"lse", "is_mla", "k_scale"} <= set(params)


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
    monkeypatch.setattr(mla, "_num_kv_splits", mla._split_heuristic)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"multi_processor_count": 4}))


@pytest.mark.usefixtures("four_sm_device")
def test_triton_adapter_passes_the_arguments_triton_mla_passes(monkeypatch):
    seen = {}
    monkeypatch.setattr(mla, "_import_decode_attention", lambda: emulated_decode(seen))
    case = smoke_cases()[-1]
    assert check_case(case, case._triton_kernel(CPU), CPU, seed=4).error < case.tolerance
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

    monkeypatch.setattr(mla, "_import_decode_attention", lambda: before_lse)
    case = smoke_cases()[1]
    assert check_case(case, case._triton_kernel(CPU), CPU, seed=4).error < case.tolerance
    assert seen["page_size"] == 16


@pytest.mark.parametrize(("max_len", "sms", "splits"), [(1, 132, 1), (1024, 132, 2), (1500, 132, 2),
                                                        (131072, 132, 256), (131072, 60, 120)])
def test_kv_split_heuristic(max_len, sms, splits):
    assert mla._split_heuristic(max_len, sms) == splits


# --- end to end ---------------------------------------------------------------------------------


def test_benchmark_module_runs_its_smoke_cases(pytester, tmp_path):
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_mla.py"), "--rootdir", str(REPO), "--device", "cpu",
        "--benchmark-storage", str(tmp_path), "--budget-ms", "50")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0, result.stdout.str()
    assert outcomes.get("errors", 0) == 0, result.stdout.str()
    assert outcomes.get("passed", 0) >= 3  # torch: 2 uniform + 1 mixed smoke case; vllm ones pass or skip
