"""The all-reduce benchmark's pieces with literal numbers, and the benchmark end to end on 2 gloo ranks."""

import json
import types

import pytest

from decodebench import timing
from decodebench.distributed import allreduce, communicators
from decodebench.distributed.allreduce import (
    AllReduceCase,
    allreduce_cases,
    bandwidths,
    bus_factor,
    check_sum,
    collective_timers,
    make_message,
    preflight,
    timer_note,
)
from decodebench.distributed.links import LinkMode, link_summary, vllm_would_use
from decodebench.errors import BackendUnavailable, KernelMismatch
from decodebench.hardware import Fingerprint
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, sweep_for
from decodebench.timing import Budget, Lockstep, StopReason, TimerMode
from tests.conftest import REPO, needs_gpus

KIMI_TP8 = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)


# --- traffic: nccl-tests' formulas -----------------------------------------------------------------


@pytest.mark.parametrize(("world_size", "factor"), [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_bus_factor_is_two_n_minus_one_over_n(world_size, factor):
    assert bus_factor(world_size) == factor


def test_bandwidths_of_one_decode_token_at_24_us_on_8_ranks():
    bw = bandwidths(14_336, 24e-6, 8)
    assert bw["algbw_gbps"] == pytest.approx(0.597333, rel=1e-5)  # 14336 B / 24 us
    assert bw["busbw_gbps"] == pytest.approx(1.045333, rel=1e-5)  # x 1.75


def test_bandwidths_of_a_large_message():
    assert bandwidths(1 << 30, 0.05, 8) == pytest.approx({"algbw_gbps": 21.474836, "busbw_gbps": 37.580964})


# --- cases from DecodeShapes ------------------------------------------------------------------------


def test_decode_messages_are_tokens_times_hidden_in_bf16():
    cases = allreduce_cases(KIMI_TP8, sweep_for("nightly"))
    decode = [c for c in cases if c.tokens is not None]
    assert [c.tokens for c in decode] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert [c.nbytes for c in decode][:2] == [14_336, 28_672]
    assert decode[-1].nbytes == 256 * 7168 * 2
    assert decode[-1].dims == (256, 7168)
    sizes = [c.nbytes for c in cases if c.tokens is None]
    assert sizes[0] == 1024
    assert sizes[-1] == 256 << 20
    assert all(s & (s - 1) == 0 for s in sizes)
    assert len({c.id for c in cases}) == len(cases)


def test_case_ids_name_the_shape_or_the_size():
    assert AllReduceCase(14_336, 1, 7168).id == "m1x7168"
    assert [AllReduceCase(n).id for n in (256, 4096, 1 << 20, 1 << 30)] == \
        ["pow2-256B", "pow2-4KiB", "pow2-1MiB", "pow2-1GiB"]


# --- correctness check ------------------------------------------------------------------------------


def test_messages_are_never_zero_and_share_one_base_across_ranks():
    import torch

    case, cpu = AllReduceCase(14_336, 1, 7168), torch.device("cpu")
    ranks = [make_message(case, rank, seed=7, device=cpu).float() for rank in range(3)]
    assert ranks[0].shape == (1, 7168)
    assert ranks[0].dtype == torch.float32
    assert (ranks[0] != 0).all()
    assert set(ranks[0].unique().tolist()) <= {-4, -3, -2, -1, 1, 2, 3, 4}
    assert torch.equal(ranks[2], 3 * ranks[0])
    assert torch.equal(ranks[1], 2 * ranks[0])
    assert not torch.equal(make_message(case, 0, seed=8, device=cpu), make_message(case, 0, seed=7, device=cpu))


def simulated_sum(world_size, rank):
    """What a correct all-reduce of make_message's data returns on ``rank``."""
    return lambda x: x.mul_(world_size * (world_size + 1) // 2).div_(rank + 1)


def test_a_correct_sum_passes_exactly():
    import torch

    x = make_message(AllReduceCase(4096), rank=1, seed=3, device=torch.device("cpu"))
    assert check_sum(simulated_sum(4, rank=1), x, rank=1, world_size=4) == (0.0, 3 * 2.0**-8)


@pytest.mark.parametrize(("wrong", "name"), [
    (lambda x: x, "no-op"),
    (lambda x: x.mul_(2), "one rank missing"),
    (lambda x: x.flip(-1).mul_(3), "chunks misplaced"),
    (lambda x: x.mul_(float("nan")), "nan"),
])
def test_a_wrong_sum_fails_and_names_the_rank(wrong, name):
    import torch

    x = make_message(AllReduceCase(4096), rank=0, seed=3, device=torch.device("cpu"))
    with pytest.raises(KernelMismatch, match=r"rank 0: all-reduce sum of 2 ranks is off by .* not timed"):
        check_sum(wrong, x, rank=0, world_size=2)


# --- decisions in the parent: skips and timers ---------------------------------------------------------


def test_preflight_reasons(monkeypatch):
    monkeypatch.setattr(allreduce, "has_module", lambda name: True)  # as if vLLM were installed
    assert preflight("torch", "cpu", 2) is None
    assert preflight("vllm_pynccl", "cpu", 2) == "vLLM's PyNcclCommunicator runs on CUDA GPUs; this run is on cpu"
    assert preflight("vllm_custom", "cuda", 1) == \
        "vLLM does not use its custom all-reduce for a single rank (world size 1)"
    assert preflight("vllm_custom", "cuda", 8) is None  # vLLM itself says why it turns it off
    monkeypatch.setattr(allreduce, "has_module", lambda name: False)
    assert preflight("vllm_pynccl", "cuda", 8) == "vLLM is not installed in this environment"
    with pytest.raises(ValueError, match="unknown all-reduce backend 'mpi'"):
        preflight("mpi", "cpu", 2)


def test_pcie_only_does_not_offer_vllm_custom(monkeypatch):
    monkeypatch.setattr(allreduce, "has_module", lambda name: True)
    assert preflight("vllm_custom", "cuda", 8, LinkMode.PCIE_ONLY).startswith("--pcie-only: vLLM's custom all-reduce")
    assert preflight("vllm_pynccl", "cuda", 8, LinkMode.PCIE_ONLY) is None
    assert preflight("torch", "cuda", 8, LinkMode.PCIE_ONLY) is None


@pytest.mark.parametrize(("session", "device", "timers"), [
    (TimerMode.WALL, "cpu", ("wall",)),
    (TimerMode.KERNEL, "cuda", ("events", "graph")),
    (TimerMode.COLD, "cuda", ("events", "graph")),
    (TimerMode.GRAPH, "cuda", ("graph",)),
    (TimerMode.EVENTS, "cuda", ("events",)),
    (TimerMode.WALL, "cuda", ("wall",)),
])
def test_the_session_timer_gives_the_collective_timers(session, device, timers):
    assert tuple(t.value for t in collective_timers(session, device)) == timers


def test_a_note_says_when_the_collective_timer_is_not_the_session_timer():
    assert timer_note(TimerMode.KERNEL, TimerMode.GRAPH).startswith("--timer kernel: a collective's kernel waits")
    assert timer_note(TimerMode.EVENTS, TimerMode.EVENTS) is None
    assert timer_note(TimerMode.WALL, TimerMode.WALL) is None


# --- which all-reduce vLLM would take --------------------------------------------------------------


@pytest.mark.parametrize(("world", "nbytes", "link", "mode", "nnodes", "backend"), [
    (1, 14_336, "single", LinkMode.NATIVE, 1, "none"),
    (2, 14_336, "nvlink", LinkMode.NATIVE, 1, "vllm_custom"),
    (8, 14_336, "nvlink", LinkMode.NATIVE, 1, "vllm_custom"),
    (8, 14_336, "nvlink", LinkMode.PCIE_ONLY, 1, "vllm_pynccl"),  # the users' box at TP 8
    (8, 14_336, "pcie", LinkMode.NATIVE, 1, "vllm_pynccl"),
    (2, 14_336, "pcie", LinkMode.NATIVE, 1, "vllm_custom"),  # two PCIe GPUs: custom, if P2P works
    (2, 14_336, "nvlink", LinkMode.PCIE_ONLY, 1, "vllm_custom"),
    (8, 8 << 20, "nvlink", LinkMode.NATIVE, 1, "vllm_pynccl"),  # not under max_size
    (8, (8 << 20) - 16, "nvlink", LinkMode.NATIVE, 1, "vllm_custom"),
    (2, 1000, "nvlink", LinkMode.NATIVE, 1, "vllm_pynccl"),  # not a multiple of 16 bytes
    (3, 14_336, "nvlink", LinkMode.NATIVE, 1, "vllm_pynccl"),  # unsupported world size
    (16, 14_336, "nvlink", LinkMode.NATIVE, 2, "vllm_pynccl"),  # spans hosts
    (4, 14_336, "unknown", LinkMode.NATIVE, 1, "vllm_pynccl"),  # no NVML: not known to be NVLink
])
def test_vllm_would_use(world, nbytes, link, mode, nnodes, backend):
    path = vllm_would_use(world, nbytes, link=link, mode=mode, nnodes=nnodes)
    assert path.backend == backend
    assert path.why


def test_pcie_only_has_its_own_fingerprint_key():
    native = Fingerprint("nvidia-h200-x2-nvlink-cc90", {"key": "nvidia-h200-x2-nvlink-cc90", "device": "cuda"})
    pcie = native.with_link_mode("pcie-only")
    assert pcie.key == "nvidia-h200-x2-nvlink-cc90-pcie-only"
    assert pcie.info == {"key": pcie.key, "device": "cuda", "link_mode": "pcie-only"}
    assert native.info["key"] == "nvidia-h200-x2-nvlink-cc90"


# --- the lock step: every rank stops after the same sample -------------------------------------------


class TwoRanks:
    """A Lockstep for one process that plays rank 0 beside a simulated, slower rank 1."""

    def __init__(self, other_samples, other_late_after=None):
        self.other = iter(other_samples)
        self.other_late_after = other_late_after
        self.seen = 0

    def slowest(self, values):
        if len(values) == 1:  # the estimate
            return [max(values[0], 1e-3)]
        self.seen += 1
        late = self.other_late_after is not None and self.seen >= self.other_late_after
        return [max(values[0], next(self.other)), max(values[1], float(late))]


def test_samples_are_the_slowest_rank_and_own_samples_are_kept():
    ranks = TwoRanks([3e-6, 1e-6] * 50)
    budget = Budget(min_samples=4, max_samples=6, budget_ms=60_000, target_precision=1e-9)
    m = timing._sample(lambda: 2e-6, TimerMode.WALL, 20, budget, Lockstep(lambda: None, ranks.slowest))
    assert m.samples == (3e-6, 2e-6, 3e-6, 2e-6, 3e-6, 2e-6)
    assert m.own_samples == (2e-6,) * 6
    assert m.stop_reason is StopReason.MAX_SAMPLES


def test_a_rank_past_its_deadline_stops_every_rank():
    ranks = TwoRanks([2e-6, 1e-6] * 50, other_late_after=12)
    budget = Budget(min_samples=10, max_samples=400, budget_ms=60_000, target_precision=1e-9)
    m = timing._sample(lambda: 1e-6, TimerMode.WALL, 20, budget, Lockstep(lambda: None, ranks.slowest))
    assert (m.stop_reason, len(m.samples)) == (StopReason.BUDGET, 12)


def test_the_estimate_is_agreed_and_calls_per_sample_have_a_floor():
    barriers = []
    ranks = TwoRanks([1e-6] * 100)
    budget = Budget(min_samples=3, max_samples=3, sample_ms=1.0, min_calls_per_sample=20, warmup_ms=0)
    m = timing.measure(lambda: None, mode=TimerMode.WALL, device=torch_cpu(), budget=budget,
                       lockstep=Lockstep(lambda: barriers.append(1), ranks.slowest))
    assert m.calls_per_sample == 20  # 1 ms sample / 1 ms agreed estimate = 1 call, raised to the floor
    assert len(barriers) == 1 + 3  # before the estimate and before every sample


def test_the_kernel_timer_cannot_time_a_collective():
    with pytest.raises(ValueError, match="timer 'kernel' cannot time a collective"):
        timing._sampler_hooks(TimerMode.KERNEL, Lockstep(lambda: None, list))


def torch_cpu():
    import torch

    return torch.device("cpu")


def test_vllm_custom_skip_reason_is_what_vllm_logs():
    pytest.importorskip("vllm")
    # On the CPU build vLLM turns custom all-reduce off in its constructor (no kernels) and
    # logs why; the adapter must carry that sentence into the skip.
    ctx = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda", index=0), cache={},
                                cpu_group=lambda: None)
    with pytest.raises(BackendUnavailable, match="vLLM disabled its custom all-reduce: Custom allreduce is disabled"):
        communicators.build_communicator("vllm_custom", ctx, None)


def test_the_pcie_gate_sentence_is_picked_among_vllm_messages():
    said = ["vLLM is using nccl==2.27.3",
            "Custom allreduce is disabled because it's not supported on more than two PCIe-only GPUs. ..."]
    assert communicators.disable_reason(said).startswith("Custom allreduce is disabled because it's not supported")
    assert communicators.disable_reason([]) == "vLLM logged no reason"


def test_link_summary_of_eight_pcie_gpus():
    gpus = [{"pcie_gen": 5, "pcie_width": 16}] * 8
    pairs = [{"gpus": [i, j], "p2p_read": True, "nvlink": False} for i in range(8) for j in range(i + 1, 8)]
    topology = {"available": True, "count": 8, "gpus": gpus, "pairs": pairs, "link": "pcie"}
    assert link_summary(topology) == {"link": "pcie", "gpus": 8, "p2p_all_pairs": True, "nvlink_pairs": 0,
                                      "pcie": ["gen5 x16"]}


# --- the benchmark end to end: 2 gloo ranks --------------------------------------------------------------


CORE_FIELDS = {"component", "backend", "case", "shape", "device", "timer", "samples", "calls_per_sample",
               "stop_reason", "median_precision", "dispersion_iqr", "measure_wall_s", "notes", "reference_error",
               "tolerance", "check_seed", "timing_seed", "telemetry_before", "telemetry_after"}


def run_benchmark(pytester, tmp_path, *options):
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_allreduce.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", f"--benchmark-json={report}",
        "--device", "cpu", "--world-size", "2", "--budget-ms", "30", "-rs", *options)
    return result, report


def test_benchmark_runs_on_two_gloo_ranks_and_records_the_slowest_rank(pytester, tmp_path):
    result, report = run_benchmark(pytester, tmp_path)
    result.assert_outcomes(passed=4, skipped=8)
    result.stdout.fnmatch_lines(["*vllm_custom: vLLM's custom all-reduce runs on CUDA GPUs; this run is on cpu*"])
    benches = {b["name"]: b for b in json.loads(report.read_text())["benchmarks"]}
    assert set(benches) == {f"test_allreduce[{c}-torch-wall]"
                            for c in ("m1x7168", "m8x7168", "pow2-4KiB", "pow2-1MiB")}
    bench = benches["test_allreduce[m1x7168-torch-wall]"]
    info = bench["extra_info"]
    assert CORE_FIELDS <= set(info)  # the fields every kernel result carries too
    assert (info["component"], info["backend"], info["library"], info["timer"]) == \
        ("allreduce", "torch", "torch.distributed gloo", "wall")
    assert info["stop_reason"] in ("converged", "budget", "max_samples")
    assert info["stop_reason"] != "max_samples" or info["samples"] == 500
    assert info["device"] == "cpu"
    assert info["telemetry_before"]["available"] is False
    assert (info["message_bytes"], info["tokens"], info["world_size"], info["nnodes"]) == (14_336, 1, 2, 1)
    assert info["reference_error"] == 0.0
    assert info["timing_seed"] == info["check_seed"] + 1
    assert info["calls_per_sample"] >= 20
    assert info["busbw_gbps"] == pytest.approx(info["algbw_gbps"])  # 2 ranks: 2(n-1)/n = 1
    assert info["algbw_gbps"] == pytest.approx(14_336 / info["median_s"] / 1e9)
    # each recorded sample is the maximum over ranks, so no rank's median can exceed theirs
    assert len(info["rank_median_s"]) == 2
    assert max(info["rank_median_s"]) <= info["median_s"]
    assert info["rank_median_s"][info["slowest_rank"]] == max(info["rank_median_s"])
    assert info["allreduces_per_step"] == 123
    assert info["step_allreduce_s"] == pytest.approx(123 * info["median_s"])
    assert (info["link_mode"], info["link"]["link"]) == ("native", "unknown")  # no NVML on the CI machine
    assert info["vllm_would_use"]["backend"] == "vllm_custom"  # 2 ranks, if P2P works
    assert "NCCL_P2P_DISABLE" not in info["nccl_env"]
    assert bench["group"] == "allreduce"
    assert bench["options"]["timer"] == "device_clock"
    assert bench["stats"]["rounds"] == info["samples"] == len(bench["stats"]["data"])
    assert bench["stats"]["median"] == pytest.approx(info["median_s"])
    assert benches["test_allreduce[pow2-1MiB-torch-wall]"]["extra_info"]["allreduces_per_step"] is None


def test_pcie_only_mode_reaches_the_workers_the_results_and_the_fingerprint(pytester, tmp_path):
    result, report = run_benchmark(pytester, tmp_path, "--pcie-only", "-k", "m1x7168 and torch",
                                   "--benchmark-autosave")
    result.assert_outcomes(passed=1)
    data = json.loads(report.read_text())
    info = data["benchmarks"][0]["extra_info"]
    assert info["link_mode"] == "pcie-only"
    assert info["nccl_env"]["NCCL_P2P_DISABLE"] == "1"
    assert any(n.startswith("--pcie-only on CPU") for n in info["notes"])
    fingerprint = data["machine_info"]["decodebench"]["fingerprint"]
    assert fingerprint["link_mode"] == "pcie-only"
    assert fingerprint["key"].endswith("-pcie-only")
    assert [p.name for p in (tmp_path / "store").iterdir()] == [fingerprint["key"]]


# --- on GPUs (skipped on CPU) ------------------------------------------------------------------------



@needs_gpus(1)
def test_events_and_graph_figures_on_one_gpu(pytester, tmp_path):
    result, report = run_benchmark(pytester, tmp_path, "--device", "cuda:0", "--world-size", "1",
                                   "-k", "m1x7168 and torch")
    result.assert_outcomes(passed=2)
    infos = {b["name"]: b["extra_info"] for b in json.loads(report.read_text())["benchmarks"]}
    assert set(infos) == {"test_allreduce[m1x7168-torch-events]", "test_allreduce[m1x7168-torch-graph]"}
    for info in infos.values():
        assert info["reference_error"] == 0.0
        assert info["vllm_would_use"]["backend"] == "none"
        assert info["telemetry_after"]["available"] is True


@needs_gpus(2)
def test_vllm_custom_is_captured_in_a_graph_on_two_gpus(pytester, tmp_path):
    pytest.importorskip("vllm")
    result, report = run_benchmark(pytester, tmp_path, "--device", "cuda:0", "--world-size", "2",
                                   "-k", "m1x7168 and vllm")
    result.assert_outcomes(passed=4)
    infos = {b["name"]: b["extra_info"] for b in json.loads(report.read_text())["benchmarks"]}
    graph = infos["test_allreduce[m1x7168-vllm_custom-graph]"]
    assert (graph["timer"], graph["reference_error"], graph["library"].split()[-1]) == \
        ("graph", 0.0, "CustomAllreduce")


def test_a_collective_without_a_communicator_capture_is_graphed_in_a_plain_context():
    """The EP dispatch has no communicator of its own: ``measured_on_ranks`` without ``capture`` must hand
    the graph timer a context to enter (a None here failed every dispatch case at --timer graph on an H100)."""
    import inspect

    from decodebench.distributed.allreduce import measured_on_ranks

    default = inspect.signature(measured_on_ranks).parameters["capture"].default
    with default():
        pass
