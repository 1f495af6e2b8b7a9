"""A measuring process: one side of an A/B run, or a fresh-process re-measure of the gate, started by
:class:`decodebench.runner.ab.Worker` with this checkout's ``decodebench`` and the interpreter's own
torch and vLLM. It keeps the cases it prepared (:data:`KEEP` at most, the least recently used going
first). One JSON request per line on stdin, one reply per line on stdout (which the protocol has to
itself: whatever a kernel library prints goes to stderr); any failure is replied as ``{"error": traceback}``:

* ``{"op": "setup", "session": {...}}`` -> versions of this side's torch and vLLM;
* ``{"op": "prepare", "case": {...}}``  -> rebuild the case from its factory, check it against the
  reference, keep it; ``{"ok": ...}``, ``{"skip": reason}`` or ``{"mismatch": message}``;
* ``{"op": "measure", "case": ID, "budget_ms": B}`` -> ``samples`` of a kept case, or ``{"gone": ID}``;
* ``{"op": "drop", "case": ID}`` -> forget a case (its tensors go);
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import traceback
from collections import OrderedDict

from ..errors import BackendUnavailable, KernelMismatch
from ..hardware import vllm_version
from ..harness import RunContext, measure_prepared, prepare_kernel_case
from ..inject import Injection
from ..model import load_model_spec
from ..shapes import DecodeShapes, sweep_for
from ..timing import Budget, TimerMode

__all__ = ["main", "session_context"]


def session_context(session: dict) -> RunContext:
    """The :class:`RunContext` a ``setup`` request describes.

    >>> ctx = session_context({"device": "cpu", "timer": "wall", "budget": {"budget_ms": 50}})
    >>> ctx.timer, ctx.budget.budget_ms, ctx.injection
    (<TimerMode.WALL: 'wall'>, 50, None)
    """
    import torch

    injection = session.get("injection")
    if session["device"] == "cpu" and session.get("cpu_threads"):
        torch.set_num_threads(session["cpu_threads"])
    return RunContext(
        device=torch.device(session["device"]),
        timer=TimerMode(session["timer"]),
        budget=Budget(**session["budget"]),
        peaks=None,
        injection=Injection(injection["fraction"], tuple(injection["only"])) if injection else None,
    )


def _find_case(session: dict, request: dict):
    module, _, name = request["factory"].partition(":")
    factory = getattr(importlib.import_module(module), name)
    shapes = DecodeShapes.for_deployment(load_model_spec(session["model"]), session["tp"], ep=session.get("ep", 1),
                                         kv_cache_dtypes=tuple(session.get("kv_cache_dtypes", ["auto"])))
    for per_request in session.get("per_request", [1]):  # --verify-tokens
        for case in factory(shapes, sweep_for(session["sweep"], per_request)):
            if case.id == request["case_id"]:
                return case
    raise LookupError(f"{request['factory']} has no case {request['case_id']!r} for this model, tp and sweep")


KEEP = 8  # prepared cases a worker holds (an MLA case can hold GiBs of KV cache)


class _Side:
    def __init__(self) -> None:
        self.session: dict | None = None
        self.ctx: RunContext | None = None
        self.kept: OrderedDict[str, tuple] = OrderedDict()  # test id -> (case, prepared)

    def setup(self, message: dict) -> dict:
        import torch

        self.session, self.ctx = message["session"], session_context(message["session"])
        return {"ok": True, "python": sys.executable, "pid": os.getpid(), "torch": torch.__version__,
                "vllm": vllm_version()}

    def prepare(self, message: dict) -> dict:
        request = message["case"]
        case = _find_case(self.session, request).for_backend(request["backend"])
        self.kept.pop(request["test_id"], None)
        try:
            prepared = prepare_kernel_case(case, request["backend"], self.ctx, request["test_id"])
        except BackendUnavailable as exc:
            return {"skip": str(exc)}
        except KernelMismatch as exc:
            return {"mismatch": str(exc)}
        self.kept[request["test_id"]] = (case, prepared)
        while len(self.kept) > KEEP:
            self.kept.popitem(last=False)
        return {"ok": True, "extra": prepared.extra}

    def measure(self, message: dict) -> dict:
        if message["case"] not in self.kept:
            return {"gone": message["case"]}
        self.kept.move_to_end(message["case"])
        case, prepared = self.kept[message["case"]]
        measurement, extra = measure_prepared(prepared, case.traffic(), self.ctx, message["budget_ms"])
        return {"samples": list(measurement.samples), "extra": extra}

    def drop(self, message: dict) -> dict:
        self.kept.pop(message["case"], None)
        return {"ok": True}


def _answer(side: _Side, message: dict) -> dict:
    handler = {"setup": side.setup, "prepare": side.prepare, "measure": side.measure, "drop": side.drop}.get(
        message.get("op"))
    if handler is None:
        return {"error": f"unknown request {message.get('op')!r}"}
    try:
        return handler(message)
    except Exception:
        return {"error": traceback.format_exc()}


def main() -> None:
    """Serve requests on stdin until ``quit`` or end of input."""
    # Ctrl-C in a terminal reaches every process of its group: the session that started this
    # worker decides what an interrupt means, and stops it (quit, end of input, SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # kernel libraries printing cannot corrupt replies
    side = _Side()
    for line in sys.stdin:
        message = json.loads(line)
        if message.get("op") == "quit":
            break
        protocol.write(json.dumps(_answer(side, message), default=str) + "\n")


if __name__ == "__main__":
    main()

