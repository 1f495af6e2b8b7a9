#!/usr/bin/env bash
# A new runner's first nights, on a CUDA box whose python imports a vLLM build: from an empty
# storage, nights 1..5 of the nightly `vllm` kernel set with --benchmark-compare --gate 5%
# --benchmark-autosave (the build unchanged), then night 6: the same set with
# --inject-slowdown 5% --gate 3% against the five stored nights (nothing saved: an injected
# result is never a baseline). Then validation/gate/nights_table.py turns the nights into the
# per-night table (SLOWER, FASTER, UNDECIDED, SAME, the conclusion; caught on night 6).
#
#   validation/gate/nights.sh OUTDIR [FIRST [LAST]]
#
# OUTDIR gets night-N.json (--benchmark-json), night-N.log (the session's output and exit
# status), nights.md (the table). The storage is $STORAGE (default OUTDIR/storage): it must
# outlive the calls when the nights are run a few per call (on an H100 with --timer kernel night 1 took
# 48 s and a gated night over 150 s: its re-measure rounds; validation/gate/h100-2026-12-06/),
# e.g. `validation/gate/nights.sh $OUT 1 2`, then `3 4`, then `5 6` with the same STORAGE.
# Night 1 must start from an empty storage: it is refused otherwise. Each night is bounded by
# NIGHT_TIMEOUT seconds (default 540); PY is the interpreter (default $DECODEBENCH_PYTHON or
# python3); arguments after LAST go to pytest (a CPU smoke run: `-k "rmsnorm and m1"`).
set -uo pipefail
out=${1:?usage: validation/gate/nights.sh OUTDIR [FIRST [LAST]] [pytest args]}
storage=${STORAGE:-$out/storage}
mkdir -p "$out" "$storage"  # both relative to where it was called, not the checkout
out=$(cd "$out" && pwd) storage=$(cd "$storage" && pwd)
cd "$(dirname "$0")/../.."
first=${2:-1}
last=${3:-6}
shift $(( $# < 3 ? $# : 3 ))
py=${PY:-${DECODEBENCH_PYTHON:-python3}}
if [[ $first == 1 ]] && [[ -n $(find "$storage" -name '*.json' -print -quit) ]]; then
    echo "nights.sh: night 1 needs an empty storage, $storage holds results" >&2
    exit 2
fi
kernels=(benchmarks/ --ignore=benchmarks/test_decode.py --ignore=benchmarks/test_allreduce.py -k vllm
         -p no:cacheprovider -q --benchmark-storage "file://$storage" --benchmark-compare)
for night in $(seq "$first" "$last"); do
    if (( night <= 5 )); then
        what=(--gate 5% --benchmark-autosave)
    else
        what=(--gate 3% --inject-slowdown 5%)
    fi
    stored=$(find "$storage" -name '*.json' | wc -l)
    echo "nights.sh: night $night: $stored stored results; ${what[*]}" | tee "$out/night-$night.log" >&2
    start=$(date +%s)
    timeout -k 30 "${NIGHT_TIMEOUT:-540}" "$py" -m pytest "${kernels[@]}" "${what[@]}" \
        --benchmark-json "$out/night-$night.json" "$@" >> "$out/night-$night.log" 2>&1
    status=$?
    echo "nights.sh: night $night exit $status after $(( $(date +%s) - start )) s" | tee -a "$out/night-$night.log" >&2
    grep -E "^gate |^decodebench gate" "$out/night-$night.log" >&2
done
"$py" validation/gate/nights_table.py "$out" | tee "$out/nights.md"
