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
  ``--no-async-scheduling`` (``ci/gpu/spec.sh``'s part ``plainsync``). The verdict reads each load
  against the plain server in its method's engine mode (:func:`engine_mode`: ``ngram`` sync,
  ``ngram_gpu``, EAGLE and MTP async), where both are given;
* ``tokens per step``: decode tokens over request-steps, from vLLM's counters over the load.

With ``--host-per-token`` a third reading adds host work that grows with the tokens a step
emits: ``h``, the carried term's growth per request between the plain (sync) server's lowest and
highest C (in a plain step each request emits one token, so per request is per token there), times
the tokens a speculative step emits beyond C::

    carried(C, spec) = carried(C) + h · C · (tokens per step - 1)

On the H200 (lease 6, docs/attribution.md) the step's excess over the constant carried term grew
by 67-72 µs per extra emitted token at C = 64, and the plain sync server's carried term grew by
56 µs per request from C = 1 to 64. This reading was added after those runs; lease 7's traces
(``python -m decodebench.attribution.steps``) showed the excess to be host time per step and per
request (input preparation, rejection sampling, launch), and this reading overshot C = 64 there.

ngram's host time is in no figure; what the check misses by includes it. Usage::

    python -m decodebench.attribution.spec_verify KERNELS.json --plain PLAIN.json --spec SPEC.json... \\
        [--plain-sync PLAIN_SYNC.json] [--host-per-token] --model kimi-k2.5 --tp 1 --layers 4 [--within 0.15]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..model import load_model_spec
from .depth import with_layers
from .predict import load_results, predict_step
from .speculative import verification_step

__all__ = ["SpecCheck", "check_load", "engine_mode", "host_per_token_us", "main"]

ASYNC, SYNC, HOSTED = "async", "sync", "+host"
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
               routing: str | None = "uniform", host_per_token: float = 0.0) -> SpecCheck:
    """The check of one stored spec load (``bench``) against the plain load of the same C (``plain``);
    ``host_per_token`` (µs, :func:`host_per_token_us`) is added to the carried term for every token
    the step emits beyond C.

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
    carried = plain_us - step + host_per_token * c * (tokens_per_step - 1)
    share = float(counters.get("drafted_share") or 0.0)
    predicted = (share * verify + (1 - share) * step + carried) / tokens_per_step
    return SpecCheck(bench["name"], c, k, counters.get("acceptance_rate"), tokens_per_step, share,
                     plain_us, step, verify, carried, predicted, float(info["mean_tpot_ms"]) * 1e3, within,
                     str(counters.get("method") or "ngram"))


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


def checks(results, spec, plain: Path, spec_files: Sequence[Path], tp: int, within: float,
           host_per_token: float = 0.0) -> list[SpecCheck]:
    """One check per load of each ``spec_files`` against ``plain`` (a plain server's results), from
    kernel ``results`` on the served model ``spec``."""
    by_c = _plain_loads(plain)
    out = []
    for path in spec_files:
        for bench in _decode_results(path):
            c = int(bench["extra_info"]["max_concurrency"])
            if c not in by_c:
                raise ValueError(f"{bench['name']}: no plain load at C={c} in {plain}")
            out.append(check_load(bench, by_c[c], results, spec, tp, within, host_per_token=host_per_token))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decodebench.attribution.spec_verify",
                                     description="The speculative-decoding TPOT predicted at the measured acceptance "
                                                 "against the measured TPOT.")
    parser.add_argument("kernels", nargs="+", type=Path, help="kernel results (plain and --verify-tokens)")
    parser.add_argument("--plain", type=Path, help="test_decode JSON of the server without --spec (give it, "
                        "--plain-sync or both)")
    parser.add_argument("--spec", type=Path, action="append", required=True, help="test_decode JSON with --spec; "
                        "repeatable")
    parser.add_argument("--plain-sync", type=Path, help="test_decode JSON of the server without --spec and with "
                        "--no-async-scheduling (the engine mode ngram forces): its carried term is checked too")
    parser.add_argument("--host-per-token", action="store_true", help="also read the carried term as growing "
                        "with the tokens a step emits, at the last plain server's growth per request between its "
                        "lowest and highest C of each plain server (the verdict is then that reading)")
    parser.add_argument("--model", default="kimi-k2.5", help="Default: %(default)s")
    parser.add_argument("--tp", type=int, default=1, help="Default: %(default)s")
    parser.add_argument("--layers", type=int, default=None, help="served layers. Default: the model's")
    parser.add_argument("--within", type=float, default=0.15, help="the bar. Default: %(default)s")
    args = parser.parse_args(argv)
    if args.plain is None and args.plain_sync is None:
        parser.error("no plain server's results: give --plain, --plain-sync or both")
    modes = {mode: path for mode, path in ((ASYNC, args.plain), (SYNC, args.plain_sync)) if path is not None}
    try:
        results = [r for path in args.kernels for r in load_results(path)[0]]
        spec = load_model_spec(args.model)
        spec = with_layers(spec, args.layers) if args.layers else spec
        tables = {mode: checks(results, spec, path, args.spec, args.tp, args.within) for mode, path in modes.items()}
        hosts: dict[str, float] = {}
        if args.host_per_token:
            for mode, path in modes.items():
                hosts[mode] = host_per_token_us(_plain_loads(path), results, spec, args.tp)
                tables[mode + HOSTED] = checks(results, spec, path, args.spec, args.tp, args.within,
                                               host_per_token=hosts[mode])
    except (ValueError, OSError, KeyError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print("µs per output token; predicted = (drafted x verify + (1 - drafted) x step + carried) / tokens per step;\n"
          "beyond: µs per engine step measured beyond the predicted step ((measured - predicted) x tokens per step);\n"
          "/x-token: beyond over the tokens a step emits beyond the plain step's C ((tokens per step - 1) x C)")
    for key, rows in tables.items():
        mode = key.removesuffix(HOSTED)
        how = f"carried from the {MODE_NAMES[mode]}"
        if key.endswith(HOSTED):
            how += f", plus {hosts[mode]:.1f} µs per token a step emits beyond C (--host-per-token)"
        print(how)
        print(HEADER)
        for row in rows:
            print(row.line())
        print(f"{sum(r.ok for r in rows)} of {len(rows)} within {args.within:.0%}")
    # the verdict: each load against the plain server in the engine mode its method runs in (vLLM 0.26
    # turns async scheduling off for ngram only), with the host term when asked
    suffix = HOSTED if args.host_per_token else ""
    verdict = [tables[engine_mode(row.method, modes) + suffix][i] for i, row in enumerate(next(iter(tables.values())))]
    if len(modes) > 1:  # with one plain server the verdict is its last table, printed above
        print("verdict: each load against the plain server in its method's engine mode (ngram: "
              "--no-async-scheduling; the others: async scheduling)" + (", with the host term" if hosts else ""))
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
