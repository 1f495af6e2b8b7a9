"""decodebench: device-timed, correctness-checked benchmarks of MoE + MLA decode kernels.

The pipeline: config.json -> :class:`ModelSpec` -> :class:`DecodeShapes` -> component
case -> :func:`measure` -> pytest-benchmark stats -> ``baselines/<fingerprint>/``.
"""

from .errors import BackendUnavailable, ConfigError, KernelMismatch, ShapeError
from .model import ModelSpec, QuantSpec, load_model_spec
from .roofline import Peaks, Traffic, roofline
from .shapes import DecodeShapes, GemmShape, MLAShape, Sweep, SweepLevel, sweep_for
from .timing import Budget, Measurement, StopReason, TimerMode, measure

__all__ = [
    "BackendUnavailable",
    "Budget",
    "ConfigError",
    "DecodeShapes",
    "GemmShape",
    "KernelMismatch",
    "MLAShape",
    "Measurement",
    "ModelSpec",
    "Peaks",
    "QuantSpec",
    "ShapeError",
    "StopReason",
    "Sweep",
    "SweepLevel",
    "TimerMode",
    "Traffic",
    "load_model_spec",
    "measure",
    "roofline",
    "sweep_for",
]
