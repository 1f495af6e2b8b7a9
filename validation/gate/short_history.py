"""The stored-mode gate on a new runner's first nights, offline, over the committed H200 sessions.

Each committed session of the unchanged build is one night. A night is judged as a live session
judges it: against ``k`` stored sessions (a history of ``k`` = 1..4), its first run judged, then
each case that is not yet decided re-measured with the runs that session stored for it (the
live session's fresh-process re-measures, up to ``--gate-resamples``); a case that stored no
more runs cannot be re-measured, so its first look is its last (pessimistic: a live session
would re-measure it). Every arrangement is used: each session in turn is the night, each
``k``-subset of the others (oldest first) its history. A night *fails* when any case is SLOWER.
Under the unchanged build the sessions are exchangeable; the arrangements whose history is
older than the night (the new runner's own order) are counted apart as well.

Power: each committed ``--inject-slowdown 5%`` session at ``--gate 3%`` against ``k`` stored
sessions of the unchanged build (k = 5: all of them); a case is caught when SLOWER.

Every verdict is also checked for a SAME whose interval at the session's level reaches past
the threshold (the figure must be 0).

    python validation/gate/short_history.py --out validation/gate/h200

``--unchanged FILE...`` and ``--injected [FILE...]`` judge other sessions instead (the same kernel set
and timer; no file after ``--injected``: no power table), e.g. the lent H100's kernel-timer runs:

    python validation/gate/short_history.py --unchanged validation/tp8/h100-2026-12-05/kernel.json.gz \
        validation/tp8/h100-2026-12-05-b/kernel.json.gz validation/gate/h100-2026-12-06/night-1.json.gz \
        validation/gate/h100-2026-12-06/night-2.json.gz --injected --histories 1,2,3 --out validation/gate/h100

writes ``short-history.json.gz`` (one record per night: its sessions, counts, failing cases) and
``short-history.md`` (the tables of ``docs/validation.md``), and prints the tables; ``--verdicts
FILE.tsv.gz`` also writes every verdict of every trial (``validation/gate/verdict_changes.py``
lists those that differ between two such files).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import itertools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from decodebench import stats  # noqa: E402
from decodebench.gate import CaseInput, Policy, Verdict  # noqa: E402
from decodebench.gate import runs as R  # noqa: E402
from decodebench.gate.decision import per_test_alpha, pooled  # noqa: E402
from decodebench.gate.series import levels_of  # noqa: E402
from decodebench.harness import Run  # noqa: E402

try:
    from decodebench.runner.settle import settle  # noqa: E402
except ImportError:  # the model before the re-measure loop moved to the runner: run it for comparison
    from decodebench.gate.settle import settle  # noqa: E402
from decodebench.entry_check import usable_entries  # noqa: E402

H200 = "baselines/nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
UNCHANGED = (  # the nightly vllm kernel set, unchanged build, oldest first
    f"{H200}/0002_h200-vllm-nightly.json",
    f"{H200}/0003_h200-vllm-nightly-aa.json",
    f"{H200}/0005_h200-vllm-nightly-gated.json",
    "validation/h200/gate/stored-power-lease5/inject0-gate5/stored-power-1.json.gz",
    "validation/h200/gate/stored-power-lease9/inject0-gate5/stored-power-1.json.gz",
)
INJECTED = (  # --inject-slowdown 5% --gate 3%
    "validation/h200/gate/stored-power-lease5/inject5-gate3/stored-power-1.json.gz",
    "validation/h200/gate/stored-power-lease6/inject5-gate3/stored-power-1.json.gz",
    "validation/h200/gate/stored-power-lease6/inject5-gate3/stored-power-2.json.gz",
    "validation/h200/gate/stored-power-lease7/inject5-gate3/stored-power-1.json.gz",
    "validation/h200/gate/stored-power-lease7/inject5-gate3/stored-power-2.json.gz",
    "validation/h200/gate/stored-power-lease9/inject5-gate3-a/stored-power-2.json.gz",
    "validation/h200/gate/stored-power-lease9/inject5-gate3-b/stored-power-1.json.gz",
    "validation/h200/gate/stored-power-lease9/inject5-gate3-b/stored-power-2.json.gz",
    "validation/h200/gate/stored-power-lease9/inject5-gate3-c/stored-power-1.json.gz",
)


@dataclass(frozen=True)
class Session:
    label: str  # its path, short
    when: str  # its datetime
    entries: Mapping[str, Mapping]  # usable kernel entries by test id


def load(path: str) -> Session:
    full = ROOT / path
    with (gzip.open(full, "rt") if path.endswith(".gz") else open(full)) as f:
        document = json.load(f)
    entries, _ = usable_entries(document["benchmarks"], path)
    return Session(path.replace(f"{H200}/", "").replace("validation/h200/gate/", ""), document["datetime"], entries)


def case_runs(sessions: Sequence[Session]) -> dict[str, tuple[list, list, list]]:
    """Each case's log run values over ``sessions``, their kernel signatures and session labels."""
    runs: dict[str, tuple[list, list, list]] = {}
    for session in sessions:
        for name, entry in session.entries.items():
            values, kernels = R.run_values(entry)
            have = runs.setdefault(name, ([], [], []))
            have[0].extend(values)
            have[1].extend(kernels)
            have[2].extend([session.label] * len(values))
    return runs


def own_spreads(sessions: Sequence[Session], threshold: float = 0.05) -> dict[str, float]:
    """Each case's own run-to-run spread over ``sessions`` (log scale): its runs pooled within the
    gate's levels (:func:`~decodebench.gate.series.levels_of` at ``threshold``), whatever the model."""
    out = {}
    for name, (values, kernels, _) in case_runs(sessions).items():
        spread = pooled([lv.values for lv in levels_of(values, kernels, threshold)])
        if spread.df > 0:
            out[name] = spread.sigma
    return out


def value_levels(sessions: Sequence[Session], threshold: float) -> dict[str, list]:
    """Each case's levels over ``sessions`` by value alone (kernels set aside, to ask whether the
    levels come with other kernels)."""
    return {name: levels_of(values, [None] * len(values), threshold)
            for name, (values, _, _) in case_runs(sessions).items()}


def level_table(sessions: Sequence[Session], threshold: float = 0.05) -> str:
    """The cases with two value levels over ``sessions``: each level's floor, runs, sessions and
    the kernels its runs launched (recorded by the sessions that record them)."""
    runs = case_runs(sessions)
    lines = ["| case | level | runs | sessions | kernels |", "|---|---|---|---|---|"]
    for name, levels in sorted(value_levels(sessions, threshold).items()):
        if len(levels) < 2:
            continue
        values, kernels, labels = runs[name]
        low = stats.mean(levels[0].values)
        for level in levels:
            at = [i for i, v in enumerate(values) if v in level.values]
            signatures = {kernels[i] for i in at if kernels[i] is not None}
            names = "; ".join(sorted({k for sig in signatures for k, _ in sig})) or "not recorded"
            where = ", ".join(sorted({labels[i].split("/")[0].replace("stored-power-", "").split("_")[0] for i in at}))
            gap = math.expm1(stats.mean(level.values) - low)
            lines.append(f"| `{name.split('[')[-1].rstrip(']')}` | {math.exp(stats.mean(level.values)) * 1e6:.2f} µs "
                         f"({gap:+.1%}) | {len(level.values)} | {where} | {len(signatures)} signature(s): "
                         f"{names[:160]} |")
    return "\n".join(lines) + "\n"


def reachable(verdict, spread: float | None, single_level: bool, alpha: float, runs_now: int,
              threshold: float, change: float = 0.05) -> bool:
    """Whether the gate can catch ``change`` on this case with 95 % power by design: one level in
    its baseline, and its own ``spread`` (one run, log) small enough that with ``runs_now`` runs
    against the baseline's, at the verdict's df, a change of ``change`` lies beyond the threshold
    and its interval above 0 in 95 % of sessions."""
    if not single_level or spread is None or not verdict.df:
        return False
    se = spread * math.sqrt(1 / max(1, verdict.runs[0]) + 1 / runs_now)
    q = stats.student_t_quantile(1 - alpha, verdict.df)
    return math.log1p(change) - NormalDist().inv_cdf(0.95) * se >= max(math.log1p(threshold), q * se)


def first_run(entry: Mapping) -> tuple[dict, list[tuple[list, object]]]:
    """The entry as its first run alone, and the runs the session re-measured it with."""
    entry = copy.deepcopy(dict(entry))
    info = entry["extra_info"] = dict(entry.get("extra_info") or {})
    runs = list(info.pop("resamples", None) or [])
    kernels = list(info.pop("resample_kernels", None) or []) + [None] * len(runs)
    info.pop("gate", None)
    return entry, list(zip(runs, kernels[: len(runs)], strict=True))


def night(history: Sequence[Session], tonight: Session, policy: Policy) -> list:
    """Tonight's verdicts against ``history`` (oldest first), re-measured with its stored runs."""
    names = [n for n in tonight.entries if any(n in s.entries for s in history)]
    current, spare = {}, {}
    for name in names:
        current[name], spare[name] = first_run(tonight.entries[name])

    def remeasure(name: str):
        def again() -> Run:
            if not spare[name]:
                raise LookupError("the session stored no further run of this case")
            samples, kernels = spare[name].pop(0)
            return Run(samples, kernels)
        return again

    inputs = [CaseInput(n, current[n], tuple((s.label, s.entries[n]) for s in history if n in s.entries))
              for n in names]
    return settle(lambda: inputs, {n: remeasure(n) for n in names}, policy)


def beyond(verdict, threshold: float) -> bool:
    """A SAME whose interval at the session's level reaches past ``threshold``."""
    if verdict.verdict is not Verdict.SAME or verdict.low is None:
        return False
    limit = math.log1p(threshold) + 1e-12
    return math.log(verdict.high) > limit or math.log(verdict.low) < -limit


TIGHT = 0.01  # a case whose own spread over the unchanged sessions is at most this is "tight"


def record(history: Sequence[Session], tonight: Session, verdicts: Sequence, threshold: float, injected: bool,
           spreads: Mapping[str, float] | None = None, single: Mapping[str, bool] | None = None) -> dict:
    counts = {v.value: 0 for v in Verdict}
    for v in verdicts:
        counts[v.verdict.value] += 1
    return {"history": [s.label for s in history], "night": tonight.label, "stored": len(history),
            "in_order": all(s.when < tonight.when for s in history), "gate": threshold, "injected": injected,
            "cases": len(verdicts), **counts,
            "slower_cases": [f"{v.name}: {v.reason}" for v in verdicts if v.verdict is Verdict.SLOWER and not injected],
            "faster_cases": [f"{v.name}: {v.reason}" for v in verdicts if v.verdict is Verdict.FASTER],
            "same_beyond": [f"{v.name}: {v.reason}" for v in verdicts if beyond(v, threshold)],
            "by_family": _by_family(verdicts),
            "tight": _tight(verdicts, spreads or {}),
            "reachable": _reachable(verdicts, spreads or {}, single or {}, threshold)}


def _tight(verdicts: Sequence, spreads: Mapping[str, float]) -> dict[str, int]:
    """Trials and SLOWER among the cases whose own spread is at most :data:`TIGHT`."""
    tight = [v for v in verdicts if spreads.get(v.name, 1.0) <= TIGHT]
    return {"trials": len(tight), "slower": sum(v.verdict is Verdict.SLOWER for v in tight)}


def _reachable(verdicts: Sequence, spreads: Mapping[str, float], single: Mapping[str, bool],
               threshold: float) -> dict[str, int]:
    """Trials and SLOWER among the cases where a +5 % change is within reach by design (:func:`reachable`)."""
    policy = Policy(threshold=threshold)
    alpha = per_test_alpha(policy, sum(v.verdict is not Verdict.INCOMPARABLE for v in verdicts))
    within = [v for v in verdicts if reachable(v, spreads.get(v.name), single.get(v.name, False), alpha,
                                               policy.resamples + 1, threshold)]
    return {"trials": len(within), "slower": sum(v.verdict is Verdict.SLOWER for v in within)}


def family(name: str) -> str:
    """``…::test_moe[fused-e384-…]`` -> ``test_moe fused``: the test and the first field of its id."""
    test = name.split("::")[-1]
    head, _, rest = test.partition("[")
    return f"{head} {rest.split('-')[0]}" if rest else head


def _by_family(verdicts: Sequence) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for v in verdicts:
        row = out.setdefault(family(v.name), {"cases": 0, "slower": 0, "undecided": 0, "same": 0})
        row["cases"] += 1
        row[v.verdict.value] = row.get(v.verdict.value, 0) + 1
    return out


VERDICTS: list[str] = []  # every verdict, one tab-separated line each, for --verdicts


def _keep(kind: str, history: Sequence[Session], tonight: Session, threshold: float, verdicts: Sequence) -> list:
    """``verdicts``, each also kept as a line of :data:`VERDICTS`: which trial, the case, its verdict and reason."""
    trial = f"{kind}\t{threshold:.0%}\t{len(history)}\t{tonight.label}\t{' '.join(s.label for s in history)}"
    VERDICTS.extend(f"{trial}\t{v.name}\t{v.verdict.value}\t{v.reason}" for v in verdicts)
    return verdicts


def unchanged_nights(sessions: Sequence[Session], threshold: float, histories: Sequence[int]) -> list[dict]:
    policy = Policy(threshold=threshold)
    out = []
    for k in histories:
        for tonight in sessions:
            others = [s for s in sessions if s is not tonight]
            for history in itertools.combinations(others, k):
                verdicts = _keep("unchanged", history, tonight, threshold, night(history, tonight, policy))
                out.append(record(history, tonight, verdicts, threshold, False))
                print(f"unchanged k={k} {tonight.label}: {out[-1]['slower']} slower", file=sys.stderr)
    return out


def injected_nights(sessions: Sequence[Session], injected: Sequence[Session], threshold: float,
                    histories: Sequence[int]) -> list[dict]:
    policy = Policy(threshold=threshold)
    spreads = own_spreads(sessions)
    single = {name: len(levels) == 1 for name, levels in value_levels(sessions, threshold).items()}
    out = []
    for k, tonight in itertools.product(histories, injected):
        for history in itertools.combinations(sessions, k):
            verdicts = _keep("injected", history, tonight, threshold, night(history, tonight, policy))
            out.append(record(history, tonight, verdicts, threshold, True, spreads, single))
            print(f"injected k={k} {tonight.label}: {out[-1]['slower']} of {out[-1]['cases']}", file=sys.stderr)
    return out


def tables(records: Sequence[dict]) -> str:
    lines = ["Unchanged build (every night: each session against each k-subset of the others; in order: the",
             "history older than the night):", "",
             "| gate | stored runs | nights | failed | in order: nights | failed | SLOWER | FASTER | UNDECIDED "
             "| SAME | cases | SAME past the threshold |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = [r for r in records if not r["injected"]]
    for gate, k in sorted({(r["gate"], r["stored"]) for r in plain}):
        rows = [r for r in plain if (r["gate"], r["stored"]) == (gate, k)]
        ordered = [r for r in rows if r["in_order"]]
        total = {key: sum(r[key] for r in rows) for key in ("slower", "faster", "undecided", "same", "cases")}
        lines.append(f"| {gate:.0%} | {k} | {len(rows)} | {sum(r['slower'] > 0 for r in rows)} | {len(ordered)} "
                     f"| {sum(r['slower'] > 0 for r in ordered)} | {total['slower']} | {total['faster']} "
                     f"| {total['undecided']} | {total['same']} | {total['cases']} "
                     f"| {sum(len(r['same_beyond']) for r in rows)} |")
    injected = [r for r in records if r["injected"]]
    if injected:
        lines += ["", "+5 % injected on every case:", "",
                  "| gate | stored runs | nights | cases | caught (SLOWER) | UNDECIDED | SAME | FASTER "
                  f"| SAME past the threshold | own spread ≤ {TIGHT:.0%}: caught | within reach by design: caught |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for gate, k in sorted({(r["gate"], r["stored"]) for r in injected}):
            rows = [r for r in injected if (r["gate"], r["stored"]) == (gate, k)]
            cases = sum(r["cases"] for r in rows)
            caught = sum(r["slower"] for r in rows)
            lines.append(f"| {gate:.0%} | {k} | {len(rows)} | {cases} | {caught} ({caught / cases:.1%}) "
                         f"| {sum(r['undecided'] for r in rows)} | {sum(r['same'] for r in rows)} "
                         f"| {sum(r['faster'] for r in rows)} | {sum(len(r['same_beyond']) for r in rows)} "
                         f"| {_share(*_totals(rows, 'tight'))} | {_share(*_totals(rows, 'reachable'))} |")
        lines += ["", "By family, at the most stored runs:", "", "| family | trials | caught | UNDECIDED |",
                  "|---|---|---|---|"]
        k = max(r["stored"] for r in injected)
        families: dict[str, dict[str, int]] = {}
        for r in injected:
            if r["stored"] == k:
                for name, row in r["by_family"].items():
                    total = families.setdefault(name, {})
                    for key, n in row.items():
                        total[key] = total.get(key, 0) + n
        for name, row in sorted(families.items()):
            lines.append(f"| `{name}` | {row['cases']} | {row['slower']} ({row['slower'] / row['cases']:.0%}) "
                         f"| {row['undecided']} |")
    return "\n".join(lines) + "\n"


def _totals(rows: Sequence[dict], key: str) -> tuple[int, int]:
    """SLOWER and trials of ``rows``' ``key`` counts (0, 0 where a record has none)."""
    return tuple(sum(r.get(key, {}).get(part, 0) for r in rows) for part in ("slower", "trials"))


LEVELS_HEAD = "\nCases on two value levels over the unchanged sessions, and the kernels each level ran:\n\n"


def _share(part: int, whole: int) -> str:
    return f"{part} of {whole} ({part / whole:.1%})" if whole else "-"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder for short-history.json.gz and short-history.md")
    p.add_argument("--histories", default="1,2,3,4", help="stored runs of the unchanged nights (default 1,2,3,4)")
    p.add_argument("--gates", default="5%,3%", help="thresholds of the unchanged nights (default 5%%,3%%)")
    p.add_argument("--power-histories", default="1,2,3,4,5",
                   help="stored runs of the injected nights (default 1,2,3,4,5)")
    p.add_argument("--unchanged", nargs="+", default=list(UNCHANGED), metavar="FILE",
                   help="sessions of the unchanged build, oldest first (default: the committed H200 sessions)")
    p.add_argument("--injected", nargs="*", default=list(INJECTED), metavar="FILE",
                   help="--inject-slowdown 5%% --gate 3%% sessions (default: the committed H200 ones; none: no power)")
    p.add_argument("--verdicts", type=Path, help="also write every verdict here (gzipped TSV: trial, case, verdict, "
                   "reason), for validation/gate/verdict_changes.py")
    args = p.parse_args(argv)
    histories = [int(k) for k in args.histories.split(",")]
    power = [int(k) for k in args.power_histories.split(",")]
    if max(histories) >= len(args.unchanged):
        p.error(f"--histories {args.histories}: a night needs more stored runs than the {len(args.unchanged)} "
                f"--unchanged sessions leave beside it (at most {len(args.unchanged) - 1})")
    if args.injected and max(power) > len(args.unchanged):
        p.error(f"--power-histories {args.power_histories}: more stored runs than the {len(args.unchanged)} "
                f"--unchanged sessions")
    sessions = [load(path) for path in args.unchanged]
    injected = [load(path) for path in args.injected]
    records = []
    for gate in args.gates.split(","):
        records += unchanged_nights(sessions, float(gate.rstrip("%")) / 100, histories)
    records += injected_nights(sessions, injected, 0.03, power) if injected else []
    levels = level_table(sessions)
    text = tables(records) + LEVELS_HEAD + levels
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python validation/gate/short_history.py " + " ".join(argv if argv is not None else sys.argv[1:])
        raw = json.dumps({"command": command, "nights": records, "level_table": levels}, indent=1) + "\n"
        (args.out / "short-history.json.gz").write_bytes(gzip.compress(raw.encode(), mtime=0))
        (args.out / "short-history.md").write_text(f"$ {command}\n\n{text}")
    if args.verdicts:
        with gzip.open(args.verdicts, "wt", encoding="utf8", compresslevel=9) as f:
            f.write("kind\tgate\tstored\tnight\thistory\tcase\tverdict\treason\n")
            f.writelines(line + "\n" for line in VERDICTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
