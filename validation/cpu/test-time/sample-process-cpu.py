"""Sample every process's CPU time while a test run goes on, then sum it by kind of process.

Usage:
  $PY validation/cpu/test-time/sample-process-cpu.py OUT.json &    # then run the suite, then: touch OUT.json.stop
  $PY validation/cpu/test-time/sample-process-cpu.py --summary OUT.json   # CPU seconds by class, tab-separated

Every 0.2 s it reads each process's command line, parent and user+system CPU time (psutil), and
keeps the last reading of each (pid, start time): a process that lived less than 0.2 s is missed,
and a killed one counts up to its last sample. It costs a few per cent of one core itself.
"""

import collections
import json
import os
import sys
import time

import psutil


def sample(out: str) -> None:
    seen: dict[tuple[int, float], dict] = {}
    began = time.time()
    try:
        while not os.path.exists(out + ".stop"):
            for process in psutil.process_iter(["pid", "ppid", "cmdline", "create_time", "cpu_times", "name"]):
                info = process.info
                if info["pid"] == os.getpid() or info["cpu_times"] is None:
                    continue
                record = seen.setdefault((info["pid"], info["create_time"]), {
                    "pid": info["pid"], "ppid": info["ppid"], "start": info["create_time"] - began})
                # the last command line and name (vLLM renames its processes after they start), but
                # not the empty one of a process that is exiting
                record.update(cmd=" ".join(info["cmdline"] or [])[:300] or record.get("cmd", ""),
                              name=info["name"] or record.get("name", ""),
                              cpu=info["cpu_times"].user + info["cpu_times"].system, last=time.time() - began)
            time.sleep(0.2)
    finally:
        with open(out, "w") as f:
            json.dump(list(seen.values()), f)


def kind(record: dict) -> str:
    cmd, name = record["cmd"], record["name"]
    if name.startswith("VLLM::"):
        return "vLLM engine core (VLLM::EngineCore)"
    rules = [("vllm.entrypoints", "vLLM API server"),
             ("vllm.model_executor.models.registry",
              "vLLM model-class inspection (registry.py, the run's first server)"),
             ("tests.forked", "session zygotes and the sessions forked from them"),
             ("pytest-xdist", "the two pytest-xdist workers (in-process tests)"),
             ("case_worker", "A/B and re-measure workers (decodebench.runner.case_worker)"),
             ("multiprocessing.spawn", "multiprocessing spawn children (rank processes)"),
             ("while True: pass", "the CPU-bound neighbour of two gate tests (cpu_hog)")]
    for mark, label in rules:
        if mark in cmd:
            return label
    if "python" in cmd or "python" in name:
        return "other Python processes (CLIs, fake servers, load generators)"
    return "other processes (shell, kernel threads, the VM agent)"


def summary(path: str) -> None:
    cpu, count = collections.Counter(), collections.Counter()
    for record in json.load(open(path)):
        if record["start"] < 0:  # running before the sampler began: not the run's
            continue
        cpu[kind(record)] += record["cpu"]
        count[kind(record)] += 1
    print("cpu_s\tprocesses\tclass")
    for label, seconds in cpu.most_common():
        print(f"{seconds:.1f}\t{count[label]}\t{label}")
    print(f"{sum(cpu.values()):.1f}\t{sum(count.values())}\tall")


if __name__ == "__main__":
    summary(sys.argv[2]) if sys.argv[1] == "--summary" else sample(sys.argv[1])
