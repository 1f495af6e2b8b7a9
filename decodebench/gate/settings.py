"""The gate's options, declared once: the pytest plugin and ``python -m decodebench.gate`` both add
them (pytest's ``addoption`` and argparse's ``add_argument`` take the same arguments) and read them back
into one :class:`~decodebench.gate.decision.Policy` (:func:`add_gate_options`' example).
"""

from __future__ import annotations

from collections.abc import Callable

from ..options import confidence, fraction_up_to, int_up_to, positive_float
from .decision import Policy

__all__ = ["add_gate_options", "policy_from"]

_DEFAULT = Policy()
# The sane ranges: a threshold beyond 100 % (a case twice as slow) gates nothing; each re-measure
# round costs a run of every undecided case; a history past a thousand results is a damaged folder;
# a context past 2^20 tokens is past every DeepSeek-V3-family config.
MOST_THRESHOLD = 1.0
MOST_RESAMPLES = 20
MOST_HISTORY = 1000
MOST_CONTEXT = 1 << 20
_threshold = fraction_up_to(MOST_THRESHOLD)
_resamples = int_up_to(MOST_RESAMPLES, 0)
_history = int_up_to(MOST_HISTORY)
_context = int_up_to(MOST_CONTEXT)


def add_gate_options(add: Callable[..., object]) -> None:
    """Declare ``--gate``, ``--gate-step``, ``--gate-step-context``, ``--gate-confidence``,
    ``--gate-allow-empty``, ``--gate-resamples``, ``--gate-history`` and ``--gate-max-load`` through ``add``.

    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_gate_options(p.add_argument)
    >>> policy_from(p.parse_args(["--gate", "3%", "--gate-history", "7"]))  # doctest: +NORMALIZE_WHITESPACE
    Policy(threshold=0.03, confidence=0.95, resamples=2, history=7, max_load_per_cpu=1.5, step_threshold=None,
           step_context=8192)
    """
    add("--gate", metavar="PCT", type=_threshold, default=None,
        help="Fail the run when a benchmark is significantly slower than its baseline by more than PCT "
             "(needs --benchmark-compare, or --ab-python): a percentage (5%%) or a fraction below 1 (0.05), at "
             "most 100%%. Without it, verdicts are reported and never fail. "
             "Default: off")
    add("--gate-step", metavar="PCT", type=_threshold, default=None,
        help="Fail the run when the predicted decode step (summed change of the kernels it is made of, "
             "at each token count) is significantly slower by more than PCT, whatever the per-kernel verdicts. "
             "Default: off")
    add("--gate-step-context", metavar="TOKENS", type=_context, default=_DEFAULT.step_context,
        help="The context length at which the decode step is predicted: the step --gate-step judges and the "
             "share of it each verdict quotes. At most 1048576. Default: %(default)r")
    add("--gate-confidence", metavar="PCT", type=confidence, default=_DEFAULT.confidence,
        help="The chance that an unchanged build passes the whole session: the error rate is split over "
             "the cases (Bonferroni; a SLOWER is only called on a case's last look). Default: 95%%")
    add("--gate-allow-empty", action="store_true", default=False,
        help="Let --gate pass a run that compared nothing (no or unreadable baseline, another fingerprint, "
             "every case skipped), e.g. the first run on a new runner. Default: such a run fails")
    add("--gate-resamples", metavar="N", type=_resamples, default=_DEFAULT.resamples,
        help="Re-measure a case that is not yet SAME up to N more times before the session reports (A/B: N "
             "more sets of --ab-rounds rounds); a SLOWER stands only on all of them. 0 turns it off. "
             "Offline: nothing is re-measured. At most 20. Default: %(default)r")
    add("--gate-history", metavar="N", type=_history, default=_DEFAULT.history,
        help="Stored results of this fingerprint (newest first) that form the baseline, at most 1000. "
             "Default: %(default)r")
    add("--gate-max-load", metavar="PER_CPU", type=positive_float, default=_DEFAULT.max_load_per_cpu,
        help="A CPU result measured while the 1-minute load average per CPU was above this is never "
             "SLOWER or FASTER, only UNDECIDED (contention, not evidence). Default: %(default)r")


def policy_from(values) -> Policy:
    """The :class:`Policy` the parsed options (argparse's namespace, pytest's ``config.option``) name."""
    return Policy(threshold=values.gate or _DEFAULT.threshold, confidence=values.gate_confidence,
                  resamples=values.gate_resamples, history=values.gate_history,
                  max_load_per_cpu=values.gate_max_load, step_threshold=values.gate_step,
                  step_context=values.gate_step_context)
