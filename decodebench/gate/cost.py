"""What a verdict costs the decode step: µs per step, share of the predicted step, the step gate.

A case at token count M runs ``calls`` times per decode step of the deployment the sweep was
derived for (:meth:`decodebench.shapes.DecodeShapes.calls_per_step`, the counts the step
prediction uses). Its change per step is ``calls * (level now - level then)``; over the step
predicted from the session's kernel results at the same M (:mod:`decodebench.attribution.predict`,
full model depth, context :data:`STEP_CONTEXT`) it is a share of the step. So a +12 % on a
9 µs GEMM called 61 times reads beside a +3 % on a 350 µs MoE layer called 60 times.

The step gate (``--gate-step PCT``) sums, for every M, the changes of the cases the predicted
step is made of, with their standard errors (independent cases: variances add), and applies
the verdict model's own rule to the sum: SLOWER when its lower bound, as a share of the step,
exceeds PCT. Bonferroni over the token counts and looks keeps the session's error rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .. import stats
from ..shapes import DecodeShapes
from . import runs as R
from .model import Policy, Verdict
from .verdict import CaseVerdict

__all__ = ["STEP_CONTEXT", "StepChange", "predicted_steps", "price", "step_changes", "tokens_in"]

STEP_CONTEXT = 8192  # context length (tokens) at which a step's share is quoted


@dataclass(frozen=True)
class StepChange:
    """The predicted decode step at one token count and how this session changes it."""

    tokens: int
    step_us: float  # predicted kernel time of the step now
    change_us: float  # summed change of its terms
    low_us: float
    high_us: float
    covered: int  # terms of the step with a verdict
    terms: int
    verdict: Verdict

    @property
    def share(self) -> float:
        return self.change_us / self.step_us if self.step_us else 0.0

    def line(self, threshold: float) -> str:
        return (f"STEP {self.verdict.value.upper():<10} M={self.tokens:<4} step {self.step_us:9.1f} µs  "
                f"{self.change_us:+8.2f} µs ({self.share:+.2%}; interval {self.low_us / self.step_us:+.2%} to "
                f"{self.high_us / self.step_us:+.2%}; {self.covered} of {self.terms} terms judged; "
                f"gate {threshold:.1%})")


def predicted_steps(entries: Sequence[Mapping], shapes: DecodeShapes, tokens: Sequence[int]):
    """The step predicted at each token count from ``entries`` (kernel results, the session's
    first: a name that appears twice counts with its first entry)."""
    from ..attribution.predict import predict_step, results_from_dicts

    seen, unique = set(), []
    for entry in entries:
        if entry.get("name") not in seen:
            seen.add(entry.get("name"))
            unique.append(entry)
    results = results_from_dicts(unique)
    return {m: predict_step(results, shapes.spec, shapes.tp, m, STEP_CONTEXT) for m in sorted(set(tokens))}


def _short(name: str) -> str:
    return name.split("::", 1)[-1]


def price(verdicts: Sequence[CaseVerdict], entries: Mapping[str, Mapping], shapes: DecodeShapes | None,
          steps: Mapping[int, object]) -> list[CaseVerdict]:
    """``verdicts`` with calls per step, change in µs per step and share of the predicted step.

    >>> from decodebench.model import load_model_spec
    >>> shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    >>> v = CaseVerdict("t::x", Verdict.SLOWER, "", ratio=1.1, base_s=1e-5, tokens=8)
    >>> entry = {"extra_info": {"component": "moe", "shape": {"stage": "fused", "tokens": 8}}}
    >>> (p,) = price([v], {"t::x": entry}, shapes, {})
    >>> p.calls, round(p.cost_us, 2), p.step_share
    (60, 60.0, None)
    """
    out = []
    for verdict in verdicts:
        entry = entries.get(verdict.name) or {}
        info = entry.get("extra_info") or {}
        known = verdict.ratio is not None and verdict.base_s is not None
        if shapes is None or not known or not isinstance(info.get("shape"), Mapping):
            out.append(verdict)
            continue
        calls = shapes.calls_per_step(str(info.get("component")), info["shape"])
        cost = calls * verdict.base_s * (verdict.ratio - 1) * 1e6
        step = steps.get(verdict.tokens)
        share = cost / step.total_us if step is not None and step.total_us else None
        out.append(replace(verdict, calls=calls, cost_us=cost, step_share=share))
    return out


def step_changes(verdicts: Sequence[CaseVerdict], steps: Mapping[int, object], policy: Policy) -> list[StepChange]:
    """The summed change of each predicted step's terms, judged against ``policy.step_threshold``."""
    by_short = {_short(v.name): v for v in verdicts if v.cost_us is not None and v.se is not None}
    threshold = policy.step_threshold if policy.step_threshold is not None else policy.threshold
    alpha = (1 - policy.confidence) / (max(1, len(steps)) * policy.looks)
    changes = []
    for tokens, step in sorted(steps.items()):
        if not step.total_us:
            continue
        judged = [(term, by_short[term.benchmark]) for term in step.terms if term.benchmark in by_short]
        change = math.fsum(v.cost_us for _, v in judged)
        # se of one case's cost in µs: d(cost)/d(log ratio) = calls * base * ratio
        variance = math.fsum((v.calls * v.base_s * v.ratio * v.se * 1e6) ** 2 for _, v in judged)
        dfs = [v.df for _, v in judged if v.df]
        if judged and dfs:
            q = min(stats.student_t_quantile(1 - alpha, min(dfs)), 1e3)
            low, high = change - q * math.sqrt(variance), change + q * math.sqrt(variance)
        else:
            low, high = -math.inf, math.inf
        limit = threshold * step.total_us
        verdict = (Verdict.SLOWER if low > limit else Verdict.FASTER if high < -limit
                   else Verdict.SAME if -limit <= low and high <= limit else Verdict.UNDECIDED)
        changes.append(StepChange(tokens, step.total_us, change, low, high, len(judged), len(step.terms), verdict))
    return changes


def tokens_in(entries: Mapping[str, Mapping]) -> list[int]:
    return sorted({t for e in entries.values() if (t := R.tokens_of(e)) is not None})
