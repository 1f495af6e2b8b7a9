"""Absorbed-MLA decode attention over the paged latent KV cache, per rank: uniform batches
over the sweep's (batch, context) grid within a KV-cache budget, and one mixed-length batch,
for torch and each vLLM MLA backend that ``--mla-backends`` selects (by default the one
vLLM's own selector dispatches on this device at each ``--kv-cache-dtype``; all of them with
``--sweep full``), the cache at each ``--kv-cache-dtype``."""

import functools

import pytest

from decodebench.kernels.mla import mla_cases
from decodebench.kernels.mla_select import ask_vllm_dispatch, select_backends
from decodebench.plugin import state_of
from decodebench.shapes import SweepLevel


@functools.cache
def vllm_dispatch(head_dim: int, heads: int, device, kv_cache_dtype: str):
    """Asked once per session and KV-cache dtype: vLLM's selector imports every candidate backend."""
    return ask_vllm_dispatch(head_dim, heads, device, kv_cache_dtype)


def dispatch_of(config, kv_cache_dtype: str):
    state = state_of(config)
    return vllm_dispatch(state.shapes.mla.head_dim, state.shapes.mla.heads, state.device, kv_cache_dtype)


def pytest_generate_tests(metafunc):
    """Cases, then backends: ids read ``uniform-h8-b1-l1024-torch``, as the stored baselines name them."""
    if "mla_backend" in metafunc.fixturenames:
        config, state = metafunc.config, state_of(metafunc.config)
        cases = state.cases_of(mla_cases)
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])
        full = state.sweep.level is SweepLevel.FULL
        backends = []  # torch first, then each backend selected at any of the session's cache dtypes
        for kv in state.kv_cache_dtypes:
            chosen = select_backends(config.getoption("mla_backends"), full, lambda kv=kv: dispatch_of(config, kv))
            backends += [b for b in chosen if b not in backends]
        metafunc.parametrize("mla_backend", backends)


# the factory names how a worker rebuilds a case (A/B, fresh re-measures); the cases are
# parametrized above, crossed with the backends
@pytest.mark.cases(factory=mla_cases, parametrize=False)
def test_mla_decode(case, mla_backend, kernel_bench, pytestconfig):
    dispatch = dispatch_of(pytestconfig, case.kv_cache_dtype.spelling)
    kernel_bench(case, mla_backend, dispatch.facts(mla_backend))  # paged for the backend by the harness
