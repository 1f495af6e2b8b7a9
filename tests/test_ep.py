"""Expert parallelism: the EP shapes (tiny model and Kimi), the EP-rank MoE case on the torch backend
with a tiny INT4 model, the dispatch/combine collectives (checks, sizes, 2 gloo ranks end to end), and
the ``--what-if moe=ep`` arithmetic against hand calculations, here and on the users' PCIe box."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from decodebench.attribution.cli import scenarios as main
from decodebench.attribution.predict.ep import EPMode, apply_expert_parallel
from decodebench.attribution.predict.scenarios import answer, ep_table_lines
from decodebench.attribution.predict.step import KernelResult, Step, WhatIfError, part_of
from decodebench.attribution.predict.targets import load_target
from decodebench.attribution.predict.whatif import ChangeKind, parse_what_if
from decodebench.distributed.dispatch import (
    Collective,
    DispatchCase,
    _check,
    dispatch_cases,
    expected_chunks,
    make_input,
)
from decodebench.errors import BackendUnavailable, KernelMismatch, ShapeError
from decodebench.kernels.base import check_case, relative_error
from decodebench.kernels.int4 import dequantize
from decodebench.kernels.moe_ep import EPMoECase, ep_moe_cases, local_groups, moe_benchmark_cases
from decodebench.model import load_model_spec
from decodebench.moe_routing import RoutingDistribution, draw_experts
from decodebench.shapes import DecodeShapes, ExpertParallel, GemmShape, sweep_for
from tests.conftest import CPU, REPO, needs_vllm

TINY = load_model_spec("tiny-kimi")  # 16 experts, top-4, hidden 256, I 64 (bf16 experts)
KIMI = load_model_spec("kimi-k2.5")


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    """The tiny model with Kimi-K2.5's INT4 expert quantization (g32), as a config.json path."""
    kimi = json.loads((REPO / "decodebench/models/kimi-k2.5/config.json").read_text())
    tiny = json.loads((REPO / "decodebench/models/tiny-kimi/config.json").read_text())
    path = tmp_path_factory.mktemp("tiny-int4") / "config.json"
    path.write_text(json.dumps({**tiny, "quantization_config": kimi["quantization_config"]}))
    return str(path)


def tiny_ep_cases(tiny_int4, ep=4, level="smoke"):
    return ep_moe_cases(DecodeShapes.for_deployment(load_model_spec(tiny_int4), 1, ep=ep), sweep_for(level))


# --- EP shapes ---------------------------------------------------------------------------------


def test_ep_shapes_hold_whole_experts_per_rank():
    tiny = DecodeShapes.for_deployment(TINY, 1, ep=4).expert_parallel
    assert (tiny.local_experts, tiny.gate_up, tiny.down) == (4, GemmShape(128, 256), GemmShape(256, 64))
    kimi = DecodeShapes.for_deployment(KIMI, 8, ep=8).expert_parallel
    assert (kimi.local_experts, kimi.gate_up, kimi.down) == (48, GemmShape(4096, 7168), GemmShape(7168, 2048))
    assert list(kimi.local_range(1)) == list(range(48, 96))


@pytest.mark.parametrize(("ep", "message"), [
    (3, "n_routed_experts = 16 is not divisible by ep = 3"),
    (32, "ep = 32 ranks cannot each hold a whole expert of n_routed_experts = 16"),
    (0, "expert parallel size must be a positive integer, got 0"),
])
def test_an_ep_that_does_not_divide_the_experts_is_a_clear_error(ep, message):
    with pytest.raises(ShapeError, match=message):
        DecodeShapes.for_deployment(TINY, 1, ep=ep)


def test_expected_loads_match_a_hand_calculation_on_the_tiny_model():
    ep = DecodeShapes.for_deployment(TINY, 1, ep=4).expert_parallel
    # uniform: every expert taken with chance 4/16 per token; a rank holds 4 of 16
    load = ep.expected_loads("uniform", 2)[0]
    assert load.slots == pytest.approx(2 * 4 * 0.25)
    assert load.experts == pytest.approx(4 * (1 - 0.75**2))
    assert load.tokens == pytest.approx(2 * (1 - math.comb(12, 4) / math.comb(16, 4)))
    # skewed: experts 0..7 hot (3 of 4 slots), 8..15 cold (1 slot): ranks 0 and 1 hold the hot set
    loads = ep.expected_loads("skewed", 10)
    assert [round(r.slots, 6) for r in loads] == [15.0, 15.0, 5.0, 5.0]
    assert sum(r.slots for r in loads) == pytest.approx(10 * 4)  # every slot lands on one rank
    assert ep.imbalance("skewed", 10) == pytest.approx(1.5)
    assert ep.imbalance("uniform", 10) == pytest.approx(1.0)


def test_expected_distinct_experts_agree_with_drawn_routings():
    ep = ExpertParallel(ep=4, experts=16, top_k=4, hidden=256, intermediate=64)
    gen = torch.Generator().manual_seed(1)
    for routing in ("uniform", "skewed"):
        drawn = [draw_experts(8, 16, 4, routing, generator=gen) for _ in range(400)]
        seen = sum(d[d < 4].unique().numel() for d in drawn) / len(drawn)  # rank 0 holds experts 0..3
        assert seen == pytest.approx(ep.expected_loads(routing, 8)[0].experts, rel=0.05)


def test_a_captured_profile_weighs_each_ranks_experts():
    ep = ExpertParallel(ep=2, experts=4, top_k=1, hidden=256, intermediate=64)
    loads = ep.expected_loads("profile", 3, counts=(6, 2, 1, 1))
    assert [round(r.slots, 6) for r in loads] == [2.4, 0.6]  # 3 tokens x (0.6 + 0.2), 3 x (0.1 + 0.1)
    assert ep.busiest("profile", 3, counts=(6, 2, 1, 1)).rank == 0


def test_the_ep_option_is_validated_and_shown(pytester):
    pytester.makeconftest("pytest_plugins = ['decodebench.plugin']")
    pytester.makepyfile("def test_x(): pass")
    bad = pytester.runpytest_subprocess("--model", "tiny-kimi", "--tp", "1", "--ep", "3", "-p", "no:cacheprovider")
    bad.stderr.fnmatch_lines(["*--ep 3*n_routed_experts = 16 is not divisible by ep = 3*"])
    zero = pytester.runpytest_subprocess("--model", "tiny-kimi", "--ep", "0", "-p", "no:cacheprovider")
    zero.stderr.fnmatch_lines(["*--ep*'0' must be at least 1*"])
    good = pytester.runpytest_subprocess("--model", "tiny-kimi", "--tp", "1", "--ep", "4", "-p", "no:cacheprovider",
                                         "--benchmark-disable")
    good.stdout.fnmatch_lines(["*decodebench: model=tiny-kimi tp=1 ep=4*"])


# --- the EP-rank MoE case (torch backend, tiny INT4 model) ---------------------------------------


def test_ep_cases_have_ids_of_their_own_and_join_the_moe_benchmark(tiny_int4):
    shapes = DecodeShapes.for_deployment(load_model_spec(tiny_int4), 1, ep=4)
    ids = [c.id for c in moe_benchmark_cases(shapes, sweep_for("smoke")) if isinstance(c, EPMoECase)]
    assert ids == [f"fused-ep4-e4of16-top4-g32-n128k256-n256k64-{r}-m{m}"
                   for r in ("uniform", "skewed") for m in (1, 8)]
    assert not [
        c
        for c in moe_benchmark_cases(DecodeShapes.for_deployment(load_model_spec(tiny_int4), 1), sweep_for("smoke"))
        if isinstance(c, EPMoECase)
    ]  # no --ep: the TP cases only, ids unchanged


def test_the_case_times_the_busiest_rank_and_its_traffic_is_exact(tiny_int4):
    case = [c for c in tiny_ep_cases(tiny_int4) if c.tokens == 8 and c.routing is RoutingDistribution.SKEWED][0]
    pattern = case._pattern()
    per_rank = [int(((pattern // 4) == r).sum()) for r in range(4)]
    assert case.rank_slots == max(per_rank)
    assert case.rank in (0, 1)
    layout = case.layout
    expert_bytes = sum(layout.gemm_bytes(g) for g in (layout.gate_up, layout.down))
    traffic = case.traffic()
    assert traffic.bytes_read == case.distinct_experts * expert_bytes + 8 * 256 * 2 + 8 * 4 * (4 + 4) + 16 * 4
    assert traffic.flops == 2 * case.rank_slots * (128 * 256 + 256 * 64)
    for seed in (1, 2):  # seeds relabel the rank's experts among themselves
        ids, _ = case.route(seed)
        mine = (ids >= case.local_ids.start) & (ids < case.local_ids.stop)
        assert int(mine.sum()) == case.rank_slots
        assert ids[mine].unique().numel() == case.distinct_experts


def dense_rank_fp64(inputs, local):
    """Every local expert on every token in float64, weighted by the routing of the local slots only."""
    w, g = inputs["weights"], 32
    w13 = dequantize(w.w13_packed, w.w13_scale, g, torch.float64)
    w2 = dequantize(w.w2_packed, w.w2_scale, g, torch.float64)
    gate, up = torch.einsum("tk,enk->ten", inputs["x"].double(), w13).chunk(2, dim=-1)
    per_expert = torch.einsum("tei,eni->ten", F.silu(gate) * up, w2)
    routing = torch.zeros(inputs["x"].shape[0], local, dtype=torch.float64)
    ids = inputs["expert_map"].long()[inputs["topk_ids"].long()]
    weights = inputs["topk_weights"].double() * (ids >= 0)
    routing.scatter_add_(1, ids.clamp(min=0), weights)
    return torch.einsum("te,ten->tn", routing, per_expert)


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_reference_and_torch_backend_compute_the_ranks_slots_only(tiny_int4, routing):
    case = [c for c in tiny_ep_cases(tiny_int4) if c.tokens == 8 and c.routing.value == routing][0]
    inputs = case.make_inputs(CPU, seed=3)
    assert relative_error(case.reference(inputs), dense_rank_fp64(inputs, 4)) < 1e-5
    for variant in (case, case.check_variant()):
        assert check_case(variant, variant.kernel("torch", CPU), CPU, seed=4).error < variant.tolerance


def test_a_kernel_that_ignores_the_expert_map_is_caught(tiny_int4):
    case = [c for c in tiny_ep_cases(tiny_int4) if c.tokens == 8][0]

    def every_slot(inp):  # computes slots of other ranks' experts as if they were local
        wrapped = dict(inp, expert_map=torch.arange(16, dtype=torch.int32) % 4)
        return case.reference(wrapped).to(torch.bfloat16)

    with pytest.raises(KernelMismatch, match="differs from the reference"):
        check_case(case, every_slot, CPU, seed=5)


def test_local_groups_drop_other_ranks_slots():
    groups = local_groups(torch.tensor([[5, 1], [4, 6]]), torch.tensor([-1, -1, -1, -1, 0, 1, 2, -1]))
    assert groups.index.tolist() == [0, 1, 2]
    assert [s.tolist() for s in groups.slots] == [[2], [0], [3]]


def test_the_check_variant_keeps_k_and_n_with_fewer_experts_per_rank():
    case = ep_moe_cases(DecodeShapes.for_deployment(KIMI, 8, ep=8), sweep_for("smoke"))[0]
    variant = case.check_variant()
    assert (variant.layout.experts, variant.global_experts, variant.layout.gate_up, variant.layout.down) == \
        (4, 32, case.layout.gate_up, case.layout.down)


@needs_vllm
def test_the_vllm_backend_skips_on_cpu_naming_why(tiny_int4):
    case = tiny_ep_cases(tiny_int4)[0]
    with pytest.raises(BackendUnavailable, match="Marlin"):
        case.kernel("vllm", CPU)


def test_marlin_gets_the_expert_map_and_the_global_expert_count():
    from decodebench.kernels import marlin
    from decodebench.kernels.binding import Binding

    def fused(hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, topk_ids, quant_type_id,
              global_num_experts=-1, workspace=None, expert_map=None):
        return dict(locals())

    api = marlin.MarlinApi(Binding.of(fused, offers=marlin.FUSED_OFFERS, needs=marlin.FUSED_NEEDS), *([None] * 3),
                           quant_type_id=0)
    weights = marlin.MarlinWeights(torch.zeros(4, 1, 1), None, None, None)
    table = torch.tensor([-1] * 12 + [0, 1, 2, 3], dtype=torch.int32)
    called = api.run({"x": 1, "topk_weights": 2, "topk_ids": 3, "expert_map": table}, weights, None)
    assert called["global_num_experts"] == 16
    assert called["expert_map"] is table
    assert api.run({"x": 1, "topk_weights": 2, "topk_ids": 3}, weights, None)["global_num_experts"] == 4


# --- dispatch and combine --------------------------------------------------------------------------


def test_dispatch_message_sizes_follow_the_ep_shapes():
    cases = {c.id: c for c in dispatch_cases(DecodeShapes.for_deployment(KIMI, 8, ep=8), sweep_for("nightly"))}
    # M=256 uniform: a rank holds one of a token's experts with chance 1 - C(336,8)/C(384,8) = 0.66;
    # 256 tokens spread over 8 ranks send 256 * 0.66 / 8 = 21.1 -> 22 tokens per rank pair
    assert cases["a2a-ep8-m256-c22x7168"].chunk_bytes == 22 * 7168 * 2
    assert cases["allgather-ep8-m256-c32x7168"].message_bytes(8) == 8 * 32 * 7168 * 2
    assert "reducescatter-ep8-m1-c1x7168" in cases
    tp_only = dispatch_cases(DecodeShapes.for_deployment(KIMI, 8), sweep_for("smoke"))
    assert tp_only[0].ep == 8  # without --ep the messages are those of EP at the TP size


@pytest.mark.parametrize("collective", list(Collective))
def test_each_rank_gets_what_the_collective_owes_it_and_a_misrouted_chunk_is_caught(collective):
    world, seed = 3, 7
    case = DispatchCase(collective, 4, 2, 8, world)
    inputs = [make_input(case, r, world, seed, CPU).float() for r in range(world)]
    rows = case.chunk_tokens
    chunk = lambda x, j: x[j * rows:(j + 1) * rows]  # noqa: E731
    for rank in range(world):  # the collective done by hand
        if collective is Collective.ALL_TO_ALL:
            out = torch.cat([chunk(inputs[src], rank) for src in range(world)])
        elif collective is Collective.ALL_GATHER:
            out = torch.cat(inputs)
        else:
            out = sum(chunk(inputs[src], rank) for src in range(world))
        assert _check(case, out.to(torch.bfloat16), rank, world, seed)[0] == 0.0
        assert torch.equal(out, expected_chunks(case, rank, world, seed, CPU))
    wrong = torch.cat([chunk(inputs[src], 1) for src in range(world)]) if collective is not Collective.ALL_GATHER \
        else torch.cat(inputs[::-1])
    with pytest.raises(KernelMismatch, match="wrong rank"):
        _check(case, wrong.to(torch.bfloat16)[:expected_chunks(case, 0, world, seed, CPU).shape[0]], 0, world, seed)


def test_dispatch_benchmark_on_two_gloo_ranks(pytester, tmp_path):
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_dispatch.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", f"--benchmark-json={report}", "--device", "cpu",
        "--world-size", "2", "--budget-ms", "20", "--model", "tiny-kimi", "--tp", "1", "--ep", "4", "-k", "m1-")
    result.assert_outcomes(passed=3)
    benches = {b["name"]: b["extra_info"] for b in json.loads(report.read_text())["benchmarks"]}
    info = benches["test_dispatch[a2a-ep4-m1-c1x256-wall]"]
    assert (info["component"], info["collective"], info["world_size"], info["reference_error"]) == \
        ("ep_dispatch", "all_to_all", 2, 0.0)
    assert info["message_bytes"] == 2 * 256 * 2
    assert info["shape"]["ep"] == 4
    assert any("the message sizes are those of EP 4" in n for n in info["notes"])
    assert max(info["rank_median_s"]) <= info["median_s"]


# --- the what-if: hand calculations -----------------------------------------------------------------


def moe(name, us, tokens=64, routing="uniform", **shape):
    """A fused MoE result as measured on an H200 (4.8 TB/s): 100 MB read, its fraction of peak from its time."""
    return KernelResult(name, "moe", "vllm", {"stage": "fused", "routing": routing, "tokens": tokens, **shape},
                        us * 1e-6, {"bytes_read": 1e8, "bytes_written": 0, "flops": 0,
                                    "frac_peak_bw": 1e8 / (us * 1e-6) / 4.8e12})


EP_SHAPE = {"ep": 8, "rank": 0, "rank_slots": 74, "distinct_experts": 40, "local_experts": 48,
            "global_experts": 384, "rank_imbalance": 1.16}


def tp_step(batch=64):
    tp, ar = moe("tp", 300.0, batch), KernelResult("ar", "allreduce", "torch", {"tokens": batch}, 60e-6)
    return Step("today", batch, 1024, (part_of("moe", tp, 60), part_of("allreduce", ar, 123))), [tp, ar]


def test_ep_what_ifs_parse():
    (change,) = parse_what_if("ep=8").changes
    assert (change.group, change.kind, change.ep, change.ep_mode) == ("moe", ChangeKind.EXPERT_PARALLEL, 8, "vllm")
    assert parse_what_if("moe=ep8:a2a").label == "moe=ep8:a2a"
    assert parse_what_if("moe=ep").label == "moe=ep"
    with pytest.raises(ValueError, match="unknown EP mode 'nvl'"):
        parse_what_if("moe=ep8:nvl")


def test_vllm_ep_swaps_the_moe_and_keeps_the_combine_all_reduce():
    today, results = tp_step()
    results += [moe("ep-m64", 420.0, 64, **EP_SHAPE), moe("ep-m1", 90.0, 1, **EP_SHAPE)]
    after = apply_expert_parallel(today, "moe=ep", None, EPMode.VLLM, results)
    # hand: moe 60 x 420 = 25200; all-reduce (123 - 60) x 60 + combine 60 x 60 = 7380, as before
    assert after.groups_us() == pytest.approx({**today.groups_us(), "moe": 25200.0, "allreduce": 7380.0})
    assert any("busiest rank, rank 0 with 74 slots" in a for a in after.assumptions)
    assert any("runs no all-to-all" in a for a in after.assumptions)


def test_agrs_prices_dispatch_and_combine_from_results_over_the_ep_ranks():
    today, results = tp_step()
    results.append(moe("ep-m64", 420.0, 64, **EP_SHAPE))
    for collective, us in (("all_gather", 30.0), ("reduce_scatter", 35.0)):
        results.append(KernelResult(collective, "ep_dispatch", "torch", {"collective": collective, "tokens": 64},
                                    us * 1e-6, {"world_size": 8}))
    after = apply_expert_parallel(today, "moe=ep8:agrs", 8, EPMode.AGRS, results)
    assert after.groups_us()["allreduce"] == pytest.approx(63 * 60 + 60 * (30 + 35))  # 7680


def test_without_ep_results_the_moe_stays_at_tp_shapes_and_says_missing():
    today, results = tp_step()
    after = apply_expert_parallel(today, "moe=ep8", 8, EPMode.VLLM, results)
    assert after.groups_us() == pytest.approx(today.groups_us())
    assert any(
        a.startswith("MISSING: no EP 8 MoE results") and "benchmarks/test_moe.py --ep 8" in a for a in after.assumptions
    )
    with pytest.raises(WhatIfError, match="write moe=epN"):  # no results and no size to take
        apply_expert_parallel(today, "moe=ep", None, EPMode.VLLM, results)


def test_on_the_pcie_box_agrs_costs_what_the_link_table_says():
    """Hand calculation on rtx-pro-6000-x8-pcie (pcie5-switch: alpha 24.1 µs, busbw 41.1 GB/s) at M = 64."""
    batch = 64
    results = [moe("tp", 300.0, batch, experts=384, gate_up_n=512, gate_up_k=7168),
               moe("ep", 420.0, batch, **{**EP_SHAPE, "experts": 48, "gate_up_n": 4096, "gate_up_k": 7168})]
    from decodebench.attribution.predict.prediction import predict_step

    prediction = predict_step(results, KIMI, 8, batch, 1024)
    info = answer(prediction, results, KIMI, 8, what_ifs=[parse_what_if("moe=ep8:agrs"), parse_what_if("ep=8")],
                  targets=[load_target("rtx-pro-6000-x8-pcie")])
    there = info["projections"][0]
    allreduce = 24.1 + batch * 7168 * 2 / (41.1e9 * 8 / 14) * 1e6  # one all-reduce on the link
    gather = 24.1 + 7 * (8 * 7168 * 2) / 41.1e9 * 1e6  # ceil(64 / 8) = 8 tokens per rank
    assert there["groups_us"]["allreduce"] == pytest.approx(123 * allreduce)
    agrs, vllm = there["what_if"]
    assert agrs["groups_us"]["allreduce"] == pytest.approx(63 * allreduce + 60 * 2 * gather)
    assert vllm["groups_us"]["allreduce"] == pytest.approx(123 * allreduce)  # the combine is the all-reduce
    # the MoE at EP shapes scales like the TP term (same bytes, both memory-bound): 420/300 as long
    assert vllm["groups_us"]["moe"] == pytest.approx(there["groups_us"]["moe"] * 420 / 300)
    assert any("fits" in a and "71 GiB" in a for a in vllm["assumptions"])
    table = "\n".join(ep_table_lines([("m64", info)]))
    assert "rtx-pro-6000-x8-pcie" in table
    assert "moe=ep8:agrs" in table


def test_the_offline_command_prints_the_table_and_marks_what_is_missing(tmp_path, capsys):
    def stored(benches):
        path = tmp_path / f"{len(benches)}.json"
        path.write_text(json.dumps({"machine_info": {"decodebench": {"model": "kimi-k2.5", "tp": 8}},
                                    "benchmarks": benches}))
        return str(path)

    def bench(name, us, shape):
        return {"name": name, "stats": {"median": us * 1e-6},
                "extra_info": {"component": "moe", "backend": "vllm", "shape": shape, "bytes_read": 1e8,
                               "bytes_written": 0, "flops": 0, "frac_peak_bw": 1e8 / (us * 1e-6) / 4.8e12}}

    tp = [bench(f"tp{m}", 100.0 + m, {"stage": "fused", "routing": "uniform", "tokens": m, "experts": 384,
                                      "gate_up_n": 512, "gate_up_k": 7168}) for m in (1, 64, 256)]
    assert main([stored(tp), "--what-if", "moe=ep", "--batch", "1", "--project-to", "rtx-pro-6000-x8-pcie"]) == 0
    missing = capsys.readouterr().out
    assert "moe=ep8" in missing
    assert "MISSING: MoE at TP shapes, no EP results" in missing
    ep = [bench(f"ep{m}", 150.0 + m, {"stage": "fused", "routing": "uniform", "tokens": m, "experts": 48,
                                      "gate_up_n": 4096, "gate_up_k": 7168, **{**EP_SHAPE, "experts": 48}})
          for m in (1, 64, 256)]
    assert main([stored(tp + ep), "--what-if", "moe=ep", "--project-to", "rtx-pro-6000-x8-pcie"]) == 0
    out = capsys.readouterr().out
    assert "TP against expert parallelism" in out
    assert "moe=ep8 vs TP (rtx-pro-6000-x8-pcie)" in out
    assert "MISSING" not in out
    # here: 60 MoE layers x (150 + 64 - 100 - 64) = +3000 µs at M = 64; there x 4.8 / 1.792 (bandwidths)
    assert re.search(r"here\s+moe=ep8\s+64\s+\S+\s+\S+\s+\+3000\.0\s+moe \+3000\.0", out)
    assert re.search(r"rtx-pro-6000-x8-pcie\s+moe=ep8\s+64\s+\S+\s+\S+\s+\+8035\.7\s+moe \+8035\.7", out)



def test_dispatch_results_measured_on_the_target_replace_the_link_table(tmp_path):
    """All-gather 30 / 40 µs and reduce-scatter 32 / 44 µs at 1 and 8 tokens over 8 ranks on the target:
    at M = 64 (8 tokens per rank) the fit gives back 40 and 44 µs."""
    benches = [{"name": f"{c}-{t}", "stats": {"median": us * 1e-6},
                "extra_info": {"component": "ep_dispatch", "backend": "torch", "world_size": 8,
                               "shape": {"collective": c, "tokens": t, "chunk_bytes": t * 7168 * 2}}}
               for c, points in (("all_gather", ((1, 30.0), (8, 40.0))), ("reduce_scatter", ((1, 32.0), (8, 44.0))))
               for t, us in points]
    (tmp_path / "dispatch.json").write_text(json.dumps({"benchmarks": benches}))
    shipped = json.loads((REPO / "decodebench/attribution/predict/targets/rtx-pro-6000-x8-pcie.json").read_text())
    (tmp_path / "box.json").write_text(json.dumps({**shipped, "allreduce_results": ["dispatch.json"]}))
    results = [moe("tp", 300.0, 64, experts=384, gate_up_n=512, gate_up_k=7168),
               moe("ep", 420.0, 64, **{**EP_SHAPE, "experts": 48, "gate_up_n": 4096, "gate_up_k": 7168})]
    from decodebench.attribution.predict.prediction import predict_step

    info = answer(predict_step(results, KIMI, 8, 64, 1024), results, KIMI, 8,
                  what_ifs=[parse_what_if("moe=ep8:agrs")], targets=[load_target(str(tmp_path / "box.json"))])
    allreduce = 24.1 + 64 * 7168 * 2 / (41.1e9 * 8 / 14) * 1e6
    (agrs,) = info["projections"][0]["what_if"]
    assert agrs["groups_us"]["allreduce"] == pytest.approx(63 * allreduce + 60 * (40 + 44))
    assert any("(fit)" in p["benchmark"] for p in agrs["parts"])
