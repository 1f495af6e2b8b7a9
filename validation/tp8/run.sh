#!/usr/bin/env bash
# One rank of TP 8 on one lent GPU (real CUDA vLLM from ../shared/tools/gpu-vllm), in three parts,
# each its own device call on the same warm machine; results under OUT (the device's $OUT), the
# working files under TP8_WORK (default $HOME/tp8; kept between the calls while the machine stays warm).
#   kernels  the nightly `vllm` kernel set at --tp 8 (and torch uk/uv, the real vLLM path): --timer
#            step, saved as the re-recorded baseline, then --timer kernel (not saved); SEED, a
#            baselines/<fingerprint> folder, is copied into the storage first (a stored run of another
#            day, which the gate part then also judges against when this machine's fingerprint matches);
#   serve    Kimi-K2.5 as one rank of TP 8 (--server-rank-of 8, LAYERS layers, uniform routing) at
#            C = 1, 64, 256 with --breakdown predicted from the step results; then the offline
#            command on the same traces predicted from the kernel results;
#   gate     night 2: the step set again, gated at 5% against the saved run (autosaved), then a 5%
#            injected slowdown gated at 3%.
# EXTRA_ARGS: more pytest options for the points part (e.g. --kv-cache-dtype auto,fp8 --mla-backends all);
# POINTS_PASS_S: each points pass's limit (240 s); POINTS_GATED=0 leaves out the gated pass.
# Usage: validation/tp8/run.sh PART OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
part=${1:?usage: run.sh kernels|serve|gate OUT}
out=${2:?OUT}
res=${TP8_WORK:-$HOME/tp8}
mkdir -p "$out" "$res"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
py=python3
common=(-p no:cacheprovider -p no:randomly --model kimi-k2.5 --tp 8 -rs -q)
kernels=(benchmarks/ --ignore=benchmarks/test_decode.py --ignore=benchmarks/test_allreduce.py -k "vllm or uk- or uv-")
store=(--benchmark-storage "file://$res/store")
log() { echo "[tp8 $(date -u +%T)] $*" | tee -a "$out/steps.txt"; }

nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
    >> "$out/steps.txt" 2>&1
case $part in
points)  # only the points the serve part's prediction reads: M = 1, 64, 256 (MLA at L = 1024)
    sel=(-k "(vllm or uk- or uv-) and (m1- or m64- or m256- or b1-l1024 or b64-l1024 or b256-l1024)")
    pts=(benchmarks/ --ignore=benchmarks/test_decode.py --ignore=benchmarks/test_allreduce.py "${sel[@]}" "${common[@]}"
         ${EXTRA_ARGS:-} --budget-ms 500 --benchmark-storage "file://$res/points-store")
    rm -rf "$res/points-store"
    pass_s=${POINTS_PASS_S:-240}  # each pass's limit; every pass's files go to OUT as soon as it ends
    keep() { [[ -f $res/$1.json ]] && gzip -9nc "$res/$1.json" > "$out/$1.json.gz"  # stored compressed
             tar czf "$out/points-logs.tgz" -C "$res" $(cd "$res" && ls ./*.log) points-store 2>/dev/null; }
    for t in step kernel; do  # the step run is saved: the stored night the gated run below compares with
        save=(); [[ $t == step ]] && save=(--benchmark-save points-step)
        timeout --kill-after=10 "$pass_s" "$py" -m pytest "${pts[@]}" --timer $t "${save[@]}" \
            --benchmark-json "$res/$t.json" > "$res/$t.log" 2>&1
        log "points $t exit $?: $(tail -n 1 "$res/$t.log")"
        keep $t
    done
    [[ ${POINTS_GATED:-1} == 0 ]] && exit 0  # POINTS_GATED=0: the two timers only
    log "points: --timer step again, gated at 5% against the saved run"
    timeout --kill-after=10 "$pass_s" "$py" -m pytest "${pts[@]}" --timer step --benchmark-compare --gate 5% \
        --benchmark-json "$res/step-gated.json" > "$res/step-gated.log" 2>&1
    log "points gated exit $?: $(grep -E '^gate |decodebench gate' "$res/step-gated.log" | tail -n 2)"
    keep step-gated
    ;;
kernels)
    if [[ -n ${SEED:-} ]]; then
        mkdir -p "$res/store" && cp -r "$SEED" "$res/store/" && log "seeded the storage with $SEED"
    fi
    log "kernels: --timer step, saved"
    timeout --kill-after=10 300 "$py" -m pytest "${kernels[@]}" "${common[@]}" --timer step "${store[@]}" \
        --benchmark-save vllm-nightly-step --benchmark-json "$res/step.json" > "$res/step.log" 2>&1
    log "step exit $?: $(tail -n 1 "$res/step.log")"
    log "kernels: --timer kernel"
    timeout --kill-after=10 220 "$py" -m pytest "${kernels[@]}" "${common[@]}" --timer kernel \
        --benchmark-json "$res/kernel.json" > "$res/kernel.log" 2>&1
    log "kernel exit $?: $(tail -n 1 "$res/kernel.log")"
    for t in step kernel; do [[ -f $res/$t.json ]] && gzip -9nc "$res/$t.json" > "$out/$t.json.gz"; done  # stored compressed
    tar czf "$out/kernels-logs.tgz" -C "$res" step.log kernel.log store 2>/dev/null
    ;;
serve)
    layers=${LAYERS:-24}
    rm -rf "$res/traces" "$res/attr-step" "$res/attr-kernel"
    log "serve: --server-rank-of 8 --server-layers $layers, C = 1, 64, 256"
    timeout --kill-after=15 ${SERVE_S:-520} "$py" -m pytest benchmarks/test_decode.py "${common[@]}" --breakdown \
        --server-model kimi-k2.5 --server-rank-of 8 --server-layers "$layers" --server-routing uniform \
        --concurrency 1,64,256 --input-len 1024 --output-len 128 --e2e-rounds 1 --server-timeout-s 330 \
        --profile-dir "$res/traces" --breakdown-dir "$res/attr-step" --predict-from "$res/step.json" \
        --server-log "$res/server.log" --benchmark-json "$out/decode.json" > "$res/serve.log" 2>&1
    log "serve exit $?: $(tail -n 1 "$res/serve.log")"
    cp "$res/attr-step/attribution.txt" "$res/attribution-step.txt" 2>/dev/null
    cp "$res/attr-step/attribution.json" "$res/attribution-step.json" 2>/dev/null
    log "offline, kernel-timer results"
    timeout 120 "$py" -m decodebench breakdown "$res/traces" --model kimi-k2.5 --server-rank-of 8 \
        --server-layers "$layers" --server-routing uniform --predict-from "$res/kernel.json" --out "$res/attr-kernel" \
        > "$res/attribution-kernel.txt" 2>&1
    log "offline exit $?"
    cp "$res/attr-kernel/attribution.json" "$res/attribution-kernel.json" 2>/dev/null
    # the code torch.compile generated for the served step, which names what each triton_* kernel fuses
    find "${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}" "${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}" \
        -name '*.py' 2>/dev/null | xargs grep -l 'def triton_' 2>/dev/null | tar czf "$out/inductor-code.tgz" -T - 2>/dev/null
    tar czf "$out/serve-results.tgz" -C "$res" serve.log server.log attribution-step.txt attribution-step.json \
        attribution-kernel.txt attribution-kernel.json 2>/dev/null
    # the traces in parts of 15 MB (at most 8 files of 16 MiB come back from a lent machine)
    tar czf - -C "$res" traces 2>/dev/null | split -b 15M -a 1 - "$out/traces.tgz.part-"
    log "traces: $(du -ch "$out"/traces.tgz.part-* | tail -n 1)"
    ;;
nights)  # a new runner from an empty storage, on the points of the prediction (M = 1, 64, 256; L = 1024)
    sel=(-k "(vllm or uk- or uv-) and (m1- or m64- or m256- or b1-l1024 or b64-l1024 or b256-l1024)")
    k=(benchmarks/ --ignore=benchmarks/test_decode.py --ignore=benchmarks/test_allreduce.py "${sel[@]}")
    ns=(--benchmark-storage "file://$res/nights")
    rm -rf "$res/nights"
    timeout --kill-after=10 150 "$py" -m pytest "${k[@]}" "${common[@]}" "${ns[@]}" --benchmark-autosave \
        --benchmark-json "$out/night1.json" > "$out/night1.log" 2>&1
    log "night1 exit $?: $(tail -n 1 "$out/night1.log")"
    timeout --kill-after=10 150 "$py" -m pytest "${k[@]}" "${common[@]}" "${ns[@]}" --benchmark-compare --gate 5% \
        --benchmark-autosave --benchmark-json "$out/night2.json" > "$out/night2.log" 2>&1
    log "night2 exit $?: $(grep -E '^gate |decodebench gate' "$out/night2.log" | tail -n 2)"
    timeout --kill-after=10 150 "$py" -m pytest "${k[@]}" "${common[@]}" "${ns[@]}" --benchmark-compare --gate 3% \
        --inject-slowdown 5% --benchmark-json "$out/inject.json" > "$out/inject.log" 2>&1
    log "inject exit $?: $(grep -E '^gate |decodebench gate' "$out/inject.log" | tail -n 2)"
    ;;
gate)
    log "gate: night 2, --timer step, --gate 5%, autosaved"
    timeout --kill-after=10 280 "$py" -m pytest "${kernels[@]}" "${common[@]}" --timer step "${store[@]}" \
        --benchmark-compare --gate 5% --benchmark-autosave --benchmark-json "$out/night2.json" > "$out/night2.log" 2>&1
    log "night2 exit $?: $(grep -E '^gate |decodebench gate' "$out/night2.log" | tail -n 2)"
    log "gate: 5% injected, --gate 3%"
    timeout --kill-after=10 280 "$py" -m pytest "${kernels[@]}" "${common[@]}" --timer step "${store[@]}" \
        --benchmark-compare --gate 3% --inject-slowdown 5% --benchmark-json "$out/inject.json" > "$out/inject.log" 2>&1
    log "inject exit $?: $(grep -E '^gate |decodebench gate' "$out/inject.log" | tail -n 2)"
    ;;
esac
