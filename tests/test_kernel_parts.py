"""Per-kernel times of a traced call (the kernel timer's bookkeeping) and the split into parts,
with synthetic profiler events."""

import pytest

from decodebench import cupti, timing
from decodebench.kernel_parts import OTHER, PartRule, TimedPart, TraceAttributionError, part_seconds, split_call


def events(*calls, start=0):
    """Profiler-like (start ns, name, duration ns) for consecutive calls of (name, ns) kernels."""
    out, t = [], start
    for call in calls:
        for name, ns in call:
            out.append((t, name, ns))
            t += ns + 100
    return out


CALL = (("align", 2000), ("gemm", 10_000), ("gemm", 6000))


def test_per_kernel_seconds_are_averaged_over_the_calls_of_a_sample():
    trace = cupti.CallTrace(calls=2)
    trace.add(events(CALL, (("align", 4000), ("gemm", 12_000), ("gemm", 6000))))
    trace.add(events(CALL, CALL))
    result = trace.result()
    assert result.names == ("align", "gemm", "gemm")
    assert result.samples == ((3e-6, 11e-6, 6e-6), (2e-6, 10e-6, 6e-6))


@pytest.mark.parametrize("second_sample", [
    events(CALL, CALL[:2]),  # one kernel missing: 5 kernels in 2 calls
    events(CALL[::-1], CALL[::-1]),  # another launch order than the first sample
    events(CALL, (("align", 1), ("gemm", 1), ("sum", 1))),  # the calls of one sample differ
])
def test_calls_that_launch_different_kernels_give_no_trace(second_sample):
    trace = cupti.CallTrace(calls=2)
    trace.add(events(CALL, CALL))
    trace.add(second_sample)
    assert trace.result() is None


def test_a_measurement_without_a_kernel_timer_has_no_trace():
    import torch

    m = timing.measure(lambda: torch.ones(8).sum(), mode=timing.TimerMode.WALL, device=torch.device("cpu"),
                       budget=timing.Budget(budget_ms=5, min_samples=3))
    assert m.kernels is None


def test_rules_take_the_nth_match_in_launch_order_and_the_rest_is_other():
    rules = (PartRule("first", "gemm", nth=0), PartRule("second", "gemm", nth=1), PartRule("align", "^align"))
    assert split_call(["align", "gemm", "memset", "gemm", "gemm"], rules) == (
        "align", "first", OTHER, "second", OTHER)


def test_parts_sum_their_kernels_per_sample():
    trace = timing.KernelTrace(("a", "b", "c"), ((1.0, 2.0, 4.0), (1.0, 3.0, 5.0)))
    assert part_seconds(trace, ("x", "y", "x")) == {"x": (5.0, 6.0), "y": (2.0, 3.0)}


def test_a_missing_trace_is_an_error_that_says_why():
    with pytest.raises(TraceAttributionError, match="kernel counts differed between calls"):
        TimedPart(None, "gemm", (PartRule("gemm", "gemm"),)).attribute(None)


def test_a_part_that_no_kernel_matches_is_an_error():
    trace = timing.KernelTrace(("align",), ((1.0,),))
    with pytest.raises(TraceAttributionError, match=r"no kernel is 'gemm'.*\['align'\]"):
        TimedPart(None, "gemm", (PartRule("gemm", "gemm"),)).attribute(trace)


def test_every_launched_kernel_is_kept_by_name_even_when_calls_differ():
    # what the harness stores as extra_info["kernels"]: the key the gate reads to tell that a
    # library chose another kernel (name -> launches and seconds per timed call)
    trace = cupti.CallTrace(calls=2)
    trace.add(events(CALL, CALL))
    trace.add(events(CALL, (("align", 2000), ("gemm_b", 9000))))  # the second call picked another GEMM
    assert trace.result() is None  # no per-call split any more...
    by_name = trace.by_name()  # ...but every name is still there, medians over the two samples
    assert by_name["align"] == {"calls": 1.0, "s": 2e-6}
    assert by_name["gemm"] == {"calls": 1.5, "s": pytest.approx((16e-6 + 8e-6) / 2)}
    assert by_name["gemm_b"] == {"calls": 0.25, "s": pytest.approx(9e-6 / 4)}
    m = timing.Measurement((1e-6,), timing.TimerMode.KERNEL, 2, timing.StopReason.CONVERGED, 0.1,
                           kernels_by_name=by_name)
    assert m.summary()["kernels"] is by_name
    assert "kernels" not in timing.Measurement((1e-6,), timing.TimerMode.WALL, 1, timing.StopReason.CONVERGED,
                                               0.1).summary()
