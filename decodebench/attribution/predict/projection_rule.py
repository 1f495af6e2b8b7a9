"""The projection rule: a kernel's time on one GPU re-timed for another GPU or cache state.

A case measured at ``t`` µs here is, there::

    t_there = floor + w_there + (t - floor - w_here)        (the part w does not explain stays: latency)
    t_there = floor + (t - floor) * w_there / w_here        (where t - floor < w_here)

    w = max(DRAM bytes / (dram_fraction * datasheet DRAM B/s),
            all bytes  / (l2_bytes_per_sm_cycle * SMs * SM clock),
            all bytes  / (sm_bytes_per_cycle[component] * SMs * SM clock),   where that bound holds
            bf16 FLOPs / datasheet bf16 peak + INT4 weights / (SMs * 128 lanes * 2 * clock))

and the fused Marlin MoE, whose SM time ``s`` and memory time ``m`` overlap by a share ``k``::

    t - floor = s + m - k * min(s, m)      (s read back from t, scaled by SMs x clock; m moved)

The parameters (:class:`RuleParams`), each fitted on one GPU's own results by :func:`fit`, each
with the case that set it in ``sources``:

=========================  ========================================================================
``floor_us``               latency floor per kernel launch: the fastest kernel measured
``dram_fraction``          achievable DRAM rate over the datasheet's: the fastest stream timed warm over
                           4 L2 sizes, else the 90th percentile of the cases reading over L2 from DRAM
``l2_bytes_per_sm_cycle``  L2 rate: 90th percentile of the warm cases within L2, else (``step`` timer
                           only) of the cases whose bytes are nearly all activations (in L2 in a step)
``sm_bytes_per_cycle``     per component, the 90th percentile rate of its cases that DRAM does not bound
``moe_overlap``            ``k`` above: not fitted; :data:`MOE_OVERLAP` unless the caller gives one
=========================  ========================================================================

Which bytes come from DRAM follows the timer's cache state (:data:`CACHE_STATES`): ``warm`` (the
same tensors again and again: nothing where the working set fits in L2, everything where it does
not), ``step`` (weights, scales and KV cache from DRAM, activations from L2), ``cold`` (all). The
L2 size and SM count are what the result's machine reported, else :data:`DEVICE_FACTS`; the SM
clock the median NVML reported before the cases ran, else the table's boost clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ...hardware import device_spec
from ...registry import RegistryError, get
from ...results import Result

__all__ = ["CACHE_STATES", "DEVICE_FACTS", "MOE_OVERLAP", "Case", "DeviceFacts", "DeviceModel", "RuleParams",
           "case_of", "device_facts", "fit", "is_fused_moe", "project_case", "traffic_us"]

# The fused MoE's overlap share k: the median of the shares the ten fits of the five same-code H200/H100
# pairs read from their GPUs' runs of the MoE on fewer SMs (CUDA green contexts), 0.679-0.721
# (docs/projection.md); a GPU of another design may overlap otherwise, which its band carries.
MOE_OVERLAP = 0.70
MOE_OVERLAP_SOURCE = ("0.70, the stated default: the median share that H100 SXM and H200 SXM runs of the fused MoE "
                      "on fewer SMs read (0.679-0.721; docs/projection.md)")

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
    arch: str  # the SM design: a projection's band is measured per pair of them

    @property
    def alu_ops_per_s(self) -> float:
        return self.sms * ALU_LANES_PER_SM * 2 * self.sm_clock_hz


# L2, SMs, clock: the lent machines report theirs in every result (machine_info); these rows are for a
# GPU not at hand and the fallback.
DEVICE_FACTS = {
    "H100 SXM": DeviceFacts("H100 SXM", 3.35e12, 989e12, 50 * 2**20, 132, 1.98e9,
                            "NVIDIA H100 datasheet; 50 MB L2, 132 SMs, 1980 MHz (Hopper whitepaper)", "sm90"),
    "H200 SXM": DeviceFacts("H200 SXM", 4.8e12, 989e12, 60 * 2**20, 132, 1.98e9,
                            "NVIDIA H200 datasheet; L2 as the lent H200 reports it (62914560 B), 132 SMs, 1980 MHz",
                            "sm90"),
    "RTX PRO 6000 Blackwell": DeviceFacts(
        "RTX PRO 6000 Blackwell", 1.792e12, 503.8e12, 128 * 2**20, 188, 2.617e9,
        "GDDR7 512-bit at 28 Gbps; 128 MB L2 (a device query reports 134 MB = 128 MiB, vLLM #56128); 188 SMs; "
        "2617 MHz boost; bf16 dense 503.8 TFLOPS from a spec database (hmc-tech.com, RTX PRO 6000 Blackwell)", "sm120"),
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
    """The rule's parameters (the module docstring's table) and, per parameter, where its value came from."""

    floor_us: float
    dram_fraction: float
    l2_bytes_per_sm_cycle: float
    fitted_on: str  # the GPU and the files
    sources: dict  # parameter -> how it was obtained (the case that set it)
    sm_bytes_per_cycle: dict = field(default_factory=dict)  # component -> its SM-throughput bound
    moe_overlap: float = MOE_OVERLAP


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

    >>> p = RuleParams(1.5, 0.9, 24.0, "doc", {})
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

    >>> p = RuleParams(1.5, 0.9, 24.0, "doc", {})
    >>> h200, h100 = (DeviceModel(DEVICE_FACTS[n], p) for n in ("H200 SXM", "H100 SXM"))
    >>> big = Case("kv", "mla_decode", "vllm", {}, 600.0, "kernel", 2, 2_400_000_000, 1_000_000, 0, 0)
    >>> small = Case("g", "dense_gemm", "vllm", {}, 10.0, "kernel", 1, 30_000_000, 20_000, 3e7, 0)
    >>> round(project_case(big, h200, h100, "warm", "warm"), 1), project_case(small, h200, h100, "warm", "warm")
    (840.6, 10.0)
    """
    floor_here, floor_there = here.floor_us(case), there.floor_us(case)
    above = max(0.0, case.median_us - floor_here)
    if is_fused_moe(case):
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
    return floor_there + w_there + rest


def is_fused_moe(case: Case) -> bool:
    """The fused Marlin MoE call (both GEMMs and the glue): its SM and memory times overlap by a share."""
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


def fit(cases: Sequence[Case], facts: DeviceFacts, fitted_on: str,
        moe_overlap: tuple[float, str] = (MOE_OVERLAP, MOE_OVERLAP_SOURCE)) -> RuleParams:
    """The rule's parameters from one GPU's results (``cases``, all measured on ``facts``'s GPU), each with
    the case that set it (the module docstring's table says how); ``moe_overlap``: the fused MoE's overlap
    share and its source. Raises ValueError naming the parameter the cases cannot set.

    >>> c = [Case(f"n{i}", "rmsnorm", "vllm", {}, 3.0 + i, "step", 1, 14336, 2_000_000 * i, 0, 0) for i in range(1, 9)]
    >>> c += [Case("big", "moe", "vllm", {}, 600.0, "step", 6, 1_800_000_000, 10_000, 0, 0)]
    >>> p = fit(c, DEVICE_FACTS["H100 SXM"], "doc")
    >>> round(p.floor_us, 2), round(p.dram_fraction, 3), round(p.l2_bytes_per_sm_cycle, 2)
    (4.0, 0.933, 15.36)
    """
    k, k_source = moe_overlap
    if not 0 <= k < 1:
        raise ValueError(f"{fitted_on}: the fused MoE's overlap share {k:g} is outside [0, 1) ({k_source})")
    if not cases:
        raise ValueError(f"{fitted_on}: no cases to fit the projection rule on")
    floor_case = min(cases, key=lambda c: c.median_us / c.kernels)
    floor = floor_case.median_us / floor_case.kernels
    sources = {"floor_us": f"{floor_case.name} ({floor_case.timer}): {floor_case.median_us:.3f} µs over "
                           f"{floor_case.kernels} kernel(s), the fastest kernel measured", "moe_overlap": k_source}
    dram_fraction, sources["dram_fraction"] = _dram_fraction(cases, facts, floor)
    l2, sources["l2_bytes_per_sm_cycle"] = _l2_rate(cases, facts, floor)
    params = RuleParams(floor, dram_fraction, l2, fitted_on, sources, moe_overlap=k)
    return replace(params, sm_bytes_per_cycle=_sm_rates(cases, DeviceModel(facts, params), sources))


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


ACTIVATION_SHARE = 0.95  # a step-state case whose bytes are at least this share activations reads them from L2


def _l2_rate(cases: Sequence[Case], facts: DeviceFacts, floor: float) -> tuple[float, str]:
    """The L2 rate per SM per cycle: the 90th percentile of the warm cases within L2; where the results hold
    none (the ``step`` timer alone), of the cases within L2 whose bytes are nearly all activations, which a
    decode step finds in L2 (RMSNorm, the routing)."""
    def rates(keep) -> list[tuple[float, Case]]:
        return [(c.bytes / ((c.median_us - c.kernels * floor) * 1e-6), c) for c in cases
                if keep(c) and c.bytes <= facts.l2_bytes and c.median_us > c.kernels * floor * 1.05]
    found = rates(lambda c: CACHE_STATES[c.timer] == "warm")
    which = "warm cases within L2"
    if not found:
        found = rates(lambda c: CACHE_STATES[c.timer] == "step" and c.act_bytes >= ACTIVATION_SHARE * c.bytes)
        which = f"step-state cases within L2 whose bytes are {ACTIVATION_SHARE:.0%}+ activations (no case timed warm)"
    if not found:
        raise ValueError("no case timed warm fits in L2, nor a step-state case of activations: the L2 bandwidth "
                         "cannot be fitted")
    rate, c = _p90(found)
    per = rate / (facts.sms * facts.sm_clock_hz)
    return per, (f"{c.name} ({c.timer}): {rate / 1e12:.3f} TB/s = {per:.2f} B per SM per cycle at {facts.sms} SMs x "
                 f"{facts.sm_clock_hz / 1e6:.0f} MHz, the 90th percentile of {len(found)} {which} "
                 f"(fastest {max(r for r, _ in found) / 1e12:.3f} TB/s)")


def _p90(rates: list[tuple[float, Case]]) -> tuple[float, Case]:
    """The 90th percentile (nearest rank) of (rate, case) pairs, with its case."""
    ranked = sorted(rates, key=lambda r: r[0])
    return ranked[min(len(ranked) - 1, math.ceil(0.9 * len(ranked)) - 1)]

