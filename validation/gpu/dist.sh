#!/usr/bin/env bash
# The distributed part on one CUDA GPU with a real vLLM (world size 1 is all one GPU gives):
# the all-reduce benchmark with the events and the CUDA-graph timer (torch NCCL capture and
# replay), the --pcie-only mode recorded in results and fingerprint, and vLLM's capture APIs
# checked by name. Usage: validation/gpu/dist.sh OUTDIR   (about 45 s on an H200; every step is
# bounded and a failing step is logged, then the next one runs)
set -uo pipefail
out=${1:?usage: validation/gpu/dist.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
common=(benchmarks/test_allreduce.py -p no:cacheprovider --device cuda:0 --world-size 1 --sweep smoke
        --budget-ms 200 --benchmark-storage "file://$out/store" -rs)

step() {  # step NAME SECONDS COMMAND...: run, log to OUTDIR/NAME.txt, never stop the script
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee -a "$out/steps.txt"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "   exit $?" | tee -a "$out/steps.txt"
}

step vllm_apis 12 "$py" - <<'PY'
# the names this suite calls in vLLM, as the installed build has them
import inspect
import vllm
from vllm.distributed.device_communicators import custom_all_reduce, pynccl
print("vllm", vllm.__version__)
ca = custom_all_reduce.CustomAllreduce
for name in ("capture", "custom_all_reduce", "should_custom_ar", "register_graph_buffers", "finalize_p2p"):
    print(f"CustomAllreduce.{name}:", hasattr(ca, name))
print("CustomAllreduce.__init__", inspect.signature(ca.__init__))
print("CustomAllreduce._SUPPORTED_WORLD_SIZES", getattr(ca, "_SUPPORTED_WORLD_SIZES", None))
print("PyNcclCommunicator.all_reduce", inspect.signature(pynccl.PyNcclCommunicator.all_reduce))
PY
step native 28 "$py" -m pytest "${common[@]}" --benchmark-json "$out/allreduce.json"
step pcie_only 15 "$py" -m pytest "${common[@]}" -k m1x7168 --pcie-only --benchmark-json "$out/allreduce-pcie-only.json"
step summary 5 "$py" - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("allreduce.json", "allreduce-pcie-only.json"):
    path = out / name
    if not path.exists():
        print(f"{name}: missing")
        continue
    data = json.loads(path.read_text())
    print(f"{name}: fingerprint {data['machine_info']['decodebench']['fingerprint']['key']}")
    for b in data["benchmarks"]:
        i = b["extra_info"]
        print(f"  {b['name']}: {i['timer']} {i['median_s'] * 1e6:.2f} us, {i['samples']} samples, "
              f"stop {i['stop_reason']}, error {i['reference_error']}, link_mode {i['link_mode']}, "
              f"vLLM would use {i['vllm_would_use']['backend']}, NCCL_P2P_DISABLE={i['nccl_env'].get('NCCL_P2P_DISABLE')}")
PY
cat "$out/summary.txt"
