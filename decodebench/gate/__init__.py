"""The gate: is this build slower than the stored history, or than side A of an A/B?

One rule (:mod:`.decision`, stated on one screen in its docstring): each case's evidence (its
change against each level it could be on, the run-to-run spread and its df, the runs, whether they
were contended), two p-values from Student's t (slower; within ±threshold), one family procedure
over the session (Bonferroni decides pass or fail, Benjamini–Hochberg which other cases are
called), and a verdict. :func:`.verdict.judge` builds the evidence from stored runs in two forms:

* **stored** (``--benchmark-compare``): the runs of this session against the runs stored for
  the fingerprint (the newest ``--gate-history`` results, from a persistent step on where
  :mod:`.series` finds one, split into levels where a case lands on one of two);
* **paired** (``--ab-python``): round i of A against round i of B, interleaved in time.

The judge is a pure function of the records handed in (:func:`.verdict.judge`,
:func:`.session.assess`); the runner re-measures a case that is not SAME, a SLOWER or FASTER
called only on its last look (:mod:`decodebench.runner.settle`). Every verdict is priced in µs
per decode step (:mod:`.cost`); ``--gate-step`` gates the summed change of the predicted step.
Stored runs are all it needs: ``python -m decodebench.gate BASELINE CURRENT`` prints the
session's lines from files (:mod:`.offline`).
"""

from .decision import Policy, Verdict
from .verdict import CaseInput, CaseVerdict, judge

__all__ = ["CaseInput", "CaseVerdict", "Policy", "Verdict", "judge"]
