"""What bounds a decode kernel at per-rank sizes, and a kernel's time moved to another GPU by it.

A kernel result is re-timed for another GPU (or another cache state) from six things, each a
parameter of :class:`RuleParams` fitted on one GPU's own results (:func:`fit`) and each a row of
the fitted file that says which case or files set it:

* ``floor_us``, a **latency floor** per kernel launch: the fastest kernel measured (a call of
  ``k`` kernels takes at least ``k`` floors, however little it moves);
* ``dram_fraction``, the **achievable DRAM bandwidth** as a fraction of the datasheet's: the
  fastest rate of a case timed warm whose working set is over 4 L2 sizes (every byte from DRAM);
* ``l2_bytes_per_sm_cycle``, the **L2 bandwidth**, per SM and SM clock cycle so that it moves to a
  GPU of another SM count and clock: the fastest rate a case that fits in L2 reached, timed warm;
* ``beta``, how the part of a kernel's time that its modelled traffic ``w`` (below) does not
  explain scales when ``w`` moves: by ``(w_there / w_here) ** beta``. 0 keeps it as it is
  (latency: too few bytes in flight, a serial chain, a split-K reduction), 1 scales it with the
  traffic (the kernel keeps its fraction of the achievable bound). :func:`fit` sets 0: where the
  GPU's results hold two cache states of the same cases (``kernel`` and ``step`` timers), what they
  would pick is written beside it, not used (:func:`_beta` says why);
* ``sm_bytes_per_cycle``, per component, an **SM-throughput bound**: the bytes per SM per SM cycle
  its cases reach where DRAM does not bound them (DRAM time under half their time above the floor),
  the 90th percentile. A time bound by it scales with ``1 / (SMs × SM clock)``: the same on an H100
  SXM and an H200 (132 SMs at 1980 MHz both), which is what the Marlin MoE does at M ≥ 64. It holds
  for a case only where the case, measured here, did not move its bytes faster than it allows
  (:func:`sm_bounded`): a long-context MLA that outran it is bound by DRAM, not by it;
* ``moe_overlap``, the **fused MoE's overlap share** ``k``: its time above the floor is
  ``s + m - k min(s, m)`` (``m`` its memory time, ``s`` its SM time), read from the GPU's
  ``sm_count.py`` runs (:mod:`.sm_count`), None without them.

The traffic time ``w`` of a case on a GPU is the largest of: the bytes served from DRAM over the
achievable DRAM bandwidth; all the bytes over the L2 bandwidth (what DRAM serves passes through
L2 too); all the bytes over the component's SM throughput, where it holds; and the compute, bf16
tensor FLOPs over the datasheet's dense bf16 peak plus, for the W4A16 MoE, the INT4 → bf16
dequantisation (one CUDA-core op per weight, at ``SMs × 128 lanes × 2 × clock``), with Marlin's
tokens per expert padded to its 16-row tile. Which bytes come from DRAM follows the timer's cache
state: ``kernel`` (the same tensors again and again) reads nothing from DRAM where the working set
fits in L2 and everything where it does not (a repeated stream longer than the cache evicts each line
before its reuse: on the lent H100 every case over its 50 MiB L2 took the same time with the ``kernel``
and the ``step`` timer: 76 cases, median 0.0 %, all within 5 %, docs/projection.md); ``step`` (a
decode step: weights, scales and the KV cache from DRAM, activations from L2); ``cold`` (nothing in
L2). The L2 size is the one the result's machine reported (60 MiB on the lent H200, whose datasheet
says 50 MB), else the table below (128 MiB on the RTX PRO 6000); the SM clock is the median NVML
reported before the cases ran, else the table's boost clock.

A case measured at ``t`` here is then, there::

    t_there = floor + w_there + (t - floor - w_here) * (w_there / w_here) ** beta

(and ``floor + (t - floor) * w_there / w_here`` for a kernel faster than its model here: the rates
are 90th percentiles, so a tenth of the cases beat them), never faster than its modelled traffic
there unless it beat it here, and equal to ``t`` where nothing that bounds it differs
(an L2-resident kernel between an H100 and an H200: same die, same L2, same clocks). The fused MoE,
where ``moe_overlap`` is known, is re-timed by :func:`overlapped` instead: ``s`` read back from ``t``
and kept (scaled by the SMs and clock), ``m`` the memory time there.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...files import read_json
from ...hardware import device_spec
from ...registry import RegistryError, get
from ...results import Result, median_sm_clock_hz, read_file
from . import sm_count

__all__ = ["CACHE_STATES", "DEVICE_FACTS", "Case", "DeviceFacts", "DeviceModel", "RuleParams", "device_facts",
           "beta_pick", "fit", "load_cases", "load_params", "moe_timing", "project_case", "traffic_us",
           "with_moe_overlap"]

# The decode step's error of the rule between two GPUs at hand (projected / measured - 1, the lowest and
# the highest over both directions of the five same-code H200/H100 pairs and M = 1, 64, 256; each GPU's
# fit with its sm_count.py runs): the crosscheck.json of each pair that the projection report listed in
# docs/validation.md shows, from which the evidence's own checks recompute it.
MEASURED_STEP_ERROR = (-0.0169, 0.0277)
MEASURED_STEP_ERROR_SOURCE = "H200 SXM <-> H100 SXM, five pairs, M = 1, 64, 256: docs/validation.md"

# timer -> the cache state it times: the whole working set warm, the decode step's, or nothing in L2
CACHE_STATES = {"kernel": "warm", "graph": "warm", "events": "warm", "step": "step", "cold": "cold"}
MARLIN_TILE_ROWS = 16  # Marlin's MMA tile: a expert's tokens are padded to 16 rows
ALU_LANES_PER_SM = 128  # FP32/INT32 lanes per SM on Hopper (SM90) and Blackwell (SM120)


@dataclass(frozen=True)
class DeviceFacts:
    """What the rule reads of a GPU: datasheet DRAM bandwidth and bf16 peak, L2 size, SMs and clock."""

    name: str
    dram_bytes_per_s: float
    bf16_flops: float
    l2_bytes: int
    sms: int
    sm_clock_hz: float
    source: str

    @property
    def alu_ops_per_s(self) -> float:
        return self.sms * ALU_LANES_PER_SM * 2 * self.sm_clock_hz


# L2, SMs, clock: the lent machines report theirs in every result (machine_info); these rows are for a
# GPU not at hand and the fallback.
DEVICE_FACTS = {
    "H100 SXM": DeviceFacts("H100 SXM", 3.35e12, 989e12, 50 * 2**20, 132, 1.98e9,
                            "NVIDIA H100 datasheet; 50 MB L2, 132 SMs, 1980 MHz (Hopper whitepaper)"),
    "H200 SXM": DeviceFacts("H200 SXM", 4.8e12, 989e12, 60 * 2**20, 132, 1.98e9,
                            "NVIDIA H200 datasheet; L2 as the lent H200 reports it (62914560 B), 132 SMs, 1980 MHz"),
    "RTX PRO 6000 Blackwell": DeviceFacts(
        "RTX PRO 6000 Blackwell", 1.792e12, 503.8e12, 128 * 2**20, 188, 2.617e9,
        "GDDR7 512-bit at 28 Gbps; 128 MB L2 (a device query reports 134 MB = 128 MiB, vLLM #56128); 188 SMs; "
        "2617 MHz boost; bf16 dense 503.8 TFLOPS from a spec database (hmc-tech.com, RTX PRO 6000 Blackwell)"),
}


def device_facts(name: str, reported: dict | None = None) -> DeviceFacts:
    """The facts of GPU ``name`` (a device-table name such as ``NVIDIA H200``), with what the machine
    itself reported (``machine_info['decodebench']['fingerprint']['gpu']``) in place of the table.

    >>> f = device_facts("NVIDIA H200", {"l2_bytes": 62914560, "sm_count": 132})
    >>> f.name, f.l2_bytes, round(f.alu_ops_per_s / 1e12, 1)
    ('H200 SXM', 62914560, 66.9)
    """
    spec = device_spec(name)
    if spec is None or spec.name not in DEVICE_FACTS:
        raise ValueError(f"{name!r}: the projection rule knows no such GPU (known: {', '.join(DEVICE_FACTS)})")
    facts = DEVICE_FACTS[spec.name]
    reported = reported or {}
    l2, sms = reported.get("l2_bytes"), reported.get("sm_count")
    return replace(facts, l2_bytes=int(l2) if l2 else facts.l2_bytes, sms=int(sms) if sms else facts.sms)


@dataclass(frozen=True)
class Case:
    """One kernel result as the rule reads it: its traffic split into state and activations."""

    name: str
    component: str
    backend: str
    shape: dict
    median_us: float
    timer: str
    kernels: int  # kernel launches per call
    state_bytes: int  # weights, scales, KV cache: from DRAM in a decode step
    act_bytes: int  # activations read and written: written just before, in L2 in a step
    tensor_flops: float  # bf16 MMA FLOPs (Marlin's tokens per expert padded to its tile)
    dequant_weights: int  # INT4 weights dequantised per call (W4A16)
    kernel_names: frozenset = frozenset()  # the kernels the profiler saw it launch; empty where not recorded

    @property
    def bytes(self) -> int:
        return self.state_bytes + self.act_bytes


@dataclass(frozen=True)
class RuleParams:
    """The rule's fitted parameters and, per parameter, where its value came from."""

    floor_us: float
    dram_fraction: float
    l2_bytes_per_sm_cycle: float
    beta: float
    fitted_on: str  # the GPU and the files
    sources: dict  # parameter -> how it was obtained (the case that set it)
    sm_bytes_per_cycle: dict = field(default_factory=dict)  # component -> its SM-throughput bound
    moe_overlap: float | None = None  # the fused MoE's overlap share k (None: not measured, the larger bound)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"


def load_params(path: Path) -> RuleParams:
    """A fitted parameter file written by ``python -m decodebench crosscheck --out``."""
    try:
        raw = read_json(path)
        return RuleParams(**raw)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a projection-rule parameter file ({exc})") from None


@dataclass(frozen=True)
class DeviceModel:
    """A GPU as the rule sees it: its facts with the fitted parameters applied."""

    facts: DeviceFacts
    params: RuleParams

    @property
    def dram_bytes_per_s(self) -> float:
        return self.facts.dram_bytes_per_s * self.params.dram_fraction

    @property
    def l2_bytes_per_s(self) -> float:
        return self.params.l2_bytes_per_sm_cycle * self.facts.sms * self.facts.sm_clock_hz

    def floor_us(self, case: Case) -> float:
        return case.kernels * self.params.floor_us

    def sm_bytes_per_s(self, component: str) -> float | None:
        rate = self.params.sm_bytes_per_cycle.get(component)
        return rate * self.facts.sms * self.facts.sm_clock_hz if rate else None


# --- reading results ---------------------------------------------------------------------------


def load_cases(path: Path, backends: str = "vllm") -> tuple[list[Case], DeviceFacts]:
    """The cases of one pytest-benchmark file whose backend starts with ``backends``, and the GPU it
    ran on; ValueError naming the file when it is not a result file or names no known GPU."""
    stored = read_file(path)
    gpu = (stored.machine.get("fingerprint") or {}).get("gpu")
    if not isinstance(gpu, dict):
        raise ValueError(f"{path}: its machine_info names no GPU (machine_info.decodebench.fingerprint.gpu)")
    facts = device_facts(str(gpu.get("name", "")), gpu)
    clock_hz = median_sm_clock_hz(stored.results)
    if clock_hz:  # the SM clock the run had (NVML), not the datasheet's
        facts = replace(facts, sm_clock_hz=clock_hz)
    cases = [c for c in map(case_of, stored.results) if c is not None and c.backend.startswith(backends)]
    unknown = sorted({c.timer for c in cases} - set(CACHE_STATES))
    if unknown:
        raise ValueError(f"{path}: timer(s) {', '.join(unknown)}: the rule knows the cache state of "
                         f"{', '.join(CACHE_STATES)} only")
    return cases, facts


def case_of(result: Result) -> Case | None:
    """A kernel result as a :class:`Case`; None for one without traffic or a collective.

    >>> r = Result("g", "dense_gemm", "vllm", {"M": 1, "N": 512, "K": 7168}, 1e-5, {"timer": "kernel",
    ...            "bytes_read": 7354368, "bytes_written": 1024, "flops": 7340032,
    ...            "kernels": {"a": {"calls": 1.0}, "b": {"calls": 1.0}}})
    >>> c = case_of(r); c.kernels, c.state_bytes, c.act_bytes
    (2, 7340032, 15360)
    """
    nbytes = result.bytes
    if not nbytes:
        return None
    try:
        spec = get(result.component)
        if spec.state_bytes is None:
            return None  # a collective
        state = min(nbytes, spec.state(result.shape, result.info))
        flops, weights = _compute(result.component, result.shape, result.info, state)
    except (RegistryError, KeyError) as exc:
        raise ValueError(f"{result.name}: {exc}") from None
    return Case(result.name, result.component, result.backend, result.shape, result.median_s * 1e6,
                str(result.timer or "kernel"), _kernels(spec, result), state, nbytes - state, flops, weights,
                frozenset(result.launched))


def _kernels(spec, result: Result) -> int:
    """The kernels one call launched: as its result records them, else as its component declares."""
    if result.launched:
        return max(1, round(sum(float(k.get("calls", 1)) for k in result.launched.values())))
    return spec.launches


def _compute(component: str, s: dict, info: dict, state: int) -> tuple[float, int]:
    """bf16 tensor FLOPs (Marlin's per-expert tokens padded to 16 rows) and INT4 weights dequantised."""
    flops = float(info.get("flops") or 0)
    if component != "moe" or not flops:
        return flops, 0
    weights = int(state / 0.5625)  # 4 bits + a bf16 scale per 32: 0.5625 B per weight
    tokens = s["tokens"]
    experts_read = max(1.0, min(s["experts"], weights / max(1, _expert_weights(s))))
    rows = tokens * s["top_k"] / experts_read  # mean tokens per expert read
    padded = MARLIN_TILE_ROWS * math.ceil(max(rows, 1e-9) / MARLIN_TILE_ROWS)
    return 2.0 * padded * weights, weights


def _expert_weights(s: dict) -> int:
    up = s["gate_up_n"] * s["gate_up_k"]
    down = s["down_n"] * s["down_k"]
    return {"gate_up": up, "down": down}.get(s.get("stage"), up + down)


# --- the rule ------------------------------------------------------------------------------------


def traffic_us(case: Case, device: DeviceModel, state: str, sm: bool = True) -> tuple[float, str]:
    """The modelled time of the case's traffic on ``device`` in cache state ``state`` (warm, step,
    cold), and what bounds it (dram, l2 or compute).

    >>> p = RuleParams(1.5, 0.9, 24.0, 1.0, "doc", {})
    >>> dev = DeviceModel(DEVICE_FACTS["H200 SXM"], p)
    >>> c = Case("g", "dense_gemm", "vllm", {}, 10.0, "kernel", 1, 30_000_000, 20_000, 3e7, 0)
    >>> [(round(us, 2), bound) for us, bound in (traffic_us(c, dev, s) for s in ("warm", "step"))]
    [(4.79, 'l2'), (6.94, 'dram')]
    """
    if state == "warm":
        dram = warm_dram_bytes(case.bytes, device.facts.l2_bytes)
    elif state == "step":
        dram = case.state_bytes
    elif state == "cold":
        dram = case.bytes
    else:
        raise ValueError(f"cache state {state!r}: one of warm, step, cold")
    l2 = case.bytes  # what comes from DRAM passes through L2 too
    compute = (case.tensor_flops / device.facts.bf16_flops + case.dequant_weights / device.facts.alu_ops_per_s)
    terms = {"dram": dram / device.dram_bytes_per_s, "l2": l2 / device.l2_bytes_per_s, "compute": compute}
    sm_rate = device.sm_bytes_per_s(case.component) if sm else None
    if sm_rate:
        terms["sm"] = case.bytes / sm_rate
    bound = max(terms, key=terms.get)
    return terms[bound] * 1e6, bound


def warm_dram_bytes(nbytes: int, l2_bytes: int) -> int:
    """The bytes a call timed warm (the same tensors again and again) reads from DRAM: none where they fit
    in L2, all where they do not (a repeated stream longer than the cache evicts each line before its reuse)."""
    return 0 if nbytes <= l2_bytes else nbytes


def project_case(case: Case, here: DeviceModel, there: DeviceModel, state_here: str, state_there: str) -> float:
    """The case's µs per call on ``there`` in ``state_there``, from its time measured on ``here``.

    >>> p = RuleParams(1.5, 0.9, 24.0, 0.0, "doc", {})
    >>> h200, h100 = (DeviceModel(DEVICE_FACTS[n], p) for n in ("H200 SXM", "H100 SXM"))
    >>> big = Case("kv", "mla_decode", "vllm", {}, 600.0, "kernel", 2, 2_400_000_000, 1_000_000, 0, 0)
    >>> small = Case("g", "dense_gemm", "vllm", {}, 10.0, "kernel", 1, 30_000_000, 20_000, 3e7, 0)
    >>> round(project_case(big, h200, h100, "warm", "warm"), 1), project_case(small, h200, h100, "warm", "warm")
    (840.6, 10.0)
    """
    floor_here, floor_there = here.floor_us(case), there.floor_us(case)
    above = max(0.0, case.median_us - floor_here)
    if here.params.moe_overlap is not None and is_fused_moe(case):
        m_here = traffic_us(case, here, state_here, sm=False)[0]
        m_there = traffic_us(case, there, state_there, sm=False)[0]
        return floor_there + overlapped(above, m_here, m_there, here.params.moe_overlap, sm_ratio(here, there))
    sm = sm_bounded(case, here)
    w_here, _ = traffic_us(case, here, state_here, sm)
    w_there, _ = traffic_us(case, there, state_there, sm)
    if w_here <= 0:
        return floor_there + above
    ratio = w_there / w_here
    rest = above - w_here  # the time above the floor that the modelled traffic does not explain
    if rest <= 0:  # faster than its model here (the rates are 90th percentiles): it keeps that fraction of it
        return floor_there + above * ratio
    return floor_there + w_there + rest * ratio ** here.params.beta


def is_fused_moe(case: Case) -> bool:
    """The fused Marlin MoE call (both GEMMs and the glue), the one ``sm_count.py`` times on fewer SMs."""
    return case.component == "moe" and case.shape.get("stage") == "fused"


def sm_ratio(here: DeviceModel, there: DeviceModel) -> float:
    """How much longer SM-bound work takes there than here: ``(SMs x clock) here / (SMs x clock) there``."""
    return (here.facts.sms * here.facts.sm_clock_hz) / (there.facts.sms * there.facts.sm_clock_hz)


def overlapped(above: float, m_here: float, m_there: float, k: float, sm_scale: float = 1.0) -> float:
    """A time above the floor ``above = s + m - k min(s, m)`` (``m``: the memory time, ``s``: the SM time,
    ``k``: the share of the shorter that hides under the longer) with ``m`` moved from ``m_here`` to
    ``m_there`` and ``s`` scaled by ``sm_scale``; a time no longer than its memory time here keeps that
    fraction of it.

    >>> round(overlapped(341.5, 204.5, 285.0, 0.69), 1)  # the fused MoE at M = 64: s 278.1 µs, H200 -> H100
    371.2
    """
    if m_here <= 0:
        return above * sm_scale
    if above <= m_here:
        return above * m_there / m_here
    s = above - (1 - k) * m_here  # s >= m_here
    if s < m_here:  # s < m_here: above = m_here + (1 - k) s
        s = (above - m_here) / (1 - k)
    s *= sm_scale
    return s + m_there - k * min(s, m_there)


def sm_bounded(case: Case, here: DeviceModel) -> bool:
    """Whether the case's component's SM-throughput bound holds for it: not where the case, measured here,
    moved its bytes faster than that bound allows (its time is then bounded by something else: DRAM)."""
    rate = here.sm_bytes_per_s(case.component)
    above = case.median_us - here.floor_us(case)
    return bool(rate) and (above <= 0 or case.bytes / (above * 1e-6) <= rate)


# --- fitting on one GPU ----------------------------------------------------------------------------


def fit(cases: Sequence[Case], facts: DeviceFacts, fitted_on: str, sm_counts: Sequence[Path] = ()) -> RuleParams:
    """The rule's parameters from one GPU's results (``cases``, all measured on ``facts``'s GPU) and, for
    the fused MoE's overlap share, that GPU's ``sm_count.py`` runs (``sm_counts``; none: the fused MoE
    takes the larger of its bounds, like every other kernel).

    The floor is the fastest kernel measured; the DRAM fraction the fastest DRAM rate of a case that
    streams more than 4 L2 sizes timed warm (every byte from DRAM), else the 90th percentile of the cases
    that read more than L2 from DRAM in the step or cold state; the L2 bandwidth the 90th percentile of
    the warm cases that fit in L2; ``beta`` 0 (:func:`_beta` says why and what the two cache states
    here would pick). Raises ValueError when the cases cannot set a parameter (no case outside L2, none
    inside) or an SM-count file is not this GPU's.
    """
    if not cases:
        raise ValueError(f"{fitted_on}: no cases to fit the projection rule on")
    floor_case = min(cases, key=lambda c: c.median_us / c.kernels)
    floor = floor_case.median_us / floor_case.kernels
    sources = {"floor_us": f"{floor_case.name} ({floor_case.timer}): {floor_case.median_us:.3f} µs over "
                           f"{floor_case.kernels} kernel(s), the fastest kernel measured"}
    dram_fraction, sources["dram_fraction"] = _dram_fraction(cases, facts, floor)
    l2, sources["l2_bytes_per_sm_cycle"] = _l2_rate(cases, facts, floor)
    params = RuleParams(floor, dram_fraction, l2, 0.0, fitted_on, sources)
    sm_rates = _sm_rates(cases, DeviceModel(facts, params), sources)
    params = replace(params, sm_bytes_per_cycle=sm_rates)
    sources["beta"] = _beta(cases, facts, params)
    sources["moe_overlap"] = ("not measured (no sm_count.py run of this GPU given): the fused MoE takes the larger "
                              "of its bounds")
    return with_moe_overlap(replace(params, sources=sources), cases, facts, sm_counts)


def with_moe_overlap(params: RuleParams, cases: Sequence[Case], facts: DeviceFacts,
                     sm_counts: Sequence[Path]) -> RuleParams:
    """``params`` with the fused MoE's overlap share read from the GPU's ``sm_count.py`` runs (none: as it
    is), each case at the fit's floor and DRAM rate and, where ``cases`` hold it timed warm, at its measured
    time there; ValueError naming the files where they are not this GPU's or read a share outside [0, 1)."""
    if not sm_counts:
        return params
    floor_us, measured_us = moe_timing(cases, params.floor_us)
    overlap, how = sm_count.overlap_share(sm_counts, facts.name, floor_us, DeviceModel(facts, params).dram_bytes_per_s,
                                          measured_us)
    if not 0 <= overlap < 1:
        raise ValueError(f"{', '.join(map(str, sm_counts))}: the fused MoE's overlap share reads {overlap:.3f}; the "
                         "rule needs 0 (the sum of its SM and memory times) up to under 1 (the larger of the two)")
    return replace(params, moe_overlap=overlap, sources={**params.sources, "moe_overlap": how})


def moe_timing(cases: Sequence[Case], floor_us: float) -> tuple[Callable[[str], float], Callable[[str], float | None]]:
    """How the rule reads an ``sm-count.json`` case against ``cases`` (:func:`.sm_count.readings`): its floor
    (``floor_us`` per launch times the case's launches; a fused MoE's 6 where the results lack it), and its
    time timed warm in the results (None where they lack it)."""
    launches = {c.name: c.kernels for c in cases}
    timed = {c.name: c.median_us for c in cases if CACHE_STATES[c.timer] == "warm" and is_fused_moe(c)}
    return (lambda case: launches.get(sm_count.result_name(case), get("moe").launches) * floor_us,
            lambda case: timed.get(sm_count.result_name(case)))


SM_BOUND_SHARE = 0.5  # a case whose DRAM time is under this share of its time above the floor is not DRAM-bound


def _sm_rates(cases: Sequence[Case], device: DeviceModel, sources: dict) -> dict:
    """Per component, the bytes per SM per cycle that its cases reach where DRAM does not bound them."""
    rates: dict[str, list] = {}
    for c in cases:
        above = c.median_us - device.floor_us(c)
        state = CACHE_STATES[c.timer]
        dram_us = {"warm": warm_dram_bytes(c.bytes, device.facts.l2_bytes), "step": c.state_bytes,
                   "cold": c.bytes}[state] / device.dram_bytes_per_s * 1e6
        if above > 0.05 * device.floor_us(c) and dram_us < SM_BOUND_SHARE * above:
            per_cycle = c.bytes / (above * 1e-6) / (device.facts.sms * device.facts.sm_clock_hz)
            rates.setdefault(c.component, []).append((per_cycle, c))
    out = {}
    for comp, rs in sorted(rates.items()):
        if len(rs) < 3:
            continue
        rate, c = _p90(rs)
        out[comp] = rate
        sources[f"sm_bytes_per_cycle.{comp}"] = (f"{c.name} ({c.timer}): {rate:.2f} B per SM per cycle, the 90th "
                                                 f"percentile of {len(rs)} {comp} cases whose DRAM time is under "
                                                 f"{SM_BOUND_SHARE:.0%} of their time above the floor")
    return out


def _dram_fraction(cases: Sequence[Case], facts: DeviceFacts, floor: float) -> tuple[float, str]:
    """The achievable DRAM bandwidth over the datasheet's: the fastest stream measured. A case timed warm
    whose working set is over 4 L2 sizes reads every byte from DRAM, so its rate is DRAM's; the 90th
    percentile of every case's rate would be the kernels' mix, not the GPU's (it moved by 4 % between
    two runs of one H200 when step-timer cases joined). Without such a case, the 90th percentile of the
    cases that read more than L2 from DRAM in the step or cold state (their DRAM bytes are a model)."""
    streams = sorted(((c.bytes / ((c.median_us - c.kernels * floor) * 1e-6), c) for c in cases
                      if CACHE_STATES[c.timer] == "warm" and c.bytes > 4 * facts.l2_bytes
                      and c.median_us > c.kernels * floor), key=lambda r: r[0])
    if streams:
        rate, c = streams[-1]
        nxt = f"; next {streams[-2][0] / 1e12:.3f} TB/s" if len(streams) > 1 else ""
        return (rate / facts.dram_bytes_per_s,
                f"{c.name} ({c.timer}): {rate / 1e12:.3f} TB/s of {facts.dram_bytes_per_s / 1e12:.3g} TB/s datasheet, "
                f"the fastest of {len(streams)} cases timed warm over 4 L2 sizes (every byte from DRAM){nxt}")
    rates = []
    for c in cases:
        state = CACHE_STATES[c.timer]
        dram = {"warm": 0, "step": c.state_bytes, "cold": c.bytes}[state]
        if dram > facts.l2_bytes:
            rates.append((dram / ((c.median_us - c.kernels * floor) * 1e-6), c))
    if not rates:
        raise ValueError("no case reads more than its GPU's L2 from DRAM: the achievable DRAM bandwidth "
                         "cannot be fitted (run a sweep with the nightly MLA and MoE points)")
    rate, c = _p90(rates)
    return (rate / facts.dram_bytes_per_s,
            f"{c.name} ({c.timer}): {rate / 1e12:.3f} TB/s of {facts.dram_bytes_per_s / 1e12:.3g} TB/s datasheet, "
            f"the 90th percentile of {len(rates)} cases that read more than their L2 from DRAM in the step or cold "
            f"state (no case timed warm over 4 L2 sizes; fastest {max(r for r, _ in rates) / 1e12:.3f} TB/s)")


def _l2_rate(cases: Sequence[Case], facts: DeviceFacts, floor: float) -> tuple[float, str]:
    rates = [(c.bytes / ((c.median_us - c.kernels * floor) * 1e-6), c) for c in cases
             if CACHE_STATES[c.timer] == "warm" and c.bytes <= facts.l2_bytes
             and c.median_us > c.kernels * floor * 1.05]
    if not rates:
        raise ValueError("no case timed warm fits in L2: the L2 bandwidth cannot be fitted "
                         "(needs kernel-timer results)")
    rate, c = _p90(rates)
    per = rate / (facts.sms * facts.sm_clock_hz)
    return per, (f"{c.name} ({c.timer}): {rate / 1e12:.3f} TB/s = {per:.2f} B per SM per cycle at {facts.sms} SMs x "
                 f"{facts.sm_clock_hz / 1e6:.0f} MHz, the 90th percentile of {len(rates)} warm cases within L2 "
                 f"(fastest {max(r for r, _ in rates) / 1e12:.3f} TB/s)")


def _p90(rates: list[tuple[float, Case]]) -> tuple[float, Case]:
    """The 90th percentile (nearest rank) of (rate, case) pairs, with its case."""
    ranked = sorted(rates, key=lambda r: r[0])
    return ranked[min(len(ranked) - 1, math.ceil(0.9 * len(ranked)) - 1)]


def beta_pick(cases: Sequence[Case], facts: DeviceFacts, params: RuleParams) -> tuple[float, dict, int] | None:
    """Where the same cases were timed warm and in the step state, the ``beta`` in [0, 1] (steps of 0.05) that
    projects the warm times onto the step times with the least median error, that error per value tried, and
    the number of such pairs (None: fewer than 10)."""
    warm = {c.name: c for c in cases if CACHE_STATES.get(c.timer) == "warm"}
    pairs = [(warm[c.name], c) for c in cases if CACHE_STATES.get(c.timer) == "step" and c.name in warm]
    if len(pairs) < 10:
        return None
    errors = {}
    for beta in (i / 20 for i in range(21)):
        model = DeviceModel(facts, replace(params, beta=beta))
        errors[beta] = statistics.median(abs(project_case(w, model, model, "warm", "step") / s.median_us - 1)
                                         for w, s in pairs)
    return min(errors, key=errors.get), errors, len(pairs)


def _beta(cases: Sequence[Case], facts: DeviceFacts, params: RuleParams) -> str:
    """Why ``beta`` is 0, and what the GPU's own two cache states would pick (:func:`beta_pick`). That
    criterion is flat on every GPU at hand (its pick misses by 0.4-1.1 points less than 0), and the picks
    (0.25-0.4 on the lent H100s, 1 on an H200) lifted the per-kernel p90 of every pair's cross-GPU check over
    15 % (docs/projection.md), so it is reported, not used."""
    kept = "0: the time the modelled traffic does not explain is kept as latency"
    picked = beta_pick(cases, facts, params)
    if picked is None:
        return f"{kept} (the results hold no cases timed both warm and in the step state)"
    best, errors, n = picked
    return (f"{kept}. The {n} cases timed in the step state here (and warm) would pick {best:g} (median miss of the "
            f"warm -> step projection on this GPU {errors[best]:.1%}; at 0: {errors[0.0]:.1%}; at 1: "
            f"{errors[1.0]:.1%}): a criterion this flat does not set it")


def by_name(cases: Iterable[Case]) -> dict[str, Case]:
    return {c.name: c for c in cases}
