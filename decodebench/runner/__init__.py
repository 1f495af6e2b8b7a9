"""Measuring in other processes, apart from the judge: :mod:`.ab` (the A/B sides), :mod:`.case_worker`
(the measuring process), :mod:`.fresh` (a fresh process per re-measure round), :mod:`.remeasure` (how
each case can be measured again) and :mod:`.settle` (the loop that re-measures open cases). They hand on
typed runs; the verdicts are :mod:`decodebench.gate`'s.
"""
