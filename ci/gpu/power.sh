#!/usr/bin/env bash
# Gate power on a CUDA machine with a real vLLM build: false alarms on A/A comparisons and
# detections of 2/5/10 % injected slowdowns on six vLLM kernel cases (ci/gate_power.py).
# Run from the repository root: ci/gpu/power.sh OUTDIR   (about 4 minutes on an H200)
# `python3` must import vLLM; PYTHONPATH gets the repository. A failing step is logged and
# the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: ci/gpu/power.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv > "$out/nvidia-smi.txt" 2>&1 || echo "power.sh: nvidia-smi failed" >&2
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" \
    > "$out/versions.txt" 2>&1 || echo "power.sh: torch/vLLM versions unreadable (see versions.txt)" >&2
timeout 290 python3 ci/gate_power.py "$out" --deadline-s 225 2>&1 | tee "$out/power.log"
status=${PIPESTATUS[0]}
echo "power.sh: gate_power exit $status; results in $out/power.md" >&2
exit "$status"
