"""One rank's profiler trace (Chrome trace JSON, optionally gzipped) read as data.

vLLM's torch profiler writes one ``...rank<r>.<id>.pt.trace.json[.gz]`` per worker and window.
From it we keep the **step marks** (the worker's ``execute_context_<n>(<tokens>)_generation_<n>(<tokens>)``
annotations: how many requests were in prefill and in decode in that step) and the **kernels**
(device events on a GPU trace, each CPU op's self time on a CPU-only one), as
docs/attribution.md ("Steps, kernels, busy and idle") defines them.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Kernel", "RankTrace", "StepMark", "TraceError", "load_events", "load_trace", "rank_of", "step_annotation",
           "trace_files"]

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
_STEP = re.compile(r"^execute_(?:\d+_)?context_(\d+)\((?:sq)?(\d+)[^)]*\)_generation_(\d+)\((?:sq)?(\d+)")
COMPILED_REGION = "CompiledFxGraph"  # torch.compile's annotation around an inductor graph call
_RANK = re.compile(r"rank(\d+)\.")


class TraceError(ValueError):
    """A trace that cannot be read as a decode-step trace (the message says why)."""


@dataclass(frozen=True)
class Kernel:
    """One kernel (or leaf CPU op): times in µs on the trace's clock."""

    name: str
    start_us: float
    dur_us: float
    launch_us: float  # CPU time of the launch (the op's own start on a CPU trace)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class StepMark:
    """A model step as the worker annotated it: when it began and what its batch held."""

    start_us: float
    label: str
    context_requests: int
    context_tokens: int
    generation_requests: int
    generation_tokens: int

    @property
    def is_decode(self) -> bool:
        """Only requests past their prefill, one new token each."""
        return self.context_requests == 0 and self.generation_tokens == self.generation_requests > 0


@dataclass(frozen=True)
class RankTrace:
    path: Path
    rank: int
    on_device: bool  # kernels are GPU kernels (else leaf CPU ops)
    steps: tuple[StepMark, ...]
    kernels: tuple[Kernel, ...]


def rank_of(path: Path) -> int:
    """The global rank in a vLLM worker trace's file name (0 when it names none).

    >>> rank_of(Path("dp0_pp0_tp1_dcp0_ep0_rank1.1764.pt.trace.json.gz"))
    1
    """
    match = _RANK.search(path.name)
    return int(match.group(1)) if match else 0


def trace_files(directory: Path) -> set[Path]:
    """The worker traces in ``directory`` (front-end ``async_llm`` traces hold no kernels and are left out)."""
    return {p for p in Path(directory).glob("*.pt.trace.json*") if "async_llm" not in p.name}


def load_trace(path: Path) -> RankTrace:
    """Read one worker trace; raises :class:`TraceError` if it has no step marks or no kernels.

    Example::

        trace = load_trace(Path("/tmp/vtrace/dp0_pp0_tp0_dcp0_ep0_rank0.1764.pt.trace.json.gz"))
        len(trace.steps), trace.kernels[0].name
    """
    events = _events(path)
    steps = _step_marks(events)
    if not steps:
        raise TraceError(f"{path}: no step annotations (execute_context_..._generation_...); was the profiler "
                         "recording CPU activity, and did any model step run in the window?")
    on_device = any(e.get("cat") in DEVICE_CATS for e in events)
    kernels = _device_kernels(events) if on_device else _self_time_ops(events, _step_thread(events))
    if not kernels:
        raise TraceError(f"{path}: no kernels or ops in the trace")
    return RankTrace(Path(path), rank_of(Path(path)), on_device, steps, kernels)


def load_events(path: Path) -> list[dict]:
    """The complete events (``"ph": "X"``, with a duration) of a Chrome trace; :class:`TraceError` if unreadable."""
    return _events(path)


def step_annotation(event: dict) -> StepMark | None:
    """The step mark an event is, or None (any event with a ``name``; its ``ts`` where it has one).

    >>> step_annotation({"name": "execute_context_0(0)_generation_4(20)", "ts": 5}).generation_tokens
    20
    >>> step_annotation({"name": "gpu_model_runner: draft"}) is None
    True
    """
    match = _STEP.match(event.get("name", ""))
    if not match or event.get("cat", "user_annotation") != "user_annotation":
        return None
    ctx, ctx_tok, gen, gen_tok = map(int, match.groups())
    return StepMark(float(event.get("ts", 0.0)), event["name"], ctx, ctx_tok, gen, gen_tok)


def _events(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError, EOFError, RecursionError) as exc:  # RecursionError: nested past the parser
        raise TraceError(f"{path}: not a readable Chrome trace ({exc})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{path}: no traceEvents list")
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]
    for event in complete:
        problem = _malformed(event)
        if problem:
            name = event.get("name")
            shown = repr(name[:80] + "…" if isinstance(name, str) and len(name) > 80 else name)
            raise TraceError(f"{path}: event {shown}: {problem}; a profiler does not write that")
    return complete


def _malformed(event: dict) -> str | None:
    """What makes a complete event unusable (a time that is not a finite number, a negative duration, a
    name or args of the wrong type), or None.

    >>> _malformed({"name": "k", "ts": 5.0, "dur": -2})
    'dur -2 is negative'
    >>> _malformed({"name": "k", "ts": 5.0, "dur": 2, "args": {}}) is None
    True
    """
    for key in ("ts", "dur"):
        value = event.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{key} {value!r} is not a finite number of µs"
    if event["dur"] < 0:
        return f"dur {event['dur']!r} is negative"
    if not isinstance(event.get("name", ""), str) or not isinstance(event.get("args", {}), dict):
        return "its name is not a string or its args not an object"
    return None


def _step_marks(events: list[dict]) -> tuple[StepMark, ...]:
    marks = [mark for mark in map(step_annotation, events) if mark is not None]
    return tuple(sorted(marks, key=lambda m: m.start_us))


def _step_thread(events: list[dict]) -> tuple[object, object]:
    for event in events:
        if event.get("cat") == "user_annotation" and _STEP.match(event.get("name", "")):
            return event.get("pid"), event.get("tid")
    raise TraceError("no step annotation")


def _device_kernels(events: list[dict]) -> tuple[Kernel, ...]:
    launches = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    kernels = []
    for e in events:
        if e.get("cat") in DEVICE_CATS:
            start = float(e["ts"])
            launch = launches.get(e.get("args", {}).get("correlation"), start)
            kernels.append(Kernel(e.get("name", "?"), start, float(e["dur"]), launch))
    return tuple(sorted(kernels, key=lambda k: k.start_us))


def _self_time_ops(events: list[dict], thread: tuple[object, object]) -> tuple[Kernel, ...]:
    """The self time of every CPU op of ``thread``: each op minus the ops nested in it, as pieces.

    An op's name stays on the time it spends itself (``aten::addmm``'s GEMM), not on the
    bookkeeping ops it calls; the pieces never overlap and add up to the top-level ops.
    Inductor-compiled regions count as one op each (their generated code calls no ops).
    """
    ops = sorted((e for e in events if _is_op(e) and (e.get("pid"), e.get("tid")) == thread),
                 key=lambda e: (float(e["ts"]), -float(e["dur"])))
    pieces: list[Kernel] = []
    stack: list[list] = []  # [name, end, cursor] of the ops that contain the current time

    def close_until(t: float) -> None:
        while stack and stack[-1][1] <= t:
            name, end, cursor = stack.pop()
            _add_piece(pieces, name, cursor, end)
            if stack:
                stack[-1][2] = end

    for op in ops:
        start, end = float(op["ts"]), float(op["ts"]) + float(op["dur"])
        close_until(start)
        if stack:
            _add_piece(pieces, stack[-1][0], stack[-1][2], start)
            end = min(end, stack[-1][1])
        stack.append([op.get("name", "?"), end, start])
    close_until(float("inf"))
    return tuple(sorted(pieces, key=lambda k: k.start_us))


def _is_op(event: dict) -> bool:
    cat = event.get("cat")
    return cat == "cpu_op" or (cat == "user_annotation" and COMPILED_REGION in event.get("name", ""))


def _add_piece(pieces: list[Kernel], name: str, start: float, end: float) -> None:
    if end > start:
        pieces.append(Kernel(name, start, end - start, start))
