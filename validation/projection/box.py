"""The decode step on the users' box: TPOT = kernels + all-reduces + what the profile adds.

From kernel results here, the TPOT per decode step on a target machine (the 8x RTX PRO 6000 box)
as a sum of terms, each shown with where it comes from:

* **kernels** and **all-reduces**: the product's one projection, ``project.project`` (the path of
  ``scenarios --project-to``: the rule fitted once per GPU on its own results, each kernel in the
  decode step's cache state there, the target's MLA backend swapped in, the all-reduces over the
  target's link); the published PCIe custom all-reduce beside NCCL's;
* **kernels no benchmark covers** (sampling, copies and casts, other): from two committed
  profiles of the step at two depths, a fixed part and a part per layer, carried to the target's
  depth unscaled;
* **GPU idle** (host time between steps and kernels that the GPU does not hide): the larger of
  the idle a GPU-bound profiled load left and the host's step time (a host-bound load's step
  wall) less the target's busy time.

The band is the one the product prints for the pair of GPU designs. Then every published figure
of a run set up like the projection (``published.json``: no MTP, DCP 1, context 0) against the
TPOT with the all-reduce that run used: the residuals ``bands.py`` turns into the Hopper -> SM120
band::

    python validation/projection/box.py RESULTS.json... --target rtx-pro-6000-x8-pcie \\
        --layer-profiles validation/h200/attribution-L2.json validation/h200/attribution-L4.json \\
        --idle-profile validation/tp8/h100-2026-12-05/profile-24-layers.json \\
        --published validation/projection/published.json --batch 1,64,128 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from decodebench.attribution.options import add_prediction_options  # noqa: E402
from decodebench.attribution.predict.prediction import load_results, predict_step, step_of  # noqa: E402
from decodebench.attribution.predict.project import ALLREDUCE, Projection, project  # noqa: E402
from decodebench.attribution.predict.projection_rule import case_of  # noqa: E402
from decodebench.attribution.predict.step import KernelResult, WhatIfError  # noqa: E402
from decodebench.attribution.predict.targets import Target, load_target  # noqa: E402
from decodebench.files import read_json, write_atomic  # noqa: E402
from decodebench.model import load_model_spec  # noqa: E402
from decodebench.options import output_dir, positive_int_list  # noqa: E402
from decodebench.registry import not_benchmarked  # noqa: E402
from decodebench.shapes import DecodeShapes  # noqa: E402

__all__ = ["ProfileTerms", "load_profile_terms", "load_published", "main", "projected", "residuals", "tpot_rows"]

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


def projected(paths: Sequence[Path], target: Target, batch: int, context: int, spec) -> Projection:
    """The step of ``paths``' results on ``target``, by the product's one path (``project``, as
    ``scenarios --project-to`` runs it): vLLM's kernels, and torch's only for the dense GEMMs vLLM runs
    through torch (the absorbed MLA's uk, uv)."""
    results: list[KernelResult] = []
    for path in paths:
        results += [r for r in load_results(path)[0] if r.backend.startswith("vllm") or r.component == "dense_gemm"]
    return project(step_of(predict_step(results, spec, target.tp, batch, context), results), spec, target.tp,
                   target, results)


def tpot_rows(paths: Sequence[Path], target: Target, terms: ProfileTerms, batches: Sequence[int], context: int,
              published: dict, model: str = "kimi-k2.5", custom_ar: dict | None = None) -> list[dict]:
    """One row per batch: every term with its source, the TPOT, the band the projection carries, the published
    figure."""
    spec = load_model_spec(model)
    rows = []
    for batch in batches:
        there = projected(paths, target, batch, context, spec)
        groups = there.step.groups_us()
        ar_us = groups.pop(ALLREDUCE, 0.0)
        kernels_us = sum(groups.values())
        ar_how = next((p.how for p in there.step.parts if p.group == ALLREDUCE), "")
        other_us, other_how = terms.not_benchmarked_us(batch, spec.num_layers)
        idle_us, idle_how = terms.idle_us(batch, kernels_us + ar_us + other_us)
        tpot = kernels_us + ar_us + other_us + idle_us
        row = {"batch": batch, "context": context, "kernels_us": kernels_us, "groups_us": groups,
               "allreduce_us": ar_us, "allreduce_how": ar_how, "not_benchmarked_us": other_us,
               "not_benchmarked_how": other_how, "idle_us": idle_us, "idle_how": idle_how, "tpot_us": tpot,
               "projected_us": there.step.total_us, "allreduce_share": ar_us / tpot, "rule": there.rule.value,
               "band": there.bracket, "assumptions": list(there.step.assumptions)}
        if there.band is not None:
            row["tpot_band_us"] = (tpot / (1 + there.band.high), tpot / (1 + there.band.low))
            row["band_ends"] = (there.band.low, there.band.high)
            row["band_pair"] = f"{there.band.source_arch} -> {there.band.target_arch}"
        row["kv_us"] = kv_us(there, target)
        if custom_ar:
            row["custom_allreduce_us"], row["custom_allreduce_how"] = _custom_allreduce(spec, target, batch, custom_ar)
        row["published"] = published.get(str(batch))
        rows.append(row)
    return rows


def kv_us(there: Projection, target: Target) -> float:
    """The MLA term's KV-cache reads on the target at the datasheet DRAM rate: the time a context of the step's
    ``L`` spends reading the cache, which a run at context 0 nearly does without and an fp8 cache halves."""
    return sum(case_of(p.result).state_bytes * p.calls for p in there.step.parts
               if p.group == "mla_attention" and p.result is not None) / target.peaks.bytes_per_s * 1e6


def kv_dtype_rows(path: Path, backend: str = "vllm-triton_mla") -> list[dict]:
    """``backend``'s MLA decode timed at both cache dtypes in one result file: per batch and context, µs per call
    with a bf16 and with an fp8 cache (what an fp8 cache changes of the MLA term on the GPU measured)."""
    times: dict[tuple, dict] = {}
    for r in load_results(path)[0]:
        if r.component == "mla_decode" and r.backend == backend and not r.shape.get("mixed"):
            key = (r.shape["batch"], r.shape["context_max"], r.timer)
            times.setdefault(key, {})[r.shape.get("kv_cache_dtype", "auto")] = r.median_s * 1e6
    return [{"file": str(path), "backend": backend, "batch": b, "context": ctx, "timer": timer,
             "bf16_us": t["auto"], "fp8_us": t["fp8"]} for (b, ctx, timer), t in sorted(times.items())
            if {"auto", "fp8"} <= t.keys()]


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


def like_for_like(published: dict, batches: Sequence[int]) -> list[tuple[dict, dict]]:
    """Every published figure of a run set up as the box projects it (no MTP, DCP 1, context 0), at a
    projected concurrency: (its run, the figure)."""
    return [(run, fig) for run in published.get("runs", []) if run.get("mtp") is False and run.get("dcp") == 1
            for fig in run["figures"] if str(fig["context"]) == "0" and fig["concurrency"] in batches]


def residuals(rows: list[dict], published: dict) -> list[dict]:
    """Per like-for-like published figure: the TPOT with the all-reduce its run used, its terms, the band the
    projection carries, the residual and the terms that could carry it (:func:`carriers`)."""
    by_batch = {row["batch"]: row for row in rows}
    out = []
    for run, fig in like_for_like(published, list(by_batch)):
        row = by_batch[fig["concurrency"]]
        custom = str(run.get("allreduce") or "").startswith("pcie_custom") and "custom_allreduce_us" in row
        tpot = row["tpot_us"] - row["allreduce_us"] + (row["custom_allreduce_us"] if custom else row["allreduce_us"])
        terms = {"kernels": row["kernels_us"], "allreduces": tpot - row["tpot_us"] + row["allreduce_us"],
                 "not_benchmarked": row["not_benchmarked_us"], "idle": row["idle_us"]}
        ends = row.get("band_ends")
        out.append({"run": run["id"], "concurrency": fig["concurrency"], "published_ms": fig["tpot_ms"],
                    "allreduce": "custom" if custom else "nccl",
                    "kv_cache_dtype": run.get("kv_cache_dtype") or "not stated",
                    "projected_ms": tpot / 1e3, "terms_ms": {k: round(v / 1e3, 3) for k, v in terms.items()},
                    "residual": tpot / (fig["tpot_ms"] * 1e3) - 1,
                    "band": None if ends is None else {"pair": row["band_pair"], "ms": [
                        round(tpot / (1 + ends[1]) / 1e3, 3), round(tpot / (1 + ends[0]) / 1e3, 3)]},
                    **carriers(row, terms["allreduces"], tpot - fig["tpot_ms"] * 1e3)})
    return out


def carriers(row: dict, allreduce_us: float, excess_us: float) -> dict:
    """What the model says of a residual of ``excess_us`` (projected - published): the KV cache's part of the MLA
    term (context 0 reads next to none of it), and the terms of the step (each kernel group, the all-reduces, the
    kernels no benchmark covers, GPU idle) large enough to carry the rest alone, each with the change it would need,
    the largest first. Which of them does is not in the model: that needs the term measured on the box."""
    terms = {**{f"kernels {g}": us for g, us in row["groups_us"].items()}, "allreduces": allreduce_us,
             "not_benchmarked": row["not_benchmarked_us"], "idle": row["idle_us"]}
    rest = excess_us - min(row["kv_us"], max(excess_us, 0.0))
    able = {name: -rest / us for name, us in terms.items() if us > 0 and abs(rest) <= us}
    return {"kv_ms": round(row["kv_us"] / 1e3, 3), "rest_ms": round(rest / 1e3, 3),
            "could_carry": {name: round(change, 4) for name, change in sorted(able.items(), key=lambda i: -abs(
                terms[i[0]]))}}


SETUP = ("model", "allreduce", "nccl", "kv_cache_dtype", "mla_backend", "max_model_len", "vllm", "image", "host",
         "method", "speculative")  # a published run's setup fields
MODELLED = {"allreduce": "the all-reduce term (custom or NCCL)", "kv_cache_dtype": "half the KV cache's time (fp8)",
            "mla_backend": "not modelled: the box takes TRITON_MLA"}


def setup_pairs(rows: list[dict], published: dict) -> list[dict]:
    """Like-for-like figures of one source page and concurrency whose runs differ in one setup field the model
    has a term for (:data:`MODELLED`) and in nothing else: the published change against the model's."""
    figures = residuals(rows, published)
    runs = {run["id"]: run for run in published.get("runs", [])}
    out = []
    for i, a in enumerate(figures):
        for b in figures[i + 1:]:
            ra, rb = runs[a["run"]], runs[b["run"]]
            differ = [k for k in SETUP if ra.get(k) != rb.get(k)]
            same_page = (ra["source"]["repo"], ra["source"]["path"]) == (rb["source"]["repo"], rb["source"]["path"])
            if same_page and a["concurrency"] == b["concurrency"] and len(differ) == 1 and differ[0] in MODELLED:
                out.append({"field": differ[0], "concurrency": a["concurrency"], "runs": [a["run"], b["run"]],
                            "values": [ra.get(differ[0]), rb.get(differ[0])],
                            "published_ms": round(b["published_ms"] - a["published_ms"], 3),
                            "model_ms": _model_change(differ[0], a, b)})
    return out


def _model_change(field: str, a: dict, b: dict) -> float | None:
    """The model's change of the TPOT from figure ``a``'s run to ``b``'s in ``field`` (None: not modelled)."""
    if field == "allreduce":
        return round(b["terms_ms"]["allreduces"] - a["terms_ms"]["allreduces"], 3)
    if field == "kv_cache_dtype":
        halves = {"fp8": 0.5, "bf16": 1.0, "auto": 1.0}
        share = [halves.get(str(f["kv_cache_dtype"])) for f in (a, b)]
        return None if None in share else round(a["kv_ms"] * (share[1] - share[0]), 3)
    return None


def lines(rows: list[dict], target: Target, sources: list[str], published: dict, kv: Sequence[dict] = ()) -> list[str]:
    out = [f"{target.name}: TPOT per decode step, ms (kernels and all-reduces: the product's project(), as "
           "scenarios --project-to runs it)"]
    for row in rows:
        out.append(f"C = {row['batch']} (L = {row['context']})")
        for group, us in row["groups_us"].items():
            if us:
                out.append(f"  kernels {group:<16}{us / 1e3:>9.2f}")
        out.append(f"  {'kernels':<24}{row['kernels_us'] / 1e3:>9.2f}   rule: {row['rule']}")
        out.append(f"  {'all-reduces':<24}{row['allreduce_us'] / 1e3:>9.2f}   {row['allreduce_how']}")
        if "custom_allreduce_us" in row:
            out.append(f"  {'(PCIe custom)':<24}{row['custom_allreduce_us'] / 1e3:>9.2f}   "
                       f"{row['custom_allreduce_how']}")
        out.append(f"  {'not benchmarked':<24}{row['not_benchmarked_us'] / 1e3:>9.2f}   {row['not_benchmarked_how']}")
        out.append(f"  {'GPU idle':<24}{row['idle_us'] / 1e3:>9.2f}   {row['idle_how']}")
        band = row.get("tpot_band_us")
        out.append(f"  {'TPOT':<24}{row['tpot_us'] / 1e3:>9.2f}   " + (
            f"[{band[0] / 1e3:.2f} .. {band[1] / 1e3:.2f}]: " if band else "") + row["band"])
        out.append(f"  all-reduce share {row['allreduce_share']:.1%}")
    if published:
        out.append("published figures set up like the projection (no MTP, DCP 1, context 0): projected / published "
                   "- 1, the band the projection carries, and which terms could carry the residual")
        out += [line for r in residuals(rows, published) for line in _residual_lines(r)]
        out += _pair_lines(setup_pairs(rows, published))
    out += _kv_lines(kv) + [f"profiles: {', '.join(sources)}"]
    return out


def _pair_lines(pairs: Sequence[dict]) -> list[str]:
    return ["published runs of one page that differ in one setup field the model has a term for: the published "
            "TPOT's change against the model's"] + [
        f"  C = {p['concurrency']:<4} {p['field']} {p['values'][0]} -> {p['values'][1]} ({p['runs'][0]} -> "
        f"{p['runs'][1]}): published {p['published_ms']:+.2f} ms, model "
        + (f"{p['model_ms']:+.2f} ms" if p["model_ms"] is not None else MODELLED[p["field"]]) for p in pairs]


def _kv_lines(kv: Sequence[dict]) -> list[str]:
    if not kv:
        return []
    return [f"an fp8 KV cache on the GPU measured ({kv[0]['file']}, {kv[0]['backend']}): µs per call, bf16 / fp8"] + [
        f"  C = {k['batch']:<4} L = {k['context']} ({k['timer']} timer): {k['bf16_us']:.1f} / {k['fp8_us']:.1f} "
        f"({k['fp8_us'] / k['bf16_us'] - 1:+.1%})" for k in kv]


def _residual_lines(r: dict) -> list[str]:
    band = f"band {r['band']['ms'][0]:.2f} .. {r['band']['ms'][1]:.2f} ms ({r['band']['pair']})" if r["band"] else \
        "error not measured"
    carry = ", ".join(f"{name} ({change:+.0%})" for name, change in r["could_carry"].items()) or "none"
    return [f"  {r['run']:<40} C = {r['concurrency']:<4} published {r['published_ms']:6.2f} ms, projected "
            f"{r['projected_ms']:6.2f} ms = " + " + ".join(f"{k} {v:.2f}" for k, v in r["terms_ms"].items())
            + f" ({r['allreduce']} all-reduce; their KV {r['kv_cache_dtype']}, ours bf16): {r['residual']:+.1%}, "
            f"{band}",
            f"  {'':<40} the KV cache's {r['kv_ms']:.2f} ms at L = 1024 taken off (the most context 0 saves), "
            f"{r['rest_ms']:+.2f} ms left; "
            f"terms that could carry it alone: {carry}"]


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
    p = argparse.ArgumentParser(prog="python validation/projection/box.py",
                                description="The TPOT of a target box from kernel results here, term by term.")
    p.add_argument("results", nargs="+", type=Path, metavar="RESULTS.json", help="kernel results here")
    p.add_argument("--target", default="rtx-pro-6000-x8-pcie", metavar="TARGET",
                   help="target id or file. Default: %(default)s")
    p.add_argument("--layer-profiles", nargs=2, type=Path, required=True, metavar="ATTRIBUTION.json",
                   help="two attribution JSON files of the step at two depths")
    p.add_argument("--idle-profile", type=Path, required=True, metavar="ATTRIBUTION.json|.txt",
                   help="an attribution JSON or printed table whose loads include a GPU-bound one")
    p.add_argument("--published", type=Path, default=None, metavar="FILE",
                   help="published figures (published.json). Default: none")
    p.add_argument("--batch", type=positive_int_list, default=(1, 64, 128), metavar="LIST",
                   help="concurrencies. Default: 1,64,128")
    add_prediction_options(p.add_argument, ("context",), {"context": (1024, "1024")})
    p.add_argument("--kv-dtypes", type=Path, default=None, metavar="RESULTS.json",
                   help="results of the box's MLA backend at both cache dtypes (--kv-cache-dtype auto,fp8): what an "
                   "fp8 cache changes of it. Default: none")
    p.add_argument("--out", type=output_dir, default=None, metavar="DIR",
                   help="write box.txt and box.json. Default: print")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        target = load_target(args.target)
        terms = load_profile_terms(args.layer_profiles, args.idle_profile)
        published = load_published(args.published) if args.published else {}
        rows = tpot_rows(args.results, target, terms, args.batch, args.context, published.get("tpot", {}),
                         custom_ar=published.get("custom_allreduce"))
        kv = kv_dtype_rows(args.kv_dtypes) if args.kv_dtypes else []
    except (ValueError, WhatIfError, OSError, KeyError) as exc:
        print(f"{_parser().prog}: error: {exc}", file=sys.stderr)
        return 2
    text = "\n".join(lines(rows, target, terms.sources, published, kv)) + "\n"
    sys.stdout.write(text)
    if args.out:
        write_atomic(args.out / "box.txt", text.encode())
        write_atomic(args.out / "box.json", json.dumps({"rows": rows, "published": residuals(rows, published),
                                                        "setup_pairs": setup_pairs(rows, published),
                                                        "kv_dtypes": kv},
                                                       indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
