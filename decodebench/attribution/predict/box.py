"""The decode step on the users' box: TPOT = kernels + all-reduces + what the profile adds.

From kernel results of one GPU here, the TPOT per decode step on a target machine (the 8x
RTX PRO 6000 box) as a sum of terms, each shown with where it comes from:

* **kernels**: the step predicted (:mod:`.predict`) from the results projected by the rule of
  :mod:`.projection_rule`, fitted on the results' own GPU, to the target in the decode step's
  cache state (weights from DRAM, activations in L2); the MLA term from the backend vLLM's
  selector runs on the target's GPU (the target file's ``backends``: ``TRITON_MLA`` on SM120);
* **all-reduces**: ``DecodeShapes.allreduces_per_step`` over the target's link, ``alpha + bytes /
  beta`` from the link table, with the path vLLM takes there (:func:`~decodebench.distributed.links.vllm_would_use`);
* **kernels no benchmark covers** (sampling, copies and casts, other): from two committed
  profiles of the step at two depths, a fixed part and a part per layer, carried to the target's
  depth unscaled;
* **GPU idle** (host time between steps and kernels that the GPU does not hide): the larger of
  the idle a GPU-bound profiled load left and the host's step time (a host-bound load's step
  wall) less the target's busy time.

The kernels' bracket is the rule's best estimate divided by (1 + the largest and the smallest
step error the cross-GPU checks measured, ``crosscheck.json``, one or more), not a what-if. The fused
MoE's overlap share comes from each GPU's ``sm_count.py`` runs (``--sm-count``); without them that
GPU's fused MoE takes the larger of its bounds. Published figures
for the box are set beside it with their sources (``published.json``)::

    python -m decodebench box RESULTS.json... --target rtx-pro-6000-x8-pcie \\
        --layer-profiles L2.json L4.json --idle-profile PROFILE.json [--crosscheck DIR/crosscheck.json] \\
        [--published PUBLISHED.json] [--sm-count sm-count.json...] --batch 1,64,128 --out DIR

(``--layer-profiles``: the ``attribution.json`` of ``breakdown`` at two depths; ``--idle-profile``: one of a
GPU-bound load; docs/validation.md lists the reports that name the files behind its figures.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from ...distributed.links import LinkMode, vllm_would_use
from ...files import read_json, write_atomic
from ...model import load_model_spec
from ...options import output_dir, positive_int_list
from ...registry import group_components, not_benchmarked
from ...shapes import DecodeShapes
from ..options import add_prediction_options
from . import sm_count
from .prediction import load_results, predict_step
from .projection_rule import (
    CACHE_STATES,
    DeviceModel,
    RuleParams,
    device_facts,
    fit,
    load_cases,
    project_case,
    traffic_us,
)
from .step import KernelResult, WhatIfError
from .targets import Target, load_target

__all__ = ["ProfileTerms", "load_crosscheck", "load_profile_terms", "load_published", "main", "tpot_rows"]

HOST_BOUND = 0.2  # a load whose GPU idled more than this share of its step was bound by the host


class ProfileTerms:
    """What the committed profiles say beside the kernels: per load, the kernels no benchmark covers
    (fixed + per layer) and the GPU's idle and busy time."""

    def __init__(self, layer_rows: list[dict], idle_rows: list[dict], sources: list[str]):
        self.layer_rows, self.idle_rows, self.sources = layer_rows, idle_rows, sources

    def not_benchmarked_us(self, batch: int, layers: int) -> tuple[float, str]:
        """The kernels no benchmark covers at ``layers`` layers: a line through the two depths profiled at
        the concurrency nearest ``batch``."""
        near = min({r["concurrency"] for r in self.layer_rows}, key=lambda c: abs(c - batch))
        rows = sorted((r for r in self.layer_rows if r["concurrency"] == near), key=lambda r: r["layers"])
        if len({r["layers"] for r in rows}) < 2:
            raise ValueError(f"C={near}: the layer profiles hold one depth; two are needed for the part per layer")
        (l1, u1), (l2, u2) = (rows[0]["layers"], rows[0]["us"]), (rows[-1]["layers"], rows[-1]["us"])
        per_layer = (u2 - u1) / (l2 - l1)
        fixed = u1 - per_layer * l1
        return fixed + per_layer * layers, (f"{fixed:.1f} µs fixed + {per_layer:.2f} µs per layer x {layers} "
                                            f"(profiled {u1:.1f} µs at {l1} layers and {u2:.1f} at {l2}, C={near}), "
                                            "unscaled")

    def idle_us(self, batch: int, busy_us: float) -> tuple[float, str]:
        """GPU idle on the target: the larger of a GPU-bound load's idle and the host's step less ``busy_us``."""
        gpu_bound = [r for r in self.idle_rows if r["idle_us"] < HOST_BOUND * r["wall_us"]]
        host_bound = [r for r in self.idle_rows if r["idle_us"] >= HOST_BOUND * r["wall_us"]]
        if not gpu_bound:
            raise ValueError("no profiled load was GPU-bound: the idle a busy GPU leaves is not known")
        residual = min(gpu_bound, key=lambda r: (abs(r["concurrency"] - batch), r["idle_us"]))
        host = max((r for r in host_bound if r["concurrency"] <= max(batch, 1)), key=lambda r: r["wall_us"],
                   default=None)
        waiting = host["wall_us"] - busy_us if host else 0.0
        how = (f"{residual['label']}: {residual['idle_us']:.1f} µs idle with the GPU busy {residual['busy_us']:.0f} "
               f"µs a step (GPU-bound)")
        if host:
            how += (f"; the host's step ({host['label']}, host-bound: {host['wall_us']:.0f} µs wall) is "
                    f"{'shorter than' if waiting <= residual['idle_us'] else 'longer than'} the target's busy "
                    f"{busy_us:.0f} µs")
        return max(residual["idle_us"], waiting), how


def load_profile_terms(layer_profiles: Sequence[Path], idle_profile: Path) -> ProfileTerms:
    """The profile terms from attribution JSON files at two depths and an attribution JSON or printed
    table of loads (their busy, idle and step wall); ValueError naming a file that lacks them."""
    layer_rows = []
    for path in layer_profiles:
        try:
            runs = read_json(path)
            for label, run in runs.items():
                layer_rows.append({"label": f"{path}:{label}", "layers": int(run["layers"]),
                                   "concurrency": _concurrency(label),
                                   "us": sum(run["components_us"].get(c, 0.0) for c in not_benchmarked())})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not an attribution JSON with layers and components_us ({exc})") from None
    return ProfileTerms(layer_rows, _idle_rows(Path(idle_profile)), [str(p) for p in (*layer_profiles, idle_profile)])


def _concurrency(label: str) -> int:
    """``c64-in1024-out128`` -> 64."""
    head = label.split("-")[0]
    if not head.startswith("c") or not head[1:].isdigit():
        raise ValueError(f"load label {label!r} does not start with cN")
    return int(head[1:])


def _idle_rows(path: Path) -> list[dict]:
    """Per profiled load: its concurrency, busy, idle and step wall, from an attribution JSON (each load's
    ``batch``, ``busy_us``, ``idle_us``, ``step_wall_us``) or a printed attribution table."""
    if path.suffix == ".json":
        try:
            return [{"label": f"{path}:{label}", "concurrency": int(run["batch"]), "busy_us": float(run["busy_us"]),
                     "idle_us": float(run["idle_us"]), "wall_us": float(run["step_wall_us"])}
                    for label, run in read_json(path).items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not an attribution JSON with batch, busy_us, idle_us and step_wall_us "
                             f"per load ({exc})") from None
    try:
        lines = path.read_text().splitlines()
        labels = [word for word in lines[0].split() if word[:1] == "c" and word[1:2].isdigit()]  # the loads
        end = next((i for i, line in enumerate(lines) if labels and line.startswith(labels[0] + ":")), len(lines))
        table = lines[1:end]  # the per-load table, up to the first load's own lines
        rows = {" ".join(w for w in line.split() if not w.replace(".", "").isdigit()): [
            w for w in line.split() if w.replace(".", "").isdigit()] for line in table}
        busy, idle, wall = (rows[k] for k in ("busy", "gpu_idle", "step wall"))
        rows_of = zip(labels, busy, idle, wall, strict=False)
        return [{"label": f"{path}:{label}", "concurrency": _concurrency(label), "busy_us": float(b),
                 "idle_us": float(i), "wall_us": float(w)} for label, b, i, w in rows_of]
    except (OSError, IndexError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a printed attribution table with busy, gpu_idle and step wall rows ({exc})") \
            from None


def _kernel_step(paths: Sequence[Path], target: Target, batch: int, context: int, spec,
                 fits: dict[str, RuleParams]):
    """The step of the target's kernels (every result projected in the decode step's cache state by
    the rule fitted on its own GPU, the target's MLA backend in place of the measured one), the same
    results' step here, and the step with every kernel at the rule's bound there (floor + traffic:
    none of the time the model does not explain)."""
    results, projected, bound = [], {}, {}
    for path in paths:
        cases, facts = load_cases(path, "")
        here = DeviceModel(facts, fits[facts.name])
        there = DeviceModel(device_facts(target.device.name), fits[facts.name])
        for c in cases:
            projected[c.name] = project_case(c, here, there, CACHE_STATES[c.timer], "step")
            bound[c.name] = there.floor_us(c) + traffic_us(c, there, "step")[0]
        results += load_results(path)[0]
    results = _target_backends(results, target)
    steps = [predict_step([replace(r, median_s=values[r.name] * 1e-6) for r in results if r.name in values],
                          spec, target.tp, batch, context) for values in (projected, bound)]
    return steps[0], predict_step(results, spec, target.tp, batch, context), steps[1]


def fit_per_gpu(paths: Sequence[Path], sm_counts: Sequence[Path] = ()) -> dict[str, RuleParams]:
    """The rule fitted on each GPU's own results among ``paths`` (its vLLM cases, every timer) and on its
    ``sm_count.py`` runs among ``sm_counts``; ValueError naming an SM-count run of none of those GPUs."""
    by_gpu: dict[str, tuple[list, object, list[str]]] = {}
    for path in paths:
        cases, facts = load_cases(path)
        have = by_gpu.setdefault(facts.name, ([], facts, []))
        have[0].extend(cases)
        have[2].append(str(path))
    counts = sm_count.by_gpu(sm_counts)
    stray = sm_count.unclaimed(counts, set(by_gpu))
    if stray:
        raise ValueError(f"{stray}, and no results of that GPU are given")
    return {name: fit(cases, facts, f"{name}: {', '.join(files)}", counts.get(name, ()))
            for name, (cases, facts, files) in by_gpu.items()}


def _target_backends(results: list[KernelResult], target: Target) -> list[KernelResult]:
    """The results, with a group the target runs on another backend taken from that backend alone."""
    for swap in target.backends:
        components = group_components()[swap.group]
        if not any(r.component in components and r.backend == swap.backend for r in results):
            raise WhatIfError(f"{target.id}: runs {swap.backend} for {swap.group}, and the results hold none of it")
        results = [r for r in results if r.component not in components or r.backend == swap.backend]
    # vLLM's kernels; torch's only for the dense GEMMs vLLM runs through torch (the absorbed MLA's uk, uv):
    # the prediction takes a vllm row over a torch one of the same op
    return [r for r in results if r.backend.startswith("vllm") or r.component == "dense_gemm"]


def _allreduce(spec, target: Target, batch: int) -> tuple[float, str]:
    shapes = DecodeShapes.for_deployment(spec, target.tp)
    calls, nbytes = shapes.allreduces_per_step, shapes.allreduce_bytes(batch)
    link = target.link
    each = link.allreduce_us(nbytes, target.tp)
    path = vllm_would_use(target.tp, nbytes, link=link.kind, mode=LinkMode.NATIVE)
    return calls * each, (f"{calls} x ({link.alpha_us} µs + {nbytes} B / {link.beta_bytes_per_s(target.tp) / 1e9:.1f} "
                          f"GB/s) = {calls} x {each:.1f} µs over {link.id} ({link.source}); vLLM runs {path.backend} "
                          f"there: {path.why}")


def tpot_rows(paths: Sequence[Path], target: Target, terms: ProfileTerms, batches: Sequence[int], context: int,
              crosscheck: list | None, published: dict, model: str = "kimi-k2.5",
              custom_ar: dict | None = None, also: Sequence[Path] = (),
              sm_counts: Sequence[Path] = ()) -> tuple[list[dict], dict[str, RuleParams]]:
    """One row per batch: every term with its source, the TPOT, its bracket, the published figure;
    ``also``: more results of the same GPUs (another timer), for the fits only; ``sm_counts``: the
    ``sm_count.py`` runs of those GPUs, for the fused MoE's overlap share."""
    spec = load_model_spec(model)
    fits = fit_per_gpu([*paths, *also], sm_counts)
    low, high = _step_error_range(crosscheck)
    rows = []
    for batch in batches:
        kernels, measured, at_bound = _kernel_step(paths, target, batch, context, spec, fits)
        ar_us, ar_how = _allreduce(spec, target, batch)
        other_us, other_how = terms.not_benchmarked_us(batch, spec.num_layers)
        idle_us, idle_how = terms.idle_us(batch, kernels.total_us + ar_us + other_us)
        tpot = kernels.total_us + ar_us + other_us + idle_us
        row = {"batch": batch, "context": context, "kernels_us": kernels.total_us, "groups_us": kernels.groups_us(),
               "measured_here_us": measured.total_us, "allreduce_us": ar_us, "allreduce_how": ar_how,
               "not_benchmarked_us": other_us, "not_benchmarked_how": other_how, "idle_us": idle_us,
               "idle_how": idle_how, "tpot_us": tpot, "allreduce_share": ar_us / tpot,
               "missing": list(kernels.missing), "kernels_at_bound_us": at_bound.total_us,
               "at_bound_groups_us": at_bound.groups_us()}
        if custom_ar:
            row["custom_allreduce_us"], row["custom_allreduce_how"] = _custom_allreduce(spec, target, batch, custom_ar)
        if low is not None:
            row["tpot_bracket_us"] = (tpot - kernels.total_us + kernels.total_us / (1 + high),
                                      tpot - kernels.total_us + kernels.total_us / (1 + low))
        row["published"] = published.get(str(batch))
        rows.append(row)
    return rows, fits


def _custom_allreduce(spec, target: Target, batch: int, table: dict) -> tuple[float, str]:
    """The all-reduces with a published custom PCIe all-reduce's latency (log-log between its points),
    where it beats the link model's NCCL figure."""
    shapes = DecodeShapes.for_deployment(spec, target.tp)
    calls, nbytes = shapes.allreduces_per_step, shapes.allreduce_bytes(batch)
    points = sorted((float(b), float(us)) for b, us in table["points"])
    nccl = target.link.allreduce_us(nbytes, target.tp)
    if nbytes > points[-1][0]:
        return calls * nccl, f"{nbytes} B is past the custom all-reduce's points ({table['source']}): NCCL's figure"
    (b0, t0), (b1, t1) = next(((p, q) for p, q in zip(points, points[1:], strict=False) if p[0] <= nbytes <= q[0]),
                              (points[0], points[1]))
    each = math.exp(math.log(t0) + (math.log(t1) - math.log(t0)) * (math.log(max(nbytes, b0)) - math.log(b0))
                    / (math.log(b1) - math.log(b0)))
    each = min(each, nccl)
    return calls * each, f"{calls} x {each:.1f} µs at {nbytes} B ({table['source']})"


def _step_error_range(crosscheck: list | None) -> tuple[float | None, float | None]:
    """The smallest and largest step error of the rule over the cross-GPU check's directions and batches."""
    if not crosscheck:
        return None, None
    errors = [row["rule"]["error"] for d in crosscheck for row in d["steps"] if row["rule"]["error"] is not None]
    return (min(errors), max(errors)) if errors else (None, None)


def _overlap_text(params: RuleParams) -> str:
    return "not measured" if params.moe_overlap is None else f"{params.moe_overlap:.3f}"


def lines(rows: list[dict], target: Target, fits: dict[str, RuleParams], sources: list[str]) -> list[str]:
    out = [f"{target.name}: TPOT per decode step, ms"]
    out += [f"  rule fitted on {params.fitted_on}: floor {params.floor_us:.3f} µs per kernel, DRAM "
            f"{params.dram_fraction:.3f} of the datasheet, L2 {params.l2_bytes_per_sm_cycle:.2f} B per SM per cycle, "
            f"beta {params.beta:g}, fused MoE overlap {_overlap_text(params)}" for params in fits.values()]
    for row in rows:
        pub = row["published"]
        out.append(f"C = {row['batch']} (L = {row['context']})")
        for group, us in row["groups_us"].items():
            if us:
                out.append(f"  kernels {group:<16}{us / 1e3:>9.2f}")
        out.append(f"  {'kernels':<24}{row['kernels_us'] / 1e3:>9.2f}   (the same results as measured, unprojected: "
                   f"{row['measured_here_us'] / 1e3:.2f})")
        out.append(f"  {'all-reduces':<24}{row['allreduce_us'] / 1e3:>9.2f}   {row['allreduce_how']}")
        out.append(f"  {'not benchmarked':<24}{row['not_benchmarked_us'] / 1e3:>9.2f}   {row['not_benchmarked_how']}")
        out.append(f"  {'GPU idle':<24}{row['idle_us'] / 1e3:>9.2f}   {row['idle_how']}")
        bracket = row.get("tpot_bracket_us")
        out.append(f"  {'TPOT':<24}{row['tpot_us'] / 1e3:>9.2f}   " + (
            f"[{bracket[0] / 1e3:.2f} .. {bracket[1] / 1e3:.2f}] with the cross-GPU step error" if bracket
            else "no cross-GPU check given: no bracket"))
        out.append(f"  all-reduce share {row['allreduce_share']:.1%}")
        if pub:
            residual = row["tpot_us"] / (pub["tpot_ms"] * 1e3) - 1
            out.append(f"  published {pub['tpot_ms']:.1f} ms ({pub['what']}; {pub['source']}): {residual:+.1%}")
        out += _what_moves_it(row)
    out += [f"profiles: {', '.join(sources)}"]
    return out


def _what_moves_it(row: dict) -> list[str]:
    """The terms that would close a residual, each as the TPOT it gives."""
    out = []
    pub = row["published"]
    base = row["tpot_us"]

    def line(name: str, tpot: float, how: str) -> str:
        versus = f", {tpot / (pub['tpot_ms'] * 1e3) - 1:+.1%} against the published" if pub else ""
        return f"  with {name}: TPOT {tpot / 1e3:.2f} ms ({tpot / base - 1:+.1%}{versus}); {how}"

    if "custom_allreduce_us" in row:
        out.append(line("the published run's PCIe custom all-reduce", base - row["allreduce_us"]
                        + row["custom_allreduce_us"], row["custom_allreduce_how"]))
    moved = row["kernels_us"] - row["kernels_at_bound_us"]
    worst = max(row["groups_us"], key=lambda g: row["groups_us"][g] - row["at_bound_groups_us"].get(g, 0.0))
    out.append(line("every kernel at the rule's bound there", base - moved,
                    f"none of the time the measured kernels spend above their modelled traffic; most of it in {worst} "
                    f"({(row['groups_us'][worst] - row['at_bound_groups_us'][worst]) / 1e3:.2f} ms)"))
    return out


def load_crosscheck(path: Path) -> list[dict]:
    """A ``crosscheck.json`` of ``python -m decodebench crosscheck --out``: its directions, each with a step
    error per M; ValueError naming the file otherwise."""
    data = read_json(path)
    try:
        errors = [row["rule"]["error"] for d in data for row in d["steps"]]
        if not isinstance(data, list) or not errors or any(not isinstance(e, (int, float, type(None)))
                                                           for e in errors):
            raise TypeError("no step error in it")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a crosscheck.json written by python -m decodebench crosscheck --out "
                         f"(a list of directions, each with steps[].rule.error): {_why(exc)}") from None
    return data


def load_published(path: Path) -> dict:
    """A published-figures file (``--published``): ``tpot`` per concurrency, each with
    ``tpot_ms``, ``what`` and ``source``, and optionally ``custom_allreduce`` with ``points`` [[bytes, µs], ...]
    (two or more) and ``source``; ValueError naming the file and what is missing otherwise."""
    data = read_json(path)
    try:
        tpot = data["tpot"]
        for batch, figure in tpot.items():
            int(batch)
            if not (float(figure["tpot_ms"]) > 0 and figure["what"] and figure["source"]):
                raise ValueError(f"tpot[{batch!r}] needs tpot_ms above 0, what and source")
        custom = data.get("custom_allreduce")
        if custom is not None and (len(custom["points"]) < 2 or not custom["source"]
                                   or any(float(b) <= 0 or float(us) <= 0 for b, us in custom["points"])):
            raise ValueError("custom_allreduce needs two or more [bytes, µs] points above 0 and a source")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: not a published-figures file (tpot per concurrency with tpot_ms, what, source): "
                         f"{_why(exc)}") from None
    return data


def _why(exc: Exception) -> str:
    return f"no {exc.args[0]!r} in it" if isinstance(exc, KeyError) else str(exc)




def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decodebench box",
                                description="The TPOT of a target box from kernel results here, term by term.")
    p.add_argument("results", nargs="+", type=Path, metavar="RESULTS.json", help="kernel results of one GPU here")
    p.add_argument("--also", type=Path, action="append", default=[], metavar="FILE",
                   help="more results of the same GPU(s) with another timer, for the rule's fit only; repeatable. "
                   "Default: none")
    p.add_argument("--target", default="rtx-pro-6000-x8-pcie", metavar="TARGET",
                   help="target id or file. Default: %(default)s")
    p.add_argument("--layer-profiles", nargs=2, type=Path, required=True, metavar="ATTRIBUTION.json",
                   help="two attribution JSON files of the step at two depths")
    p.add_argument("--idle-profile", type=Path, required=True, metavar="ATTRIBUTION.json|.txt",
                   help="an attribution JSON or printed table whose loads include a GPU-bound one")
    p.add_argument("--crosscheck", type=Path, action="append", default=[], metavar="crosscheck.json",
                   help="a cross-GPU check whose step errors bracket the kernels (repeatable: the range over all). "
                   "Default: no bracket")
    p.add_argument("--published", type=Path, default=None, metavar="FILE",
                   help="published TPOT per concurrency (JSON). Default: none")
    p.add_argument("--batch", type=positive_int_list, default=(1, 64, 128), metavar="LIST",
                   help="concurrencies. Default: 1,64,128")
    add_prediction_options(p.add_argument, ("context", "sm_count"), {"context": (1024, "1024")})
    p.add_argument("--out", type=output_dir, default=None, metavar="DIR",
                   help="write box.txt and box.json. Default: print")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        target = load_target(args.target)
        terms = load_profile_terms(args.layer_profiles, args.idle_profile)
        crosscheck = [d for path in args.crosscheck for d in load_crosscheck(path)] or None
        published = load_published(args.published) if args.published else {}
        rows, fits = tpot_rows(args.results, target, terms, args.batch, args.context, crosscheck,
                                 published.get("tpot", {}), custom_ar=published.get("custom_allreduce"),
                                 also=args.also, sm_counts=args.sm_count)
    except (ValueError, WhatIfError, OSError, KeyError) as exc:
        print(f"{_parser().prog}: error: {exc}", file=sys.stderr)
        return 2
    text = "\n".join(lines(rows, target, fits, terms.sources)) + "\n"
    sys.stdout.write(text)
    if args.out:
        write_atomic(args.out / "box.txt", text.encode())
        write_atomic(args.out / "box.json", json.dumps({"fits": {n: asdict(p) for n, p in fits.items()},
                                                         "rows": rows}, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
