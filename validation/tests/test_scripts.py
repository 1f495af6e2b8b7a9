"""The validation scripts take the product's prediction options from its one declaration, as the package does."""

import re

from decodebench.attribution.options import OPTIONS
from validation.tests.evidence import VALIDATION


def test_no_validation_script_declares_a_prediction_option_of_its_own():
    flags = "|".join(re.escape(o.flag) for name, o in OPTIONS.items() if name not in ("model", "tp")) + "|--layers"
    declared = re.compile(rf"\b(?:add|add_argument|addoption)\(\s*[\"']({flags})[\"']")
    elsewhere = sorted(f"{p.relative_to(VALIDATION)}: {m.group(1)}" for p in VALIDATION.rglob("*.py")
                       for m in declared.finditer(p.read_text()))
    assert elsewhere == [], elsewhere
