#!/usr/bin/env bash
# validation/gpu/moe.sh OUTDIR -- the vLLM MoE cases on one CUDA GPU with a real vLLM (about 60-90 s
# on an H200 with vLLM 0.26): the fused Marlin layer and its two GEMMs, taken from the fused
# call's kernel trace, at every token count of the nightly sweep, uniform and skewed routing.
# Run from the repository root with the python3 that imports vLLM (PYTHONPATH holding the
# repo). Writes under OUTDIR: versions.txt, pytest.log, moe.json (pytest-benchmark JSON with
# raw samples and extra_info), summary.txt (one line per result) and steps.txt (each step's
# exit status). A failing step is logged and the next one runs.
set -uo pipefail
out=${1:?usage: validation/gpu/moe.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
py=${DECODEBENCH_PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: run with a time limit, record its exit status
    local name=$1 limit=$2
    shift 2
    echo "== $name" >&2
    timeout --kill-after=5 "$limit" "$@"
    echo "$name exit $?" >>"$out/steps.txt"
}

step versions 15 "$py" -c "
import torch
from decodebench.hardware import vllm_version
print('torch', torch.__version__, 'cuda', torch.version.cuda)
print('vllm', vllm_version())
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')
" >"$out/versions.txt" 2>&1

step pytest 72 "$py" -m pytest benchmarks/test_moe.py -k vllm -p no:cacheprovider -rs \
    --sweep nightly --device cuda --timer kernel --budget-ms 400 \
    --benchmark-storage "file://$out/store" --benchmark-json "$out/moe.json" >"$out/pytest.log" 2>&1

step summary 3 "$py" - "$out/moe.json" >"$out/summary.txt" 2>&1 <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for bench in sorted(report["benchmarks"], key=lambda b: b["name"]):
    info = bench["extra_info"]
    parts = info.get("part_median_s") or {}
    glue = " ".join(f"{k}={v * 1e6:.2f}" for k, v in parts.items())
    print(f"{bench['name']}: median {bench['stats']['median'] * 1e6:.2f} us, "
          f"{info.get('achieved_gbps', 0):.0f} GB/s ({info.get('frac_peak_bw') or 0:.0%} of peak), "
          f"ref err {info.get('reference_error', float('nan')):.2e}, stop {info.get('stop_reason')}"
          + (f" | parts us: {glue}" if glue else ""))
kernels = next((b["extra_info"].get("call_kernels") for b in report["benchmarks"]
                if b["extra_info"].get("call_kernels")), None)
if kernels:
    print("\nkernels of one fused_marlin_moe call (launch order -> part):")
    for k in kernels:
        print(f"  {k['part']:>16}  {k['name'][:160]}")
PY
rm -rf "$out/store"  # the same numbers as moe.json
cat "$out/steps.txt"
