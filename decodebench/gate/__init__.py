"""The gate: is this build slower than the stored history, or than side A of an A/B?

One model (:mod:`.decision`), one engine (:func:`.verdict.judge`), two forms:

* **stored** (``--benchmark-compare``): the runs of this session against the runs stored for
  the fingerprint (the newest ``--gate-history`` results, from a persistent step on where
  :mod:`.series` finds one, split into levels where a case lands on one of two);
* **paired** (``--ab-python``): round i of A against round i of B, interleaved in time.

The unit is the run, summarised by the log of its floor; its run-to-run spread comes from
the runs stored and measured, shrunk towards the same op at other shapes (worth 4 runs of the
case's own) and then every case of the fingerprint and timer. SLOWER when the change lies
beyond the threshold and is significant at the session's level, SAME when that interval lies
within the threshold (against the lowest of a case's levels), UNDECIDED otherwise. The judge
is a pure function of the records handed in (:func:`.verdict.judge`,
:func:`.session.assess`); the runner re-measures a case that is not SAME for every re-measure
round (:mod:`decodebench.runner.settle`), a SLOWER or FASTER called only on its last look. The
family-wise error over the cases of a session is ``1 - confidence`` (Bonferroni; the looks
take no share, :mod:`.decision` says why). Every verdict is priced in µs per decode step
(:mod:`.cost`); ``--gate-step`` gates the summed change of the predicted step. Stored runs are
all it needs: ``python -m decodebench.gate BASELINE CURRENT`` prints the session's lines from
files (:mod:`.offline`).
"""

from .decision import Policy, Verdict
from .verdict import CaseInput, CaseVerdict, judge

__all__ = ["CaseInput", "CaseVerdict", "Policy", "Verdict", "judge"]
