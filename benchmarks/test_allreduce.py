"""Tensor-parallel all-reduce of the decode step: ``[M, hidden]`` bf16 summed over the ranks of
``--world-size`` at every token count of the sweep, plus a power-of-two size sweep, per backend
and per collective timer (``collective_timer``, parametrized by fixtures/process_group.py from
``--timer``: on CUDA, CUDA events around eager calls and CUDA-graph replay)."""

import pytest

from decodebench.distributed.allreduce import BACKENDS, allreduce_cases


@pytest.mark.cases(factory=allreduce_cases)
@pytest.mark.parametrize("backend", BACKENDS)
def test_allreduce(case, backend, collective_timer, allreduce_bench):
    allreduce_bench(case, backend, collective_timer)
