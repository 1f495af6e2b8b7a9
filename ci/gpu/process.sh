#!/usr/bin/env bash
# Process-level drift and the gate's fresh-process re-measures, on any CUDA box (no vLLM
# needed: torch backends only). About 4 minutes on an H200.
#
#   ci/gpu/process.sh OUTDIR
#
# Five sessions of one fixed set of torch cases, each its own process, back to back: the
# first is stored; each later one is gated (--gate 5%) against what is stored so far and then
# stored (A/A, re-measures in fresh processes); a last one injects 10 % into half the cases.
# ci/process_drift.py then writes OUTDIR/process-drift.md: per case, the spread of the first
# run's floor across sessions (the process-to-process shift) and every gate verdict.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(mkdir -p "${1:?OUTDIR}" && cd "$1" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
select='torch and ((test_dense_gemm and (m1- or m64-) and not uk- and not uv-) or (test_rmsnorm and (m1- or m64-)) or (test_routing and (m1- or m64-)) or (test_mla_decode and l8192 and (b1- or b64-)))'
common=(benchmarks/ --sweep nightly -p no:cacheprovider "--benchmark-storage=file://$out/store" -q -rs
        --budget-ms 300 -k "$select")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$out/versions.txt" 2>&1
for i in 1 2 3 4 5; do
    gate=(); [ "$i" -gt 1 ] && gate=(--benchmark-compare --gate 5%)
    echo "== session $i ($(date -u +%T))"
    timeout --kill-after=10 150 python3 -m pytest "${common[@]}" --benchmark-autosave "${gate[@]}" \
        --benchmark-json "$out/s$i.json" > "$out/s$i.log" 2>&1
    echo "exit $?"; grep -E "^(SLOWER|UNDECIDED)|^gate|passed|failed" "$out/s$i.log" | tail -8
done
echo "== injected 10% ($(date -u +%T))"
args=(); for t in o_proj lm_head "rmsnorm[add"; do args+=(--inject-only "$t"); done
timeout --kill-after=10 150 python3 -m pytest "${common[@]}" --benchmark-compare --gate 5% \
    --inject-slowdown 10% "${args[@]}" --benchmark-json "$out/inject.json" > "$out/inject.log" 2>&1
echo "exit $?"; grep -E "^gate|passed|failed" "$out/inject.log" | tail -4
python3 ci/process_drift.py "$out" > "$out/process-drift.md"; cat "$out/process-drift.md"
