"""The errors decodebench raises on purpose, each naming what is wrong."""

__all__ = [
    "BackendUnavailable",
    "ConfigError",
    "KernelMismatch",
    "ServerError",
    "ShapeError",
]


class ConfigError(ValueError):
    """A model config.json is missing, malformed or lacks a field decode shapes need."""


class ShapeError(ValueError):
    """A deployment (TP size, group size, page size) does not divide the model's dimensions."""


class BackendUnavailable(RuntimeError):
    """A backend cannot run here (package, op or device missing); benchmarks turn it into a skip."""


class KernelMismatch(AssertionError):
    """A kernel's output disagrees with the reference; the case is failed and never timed."""


class ServerError(RuntimeError):
    """A server did not start, did not answer, or left processes behind; the message says which."""
