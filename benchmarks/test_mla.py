"""Absorbed-MLA decode attention over the paged latent KV cache, per rank: uniform batches
over the sweep's (batch, context) grid within a KV-cache budget, and one mixed-length batch,
for torch and each vLLM MLA backend that ``--mla-backends`` selects (by default the one
vLLM's own selector dispatches on this device; all of them with ``--sweep full``)."""

import functools

import pytest

from decodebench.kernels.mla import mla_cases
from decodebench.kernels.mla_select import ask_vllm_dispatch, select_backends
from decodebench.plugin import state_of
from decodebench.shapes import SweepLevel


@functools.cache
def vllm_dispatch(head_dim: int, heads: int, device):
    """Asked once per session: vLLM's selector imports every candidate backend."""
    return ask_vllm_dispatch(head_dim, heads, device)


def dispatch_of(config):
    state = state_of(config)
    return vllm_dispatch(state.shapes.mla.head_dim, state.shapes.mla.heads, state.device)


def pytest_generate_tests(metafunc):
    """Cases, then backends: ids read ``uniform-h8-b1-l1024-torch``, as the stored baselines name them."""
    if "mla_backend" in metafunc.fixturenames:
        config, state = metafunc.config, state_of(metafunc.config)
        cases = state.cases_of(mla_cases)
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])
        backends = select_backends(config.getoption("mla_backends"), state.sweep.level is SweepLevel.FULL,
                                   lambda: dispatch_of(config))
        metafunc.parametrize("mla_backend", backends)


# the factory names how a worker rebuilds a case (A/B, fresh re-measures); the cases are
# parametrized above, crossed with the backends
@pytest.mark.cases(factory=mla_cases, parametrize=False)
def test_mla_decode(case, mla_backend, kernel_bench, device_benchmark, pytestconfig):
    device_benchmark.extra_info.update(dispatch_of(pytestconfig).extra_info(mla_backend))
    kernel_bench(case, mla_backend)  # paged for the backend by the harness (KernelCase.for_backend)
