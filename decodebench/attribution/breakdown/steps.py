"""Where an engine step's wall time goes: the GPU's busy time beside the host's, from one profiler trace.

The breakdown (:mod:`.analyse`) splits the GPU's kernels into the model's components and predicts
them. This module answers the question before it: is the step bound by the GPU or by the host,
and where on the host is the rest? It is what ``--breakdown`` reports for a server started with
``--spec``, and what ``python -m decodebench steps TRACE_DIR`` prints (docs/benchmarks.md, "Where
a step's time goes").

Each full decode step (every request of the window in decode, none in prefill) is the time from
one step annotation to the next. In it: ``gpu_busy``, the union of the device's kernels, copies and
memsets, and ``gpu_idle`` the rest; on the thread that runs the steps, ``gpu_wait``, host calls that
block on the GPU (:data:`WAIT_CALLS` and every copy) at any depth, and the top-level spans less the
waits inside them: ``execute`` (the step annotation itself), ``ops`` (every other top-level span)
and ``untraced`` (the step's time in no span: Python in the engine between ops); ``scopes``, vLLM's
own named scopes (recorded only with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``, which ``--breakdown``
sets), less the GPU waits inside them. The figures are means over the window's full decode steps,
so the four host columns add up to the step; profiling slows the host, so the split, not the sum,
is the finding.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .components import union_us
from .trace import DEVICE_CATS, TraceError, load_events, step_annotation

__all__ = ["StepTime", "WAIT_CALLS", "report", "step_time"]

# host calls that return only when the GPU has caught up; and the copies: a copy to pageable host
# memory blocks in cudaMemcpyAsync too (vLLM 0.26's sampled tokens under speculation, 4.6 ms of a
# 23 ms profiled step on the H200), and a copy that does not block lasts a few µs
WAIT_CALLS = frozenset({"cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                        "cuEventSynchronize", "cuStreamSynchronize", "cuCtxSynchronize"})
COPY_CALLS = ("cudaMemcpy", "cuMemcpy")
HOST_CATS = frozenset({"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function"})
COLUMNS = ("wall", "gpu_busy", "gpu_idle", "execute", "gpu_wait", "ops", "untraced")


def _waits(event: dict) -> bool:
    name = event.get("name", "")
    return name in WAIT_CALLS or name.startswith(COPY_CALLS)


@dataclass(frozen=True)
class StepTime:
    """One trace's full decode steps: µs per step (means) of each column, and vLLM's scopes."""

    label: str  # the batch of the steps measured: requests in decode and their tokens
    steps: int
    us: dict[str, float]  # COLUMNS -> µs per step
    scopes: dict[str, float] = field(default_factory=dict)  # vLLM scope name -> µs per step
    top_ops: dict[str, float] = field(default_factory=dict)  # the largest "ops" by name, µs per step

    def to_dict(self) -> dict:
        return {"label": self.label, "steps": self.steps, **{f"{k}_us": round(v, 1) for k, v in self.us.items()},
                "scopes_us": {k: round(v, 1) for k, v in self.scopes.items()},
                "top_ops_us": {k: round(v, 1) for k, v in self.top_ops.items()}}


def step_time(path: Path, top: int = 6) -> StepTime:
    """The split of ``path``'s full decode steps; :class:`TraceError` when it holds fewer than two."""
    events = load_events(path)
    marks = sorted((e for e in events if step_annotation(e)), key=lambda e: float(e["ts"]))
    if not marks:
        raise TraceError(f"{path}: no step annotations (execute_context_..._generation_...)")
    thread = (marks[0].get("pid"), marks[0].get("tid"))
    full = _full_decode_names(marks)
    if not full:
        raise TraceError(f"{path}: no decode step (every step had a request in prefill)")
    windows = [(float(a["ts"]), float(b["ts"]), a) for a, b in zip(marks, marks[1:], strict=False) if a["name"] in full]
    if not windows:
        raise TraceError(f"{path}: a single full decode step, with no next step to end it")
    device = _Spans((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in events
                    if e.get("cat") in DEVICE_CATS)
    on_thread = [e for e in events if e.get("cat") in HOST_CATS and (e.get("pid"), e.get("tid")) == thread]
    host = _Spans(_as_span(e) for e in _top_level(on_thread) if not _waits(e))
    waits = _Spans(_as_span(e) for e in on_thread if _waits(e))
    scopes = _Spans(_as_span(e) for e in on_thread if e.get("cat") == "user_annotation" and ":" in e.get("name", "")
                    and not step_annotation(e))
    totals: dict[str, float] = defaultdict(float)
    scope_totals: Counter = Counter()
    op_totals: Counter = Counter()

    def host_part(span: tuple[float, float, dict], start: float, end: float) -> float:
        """A span's time in [start, end) that is not spent waiting on the GPU."""
        s, t = max(start, span[0]), min(end, span[1])
        return max(0.0, t - s - waits.covered(s, t)) if t > s else 0.0

    for start, end, mark in windows:
        wall = end - start
        busy = device.covered(start, end)
        wait = waits.covered(start, end)  # at any depth: vLLM's scopes hold the waits in 0.26
        execute = ops = 0.0
        for span in host.overlapping(start, end):
            part = host_part(span, start, end)
            if span[2] is mark:
                execute += part
            else:
                ops += part
                op_totals[span[2].get("name", "?")] += part
        for span in scopes.overlapping(start, end):
            scope_totals[span[2]["name"]] += host_part(span, start, end)
        values = (wall, busy, wall - busy, execute, wait, ops, wall - execute - wait - ops)
        for key, value in zip(COLUMNS, values, strict=True):
            totals[key] += value
    n = len(windows)
    return StepTime(_batch(full), n, {k: totals[k] / n for k in COLUMNS},
                    {k: v / n for k, v in sorted(scope_totals.items()) if v > 0},
                    {k: v / n for k, v in op_totals.most_common(top)})


def _full_decode_names(marks: Sequence[dict]) -> set[str]:
    """The step annotations of the window's full decode steps: no request in prefill, the most requests
    in decode (with speculation their tokens differ from step to step: drafts found or not)."""
    parsed = {e["name"]: step_annotation(e) for e in marks}
    decode = {name: m for name, m in parsed.items() if m.context_requests == 0 and m.generation_requests > 0}
    most = max((m.generation_requests for m in decode.values()), default=0)
    return {name for name, m in decode.items() if m.generation_requests == most}


def _batch(names: set[str]) -> str:
    """``"64 in decode, 228-320 tokens"`` for the step annotations ``names``."""
    marks = [step_annotation({"name": name}) for name in names]
    low, high = min(m.generation_tokens for m in marks), max(m.generation_tokens for m in marks)
    tokens = f"{low}" if low == high else f"{low}-{high}"
    return f"{marks[0].generation_requests} in decode, {tokens} tokens"


def _top_level(events: Iterable[dict]) -> list[dict]:
    """The spans no other span of the same thread contains (the earliest and longest first)."""
    out: list[dict] = []
    end = float("-inf")
    for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        if float(e["ts"]) >= end:
            out.append(e)
            end = float(e["ts"]) + float(e["dur"])
    return out


def _as_span(event: dict) -> tuple[float, float, dict]:
    return float(event["ts"]), float(event["ts"]) + float(event["dur"]), event


class _Spans:
    """``(start, end, event)`` spans sorted by start, found by the window they overlap."""

    def __init__(self, spans: Iterable[tuple[float, float, dict]]):
        self.spans = sorted(spans, key=lambda span: (span[0], -span[1]))
        self.starts = [span[0] for span in self.spans]
        self.longest = max((end - start for start, end, _ in self.spans), default=0.0)

    def overlapping(self, start: float, end: float) -> list[tuple[float, float, dict]]:
        """The spans with time in [start, end) (a span begun up to the longest span's length before)."""
        first = bisect.bisect_left(self.starts, start - self.longest)
        last = bisect.bisect_left(self.starts, end)
        return [span for span in self.spans[first:last] if span[1] > start]

    def covered(self, start: float, end: float) -> float:
        """The time in [start, end) the spans cover."""
        return union_us((max(s, start), min(e, end)) for s, e, _ in self.overlapping(start, end))


def report(rows: Sequence[tuple[str, StepTime]]) -> str:
    """One column per load: the split, the vLLM scopes, the largest ops."""
    if not rows:
        return "no profiled load"
    width, name = max(12, *(len(label) for label, _ in rows)), 40
    head = f"{'µs/step':<{name}}" + "".join(f"{label:>{width + 2}}" for label, _ in rows)
    lines = [head, f"{'steps':<{name}}" + "".join(f"{t.steps:>{width + 2}}" for _, t in rows)]
    for key in COLUMNS:
        lines.append(f"{key:<{name}}" + "".join(f"{t.us[key]:>{width + 2}.1f}" for _, t in rows))
    for title, attr in (("vLLM scopes", "scopes"), ("largest ops", "top_ops")):
        ops = sorted({op for _, t in rows for op in getattr(t, attr)})
        if ops:
            lines.append(f"{title}:")
            for op in ops:
                lines.append(f"  {op[:name - 2]:<{name - 2}}" + "".join(
                    f"{getattr(t, attr).get(op, 0.0):>{width + 2}.1f}" for _, t in rows))
    lines.append("; ".join(f"{label}: {t.label}" for label, t in rows))
    return "\n".join(lines)
