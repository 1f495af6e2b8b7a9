"""Expert-parallel dispatch and combine: the all-to-all of an EP all-to-all backend, and vLLM's
all-gather + reduce-scatter fallback, at EP message sizes (``--ep``, else the TP size) for every
token count of the sweep, over the ranks of ``--world-size``, per collective timer (on CUDA,
CUDA events around eager calls and CUDA-graph replay)."""

import pytest

from decodebench.distributed.dispatch import dispatch_cases


@pytest.mark.cases(factory=dispatch_cases)
def test_dispatch(case, collective_timer, dispatch_bench):
    dispatch_bench(case, collective_timer)
