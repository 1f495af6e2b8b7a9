"""Expert routing of every MoE layer: the router GEMM (hidden -> one logit per expert)
and the top-k selection (scores, correction bias, top-k, renormalize, routed scaling),
at the decode batch sizes of the sweep."""

import pytest

from decodebench.kernels.backends import backends_for
from decodebench.kernels.router import router_gemm_cases, topk_cases


@pytest.mark.cases(factory=router_gemm_cases)
@pytest.mark.parametrize("backend", backends_for("router_gemm"))
def test_router_gemm(case, backend, kernel_bench):
    kernel_bench(case, backend)


@pytest.mark.cases(factory=topk_cases)
@pytest.mark.parametrize("backend", backends_for("routing_topk"))
def test_routing_topk(case, backend, kernel_bench):
    kernel_bench(case, backend)
