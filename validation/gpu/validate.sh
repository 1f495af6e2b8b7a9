#!/usr/bin/env bash
# The GPU validation of docs/validation.md, docs/attribution.md and docs/e2e.md, on any CUDA
# box whose python3 imports a vLLM build (on the lent H200: vLLM 0.26 from
# ../shared/tools/gpu-vllm). One part per call, each within 10 minutes on an H200:
#
#   validation/gpu/validate.sh kernels OUTDIR   timer check; the nightly sweep with every backend,
#                                       saved as a baseline, then a second sweep gated
#                                       against it (A/A); the gate's power (validation/gate_power.py)
#   validation/gpu/validate.sh serve OUTDIR     decode-step breakdown and prediction on a live vLLM
#                                       server with a reduced-layer Kimi-K2.5 (validation/gpu/attrib.sh)
#   validation/gpu/validate.sh extras OUTDIR    the per-part checks: validation/gpu/{dist,mla,moe}.sh
#   validation/gpu/validate.sh whatif OUTDIR    a what-if (--what-if mla_attention=vllm-triton_mla) against
#                                       a server started with TRITON_MLA (validation/gpu/whatif.sh)
#
# Every step is bounded by `timeout` and a failing step does not stop the next; everything
# is packed into OUTDIR/<part>.tgz at the end, beside the short logs.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
gpu_part_setup "${1:?usage: validation/gpu/validate.sh kernels|serve|extras|whatif OUTDIR}" "${2:?OUTDIR}"

sweep() {  # sweep SECONDS NAME EXTRA...: the kernel and all-reduce benchmarks, nightly sweep
    step "$1" "$2" python3 -m pytest benchmarks/ --ignore=benchmarks/test_decode.py --sweep nightly \
        -p no:cacheprovider "--benchmark-storage=file://$work/store" --benchmark-autosave -rs -q "${@:3}"
}

case $part in
kernels)  # about 9 minutes on an H200
    versions > "$work/versions.txt" 2>&1; cat "$work/versions.txt"
    sweep 250 sweep1 --mla-backends all --budget-ms 1000 --benchmark-json "$work/sweep1.json"
    sweep 130 sweep2 -k vllm --budget-ms 1000 --benchmark-compare --gate 5% \
        --summary-md "$work/summary.md" --benchmark-json "$work/sweep2.json"
    step 110 power python3 validation/gate_power.py "$work/power" --deadline-s 90
    ;;
serve)  # about 9 minutes
    versions > "$work/versions.txt" 2>&1
    step 595 attrib validation/gpu/attrib.sh "$work/attrib"
    ;;
extras)  # about 7 minutes: every MLA backend (a stored result of its own), the gate's power,
         # and the per-part checks of mla (vLLM's dispatch answer) and dist
    versions > "$work/versions.txt" 2>&1
    step 150 mla-sweep python3 -m pytest benchmarks/test_mla.py --sweep nightly --mla-backends all \
        -p no:cacheprovider "--benchmark-storage=file://$work/store" --benchmark-autosave -rs -q \
        --benchmark-json "$work/mla-sweep.json"
    step 170 power python3 validation/gate_power.py "$work/power" --deadline-s 150
    for s in mla dist; do step 70 "$s" "validation/gpu/$s.sh" "$work/$s"; done
    ;;
whatif)  # about 6-7 minutes: kernels, then two server starts
    versions > "$work/versions.txt" 2>&1
    step 560 whatif validation/gpu/whatif.sh "$work/whatif"
    ;;
*)
    echo "unknown part '$part': kernels, serve, extras or whatif" >&2; exit 2 ;;
esac
cp "$work"/*.log "$work"/*.md "$out"/ 2>/dev/null || true
