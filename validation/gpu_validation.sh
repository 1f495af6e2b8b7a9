#!/usr/bin/env bash
# One GPU validation pass (the lent H200 or any CUDA box): timer modes against the
# profiler, the RMSNorm benchmarks twice (the second compared against the first), and
# the GPU-only unit tests. Results go to $1 (default ./gpu-validation).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-validation}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$out/nvidia-smi.txt"
python validation/validate_timers.py "$out" 2>&1
store="file://$out/store"
common=(benchmarks/test_rmsnorm.py -p no:cacheprovider "--benchmark-storage=$store" -rs)
python -m pytest "${common[@]}" --benchmark-autosave 2>&1 | tail -n 60 > "$out/rmsnorm-run1.txt"
python -m pytest "${common[@]}" --benchmark-autosave --benchmark-compare --gate 5% 2>&1 | tail -n 90 > "$out/rmsnorm-run2.txt"
python -m pytest tests/test_timing.py -q -rs 2>&1 | tail -n 15 > "$out/gpu-unit-tests.txt"
cat "$out/rmsnorm-run2.txt" "$out/gpu-unit-tests.txt"
