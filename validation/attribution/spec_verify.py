"""The speculative-decoding prediction checked against live runs, from stored results.

For each load of a server started with ``--spec`` (its ``extra_info["spec_decode"]``), the TPOT
predicted at the acceptance that server measured, against the TPOT it measured::

    predicted = (f · verify(C, K) + (1 - f) · step(C) + carried) / tokens per step

* ``step(C)`` / ``verify(C, K)``: the predicted kernel time of a plain decode step and of a
  verification step (:func:`~.speculative.verification_step`) from the kernel results;
* ``f``: the share of request-steps that carried drafts (ngram finds no match on some; those steps
  run as plain ones — exact at C = 1, a linear mix of the two step kinds at larger C);
* ``carried``: the plain server's measured TPOT at the same C minus ``step(C)`` (GPU idle, host
  work, kernels no benchmark covers), assumed unchanged per step under speculation. vLLM 0.26
  turns async scheduling off with ngram, so the host work it hides in the plain server is
  serial in the speculative one: ``--plain-sync`` names a plain server started with
  ``--no-async-scheduling`` (``validation/gpu/spec.sh``'s part ``plainsync``). The verdict reads each load
  against the plain server in its method's engine mode (:func:`engine_mode`: ``ngram`` sync,
  ``ngram_gpu``, EAGLE and MTP async), where both are given;
* ``tokens per step``: decode tokens over request-steps, from vLLM's counters over the load.

With ``--host-per-token`` a third reading adds host work that grows with the tokens a step
emits: ``h``, the carried term's growth per request between the plain (sync) server's lowest and
highest C (in a plain step each request emits one token, so per request is per token there), times
the tokens a speculative step emits beyond C::

    carried(C, spec) = carried(C) + h · C · (tokens per step - 1)

On the H200 (docs/attribution.md) the step's excess over the constant carried term grew
by 67-72 µs per extra emitted token at C = 64, and the plain sync server's carried term grew by
56 µs per request from C = 1 to 64. This reading was added after those runs; later traces
(``python -m decodebench steps``) showed the excess to be host time per step and per
request (input preparation, rejection sampling, launch), and this reading overshot C = 64 there.

With ``--window-prefill`` the carried term loses the prefill that lands inside a request's
decode window, which is held per output token instead of per step. At C = 64 the load is one wave
of prompts, and a request that got its first token early decodes beside the later ones' prefill.
That time belongs to the request, not to a step: on the H200, ``(mean ITL - median ITL)``
× chunks came to 308-342 ms a request at C = 64 in the plain server and under ngram at every K.
A speculative step that emits ``tokens per step`` tokens does not divide it. It is read from the
plain load as its mean inter-token latency less its median (about 0 at C = 1)::

    prefill   = plain mean ITL - plain median ITL                   (µs per output token)
    predicted = (f · verify + (1 - f) · step + carried - prefill) / tokens per step + prefill

With ``--host-from CAL.json...`` the reading adds the host time a speculative step costs,
measured on the same machine by runs of the same method at *other* K (calibration: ``validation/gpu/spec.sh``'s
parts ``ngram1`` and ``ngram3`` for a check at K = 2 and 4). Each calibration load's step beyond
the kernels and the plain carried term, ``beyond(C, K)``, is fitted per C as ``a(C) + b(C) · K``
(a constant from one K), and each checked load's step gets ``a(C) + b(C) · K`` added::

    predicted = (f · verify(C, K) + (1 - f) · step(C) + carried + a(C) + b(C) · K) / tokens per step

No checked run is an input, and a K both calibrated and checked is refused. The traces put
that host time in input preparation, rejection sampling, launching the forward and the proposal:
work per step and per request that no kernel result and no plain server holds; the fitted
``a + b · K`` at the users' C is what ``--what-if spec=ngram:K:ACCEPT:DRAFT_US`` takes as DRAFT_US.
Usage::

    python -m validation.attribution.spec_verify KERNELS.json --plain PLAIN.json --spec-run SPEC.json... \\
        [--plain-sync PLAIN_SYNC.json] [--window-prefill] [--host-per-token | --host-from CAL.json...] \\
        --model kimi-k2.5 --tp 1 --server-layers 4 [--within 0.15]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from decodebench.attribution.depth import with_layers
from decodebench.attribution.options import add_prediction_options
from decodebench.attribution.predict.prediction import load_results, predict_step
from decodebench.attribution.predict.speculative import verification_step
from decodebench.model import load_model_spec

__all__ = ["HostTerm", "SpecCheck", "calibrate_host", "check_load", "engine_mode", "host_per_token_us", "main",
           "window_prefill_us"]

ASYNC, SYNC, HOSTED, CALIBRATED = "async", "sync", "+host", "+calibrated"
MODE_NAMES = {ASYNC: "plain server (async scheduling)", SYNC: "plain server with --no-async-scheduling"}


@dataclass(frozen=True)
class SpecCheck:
    """One speculative load: what was measured and what was predicted, µs per output token."""

    name: str
    concurrency: int
    k: int
    acceptance_rate: float | None
    tokens_per_step: float
    drafted_share: float
    plain_tpot_us: float
    step_us: float
    verify_us: float
    carried_us: float
    predicted_us: float
    measured_us: float
    within: float
    method: str = "ngram"  # the speculative method the load ran (spec_decode.method)
    prefill_us: float = 0.0  # the plain load's prefill per output token held out of the step (--window-prefill)

    @property
    def error(self) -> float:
        return self.predicted_us / self.measured_us - 1

    @property
    def ok(self) -> bool:
        return abs(self.error) <= self.within

    @property
    def beyond_us(self) -> float:
        """µs per engine step the measured step spent beyond the predicted one (what the model
        leaves out: the draft's host time, and host work that grows with the tokens a step emits)."""
        return (self.measured_us - self.predicted_us) * self.tokens_per_step

    @property
    def beyond_per_extra_token_us(self) -> float | None:
        """``beyond_us`` over the tokens a step emits beyond a plain step's C (None without any)."""
        extra = (self.tokens_per_step - 1) * self.concurrency
        return self.beyond_us / extra if extra > 0 else None

    def line(self) -> str:
        rate = f"{self.acceptance_rate:.2f}" if self.acceptance_rate is not None else "n/a"
        extra = self.beyond_per_extra_token_us
        per_token = f"{extra:.1f}" if extra is not None else "-"
        return (f"{self.name:<44}{self.concurrency:>4}{self.k:>3}{rate:>7}{self.tokens_per_step:>7.2f}"
                f"{self.drafted_share:>8.2f}{self.plain_tpot_us:>9.1f}{self.step_us:>9.1f}{self.verify_us:>9.1f}"
                f"{self.carried_us:>9.1f}{self.predicted_us:>10.1f}{self.measured_us:>10.1f}{self.error:>+8.1%}"
                f"  {'yes' if self.ok else 'NO ':<6}{self.beyond_us:>9.1f}{per_token:>10}")


HEADER = (f"{'load':<44}{'C':>4}{'K':>3}{'accept':>7}{'tok/st':>7}{'drafted':>8}{'plain':>9}{'step':>9}"
          f"{'verify':>9}{'carried':>9}{'predicted':>10}{'measured':>10}{'error':>8}  within{'beyond':>9}"
          f"{'/x-token':>10}")


def check_load(bench: dict, plain: dict, results, spec, tp: int, within: float = 0.15,
               routing: str | None = "uniform", host_per_token: float = 0.0, host_step_us: float = 0.0,
               window_prefill: bool = False) -> SpecCheck:
    """The check of one stored spec load (``bench``) against the plain load of the same C (``plain``);
    ``host_per_token`` (µs, :func:`host_per_token_us`) is added to the carried term for every token
    the step emits beyond C, and ``host_step_us`` (:class:`HostTerm`) once per step. With
    ``window_prefill`` the plain load's :func:`window_prefill_us` is taken out of the carried term and
    added per output token.

    Raises ValueError naming what a stored result lacks.
    """
    info, base = bench["extra_info"], plain["extra_info"]
    counters = info.get("spec_decode") or {}
    if not counters.get("tokens_per_step"):
        raise ValueError(f"{bench['name']}: no spec_decode counters with tokens_per_step in extra_info")
    c, k = int(info["max_concurrency"]), int(counters["k"])
    context = _mean_context(info)
    step = predict_step(list(results), spec, tp, c, context, routing).total_us
    verify = verification_step(results, spec, tp, c, context, k, routing).total_us
    plain_us = float(base["mean_tpot_ms"]) * 1e3
    tokens_per_step = float(counters["tokens_per_step"])
    prefill = window_prefill_us(plain) if window_prefill else 0.0
    carried = plain_us - step - prefill + host_per_token * c * (tokens_per_step - 1) + host_step_us
    share = float(counters.get("drafted_share") or 0.0)
    predicted = (share * verify + (1 - share) * step + carried) / tokens_per_step + prefill
    return SpecCheck(bench["name"], c, k, counters.get("acceptance_rate"), tokens_per_step, share,
                     plain_us, step, verify, carried, predicted, float(info["mean_tpot_ms"]) * 1e3, within,
                     str(counters.get("method") or "ngram"), prefill)


def window_prefill_us(plain: dict) -> float:
    """µs per output token a plain load spent on prefill inside its requests' decode windows: its
    mean inter-token latency less its median (the steps that carried another request's prefill are
    the tail; a plain step emits one token per request), 0 where the median is the larger.
    Raises ValueError where the load has no ITL statistics.

    >>> window_prefill_us({"name": "c64", "extra_info": {"mean_itl_ms": 13.5, "median_itl_ms": 11.0}})
    2500.0
    """
    info = plain["extra_info"]
    try:
        mean, median = float(info["mean_itl_ms"]), float(info["median_itl_ms"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{plain['name']}: no mean_itl_ms and median_itl_ms in extra_info") from None
    return max(0.0, mean - median) * 1e3


def _mean_context(info: dict) -> int:
    """The mean context over a load's decode: its prompt and half its output."""
    return int(info["input_len"]) + int(info["output_len"]) // 2


def _decode_results(path: Path) -> list[dict]:
    try:
        return [b for b in json.loads(Path(path).read_text())["benchmarks"]
                if (b.get("extra_info") or {}).get("component") == "decode_e2e"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a pytest-benchmark result file with e2e decode results ({exc})") from None


def _plain_loads(plain: Path) -> dict[int, dict]:
    return {int(b["extra_info"]["max_concurrency"]): b for b in _decode_results(plain)
            if not b["extra_info"].get("spec_decode")}


def host_per_token_us(plain_loads: dict[int, dict], results, spec, tp: int, routing: str | None = "uniform") -> float:
    """µs of carried term per request (a plain step's emitted token): its growth from the lowest to
    the highest C of a plain server's loads (``{C: stored load}``). Raises ValueError with fewer than
    two loads."""
    if len(plain_loads) < 2:
        raise ValueError(f"the host time per token needs plain loads at two C (got C={sorted(plain_loads)})")
    low, high = min(plain_loads), max(plain_loads)

    def carried(c: int) -> float:
        info = plain_loads[c]["extra_info"]
        step = predict_step(list(results), spec, tp, c, _mean_context(info), routing).total_us
        return float(info["mean_tpot_ms"]) * 1e3 - step

    return (carried(high) - carried(low)) / (high - low)


@dataclass(frozen=True)
class HostTerm:
    """µs a speculative step spends beyond its kernels and the plain server's carried term, per C:
    ``a + b · K`` fitted to calibration loads at other K (:func:`calibrate_host`).

    >>> term = HostTerm({1: ((1, 1000.0), (3, 1200.0)), 64: ((1, 5000.0),)})
    >>> term.at(1, 2), term.at(1, 4), term.at(64, 4)
    (1100.0, 1300.0, 5000.0)
    >>> term.describe(1)
    'C=1: 900 + 100 x K µs (from K=1: 1000, K=3: 1200)'
    """

    points: dict[int, tuple[tuple[int, float], ...]]  # C -> ((K, beyond µs per step), ...)

    def coefficients(self, c: int) -> tuple[float, float]:
        """``(a, b)`` at ``c``: least squares over the calibration Ks; ``b = 0`` from one K."""
        points = self.points.get(c)
        if not points:
            raise ValueError(f"no calibration load at C={c} (calibrated: C={sorted(self.points)})")
        ks, values = [k for k, _ in points], [v for _, v in points]
        k_mean, v_mean = sum(ks) / len(ks), sum(values) / len(values)
        spread = sum((k - k_mean) ** 2 for k in ks)
        slope = sum((k - k_mean) * (v - v_mean) for k, v in points) / spread if spread else 0.0
        return v_mean - slope * k_mean, slope

    def at(self, c: int, k: int) -> float:
        a, b = self.coefficients(c)
        return a + b * k

    def describe(self, c: int) -> str:
        a, b = self.coefficients(c)
        given = ", ".join(f"K={k}: {v:.0f}" for k, v in sorted(self.points[c]))
        return f"C={c}: {a:.0f} + {b:.0f} x K µs (from {given})"


def calibrate_host(results, spec, plain: Path, calibration: Sequence[Path], tp: int,
                   checked_ks: Sequence[int] = (), window_prefill: bool = False) -> HostTerm:
    """The :class:`HostTerm` of calibration runs (``test_decode`` JSON with ``--spec``), each load's
    step beyond the prediction with the constant carried term of ``plain``. Raises ValueError where a
    calibration K is also checked (``checked_ks``): a check must not be its own input."""
    points: dict[int, list[tuple[int, float]]] = {}
    for row in checks(results, spec, plain, calibration, tp, within=1.0, window_prefill=window_prefill):
        if row.k in checked_ks:
            raise ValueError(f"{row.name}: K={row.k} is both a calibration and a checked load; calibrate "
                             "from other K")
        points.setdefault(row.concurrency, []).append((row.k, row.beyond_us))
    return HostTerm({c: tuple(sorted(p)) for c, p in points.items()})


def checks(results, spec, plain: Path, spec_files: Sequence[Path], tp: int, within: float,
           host_per_token: float = 0.0, host: HostTerm | None = None,
           window_prefill: bool = False) -> list[SpecCheck]:
    """One check per load of each ``spec_files`` against ``plain`` (a plain server's results), from
    kernel ``results`` on the served model ``spec``; ``host`` adds its per-step term at each load's C and K."""
    by_c = _plain_loads(plain)
    out = []
    for path in spec_files:
        for bench in _decode_results(path):
            info = bench["extra_info"]
            c = int(info["max_concurrency"])
            if c not in by_c:
                raise ValueError(f"{bench['name']}: no plain load at C={c} in {plain}")
            k = int((info.get("spec_decode") or {}).get("k") or 0)
            host_step = host.at(c, k) if host is not None else 0.0
            out.append(check_load(bench, by_c[c], results, spec, tp, within, host_per_token=host_per_token,
                                  host_step_us=host_step, window_prefill=window_prefill))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validation.attribution.spec_verify",
                                     description="The speculative-decoding TPOT predicted at the measured acceptance "
                                                 "against the measured TPOT.")
    parser.add_argument("kernels", nargs="+", type=Path, help="kernel results (plain and --verify-tokens)")
    parser.add_argument("--plain", type=Path, help="test_decode JSON of the server without --spec (give it, "
                        "--plain-sync or both)")
    parser.add_argument("--spec-run", type=Path, action="append", required=True, metavar="JSON",
                        help="test_decode JSON of a server started with --spec; repeatable")
    parser.add_argument("--plain-sync", type=Path, help="test_decode JSON of the server without --spec and with "
                        "--no-async-scheduling (the engine mode ngram forces): its carried term is checked too")
    parser.add_argument("--window-prefill", action="store_true", help="hold the prefill inside a request's "
                        "decode window (the plain load's mean ITL less its median) per output token, not per step")
    host = parser.add_mutually_exclusive_group()
    host.add_argument("--host-per-token", action="store_true", help="also read the carried term as growing "
                      "with the tokens a step emits, at the last plain server's growth per request between its "
                      "lowest and highest C of each plain server (the verdict is then that reading)")
    host.add_argument("--host-from", type=Path, action="append", default=[], metavar="CAL.json",
                      help="test_decode JSON with --spec at other K than the checked ones, on the same machine: "
                      "also read each step with the host time those runs measured beyond the prediction, a + b x K "
                      "per C (the verdict is then that reading); repeatable")
    add_prediction_options(parser.add_argument, ("model", "tp", "server_layers"),
                           {"model": (None, "kimi-k2.5"), "tp": (1, "1")})
    parser.add_argument("--within", type=float, default=0.15, help="the bar. Default: %(default)s")
    args = parser.parse_args(argv)
    if args.plain is None and args.plain_sync is None:
        parser.error("no plain server's results: give --plain, --plain-sync or both")
    modes = {mode: path for mode, path in ((ASYNC, args.plain), (SYNC, args.plain_sync)) if path is not None}
    try:
        results = [r for path in args.kernels for r in load_results(path)[0]]
        spec = args.model or load_model_spec("kimi-k2.5")
        spec = with_layers(spec, args.server_layers) if args.server_layers else spec
        window = {"window_prefill": args.window_prefill}
        tables = {mode: checks(results, spec, path, args.spec_run, args.tp, args.within, **window)
                  for mode, path in modes.items()}
        hosts: dict[str, float] = {}
        terms: dict[str, HostTerm] = {}
        if args.host_per_token:
            for mode, path in modes.items():
                hosts[mode] = host_per_token_us(_plain_loads(path), results, spec, args.tp)
                tables[mode + HOSTED] = checks(results, spec, path, args.spec_run, args.tp, args.within,
                                               host_per_token=hosts[mode], **window)
        if args.host_from:
            checked = {row.k for row in next(iter(tables.values()))}  # the checked loads, read once above
            for mode, path in modes.items():
                terms[mode] = calibrate_host(results, spec, path, args.host_from, args.tp, sorted(checked), **window)
                tables[mode + CALIBRATED] = checks(results, spec, path, args.spec_run, args.tp, args.within,
                                                   host=terms[mode], **window)
    except (ValueError, OSError, KeyError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print("µs per output token; predicted = (drafted x verify + (1 - drafted) x step + carried) / tokens per step;\n"
          "beyond: µs per engine step measured beyond the predicted step ((measured - predicted) x tokens per step);\n"
          "/x-token: beyond over the tokens a step emits beyond the plain step's C ((tokens per step - 1) x C)")
    for key, rows in tables.items():
        mode = key.removesuffix(HOSTED).removesuffix(CALIBRATED)
        how = f"carried from the {MODE_NAMES[mode]}"
        if args.window_prefill:
            prefills = {row.concurrency: row.prefill_us for row in rows}
            how += (", less the prefill inside a request's decode window, held per output token ("
                    + ", ".join(f"C={c}: {us:.1f} µs" for c, us in sorted(prefills.items())) + "; --window-prefill)")
        if key.endswith(HOSTED):
            how += f", plus {hosts[mode]:.1f} µs per token a step emits beyond C (--host-per-token)"
        if key.endswith(CALIBRATED):
            term = terms[mode]
            how += (", plus the host time per speculative step the calibration runs measured (--host-from): "
                    + "; ".join(term.describe(c) for c in sorted(term.points)))
        print(how)
        print(HEADER)
        for row in rows:
            print(row.line())
        print(f"{sum(r.ok for r in rows)} of {len(rows)} within {args.within:.0%}")
    # the verdict: each load against the plain server in the engine mode its method runs in (vLLM 0.26
    # turns async scheduling off for ngram only), with the host term when asked
    suffix = HOSTED if args.host_per_token else CALIBRATED if args.host_from else ""
    verdict = [tables[engine_mode(row.method, modes) + suffix][i] for i, row in enumerate(next(iter(tables.values())))]
    if len(modes) > 1:  # with one plain server the verdict is its last table, printed above
        print("verdict: each load against the plain server in its method's engine mode (ngram: "
              "--no-async-scheduling; the others: async scheduling)" + (", with the host term" if suffix else ""))
        print(HEADER)
        for row in verdict:
            print(row.line())
        print(f"{sum(r.ok for r in verdict)} of {len(verdict)} within {args.within:.0%}")
    return 0 if verdict and all(r.ok for r in verdict) else 1


def engine_mode(method: str, given) -> str:
    """The plain server a load of ``method`` is checked against, of the engine modes ``given``: vLLM 0.26
    runs ``ngram`` without async scheduling and the other methods (``ngram_gpu``, EAGLE, MTP) with it;
    the one given stands in where the other is missing.

    >>> engine_mode("ngram", {ASYNC, SYNC}), engine_mode("ngram_gpu", {ASYNC, SYNC}), engine_mode("ngram_gpu", {SYNC})
    ('sync', 'async', 'sync')
    """
    wanted = SYNC if method == "ngram" else ASYNC
    return wanted if wanted in given else next(iter(given))


if __name__ == "__main__":
    sys.exit(main())
