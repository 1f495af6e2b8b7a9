"""pytest wiring: options, session state, parametrization, baselines and the gate.

Registered from the repository's ``conftest.py``. The fixtures benchmarks use live
in ``fixtures/``; the measuring itself lives in the library modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from . import gate
from .baselines import FingerprintStorage, check_can_save, check_pytest_benchmark, load_history
from .bridge import DEVICE_CLOCK
from .errors import ConfigError, ShapeError
from .gate import summary
from .gate.reference import Baseline, baseline_from_history, label_of, new_cases, why_nothing
from .gate.session import Judgment, assess, conclude
from .gate.settings import add_gate_options, policy_from
from .hardware import Fingerprint, device_spec, fingerprint, measure_cpu_peaks
from .harness import RunContext
from .kernels.mla_select import parse_mla_backends
from .limits import fields_of, format_bytes, memory_limit, oversized
from .model import ModelSpec, load_model_spec
from .moe_routing import RoutingProfileError
from .neighbours import Neighbours, device_key
from .options import choice, float_up_to, fraction_up_to, positive_int, take_negative_values
from .results import check_run, read_entry, record_of, stored_entries, stored_fingerprint
from .runner.fresh import FreshProcesses
from .runner.remeasure import Remeasures, Source
from .runner.settle import Remeasured, describe_round, failures, settle, with_kept
from .shapes import KV_CACHE_DTYPES, DecodeShapes, Sweep, SweepLevel, sweep_for
from .timing import Budget, TimerMode, modes_for_device

__all__ = ["DecodebenchState", "state_of"]

_STATE_KEY = pytest.StashKey["DecodebenchState"]()
_COMPARE_KEY = pytest.StashKey[object]()
REPO_ROOT = Path(__file__).resolve().parent.parent

_CPU_BUDGET = Budget(warmup_ms=10, budget_ms=300, sample_ms=2.0, target_precision=0.01)
_GPU_BUDGET = Budget(warmup_ms=25, budget_ms=2000, sample_ms=0.2, target_precision=0.005)


# --- option parsers: each rejects a bad value with a message naming it -----------------


def _mla_backends(text: str) -> str:
    try:
        return parse_mla_backends(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device_name(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}; use auto, cpu, cuda or cuda:N")


def _cpu_threads(text: str) -> str:
    if text == "all":
        return text
    try:
        threads = positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--cpu-threads {text!r}: use a whole number of 1 or more, or all") from None
    cpus = len(os.sched_getaffinity(0))
    if threads > cpus:  # more threads than CPUs time their own contention
        raise argparse.ArgumentTypeError(f"--cpu-threads {text!r}: this process may use {cpus} CPUs; use at most "
                                         f"{cpus}, or all")
    return str(threads)


def cpu_thread_count(text: str) -> int:
    """The thread count ``--cpu-threads`` names on this machine.

    >>> cpu_thread_count("3"), cpu_thread_count("all") == (os.cpu_count() or 1)
    (3, True)
    """
    return (os.cpu_count() or 1) if text == "all" else int(text)


MOST_VERIFY_TOKENS = 64  # speculative decoding verifies a handful of drafts; 64 is far past any in use


def _verify_tokens(text: str) -> tuple[int, ...]:
    values = tuple(positive_int(part.strip()) for part in text.split(",") if part.strip())
    if any(v > MOST_VERIFY_TOKENS for v in values):
        raise argparse.ArgumentTypeError(f"--verify-tokens {text!r}: at most {MOST_VERIFY_TOKENS} tokens per request "
                                         "(a verification step of K drafts has K + 1)")
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"--verify-tokens {text!r}: a comma list of distinct token counts, e.g. 1,3,5")
    return values


def _kv_cache_dtypes(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [v for v in values if v not in KV_CACHE_DTYPES]
    if unknown or not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"--kv-cache-dtype {text!r}: a comma list of distinct KV-cache dtypes as "
                                         f"vLLM spells them ({', '.join(KV_CACHE_DTYPES)}), e.g. auto,fp8")
    return values


_TIMERS = ("auto",) + tuple(m.value for m in TimerMode)
_SWEEPS = ("auto",) + tuple(s.value for s in SweepLevel)


def pytest_addoption(parser):
    _values_may_start_with_minus(parser)
    group = parser.getgroup("decodebench", "decodebench (decode-path benchmarks)")
    add = group.addoption
    add("--model", metavar="NAME|PATH", default="kimi-k2.5",
        help="Model whose shapes are benchmarked: a bundled name (decodebench/models/) or a config.json path. "
             "Default: %(default)r")
    add("--tp", metavar="N", type=positive_int, default=8,
        help="Tensor-parallel size the per-rank shapes are derived for. Default: %(default)r")
    add("--ep", metavar="N", type=positive_int, default=1,
        help="Expert-parallel size: with N > 1 each of N ranks holds experts/N whole experts, and the MoE "
             "benchmark also times one rank of that layout (its ids carry epN) and the dispatch/combine "
             "benchmark its message sizes; N must divide the routed experts. vLLM runs EP at "
             "--enable-expert-parallel with EP = TP x DP. Default: %(default)r (the experts split by TP only)")
    add("--sweep", metavar="LEVEL", type=choice("sweep level", _SWEEPS), default="auto",
        help="Shape points to visit: smoke, nightly or full; auto is smoke on CPU and nightly on GPU. "
             "Default: %(default)r")
    add("--verify-tokens", metavar="LIST", type=_verify_tokens, default=(1,),
        help="Tokens per request of the steps benchmarked, comma-separated: N > 1 is a speculative verification "
             "step (K + 1 for K draft tokens): the token-wise benchmarks run at M = requests x N (ids m64x3) and "
             "MLA with N causal query tokens per request (ids b64x3), the requests being the sweep's token counts; "
             "1 is the plain decode step; at most 64. E.g. 1,3,5. Default: 1")
    add("--kv-cache-dtype", metavar="LIST", type=_kv_cache_dtypes, default=("auto",),
        help="The latent KV cache's dtypes, comma-separated, as vLLM's --kv-cache-dtype spells them: auto (the "
             "model's, bf16), bfloat16, fp8 (e4m3 on CUDA), fp8_e4m3, fp8_e5m2. The benchmarks of the latent cache "
             "(MLA decode ...) run at each (ids -kvfp8 ...; auto keeps the plain ids); a vLLM backend that does not "
             "take a dtype skips with vLLM's reason. Default: auto")
    add("--device", metavar="DEV", type=_device_name, default="auto",
        help="Device to run kernels on: auto (cuda if present), cpu, cuda or cuda:N. Default: %(default)r")
    add("--cpu-threads", metavar="N|all", type=_cpu_threads, default="1",
        help="Threads of a CPU kernel (torch.set_num_threads); all: one per CPU, as vLLM's CPU worker "
             "runs. One thread is the default because it times the same in every process: on the "
             "2-core CI machine a 2-thread op ran +60%% in 3 of 8 processes for the whole process. "
             "At most the CPUs this process may use. Ignored on CUDA. Default: %(default)r")
    add("--timer", metavar="MODE", type=choice("timer", _TIMERS), default="auto",
        help="How to time kernels: step (CUPTI kernel-only, with the decode step's cache state: weights, "
             "scales and KV cache from memory, activations in L2), kernel (CUPTI kernel-only, the same "
             "tensors call after call), graph (CUDA-graph replay), cold (kernel-only, L2 flushed), events "
             "(CUDA events around eager calls), wall (host clock); auto is step on CUDA and wall on CPU "
             "(collectives: events and graph). "
             "Default: %(default)r")
    add("--budget-ms", metavar="MS", type=float_up_to(3_600_000.0), default=None,
        help="Wall-clock budget for sampling one case, after warm-up. "
             "At most an hour (3600000). Default: 300 on CPU, 2000 on GPU")
    add("--target-precision", metavar="PCT", type=fraction_up_to(0.5), default=None,
        help="Stop sampling once the median's 95%% interval half-width is below this (at most 50%%). "
             "Default: 1%% on CPU, 0.5%% on GPU")
    add("--mla-backends", metavar="WHICH", type=_mla_backends, default="auto",
        help="MLA decode backends: dispatched (torch + the one vLLM's selector picks here), all, or a "
             "comma-separated list of ids (torch, vllm-flash_attn_mla, vllm-flashmla, ...); auto is all "
             "with --sweep full and dispatched otherwise. Default: %(default)r")
    add_gate_options(add)
    add("--gate-remeasure", metavar="WHERE", type=choice("re-measure place", ("fresh", "session")),
        default="fresh",
        help="Where a stored-mode re-measure runs: fresh (a new worker process per round, so a slow or fast "
             "process counts as run-to-run variation) or session (this process: faster to start, blind to "
             "process-level shifts). Default: %(default)r")
    add("--summary-md", metavar="PATH", default=None,
        help="Write the markdown verdict summary here. Default: $GITHUB_STEP_SUMMARY when set, else "
             "beside --benchmark-json (<name>.summary.md), else none")


def _values_may_start_with_minus(parser) -> None:
    """``--gate -5%`` reaches its parser, which names the problem (:func:`take_negative_values`)."""
    optparser = getattr(parser, "optparser", None)  # pytest 9: one argparse parser for the session
    if optparser is not None:
        take_negative_values(optparser)
        return
    build = parser._getparser  # pytest 8 builds it at each parse

    def build_taking_negative_values():
        made = build()
        take_negative_values(made)
        return made

    parser._getparser = build_taking_negative_values


# --- session state ---------------------------------------------------------------------


@dataclass
class DecodebenchState:
    """Everything the options decide, resolved once per session."""

    spec: ModelSpec
    shapes: DecodeShapes
    sweep: Sweep
    device: object  # torch.device
    timer: TimerMode
    budget: Budget
    fingerprint: Fingerprint
    policy: gate.Policy
    gate_threshold: float | None  # --gate: fail on SLOWER beyond it; None: report only
    allow_empty: bool = False
    baseline: Baseline | None = None
    judgment: Judgment | None = None
    selected: int | None = 0  # benchmark items collected (None: interrupted while collecting)
    remeasures: Remeasures = field(default_factory=Remeasures)  # how each case can be measured again
    fresh: FreshProcesses | None = None  # the new processes of stored-mode re-measures (abplugin sets it up)
    ab_mode: bool = False  # --ab-python: verdicts are B against A
    interrupts: InterruptGuard = field(default_factory=lambda: InterruptGuard())
    session: object = None  # the pytest session
    neighbours: Neighbours | None = None  # this session's record on its device, and the others it saw
    other_sessions: list[str] = field(default_factory=list)  # measuring sessions on the device beside this one
    kept: Remeasured = field(default_factory=Remeasured)  # what the re-measures returned, written at storage
    verify_tokens: tuple[int, ...] = (1,)  # --verify-tokens: tokens per request of the steps benchmarked
    collection_errors: list[str] = field(default_factory=list)  # what the model's shapes refused at collection

    @property
    def kv_cache_dtypes(self) -> list[str]:
        """``--kv-cache-dtype``, as vLLM spells each."""
        return [d.spelling for d in self.shapes.kv_cache_dtypes]

    def cases_of(self, factory) -> list:
        """``factory``'s cases at every ``--verify-tokens`` value (each a sweep of its own)."""
        return [case for n in self.verify_tokens
                for case in factory(self.shapes, dataclasses.replace(self.sweep, per_request=n))]

    @functools.cached_property
    def run_context(self) -> RunContext:
        if self.device.type == "cuda":
            spec = device_spec(self.fingerprint.info["gpu"]["name"])
            peaks = spec.peaks if spec else None
        else:
            peaks = measure_cpu_peaks()
        return RunContext(self.device, self.timer, self.budget, peaks)

    def machine_info(self) -> dict:
        return {
            "fingerprint": self.fingerprint.info,
            "model": self.spec.name,
            "tp": self.shapes.tp,
            "ep": self.shapes.ep,
            "sweep": self.sweep.level.value,
            "timer": self.timer.value,
            **({"verify_tokens": list(self.verify_tokens)} if self.verify_tokens != (1,) else {}),
            **({"kv_cache_dtypes": self.kv_cache_dtypes} if self.kv_cache_dtypes != ["auto"] else {}),
        }


def state_of(config) -> DecodebenchState:
    return config.stash[_STATE_KEY]


def _resolve_device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise pytest.UsageError(f"--device {name}: no CUDA device is visible to torch {torch.__version__}")
        device = torch.device(name)
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return torch.device("cpu")


def _build_state(config) -> DecodebenchState:
    opt = config.option
    device = _resolve_device(opt.device)
    if device.type == "cpu":
        import torch

        torch.set_num_threads(cpu_thread_count(opt.cpu_threads))
    try:
        spec = load_model_spec(opt.model)
        shapes = DecodeShapes.for_deployment(spec, opt.tp, ep=opt.ep, kv_cache_dtypes=opt.kv_cache_dtype)
    except (ConfigError, ShapeError) as exc:
        raise pytest.UsageError(f"--model {opt.model} --tp {opt.tp} --ep {opt.ep}: {exc}") from None
    modes = modes_for_device(device)
    timer = modes[0] if opt.timer == "auto" else TimerMode(opt.timer)
    if timer not in modes:
        raise pytest.UsageError(f"--timer {timer.value} needs a CUDA device; on {device} use: "
                                f"{', '.join(m.value for m in modes)}")
    level = opt.sweep if opt.sweep != "auto" else ("nightly" if device.type == "cuda" else "smoke")
    budget = _GPU_BUDGET if device.type == "cuda" else _CPU_BUDGET
    if opt.budget_ms is not None:
        budget = dataclasses.replace(budget, budget_ms=opt.budget_ms)
    if opt.target_precision is not None:
        budget = dataclasses.replace(budget, target_precision=opt.target_precision)
    policy = policy_from(opt)
    return DecodebenchState(spec, shapes, sweep_for(level), device, timer, budget, fingerprint(device), policy,
                            opt.gate, opt.gate_allow_empty, ab_mode=getattr(opt, "ab_python", None) is not None,
                            verify_tokens=opt.verify_tokens, neighbours=Neighbours(device_key(device)))


# --- configure: state first, then key pytest-benchmark's storage by the fingerprint -------


@pytest.hookimpl(tryfirst=True)  # its cleanup (below) then runs after every other plugin's
def pytest_configure(config):
    import pytest_benchmark

    try:
        check_pytest_benchmark(pytest_benchmark.__version__)
    except RuntimeError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.addinivalue_line("markers", "cases(factory=f, parametrize=True): parametrize `case` with "
                            "f(DecodeShapes, Sweep); parametrize=False only names the factory (the module "
                            "parametrizes `case` itself)")
    _check_storage(config.getoption("benchmark_storage", None))
    config.stash[_STATE_KEY] = state = _build_state(config)
    # the guard stays until the very end: pytest collects garbage in its own unconfigure and cleanup, where a
    # second Ctrl-C used to land as a KeyboardInterrupt traceback after the conclusion (a fresh-clone CI run of
    # test_interrupts); cleanups run last-in first-out, and this one is added before pytest's own
    config.add_cleanup(state.interrupts.uninstall)
    # pytest-benchmark configures after this (trylast) and would load --benchmark-compare
    # from its host-keyed folder; hold the option back until the storage is re-keyed.
    config.stash[_COMPARE_KEY] = getattr(config.option, "benchmark_compare", None)
    config.option.benchmark_compare = None


def _check_storage(url: str | None) -> None:
    """Refuse a ``--benchmark-storage`` the gate cannot read, before pytest-benchmark opens it (an
    ``elasticsearch+http://`` one ended in a 36-line INTERNALERROR)."""
    if url and "://" in url and not url.startswith("file://"):
        raise pytest.UsageError(f"--benchmark-storage {url}: decodebench stores and reads results as files "
                                "(file://PATH or a folder); other storages are not supported")


def pytest_sessionstart(session):
    """Point pytest-benchmark's file storage at ``baselines/<fingerprint>/``, then load the comparison."""
    config = session.config
    state = state_of(config)
    wanted_compare = config.option.benchmark_compare = config.stash[_COMPARE_KEY]
    state.session = session
    # SIGTERM and SIGHUP end every session as Ctrl-C does; Ctrl-C itself is taken over only where the
    # session ends with a conclusion, which it then keeps
    state.interrupts.install(sigint=bool(_gating(state) or wanted_compare))
    try:  # the folder of the session records: unwritable, every test erred
        if not config.option.collectonly:
            state.neighbours.check_writable()
    except ValueError as exc:
        raise pytest.UsageError(f"{exc}; nothing was measured") from None
    bench_session = getattr(config, "_benchmarksession", None)
    if bench_session is None or not hasattr(bench_session.storage, "path"):
        return  # pytest-benchmark disabled, or elasticsearch storage: leave it as configured
    root = bench_session.storage.path
    if config.getoption("benchmark_storage") == "file://./.benchmarks":  # pytest-benchmark's default
        root = REPO_ROOT / "baselines"
    key = state.fingerprint.key
    bench_session.machine_id = key
    bench_session.storage = FingerprintStorage(root, logger=bench_session.logger, default_machine_id=key,
                                               session=session)
    check_can_save(bench_session)  # before anything is measured
    bench_session.save_data = True  # the gate compares raw samples, so baselines keep them
    if not wanted_compare:
        return
    try:  # a stored file that cannot be read, or a named one that is no baseline: refused before any work
        _load_baseline(state, bench_session, wanted_compare)
    except ValueError as exc:
        raise pytest.UsageError(f"{exc}; nothing was measured") from None


def _load_baseline(state: DecodebenchState, bench_session, wanted_compare) -> None:
    key = state.fingerprint.key
    if wanted_compare is True:  # the newest readable results of this fingerprint, chosen here
        history = load_history(bench_session.storage.path / key, key)
        state.baseline = baseline_from_history(history, state.policy.history)
        bench_session.compare = str(history.results[-1].path) if history.results else None
        bench_session.handle_loading()
        return
    bench_session.compare = wanted_compare  # a NUM or path the user named: pytest-benchmark finds it
    state.baseline = Baseline(f"--benchmark-compare={wanted_compare}")
    bench_session.handle_loading()
    for path, mapping in bench_session.compared_mapping.items():
        state.baseline.source = str(path)
        state.baseline.add(label_of(Path(path)), mapping.values(), path)
    state.baseline.skipped = (*getattr(bench_session.storage, "skipped", ()), *state.baseline.skipped)
    if not bench_session.compared_mapping:
        state.baseline.problem = f"--benchmark-compare={wanted_compare}: no readable stored result matches"


def pytest_report_header(config):
    state = state_of(config)
    bench_session = getattr(config, "_benchmarksession", None)
    where = getattr(getattr(bench_session, "storage", None), "path", None)
    return [
        f"decodebench: model={state.spec.name} tp={state.shapes.tp} ep={state.shapes.ep} "
        f"sweep={state.sweep.level.value} "
        f"device={state.device} timer={state.timer.value}",
        f"decodebench: fingerprint={state.fingerprint.key}"
        + (f" baselines={where}/{state.fingerprint.key}" if where else ""),
    ]


def pytest_benchmark_update_machine_info(config, machine_info):
    state = state_of(config)
    machine_info["decodebench"] = state.machine_info()
    why = _interrupted_by(state)
    if why:  # a partial run: stored for the record, never a baseline (decodebench.results.interrupted_by)
        machine_info["decodebench"]["interrupted"] = why


def _interrupted_by(state: DecodebenchState) -> str | None:
    """What interrupted this session (``SIGTERM``, ``SIGINT``), or None."""
    if state.interrupts.name:
        return state.interrupts.name
    session = state.session
    return "SIGINT" if session is not None and session.exitstatus == pytest.ExitCode.INTERRUPTED else None


def pytest_benchmark_compare_machine_info(config, benchmarksession, machine_info, compared_benchmark):
    state = state_of(config)
    theirs = stored_fingerprint(compared_benchmark)
    if theirs == state.fingerprint.key:
        return
    message = (f"baseline measured on {theirs or 'an unknown machine (no decodebench fingerprint)'}, "
               f"this run is {state.fingerprint.key}: timings are not comparable")
    if state.baseline is not None:
        state.baseline.problem = message
    benchmarksession.compare_fail = []


# --- parametrization and collection ------------------------------------------------------


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("cases")
    if marker is None or "case" not in metafunc.fixturenames or marker.kwargs.get("parametrize") is False:
        return
    state = state_of(metafunc.config)
    try:
        cases = state.cases_of(marker.kwargs["factory"])
    except (ConfigError, ShapeError, RoutingProfileError) as exc:  # a usage error once collection ends
        state.collection_errors.append(f"{metafunc.definition.nodeid}: {exc}")
        cases = []
    metafunc.parametrize("case", [_skip_if_not_applicable(c) for c in cases], ids=[c.id for c in cases])


def _skip_if_not_applicable(case):
    """A case that states why it does not apply to this model skips before its fixtures start (a process
    group, a server)."""
    reason = getattr(case, "not_applicable", None)
    return pytest.param(case, marks=pytest.mark.skip(reason=reason)) if isinstance(reason, str) else case


def pytest_collection_finish(session):
    """How many benchmark cases the session selected (after -k and the like): an interrupted
    gate says how many of them it judged. A model tensor a selected benchmark allocates whole, or a
    selected case whose least traffic (its inputs and outputs), beyond the device's memory is a usage
    error before anything is allocated."""
    state = state_of(session.config)
    if state.interrupts.count:  # interrupted while collecting (pytest still calls this): no selection yet
        state.selected = None
        return
    state.selected = sum("device_benchmark" in getattr(i, "fixturenames", ()) for i in session.items)
    cases = [(item, item.callspec.params["case"]) for item in session.items
             if "case" in getattr(getattr(item, "callspec", None), "params", {})]
    sized = [(item, case.traffic().bytes) for item, case in cases if callable(getattr(case, "traffic", None))]
    if not sized:
        return
    limit, opt = memory_limit(state.device), session.config.option
    too_large = oversized(state.shapes, limit, frozenset(getattr(case, "component", "") for _, case in cases))
    if too_large:  # the model's largest tensor a selected benchmark allocates whole
        raise pytest.UsageError(f"--model {opt.model} --tp {opt.tp} on {state.device}: {too_large}")
    item, need = max(sized, key=lambda pair: pair[1])
    if need > limit.bytes:
        shape = item.callspec.params["case"].shape()
        field = fields_of(state.spec, shape)
        raise pytest.UsageError(f"{item.nodeid}: its inputs and outputs take at least {format_bytes(need)} "
                                f"(shape {shape}{'; ' + field if field else ''}), more than {limit.what}; "
                                "deselect it or use a smaller model (--model) or a larger --tp")


def pytest_runtest_setup(item):
    """A session that measures says so to the other sessions of its device (:mod:`decodebench.neighbours`)."""
    state = item.config.stash.get(_STATE_KEY, None)
    if state is not None and state.neighbours is not None and "device_benchmark" in getattr(item, "fixturenames", ()):
        state.neighbours.enter()


def _see_neighbours(state: DecodebenchState) -> None:
    """The measuring sessions that overlapped this one on its device (docs/stored-results.md), looked for
    at every judgment; once seen, a session stays named (``pid 42 (running)``, later ``pid 42 (ended)``)."""
    seen = state.neighbours.seen() if state.neighbours is not None else []
    by_pid = {other.split(" (")[0]: other for other in [*state.other_sessions, *seen]}
    state.other_sessions = list(by_pid.values())


@pytest.hookimpl(tryfirst=True)  # before -k deselects: the model is wrong whatever is selected
def pytest_collection_modifyitems(config, items):
    state = state_of(config)
    if state.collection_errors:
        opt = config.option
        raise pytest.UsageError(f"--model {opt.model} --tp {opt.tp} --ep {opt.ep}: "
                                + "; ".join(state.collection_errors))
    for item in items:
        if "device_benchmark" not in getattr(item, "fixturenames", ()):
            continue
        existing = item.get_closest_marker("benchmark")
        kwargs = dict(existing.kwargs) if existing else {}
        kwargs["timer"] = DEVICE_CLOCK
        case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
        component = getattr(case, "component", None)  # an empty factory leaves pytest's NOTSET here
        if component is not None and "group" not in kwargs:
            kwargs["group"] = component
        item.add_marker(pytest.mark.benchmark(**kwargs), append=False)


# --- Ctrl-C ------------------------------------------------------------------------------------


class InterruptGuard:
    """Ctrl-C, SIGTERM and SIGHUP in a session (docs/gate.md, The conclusion). The first raises
    KeyboardInterrupt where it lands; later ones, and any once the verdicts are in, only count (a second
    Ctrl-C used to land in pytest's handling of the first and leave no conclusion). Ctrl-C is taken only
    in a session that concludes (``install(sigint=...)``); a signal ignored at the start stays ignored."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.count = 0
        self.raising = True
        self.name: str | None = None  # the first signal's name
        self._previous: dict[int, object] = {}

    def install(self, sigint: bool = True) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.SIGNALS:
            previous = signal.getsignal(signum)
            if signum in self._previous or previous is signal.SIG_IGN or (
                    signum == signal.SIGINT and not (sigint and callable(previous))):
                continue
            self._previous[signum] = previous  # SIGINT: pytest's, Python's default raising KeyboardInterrupt
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.count += 1
        self.name = self.name or signal.Signals(signum).name
        if self.raising:
            self.raising = False
            previous = self._previous.get(signum)
            if signum == signal.SIGINT and callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt(self.name)
        elif self.count == 2:
            print("\ndecodebench: interrupted; stopping the workers and concluding", file=sys.stderr, flush=True)

    def uninstall(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            self._previous.clear()


@pytest.hookimpl(tryfirst=True)  # before the terminal reporter formats the traceback
def pytest_keyboard_interrupt(excinfo):
    seen, exc = set(), excinfo.value  # its traceback is excinfo.tb
    while exc is not None and id(exc) not in seen:  # and the exceptions it was raised from or during
        seen.add(id(exc))
        number_lineless_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def number_lineless_frames(tb) -> int:
    """Give every entry of a traceback a line number; how many had none.

    On Python 3.11 a Ctrl-C that lands on an instruction without a source location leaves a
    traceback entry whose ``tb_lineno`` is None, and pytest's report of the KeyboardInterrupt
    then dies in ``TracebackEntry.lineno`` (None - 1) with a traceback after the gate's
    conclusion (seen once in a fresh-clone CI run of ``test_interrupts``). Such an entry is
    replaced by one pointing at its function's first line; the head (pytest's own frame, where
    the interrupt is caught) always has a line."""
    fixed = 0
    while tb is not None and tb.tb_next is not None:
        entry = tb.tb_next
        if entry.tb_lineno is None:
            # no instruction (-1): the traceback module then reads the line we give
            entry = types.TracebackType(entry.tb_next, entry.tb_frame, -1, entry.tb_frame.f_code.co_firstlineno)
            tb.tb_next = entry
            fixed += 1
        tb = entry
    return fixed


# --- the gate: the plugin only wires the runner (decodebench.runner) to the judge (decodebench.gate) ------


def _ran(bench_session) -> list:
    return [b for b in bench_session.benchmarks if b and not getattr(b, "skipped", False) and not b.has_error]


def _cases(state: DecodebenchState, benches: list) -> list[gate.CaseInput]:
    """The session's cases as they stand: each benchmark's record (marked with the other sessions on
    its device) and, in stored mode, its stored records."""
    documents = {b.fullname: b.as_dict(include_data=True) for b in benches}
    records = {name: dataclasses.replace(read_entry(d), other_sessions=tuple(state.other_sessions))
               for name, d in documents.items()}
    if state.ab_mode:
        return [gate.CaseInput(name, r) for name, r in records.items() if record_of(documents[name]).paired is not None]
    if state.baseline is None or state.baseline.problem:
        return []
    state.baseline.drop_copies_of(records, "this session")  # a stored copy of this run is not its baseline
    return [gate.CaseInput(name, r, tuple(state.baseline.entries[name]))
            for name, r in records.items() if state.baseline.entries.get(name)]


def _remeasurers(state: DecodebenchState, benches: list) -> dict:
    """Node id -> what :func:`~decodebench.runner.settle.settle` calls for one more run of the
    benchmark (A/B: one fresh pair's rounds), checked."""
    measure = _rounds if state.ab_mode else _run
    return {b.fullname: functools.partial(measure, b, source) for b in benches
            if (source := state.remeasures.source(b.fullname)) is not None}


def _run(bench, source: Source):
    run = source.measure()
    check_run(f"{bench.fullname}, re-measured", run.samples, run.kernels)
    return run


def _rounds(bench, source: Source):
    rounds = source.measure()
    check_run(f"{bench.fullname}, re-measured", [s for r in (*rounds.runs_a, *rounds.runs_b) for s in r])
    return rounds


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config, benchmarks, output_json):
    """What the session added to its entries, written as pytest-benchmark stores them (a saved run and
    ``--benchmark-json`` alike): re-measured runs or rounds, the other sessions on the device, the verdicts
    (:func:`decodebench.results.stored_entry`)."""
    state = config.stash.get(_STATE_KEY, None)
    if state is None:
        return
    verdicts = {v.name: v.record() for v in state.judgment.verdicts} if state.judgment is not None else {}
    output_json["benchmarks"] = stored_entries(output_json["benchmarks"], lambda name: _added(state, name, verdicts))


def _added(state: DecodebenchState, name: str, verdicts: dict) -> dict:
    """What the session added to case ``name``: its re-measured runs (A/B: rounds), the other sessions, its verdict."""
    measured = state.kept.runs.get(name, ())
    source = state.remeasures.source(name) if measured and not state.ab_mode else None
    return {"runs": () if state.ab_mode else measured, "rounds": measured if state.ab_mode else (),
            "where": source.where if source is not None else None, "other_sessions": state.other_sessions,
            "gate": verdicts.get(name)}


def _announce(config):
    """Print a re-measure round's line as it starts: the end of a session otherwise goes silent."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    rounds = state_of(config).policy.resamples
    return lambda number, todo: reporter and reporter.write_line(describe_round(number, rounds, todo))


def _judge(session, interrupted: bool) -> Judgment:
    state = state_of(session.config)
    bench_session = getattr(session.config, "_benchmarksession", None)
    benches = _ran(bench_session) if bench_session else []
    by_name = {b.fullname: b for b in benches}
    prediction = state.baseline.records() if state.baseline and not state.baseline.problem else ()
    notes = {}

    def cases_now() -> list[gate.CaseInput]:  # the other sessions are looked for at every judgment
        _see_neighbours(state)
        return _cases(state, benches)

    if not interrupted:  # interrupted: judge what ran, re-measure nothing (the workers may be gone)
        notes = failures(settle(cases_now, _remeasurers(state, benches), state.policy, state.remeasures.end_round,
                                _announce(session.config), state.kept))  # an interrupt keeps the runs it let finish
    judgment = assess(with_kept(cases_now(), state.kept), state.policy, shapes=state.shapes,
                      prediction_entries=prediction, notes=notes)
    new = [] if state.ab_mode else new_cases(state.baseline, by_name)
    judgment.conclusion = conclude(judgment.verdicts, judgment.steps, state.policy, gate=state.gate_threshold,
                                   allow_empty=state.allow_empty,
                                   nothing_why=_why_nothing(state, len(benches), judgment.verdicts, new),
                                   selected=state.selected, interrupted=interrupted, signal=state.interrupts.name,
                                   new=new)
    if state.other_sessions:
        judgment.conclusion = dataclasses.replace(judgment.conclusion, line=judgment.conclusion.line + (
            f"; measured beside another session on this device ({', '.join(state.other_sessions)}): "
            "no case called SLOWER or FASTER, the results marked"))
    return judgment


def _why_nothing(state: DecodebenchState, ran: int, verdicts, new: list[str]) -> str:
    if state.ab_mode:
        return f"no case ran on both sides ({ran} benchmarks ran; all skipped, failed or deselected?)"
    return why_nothing(state.baseline, ran, [v.name for v in verdicts], [v.reason for v in verdicts], new)


def _gating(state: DecodebenchState) -> bool:
    """Whether this session has verdicts to give: a baseline, an A/B run, or a gate asked for."""
    return state.ab_mode or state.baseline is not None or state.gate_threshold is not None \
        or state.policy.step_threshold is not None


# Outermost wrapper, work done before it yields: before pytest-benchmark saves (its storage hook,
# above, writes the re-measured runs and the verdicts) and before the terminal reporter prints the summary.
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    state = state_of(session.config)
    _see_neighbours(state)
    if _gating(state):
        state.session = session
        guard = state.interrupts
        interrupted = guard.count > 0 or exitstatus == pytest.ExitCode.INTERRUPTED or bool(session.shouldstop)
        try:
            state.judgment = _judge(session, interrupted)
        except KeyboardInterrupt:  # while re-measuring: judge what is in, re-measure nothing
            state.judgment = _judge(session, True)
        guard.raising = False  # the verdicts are in: a Ctrl-C from here on only counts
        _fail_if(session, state.judgment.conclusion)
    yield


def _fail_if(session, conclusion) -> None:
    if conclusion.interrupted and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.INTERRUPTED
    elif conclusion.failed and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _interrupted_late(state: DecodebenchState) -> None:
    """A Ctrl-C that came after the verdicts (while saving or printing): the session still ends
    saying it was interrupted, with the cases it judged."""
    judgment = state.judgment
    if state.interrupts.count and not judgment.conclusion.interrupted:
        judgment.conclusion = conclude(judgment.verdicts, judgment.steps, state.policy, gate=state.gate_threshold,
                                       allow_empty=state.allow_empty, nothing_why="", selected=state.selected,
                                       interrupted=True, signal=state.interrupts.name)
        if state.session is not None:
            _fail_if(state.session, judgment.conclusion)


def pytest_unconfigure(config):
    state = config.stash.get(_STATE_KEY, None)
    if state is not None and state.neighbours is not None:
        state.neighbours.leave()


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's tables
def pytest_terminal_summary(terminalreporter):
    state = state_of(terminalreporter.config)
    if state.other_sessions:
        terminalreporter.write_line(
            f"decodebench: another session measured on this device during this run "
            f"({', '.join(state.other_sessions)}): its load is in these timings; the results are marked, and never "
            "SLOWER or FASTER", yellow=True)
    judgment = state.judgment
    if judgment is None:
        return
    _interrupted_late(state)
    write = terminalreporter.write_line
    title = "decodebench verdicts (A/B: B against A)" if state.ab_mode else "decodebench verdicts against the baseline"
    terminalreporter.section(title)
    for skipped in state.baseline.skipped if state.baseline and not state.ab_mode else ():
        write(f"skipped stored result: {skipped}", yellow=True)
    conclusion = judgment.conclusion
    for line in judgment.lines(state.policy)[:-1]:
        write(line, red=line.startswith(("SLOWER", "STEP SLOWER")), green=line.startswith("FASTER"))
    write(conclusion.line, red=conclusion.failed, green=not conclusion.failed and conclusion.compared > 0,
          yellow=conclusion.compared == 0, bold=True)
    target = summary.summary_target(terminalreporter.config)
    if target is not None:
        text = summary.markdown_summary(judgment.verdicts, conclusion.line,
                                        summary.artifact_links(terminalreporter.config), judgment.steps)
        summary.write_summary(target, text)
        write(f"decodebench: markdown summary in {target}")
