"""The gate: is this build slower than the stored history, or than side A of an A/B? The rule is
:mod:`.decision`'s, the evidence :func:`.verdict.judge`'s; its modules: docs/development.md, Layout;
the model: docs/gate.md.
"""

from .decision import Policy, Verdict
from .verdict import CaseInput, CaseVerdict, judge

__all__ = ["CaseInput", "CaseVerdict", "Policy", "Verdict", "judge"]
