"""What the evidence's checks share: the repository root and the validation scripts imported by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VALIDATION = REPO / "validation"


def validation_script(path: str):
    """A script of ``validation/`` (no package) imported by its path under its own name, once per process:
    the scripts import each other by name, and a dataclass of theirs needs its module in ``sys.modules``."""
    name = Path(path).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / path)
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
