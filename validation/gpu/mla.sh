#!/usr/bin/env bash
# MLA decode and dense bf16 GEMMs on one CUDA GPU with a real vLLM (about 2 minutes on an H200):
# what vLLM's selector dispatches, every vLLM MLA backend (runnable ones timed, the rest skipped
# with their reason) at b1 l1K, b64 l1K and b64 l8K, and the dense GEMMs at M = 1 and 64 for
# TP 1 and TP 8. Usage: validation/gpu/mla.sh OUTDIR. Each step logs and the next one runs regardless.
set -uo pipefail
out=${1:?usage: validation/gpu/mla.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUTDIR/NAME.txt, never stop the script
    local name=$1 limit=$2; shift 2
    echo "== $name"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    echo "rc=$?" >> "$out/$name.txt"
    tail -n 25 "$out/$name.txt"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$out/nvidia-smi.txt" 2>&1
step dispatch 60 "$py" - "$out/dispatch.json" <<'PY'
import json, sys, torch
from decodebench.hardware import vllm_version
from decodebench.kernels.mla_select import ask_vllm_dispatch
device = torch.device("cuda")
answers = {f"heads{h}": vars(ask_vllm_dispatch(576, h, device)) for h in (8, 64)}  # Kimi at TP 8 and TP 1
answers["vllm"], answers["gpu"] = vllm_version(), torch.cuda.get_device_name(device)
json.dump(answers, open(sys.argv[1], "w"), indent=2, default=str)
print(json.dumps(answers, indent=2, default=str))
PY
common=(-p no:cacheprovider -rs "--benchmark-storage=file://$out/store" --sweep nightly)
step mla-backends 120 "$py" -m pytest benchmarks/test_mla.py "${common[@]}" --mla-backends all --budget-ms 250 \
    -k "uniform-h8-b1-l1024 or uniform-h8-b64-l1024 or uniform-h8-b64-l8192" --benchmark-json "$out/mla.json"
for tp in 1 8; do
    step "dense-tp$tp" 90 "$py" -m pytest benchmarks/test_dense.py "${common[@]}" --tp "$tp" --budget-ms 150 \
        -k "m1-torch or m1-vllm or m64-torch or m64-vllm" --benchmark-json "$out/dense-tp$tp.json"
done
"$py" - "$out" <<'PY' > "$out/summary.txt" 2>&1
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("mla.json", "dense-tp1.json", "dense-tp8.json"):
    path = out / name
    if not path.exists():
        print(f"{name}: missing (see the step's log)")
        continue
    for b in json.loads(path.read_text())["benchmarks"]:
        e = b["extra_info"]
        mark = " DISPATCHED" if e.get("dispatched") else ""
        print(f"{b['name']:70s} {b['stats']['median'] * 1e6:10.1f} us  {e.get('frac_peak_bw') or 0:6.1%} of peak BW{mark}")
PY
cat "$out/summary.txt"
