"""Measuring in other processes: the runner, apart from the judge.

* :mod:`.ab`: the A/B sides, one worker process each, interleaved rounds of a case in pairs;
* :mod:`.case_worker`: the measuring process itself (``python -m decodebench.runner.case_worker``);
* :mod:`.fresh`: re-measures (and the confirmation of a SLOWER on one run) in a new process per round;
* :mod:`.remeasure`: the session's record of how each case can be measured again;
* :mod:`.settle`: the loop that re-measures the cases the judge leaves open, round by round.

What they hand on is typed: a :class:`~decodebench.harness.Run` per re-measure, a
:class:`~.ab.Rounds` per A/B case. The verdicts are :mod:`decodebench.gate`'s, a pure function
of the stored runs; the pytest plugin wires the two together.
"""
