"""A stand-in for vLLM's OpenAI API server, for fast tests of the server fixture and the client.

Takes vLLM's command line (``-m MODULE`` and unknown flags are ignored; ``--host``,
``--port``, ``--model``, ``--max-model-len`` and ``--api-key`` are honoured) plus:

``--fake-mode ok|exit|usage|hang|tree``
    ok: serve; exit: fail at once with exit code 3; usage: print a long usage text, then
    an argparse error, and exit with code 2 (as vLLM does for a bad flag); hang: never answer /health;
    tree: serve, after spawning sleepers that a careless teardown would leave behind
    (a child, one that left the process group, and its child).
``--fake-stubborn``
    in tree mode, also spawn a sleeper that ignores SIGTERM.
``--fake-pids FILE``
    every process it spawns (and the server itself) appends its pid to FILE.
``--fake-fail-from N``
    completion requests from the N-th on (0-based, warm-up included) answer HTTP 500.
``--fake-die-at N``
    the N-th completion request (0-based, warm-up included) streams its first token, then the
    server dies, as ``--fake-die-how`` says: ``kill`` (SIGKILL itself: no last words, as a
    ``kill -9`` of vLLM's API server) or ``crash`` (log an engine error, exit with code 1).
``--fake-stall-at N``
    the N-th completion request (0-based, warm-up included) streams ``--fake-stall-after`` tokens
    (default 1), then sends nothing more, holding its connection open; the server stays up.
``--fake-ping-s S``
    the stalled request sends an SSE comment (``: ping``) every S seconds instead of nothing, as
    proxies and some servers keep a connection alive.
``--fake-usage JSON``
    the usage event says ``completion_tokens`` is this JSON value (``0``, ``-3``, ``1e12``), not the
    tokens streamed.
``--fake-mid-event TEXT``
    after the first token, an event ``data: TEXT`` (``null``: not a JSON object).
``--fake-tokens N``
    stream N tokens whatever ``max_tokens`` asks (usage counts them), as a server that ignores it.
``--fake-fault-at N``
    the three above apply to the N-th completion request only (0-based, warm-up included), not to all.
``--fake-close-at N``
    the N-th completion request streams one token, then its connection is closed (no ``[DONE]``);
    the server stays up.
``--fake-non-sse-at N``
    the N-th completion request answers 200 with an HTML page, not an event stream.
``--fake-metrics-drip S``
    /metrics sends its body one byte every S seconds (each byte within any read timeout).
``--fake-no-tpot``
    /metrics leaves out vLLM's TPOT histogram (as a vLLM that renamed it would).
``--fake-token-s S``
    seconds between streamed tokens (default 0.002).
``--fake-one-chunk``
    generate tokens at the same pace (and count them so in /metrics) but stream them all
    in one chunk at the end, as a starved server coalesces its stream.
``--fake-burst``
    generate tokens at the same pace, but send every token's event in one write at the end,
    as a client that fell behind the stream reads them all at once.
``--speculative-config JSON``
    vLLM's flag: with ``num_speculative_tokens`` K, /metrics also serves vLLM's spec-decode
    counters as a server would count them if every decode step drafted K tokens and accepted the
    first ``--fake-accept`` (default 1) of them: a request of N tokens takes ceil((N - 1) / (A + 1))
    steps (the last one's accepted drafts cut to what is left).

It serves /health, /version, /v1/models, /metrics (the four histograms the benchmark
cross-checks, as _sum/_count) and streaming /v1/completions, using the standard library only.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLEEPER = """
import os, signal, subprocess, sys, time
role, pids = sys.argv[1], sys.argv[2]
if role == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if role == "escaper":
    os.setpgrp()  # leaves the server's process group, stays in its session
    subprocess.Popen([sys.executable, "-c", sys.argv[3], "grandchild", pids, sys.argv[3]])
with open(pids, "a") as f:
    f.write(f"{os.getpid()}\\n")
time.sleep(600)
"""


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", dest="module")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--api-key")
    parser.add_argument("--fake-mode", default="ok", choices=("ok", "exit", "usage", "hang", "tree"))
    parser.add_argument("--fake-pids")
    parser.add_argument("--fake-stubborn", action="store_true")
    parser.add_argument("--fake-fail-from", type=int)
    parser.add_argument("--fake-die-at", type=int)
    parser.add_argument("--fake-die-how", default="kill", choices=("kill", "crash"))
    parser.add_argument("--fake-token-s", type=float, default=0.002)
    parser.add_argument("--fake-stall-at", type=int)
    parser.add_argument("--fake-stall-after", type=int, default=1)
    parser.add_argument("--fake-close-at", type=int)
    parser.add_argument("--fake-ping-s", type=float)
    parser.add_argument("--fake-usage", type=json.loads)
    parser.add_argument("--fake-mid-event")
    parser.add_argument("--fake-tokens", type=int)
    parser.add_argument("--fake-fault-at", type=int)
    parser.add_argument("--fake-non-sse-at", type=int)
    parser.add_argument("--fake-no-tpot", action="store_true")
    parser.add_argument("--fake-metrics-drip", type=float)
    parser.add_argument("--fake-one-chunk", action="store_true")
    parser.add_argument("--fake-burst", action="store_true")
    parser.add_argument("--speculative-config", type=json.loads)
    parser.add_argument("--fake-accept", type=int, default=1)
    return parser.parse_known_args(argv)[0]


class Metrics:
    NAMES = ("time_to_first_token_seconds", "inter_token_latency_seconds",
             "request_time_per_output_token_seconds", "e2e_request_latency_seconds")

    SPEC = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")

    def __init__(self, spec_tokens=0, accept=1, no_tpot=False):
        self.lock = threading.Lock()
        self.shown = tuple(n for n in self.NAMES if not (no_tpot and n == "request_time_per_output_token_seconds"))
        self.sums = dict.fromkeys(self.NAMES, 0.0)
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.k, self.accept = spec_tokens, min(accept, spec_tokens)
        self.spec = dict.fromkeys(self.SPEC, 0)
        self.per_pos = [0] * spec_tokens

    def speculate(self, tokens):
        """Count one request's decode steps (its tokens after the first) as vLLM's spec-decode metrics do."""
        if not self.k:
            return
        left = tokens - 1
        with self.lock:
            while left > 0:
                accepted = min(self.accept, left - 1)
                self.spec["num_drafts"] += 1
                self.spec["num_draft_tokens"] += self.k
                self.spec["num_accepted_tokens"] += accepted
                for pos in range(accepted):
                    self.per_pos[pos] += 1
                left -= accepted + 1

    def observe(self, name, value, count=1):
        with self.lock:
            self.sums[name] += value
            self.counts[name] += count

    def text(self, model):
        lines = []
        for name in self.shown:
            labels = f'{{engine="0",model_name="{model}"}}'
            lines += [f"# TYPE vllm:{name} histogram",
                      f"vllm:{name}_sum{labels} {self.sums[name]}", f"vllm:{name}_count{labels} {self.counts[name]}"]
        lines.append('vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="64"} 1.0')  # 1024 tokens
        labels = f'engine="0",model_name="{model}"'
        for name in self.SPEC if self.k else ():
            lines += [f"# TYPE vllm:spec_decode_{name} counter", f"vllm:spec_decode_{name}_total{{{labels}}} "
                      f"{float(self.spec[name])}"]
        if self.k:
            lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{pos}"}} {float(n)}'
                      for pos, n in enumerate(self.per_pos)]
        return "\n".join(lines) + "\n"


def make_handler(args, metrics):
    requests = iter(range(1 << 30))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *values):
            sys.stderr.write(f"fake: {self.command} {self.path} {fmt % values}\n")

        def send_json(self, status, payload):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def authorized(self):
            if args.api_key and self.headers.get("Authorization") != f"Bearer {args.api_key}":
                self.send_json(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self):
            if self.path == "/health":
                self.send_json(200, {})
            elif self.path == "/version":
                self.send_json(200, {"version": "fake-1"})
            elif self.path == "/metrics":
                body = metrics.text(args.model).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for i in range(0, len(body), 1 if args.fake_metrics_drip else len(body)):
                    time.sleep(args.fake_metrics_drip or 0)
                    self.wfile.write(body[i:i + (1 if args.fake_metrics_drip else len(body))])
                    self.wfile.flush()
            elif self.path == "/v1/models" and self.authorized():
                self.send_json(200, {"data": [{"id": args.model, "max_model_len": args.max_model_len}]})
            elif self.path != "/v1/models":
                self.send_json(404, {"error": "not found"})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions" or not self.authorized():
                return
            number = next(requests)
            if args.fake_fail_from is not None and number >= args.fake_fail_from:
                self.send_json(500, {"error": {"message": f"fake engine error on request {number}"}})
                return
            if number == args.fake_non_sse_at:
                self.send_html()
                return
            self.stream(request, die=number == args.fake_die_at, stall=number == args.fake_stall_at,
                        close=number == args.fake_close_at, fault=args.fake_fault_at in (None, number))

        def send_html(self):
            body = b"<html><body>502 Bad Gateway (a proxy's page)</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def stream(self, request, die=False, stall=False, close=False, fault=False):
            start = time.perf_counter()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            tokens = args.fake_tokens if fault and args.fake_tokens is not None else request["max_tokens"]
            last = start
            for i in range(tokens):
                if i:
                    time.sleep(args.fake_token_s)
                if not args.fake_one_chunk and not args.fake_burst:
                    self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
                    self.wfile.flush()
                if i == 0 and fault and args.fake_mid_event is not None:
                    self.wfile.write(f"data: {args.fake_mid_event}\n\n".encode())
                if die:
                    die_now(args.fake_die_how)
                if stall and i + 1 == args.fake_stall_after:
                    keep_alive(self.wfile, args.fake_ping_s)
                if close:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                now = time.perf_counter()
                name = "time_to_first_token_seconds" if i == 0 else "inter_token_latency_seconds"
                metrics.observe(name, now - (start if i == 0 else last))
                if i == 0:
                    first = now
                last = now
            if args.fake_burst:
                self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n' * tokens)
            if args.fake_one_chunk:
                self.wfile.write(f'data: {{"choices": [{{"index": 0, "text": "{"x" * tokens}"}}]}}\n\n'.encode())
            counted = args.fake_usage if fault and args.fake_usage is not None else tokens
            usage = {"prompt_tokens": len(request["prompt"]), "completion_tokens": counted}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            metrics.observe("request_time_per_output_token_seconds", (last - first) / max(1, tokens - 1))
            metrics.speculate(tokens)
            metrics.observe("e2e_request_latency_seconds", last - start)

    return Handler


def keep_alive(wfile, ping_s):
    """Hold the connection open for an hour, silent or with a ``: ping`` comment every ``ping_s``."""
    end = time.monotonic() + 3600
    while time.monotonic() < end:
        time.sleep(ping_s or 3600)
        if ping_s:
            wfile.write(b": ping\n\n")
            wfile.flush()


def die_now(how):
    """End the whole server at once, mid-stream: by SIGKILL, or as an engine crash does."""
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("(EngineCore_DP0 pid=1) ERROR fake engine core died\nRuntimeError: fake engine core died",
          file=sys.stderr, flush=True)
    os._exit(1)


def print_usage_error():
    """What vLLM's argument parser prints for an unknown flag: usage (long), then one error line."""
    lines = ["usage: api_server.py [-h] [--host HOST] [--port PORT]"]
    lines += [f"                     [--fake-option-{i} VALUE]" for i in range(60)]
    lines += ["                     [--log-level {CRITICAL,ERROR,WARNING,INFO,DEBUG}]",
              "api_server.py: error: unrecognized arguments: --no-such-flag"]
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.exit(2)


def spawn_tree(pids_file, stubborn):
    for role in ("child", "escaper") + (("stubborn",) if stubborn else ()):
        subprocess.Popen([sys.executable, "-c", SLEEPER, role, pids_file, SLEEPER])


def main():
    args = parse_args(sys.argv[1:])
    if args.fake_pids:
        with open(args.fake_pids, "a") as f:
            f.write(f"{os.getpid()}\n")
    if args.fake_mode == "exit":
        print("fake: refusing to start: --fake-mode exit", file=sys.stderr, flush=True)
        sys.exit(3)
    if args.fake_mode == "usage":
        print_usage_error()
    if args.fake_mode == "hang":
        print("fake: hanging before /health", file=sys.stderr, flush=True)
        time.sleep(3600)
    if args.fake_mode == "tree":
        spawn_tree(args.fake_pids, args.fake_stubborn)
    ThreadingHTTPServer.request_queue_size = 1024  # a burst of C connections, as uvicorn's backlog takes them
    spec_tokens = (args.speculative_config or {}).get("num_speculative_tokens", 0)
    server = ThreadingHTTPServer(
        (args.host, args.port), make_handler(args, Metrics(spec_tokens, args.fake_accept, args.fake_no_tpot))
    )
    server.daemon_threads = True
    print(f"fake: serving {args.model} on {args.host}:{args.port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
