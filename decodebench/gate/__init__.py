"""The gate: is this build slower than the stored history, or than side A of an A/B?

The rule is :mod:`.decision`'s; :func:`.verdict.judge` builds each case's evidence from stored runs alone
(stored mode: this session against the fingerprint's history; paired: ``--ab-python``'s rounds),
:mod:`.cost` prices it per decode step, :mod:`.session` concludes, and :mod:`.offline` does the same from
files. The runner re-measures (:mod:`decodebench.runner.settle`). The model: docs/gate.md.
"""

from .decision import Policy, Verdict
from .verdict import CaseInput, CaseVerdict, judge

__all__ = ["CaseInput", "CaseVerdict", "Policy", "Verdict", "judge"]
