"""The published box figures of ``published.json`` as one Markdown page, so the text cannot drift from the data.

    python validation/projection/published.py > validation/projection/published.md

Checks the file first (each run's setup fields and source, each figure's TPOT against concurrency / tok/s
unless the page gave it, the ``tpot`` headline against its run) and stops naming what is wrong.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETUP = ("id", "model", "engine", "gpus", "tp", "dcp", "mtp", "speculative", "allreduce", "nccl", "kv_cache_dtype",
         "mla_backend", "max_model_len", "vllm", "image", "host", "method", "other", "source", "figures")


def load(path: Path = HERE / "published.json") -> dict:
    """``published.json`` checked; ValueError naming the run and what is wrong otherwise."""
    data = json.loads(Path(path).read_text())
    runs = {run["id"]: run for run in data["runs"]}
    if len(runs) != len(data["runs"]):
        raise ValueError(f"{path}: two runs share an id")
    for run in data["runs"]:
        _check_run(run)
    for batch, figure in data["tpot"].items():
        cell = _cell(runs[figure["run"]], "0", int(batch))
        if cell is None or abs(cell["tok_s"] - figure["tok_s"]) > 0.05:
            raise ValueError(f"tpot[{batch!r}] is not context 0, concurrency {batch} of run {figure['run']}")
    return data


def _check_run(run: dict) -> None:
    missing = [k for k in SETUP if k not in run] + [k for k in ("repo", "path", "commit") if not run["source"].get(k)]
    if missing:
        raise ValueError(f"run {run.get('id')!r}: no {', '.join(missing)}")
    for f in run["figures"]:
        if not (f["tok_s"] > 0 and f["concurrency"] >= 1):
            raise ValueError(f"run {run['id']!r}: a figure needs tok/s above 0 and concurrency 1 or more: {f}")
        if "tpot_from" not in f and abs(f["tpot_ms"] - f["concurrency"] / f["tok_s"] * 1e3) > 0.006:
            raise ValueError(f"run {run['id']!r}: tpot_ms is not concurrency / tok_s and names no tpot_from: {f}")


def _cell(run: dict, context: str, concurrency: int) -> dict | None:
    return next((f for f in run["figures"] if f["context"] == context and f["concurrency"] == concurrency), None)


def render(data: dict) -> str:
    """The page: how it is made, the runs with their setups and sources, then every figure."""
    runs = data["runs"]
    lines = ["# Published decode figures of the box class", "",
             "8x RTX PRO 6000 Blackwell (PCIe), Kimi-K2.5 / K2.6 / K2.7-Code, vLLM at TP 8: "
             f"{sum(len(r['figures']) for r in runs)} figures of {len(runs)} runs, transcribed into `published.json` "
             "from the public pages each run names; not measured here. Made by "
             "`python validation/projection/published.py > validation/projection/published.md`; edit the JSON, not "
             "this page. TPOT = concurrency / aggregate tok/s, per request and per output token (with speculative "
             "decoding, not a decode step), unless marked `page`. `published.json` `fields` defines each column.", "",
             "## Runs", "", "| run | model | DCP | spec. decoding | all-reduce | KV | MLA | vLLM | source |",
             "|---|---|---:|---|---|---|---|---|---|"]
    lines += [_run_row(r) for r in runs]
    lines += ["", "## Figures", "",
              "| run | model | DCP | spec. decoding | all-reduce | context | C | tok/s | TPOT ms | note |",
              "|---|---|---:|---|---|---|---:|---:|---:|---|"]
    lines += [_figure_row(r, f) for r in runs for f in r["figures"]]
    return "\n".join(lines) + "\n"


def _run_row(run: dict) -> str:
    src = run["source"]
    spec = run["speculative"] if run["mtp"] else "off"
    cells = (run["id"], run["model"].split("/")[-1], run["dcp"], spec, *(run[k] or "not stated" for k in
             ("allreduce", "kv_cache_dtype", "mla_backend", "vllm")),
             f"{src['repo']} `{src['path']}` @ {src['commit'][:7]}, {src['section']}")
    return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"


def _figure_row(run: dict, f: dict) -> str:
    notes = [f"{f['context_tokens']} tokens" if "context_tokens" in f else "", f.get("stat", ""), f.get("caveat", "")]
    tpot = f"{f['tpot_ms']:.2f}" + (" page" if "tpot_from" in f else "")
    spec = run["speculative"].split(",")[0] if run["mtp"] else "off"
    cells = (run["id"], run["model"].split("/")[-1], run["dcp"], spec, run["allreduce"] or "not stated", f["context"],
             f["concurrency"], f"{f['tok_s']:g}", tpot, "; ".join(n for n in notes if n))
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    sys.stdout.write(render(load(Path(args[0]) if args else HERE / "published.json")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
