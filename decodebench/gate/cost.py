"""What a verdict costs the decode step: µs per step, share of the predicted step, the step gate.

A case at token count M runs ``calls`` times per decode step of the deployment the sweep was
derived for (:meth:`decodebench.registry.ComponentSpec.calls_per_step`, the counts the step
prediction uses). Its change per step is ``calls * (level now - level then)``; over the step
predicted from the session's kernel results at the same M (:mod:`decodebench.attribution.predict.prediction`,
full model depth, context ``Policy.step_context``) it is a share of the step. So a +12 % on a
9 µs GEMM called 61 times reads beside a +3 % on a 350 µs MoE layer called 60 times.

The step gate (``--gate-step PCT``) judges, for every M, the step's change as a whole, on the
verdict model's own scale: the log of the ratio of the step now to the step then. With ``w`` a
judged term's share of the predicted step and ``d`` its case's log change, the step then is
``step * (sum(w * exp(-d)) + unjudged share)``; the log ratio's standard error follows from the
cases' (independent cases: variances add, a case that is two terms counts once, with both
weights). That change is one :class:`~decodebench.gate.decision.Comparison`, judged by
:func:`~decodebench.gate.decision.judge_step` (the rule is stated in :mod:`.decision`).
On the log scale a case known to be far slower cannot make its step's interval reach below
zero, as a sum of µs with symmetric errors could (a 5e4-fold slower kernel with a wide
interval once left its step UNDECIDED).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..registry import calls_per_step, registered
from ..results import Result, kernel_result
from ..shapes import DecodeShapes
from .decision import Comparison, Policy, Verdict, judge_step, per_test_alpha
from .verdict import CaseVerdict

__all__ = ["StepChange", "predicted_steps", "price", "step_changes"]


@dataclass(frozen=True)
class StepChange:
    """The predicted decode step at one token count and how this session changes it: the log
    ratio of the step now to the step then, with the bounds of its interval."""

    tokens: int
    step_us: float  # predicted kernel time of the step now
    log_change: float
    log_low: float
    log_high: float
    covered: int  # terms of the step with a verdict
    terms: int
    verdict: Verdict

    @property
    def change_us(self) -> float:
        """The change in µs per step that the log change now/then means, the step now being known."""
        if not math.isfinite(self.log_change):
            return math.copysign(math.inf, self.log_change)
        return self.step_us * -math.expm1(-self.log_change)

    @property
    def share(self) -> float:
        """The relative change of the step: now / then - 1."""
        return math.expm1(self.log_change)

    def line(self, threshold: float) -> str:
        low, high = (math.expm1(b) if math.isfinite(b) else b for b in (self.log_low, self.log_high))
        return (f"STEP {self.verdict.value.upper():<10} M={self.tokens:<4} step {self.step_us:9.1f} µs  "
                f"{self.change_us:+8.2f} µs ({self.share:+.2%}; interval {low:+.2%} to {high:+.2%}; "
                f"{self.covered} of {self.terms} terms judged; gate {threshold:.1%})")


def predicted_steps(records: Sequence[Result], shapes: DecodeShapes, tokens: Sequence[int], context: int):
    """The step predicted at each token count, at ``context`` tokens, from the kernel results among
    ``records`` (the session's first: a name that appears twice counts with its first record)."""
    from ..attribution.predict.prediction import predict_step

    first: dict[str, Result] = {}
    for record in records:
        first.setdefault(record.name, record)
    results = [r for r in first.values() if kernel_result(r)]
    return {m: predict_step(results, shapes.spec, shapes.tp, m, context) for m in sorted(set(tokens))}


def price(verdicts: Sequence[CaseVerdict], records: Mapping[str, Result], shapes: DecodeShapes | None,
          steps: Mapping[int, object]) -> list[CaseVerdict]:
    """``verdicts`` with calls per step, change in µs per step and share of the predicted step.

    >>> from decodebench.model import load_model_spec
    >>> shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    >>> v = CaseVerdict("t::x", Verdict.SLOWER, "", ratio=1.1, base_s=1e-5, tokens=8)
    >>> record = Result("x", "moe", "vllm", {"stage": "fused", "tokens": 8}, 1e-5)
    >>> (p,) = price([v], {"t::x": record}, shapes, {})
    >>> p.calls, round(p.cost_us, 2), p.step_share
    (60, 60.0, None)
    """
    out, in_step = [], {spec.name for spec in registered()}  # an end-to-end or EP dispatch result is not priced
    for verdict in verdicts:
        record = records.get(verdict.name)
        known = verdict.ratio is not None and verdict.base_s is not None
        if shapes is None or not known or record is None or not record.shape or record.component not in in_step:
            out.append(verdict)
            continue
        calls = calls_per_step(shapes, str(record.component), record.shape)
        cost = calls * verdict.base_s * (verdict.ratio - 1) * 1e6
        step = steps.get(verdict.tokens)
        share = cost / step.total_us if step is not None and step.total_us else None
        out.append(replace(verdict, calls=calls, cost_us=cost, step_share=share))
    return out


def step_changes(verdicts: Sequence[CaseVerdict], steps: Mapping[int, object], policy: Policy) -> list[StepChange]:
    """Each predicted step's change, judged against ``policy.step_threshold`` (module docstring).

    A case far slower, however wide its own interval, keeps its step's interval above zero:

    >>> from types import SimpleNamespace as NS
    >>> step = NS(total_us=1000.0, terms=[NS(benchmark="x", us=600.0), NS(benchmark="y", us=400.0)])
    >>> far = CaseVerdict("t::x", Verdict.SLOWER, "", ratio=5e4, se=0.6, df=3, cost_us=1.0)
    >>> (c,) = step_changes([far], {8: step}, Policy(step_threshold=0.01))
    >>> c.verdict.value, round(c.share, 3), c.log_low > 0
    ('slower', 1.5, True)
    """
    by_short = {v.name.split("::", 1)[-1]: v for v in verdicts  # a step's terms name the test without its file
                if v.cost_us is not None and v.se is not None and v.ratio}
    alpha = per_test_alpha(policy, len(steps))  # one test per token count
    changes = []
    for tokens, step in sorted(steps.items()):
        if not step.total_us:
            continue
        estimate, covered = _step_estimate(step, by_short)
        low, high = estimate.interval(alpha)
        verdict = judge_step(estimate, policy.step_threshold, policy.confidence, len(steps))
        changes.append(StepChange(tokens, step.total_us, estimate.change, low, high, covered, len(step.terms),
                                  verdict))
    return changes


def _step_estimate(step, by_short: Mapping[str, CaseVerdict]) -> tuple[Comparison, int]:
    """The log change of one predicted step (now / then) as a :class:`Comparison`, and how many of
    its terms have a verdict. Its df are the smallest of the judged cases' (none judged: no df,
    an interval without bounds)."""
    weights: dict[str, float] = {}  # share of the step now, per judged case
    for term in step.terms:
        if term.benchmark in by_short:
            weights[term.benchmark] = weights.get(term.benchmark, 0.0) + term.us / step.total_us
    judged = [(by_short[name], w) for name, w in weights.items()]
    # the step then, as a share of the step now; each judged term at its case's level then
    unjudged = math.fsum(term.us for term in step.terms if term.benchmark not in weights) / step.total_us
    then = unjudged + math.fsum(w / v.ratio for v, w in judged)
    # d(change)/d(log ratio of a case) = its term's share of the step then
    se = math.sqrt(math.fsum((w / v.ratio / then * v.se) ** 2 for v, w in judged))
    dfs = [v.df for v, _ in judged if v.df]
    covered = sum(term.benchmark in weights for term in step.terms)
    return Comparison(-math.log(then), se, min(dfs) if dfs else 0.0, level="the predicted step"), covered
