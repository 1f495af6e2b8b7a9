#!/usr/bin/env bash
# Decode-step attribution on one GPU with a real CUDA vLLM (the lent H200: vLLM 0.26 from
# ../shared/tools/gpu-vllm, which exports VLLM_USE_FLASHINFER_SAMPLER=0). About 7 minutes:
#   1. the kernel benchmarks the prediction needs, TP 1, vllm backends, M = 1 and 64, L = 1024;
#   2. test_decode against a Kimi-K2.5 server cut to 4 layers, then to 2 (--server-layers),
#      C = 1 and 64, input 1024, output 128, with --breakdown and the prediction from step 1;
#   3. the 2- and 4-layer full-depth estimates side by side (the scaling check).
# Usage: ci/gpu/attrib.sh OUTDIR   (tables, JSON and SVG under OUTDIR; traces stay in /tmp)
# A failing step is logged and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: ci/gpu/attrib.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
common=(-p no:cacheprovider -p no:randomly --model kimi-k2.5 --tp 1 "--benchmark-storage=file://$out/store" -rs)
log() { echo "[attrib $(date +%T)] $*" | tee -a "$out/steps.log"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/nvidia-smi.txt" 2>&1
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" > "$out/versions.txt" 2>&1

log "kernel benchmarks (M=1,64; L=1024; vllm)"
kernels=(benchmarks/test_rmsnorm.py benchmarks/test_moe.py benchmarks/test_routing.py benchmarks/test_mla.py)
for extra in benchmarks/test_dense*.py benchmarks/test_gemm*.py; do [[ -f $extra ]] && kernels+=("$extra"); done
timeout 100 python3 -m pytest "${kernels[@]}" "${common[@]}" --sweep nightly \
    -k "vllm and (m1- or m64- or b1-l1024- or b64-l1024-) and not skewed and (fused or not moe)" \
    "--benchmark-json=$out/kernels.json" > "$out/kernels.log" 2>&1 || log "kernel benchmarks: exit $?"
tail -n 40 "$out/kernels.log"
predict=(); [[ -s $out/kernels.json ]] && predict=("--predict-from=$out/kernels.json")

for layers in 4 2; do
    log "test_decode --server-layers $layers"
    mkdir -p "$out/L$layers"
    timeout 230 python3 -m pytest benchmarks/test_decode.py "${common[@]}" --breakdown --server-layers "$layers" \
        --server-tp 1 --concurrency 1,64 --input-len 1024 --output-len 128 --server-timeout-s 190 \
        "--profile-dir=/tmp/attrib-traces-L$layers" "--breakdown-dir=$out/L$layers" "${predict[@]}" \
        "--server-log=$out/L$layers/server.log" "--benchmark-json=$out/L$layers/decode.json" \
        > "$out/L$layers/pytest.log" 2>&1 || log "test_decode L$layers: exit $?"
    sed -n '/decode step attribution/,$p' "$out/L$layers/pytest.log" | head -n 60
    grep -E "Using .* backend|attribution_error|no attribution" "$out/L$layers/server.log" "$out/L$layers/pytest.log" \
        | head -n 10 >> "$out/steps.log"
done

log "2- vs 4-layer scaling"
python3 -m decodebench.attribution.report "$out/L4/attribution.json" "$out/L2/attribution.json" \
    > "$out/scaling.txt" 2>&1 || log "scaling check: exit $?"
cat "$out/scaling.txt"
log "done"
