"""The gate from stored files: ``python -m decodebench.gate BASELINE CURRENT [--gate PCT]``.

It prints the lines the live session prints and exits 1 when the gate fails, 0 otherwise, 2 on bad
input (:class:`BadInput`, one line naming the file); nothing is re-measured. BASELINE, CURRENT and
what is bad input: docs/gate.md, Offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..baselines import StoredResult, load_history, stored_number
from ..errors import ConfigError, ShapeError
from ..model import load_model_spec
from ..options import take_negative_values
from ..results import not_a_baseline, read_result, stored_fingerprint
from ..shapes import DecodeShapes
from .decision import Policy
from .reference import Baseline, baseline_from_history, label_of, new_cases, why_nothing
from .session import Judgment, assess, conclude
from .settings import add_gate_options, policy_from
from .verdict import CaseInput

__all__ = ["judge_files", "main"]


class BadInput(ValueError):
    """A file or folder the gate cannot use, named in the message."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decodebench.gate", description=__doc__.split("\n\n")[0])
    p.add_argument("baseline", type=Path, metavar="BASELINE", help="a fingerprint folder or a stored result file")
    p.add_argument("current", type=Path, metavar="CURRENT", help="a stored result file")
    add_gate_options(p.add_argument)
    take_negative_values(p)
    return p


def _read(path: Path) -> StoredResult:
    try:
        return StoredResult(path, read_result(path))
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def _read_current(path: Path) -> StoredResult:
    """CURRENT, every entry of it usable: a run judged without one of its cases would pass unseen."""
    current = _read(path)
    skipped = current.skipped()
    if skipped:
        more = f" (and {len(skipped) - 1} more entries)" if len(skipped) > 1 else ""
        raise BadInput(f"{skipped[0]}{more}: not a result the gate can judge")
    return current


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or a byte-identical copy of it (the same run stored twice)."""
    try:
        return a.resolve() == b.resolve() or (a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes())
    except OSError:
        return False


def _after(stored: Path, current: Path) -> bool:
    """Whether ``stored`` was saved after ``current``, a stored result of the same folder."""
    if stored.parent.resolve() != current.parent.resolve() or stored_number(current) is None:
        return False
    return (stored_number(stored), stored.name) > (stored_number(current), current.name)


def _baseline(path: Path, current: StoredResult, history: int, allow_empty: bool) -> Baseline:
    key = stored_fingerprint(current.document)
    if key is None:  # without it any machine's results would pass for this one's
        raise BadInput(f"{current.path}: records no machine fingerprint (machine_info.decodebench.fingerprint.key), "
                       "so no stored result can be known to come from the same machine")
    if path.is_dir():
        try:
            found = load_history(path, key)
        except ValueError as exc:  # a stored file that cannot be read: whatever it held, it is not skipped unseen
            raise BadInput(f"{exc}; a baseline folder's files must all be readable results") from None
        copies = [r for r in found.results if _same_file(r.path, current.path)]
        earlier = [r for r in found.results if all(r is not c for c in copies) and not _after(r.path, current.path)]
        found = dataclasses.replace(found, results=tuple(earlier), skipped=(
            *found.skipped, *(f"{r.path}: the same file as CURRENT {current.path}, not a run of its own" for r in copies
                              if r.path.resolve() != current.path.resolve())))
        if not found.results and not allow_empty:
            raise BadInput(f"{path}: {found.why_empty()}; --gate-allow-empty passes such a run")
        return baseline_from_history(found, history)
    if not path.exists():
        raise BadInput(f"{path}: no such file or folder")
    stored = _read(path)
    why = not_a_baseline(path, stored.document)
    if why:
        raise BadInput(why)
    baseline = Baseline(str(path))
    baseline.add(label_of(path), stored.document["benchmarks"], path)
    theirs = stored_fingerprint(stored.document)
    if theirs != key:
        baseline.problem = (f"baseline measured on {theirs or 'an unknown machine (no decodebench fingerprint)'}, "
                            f"this run is {key}: timings are not comparable")
    return baseline


def _shapes(current: StoredResult) -> tuple[DecodeShapes | None, str | None]:
    machine = current.document.get("machine_info")
    info = machine.get("decodebench") if isinstance(machine, Mapping) else None
    model, tp = (info.get("model"), info.get("tp")) if isinstance(info, Mapping) else (None, None)
    if not isinstance(model, str) or not isinstance(tp, int) or isinstance(tp, bool):
        return None, (f"no cost per decode step: {current.path} does not record its model and TP "
                      "(machine_info.decodebench.model and .tp)")
    try:
        return DecodeShapes.for_deployment(load_model_spec(model), tp), None
    except (ConfigError, ShapeError, ValueError) as exc:
        return None, (f"no cost per decode step: the model of {current.path} ({model!r}, TP {tp}) "
                      f"cannot be loaded: {exc}")


def judge_files(baseline_path: Path, current_path: Path, policy: Policy, gate: float | None,
                allow_empty: bool = False) -> tuple[Judgment, Baseline, list[str]]:
    """The session's judgment, from files: verdicts, steps, conclusion; the baseline; notes.

    Raises :class:`BadInput` naming a file the gate cannot use.
    """
    current = _read_current(current_path)
    baseline = _baseline(baseline_path, current, policy.history, allow_empty)
    entries = current.entries()
    baseline.drop_copies_of(entries, current.path)
    inputs = [] if baseline.problem else [CaseInput(n, e, tuple(baseline.entries[n]))
                                          for n, e in entries.items() if n in baseline.entries]
    paired = [CaseInput(n, e) for n, e in entries.items() if e.paired is not None]
    if paired:  # an A/B run's JSON: B against A, no stored baseline involved
        inputs = paired
    shapes, note = _shapes(current)
    judgment = assess(inputs, policy, shapes=shapes, prediction_entries=baseline.records())
    verdicts = judgment.verdicts
    new = [] if paired else new_cases(baseline, entries)
    why = why_nothing(baseline, len(entries), [v.name for v in verdicts], [v.reason for v in verdicts], new)
    judgment.conclusion = conclude(judgment.verdicts, judgment.steps, policy, gate=gate, allow_empty=allow_empty,
                                   nothing_why=why, new=new)
    return judgment, baseline, [note] if note else []


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    policy = policy_from(args)
    try:
        judgment, baseline, notes = judge_files(args.baseline, args.current, policy, args.gate, args.gate_allow_empty)
    except BadInput as exc:
        print(f"decodebench.gate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("decodebench.gate: interrupted, nothing judged", file=sys.stderr)
        return 130
    print(f"decodebench gate: {args.current} against {baseline.source}")
    for skipped in baseline.skipped:
        print(f"skipped stored result: {skipped}")
    for line in [*notes, *judgment.lines(policy)]:
        print(line)
    return 1 if judgment.conclusion.failed else 0
