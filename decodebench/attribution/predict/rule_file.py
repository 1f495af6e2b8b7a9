"""A GPU's projection rule as a file beside its stored results: fitted once, loaded by every projection.

``python -m decodebench fit RESULTS.json...`` fits the rule of :mod:`.projection_rule` on the results of
one GPU (every timer the files hold: the nightly's ``step`` timer alone is enough) and writes
``rule-<gpu>.json`` beside the first file (``--out`` elsewhere). The file holds the parameters, each one's
source (the case that set it), the code version of the rule, the results it was fitted on (each file's
SHA-256 and a digest of the cases) and the error bands measured per pair of SM designs (a copy of
:data:`~.project.BANDS_FILE`). ``scenarios`` and ``breakdown --project-to`` load the rule files beside the
results they are given (:func:`use_stored`); one whose cases or code version are not the projection's is
left out, and says why::

    python -m decodebench fit baselines/<fingerprint>/0002_nightly.json
    python -m decodebench scenarios baselines/<fingerprint>/0002_nightly.json --project-to rtx-pro-6000-x8-pcie
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ...files import read_json, write_atomic
from .prediction import load_results
from .project import BANDS_FILE, cases_by_gpu, cases_digest, remember, rule_for
from .projection_rule import RuleParams, device_facts

__all__ = ["CODE_VERSION", "main", "use_stored", "write_rules"]

# the rule's code: its form and fit live in projection_rule.py, a fit of other code is another rule
CODE_VERSION = hashlib.sha256((Path(__file__).parent / "projection_rule.py").read_bytes()).hexdigest()[:16]


def write_rules(paths: Sequence[Path], out: Path | None = None) -> list[Path]:
    """Fit each GPU of ``paths``' results and write its rule file (beside the first file, or in ``out``);
    ValueError naming the files when they hold no GPU's kernel results or the rule cannot be fitted."""
    results = [r for p in paths for r in load_results(p)[0]]
    by_gpu = cases_by_gpu(results)
    if not by_gpu:
        raise ValueError(f"{', '.join(map(str, paths))}: no vLLM kernel result that names its GPU")
    written = []
    for gpu, cases in by_gpu.items():
        facts = device_facts(gpu)
        params, _ = rule_for(cases, facts, f"{facts.name}: {', '.join(str(p) for p in paths)}")
        record = {"gpu": facts.name, "code_version": CODE_VERSION, "cases_digest": cases_digest(cases),
                  "results": {str(p): hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths},
                  "params": asdict(params), "bands": read_json(BANDS_FILE)["bands"]}
        target = (out or Path(paths[0]).parent) / f"rule-{facts.name.replace(' ', '-').lower()}.json"
        write_atomic(target, (json.dumps(record, indent=1) + "\n").encode())
        written.append(target)
    return written


def use_stored(paths: Sequence[Path]) -> list[str]:
    """Load the rule files beside ``paths`` for the projections of this process; a line per file: used, or
    left out and why (another code version). ValueError naming a rule file that cannot be read."""
    notes = []
    for rule in sorted({f for p in paths for f in Path(p).resolve().parent.glob("rule-*.json")}):
        try:
            record = read_json(rule)
            params = RuleParams(**record["params"])
            facts, digest, version = device_facts(record["gpu"]), record["cases_digest"], record["code_version"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{rule}: not a rule file written by python -m decodebench fit ({exc})") from None
        if version != CODE_VERSION:
            notes.append(f"{rule}: fitted by another version of the rule ({version}, this is {CODE_VERSION}): "
                         "not used; python -m decodebench fit refits it")
            continue
        remember(facts, digest, params, f"the stored fit {rule}")
        notes.append(f"{rule}: the stored fit of {facts.name}, for results that are its cases (the projection's "
                     "rule line says whether it was used)")
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m decodebench fit",
                                description="Fit the projection rule on one GPU's results and store it beside them.")
    p.add_argument("results", nargs="+", type=Path, metavar="RESULTS.json", help="kernel results (any timer)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where to write rule-<gpu>.json. Default: beside the first results file")
    args = p.parse_args(argv)
    try:
        written = write_rules(args.results, args.out)
    except (ValueError, OSError) as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(f"rule: {path}" for path in written))
    return 0
