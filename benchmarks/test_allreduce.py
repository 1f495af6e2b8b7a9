"""Tensor-parallel all-reduce of the decode step: ``[M, hidden]`` bf16 summed over the ranks of
``--world-size`` at every token count of the sweep, plus a power-of-two size sweep, per backend."""

import pytest

from decodebench.distributed.allreduce import BACKENDS, allreduce_cases


@pytest.mark.cases(factory=allreduce_cases)
@pytest.mark.parametrize("backend", BACKENDS)
def test_allreduce(case, backend, allreduce_bench):
    allreduce_bench(case, backend)
