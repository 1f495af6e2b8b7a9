#!/usr/bin/env bash
# The gate's validation on a CUDA box whose python3 imports a vLLM build (the lent H200: vLLM
# 0.26 from ../shared/tools/gpu-vllm, --profile server for FlashAttention-MLA). One part per call:
#
#   validation/gpu/gate.sh nightly OUTDIR  the nightly `vllm` kernel sweep gated against the committed
#                                  baselines (--gate 5%), then the offline gate on its JSON (the
#                                  same lines, the same exit status); ~5 min on an H200
#   validation/gpu/gate.sh power OUTDIR    A/A and 2/5/10 % injected slowdowns on the MoE cases, judged
#                                  at 1/2/3/5 % with a nightly's error budget (validation/gate_power.py)
#   validation/gpu/gate.sh stored-power OUTDIR  SESSIONS (2) stored-mode sessions of the nightly `vllm` set
#                                  against the committed baselines at --gate GATE (3%), each with
#                                  --inject-slowdown INJECT (5%; 0 for none), tallied per family by
#                                  validation/gpu/stored_power.py (trials, caught, false alarms, UNDECIDED);
#                                  two sessions of ~4-5 min fit one 10-minute call
#   validation/gpu/gate.sh real OUTDIR     A/B with side B a real edit of vLLM's Python (an extra, unfused
#                                  copy of fused_marlin_moe's output), each case's true change
#                                  measured apart beside it (two plain sessions)
#   validation/gpu/gate.sh ab OUTDIR       ci/ab of two identical environments over the nightly `vllm`
#                                  kernel set, timed (the pull-request gate in minutes)
#
# Every step is bounded by `timeout`; logs, JSON and summaries are packed into OUTDIR/<part>.tgz.
# Arguments after OUTDIR go to pytest (a smoke run on the CPU: `-k "rmsnorm and m1"`);
# VLLM_SITE names the unpacked vLLM the `real` part copies (default \$HOME/vllm-site).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
gpu_part_setup "${1:?usage: validation/gpu/gate.sh nightly|power|stored-power|real|ab OUTDIR}" "${2:?OUTDIR}"
STEP_SHOW="^(SLOWER|STEP|gate |decodebench gate|[0-9]+ passed)"
kernels=(benchmarks/ --ignore=benchmarks/test_decode.py --ignore=benchmarks/test_allreduce.py -p no:cacheprovider -rs -q)
versions > "$work/versions.txt" 2>&1
cat "$work/versions.txt"

case $part in
nightly)
    # the committed baselines are the storage: nothing is saved (no autosave), the JSON is kept
    step 420 nightly python3 -m pytest "${kernels[@]}" -k vllm --benchmark-compare --gate 5% \
        --benchmark-json "$work/nightly.json" --summary-md "$work/nightly.summary.md" "${@:3}"
    fp=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['machine_info']['decodebench']['fingerprint']['key'])" "$work/nightly.json")
    step 60 offline python3 -m decodebench.gate "baselines/$fp" "$work/nightly.json" --gate 5%
    python3 - "$work" <<'PY'
import re, sys
from pathlib import Path
work = Path(sys.argv[1])
pick = lambda t: [l for l in t.splitlines() if re.match(r"(SLOWER|FASTER|SAME|UNDECIDED|INCOMPARABLE) ", l)]
live, offline = pick((work / "nightly.log").read_text()), pick((work / "offline.log").read_text())
print(f"live {len(live)} verdict lines, offline {len(offline)}; identical: {live == offline}")
PY
    ;;
power)
    step 300 power python3 validation/gate_power.py "$work/power" --only moe --deadline-s 240 --trials 20 "${@:3}"
    cp "$work/power/power.md" "$out/" 2>/dev/null
    ;;
stored-power)
    inject=${INJECT:-5%}; gate=${GATE:-3%}
    injecting=(); [[ $inject == 0 || $inject == 0% ]] || injecting=(--inject-slowdown "$inject")
    for i in $(seq 1 "${SESSIONS:-2}"); do
        step 290 "stored-power-$i" python3 -m pytest "${kernels[@]}" -k vllm --benchmark-compare --gate "$gate" \
            "${injecting[@]}" --benchmark-json "$work/stored-power-$i.json" "${@:3}"
    done
    python3 validation/gpu/stored_power.py "$work"/stored-power-*.json | tee "$work/stored-power.md"
    cp "$work/stored-power.md" "$out/" 2>/dev/null
    ;;
real)
    site=${VLLM_SITE:-$HOME/vllm-site}; changed=$(mktemp -d)/vllm-site
    # the module that defines fused_marlin_moe (vLLM 0.26: fused_moe/experts/marlin_moe.py)
    source_file=$(grep -rl "^def fused_marlin_moe" "$site/vllm/model_executor/layers/fused_moe" | head -n 1)
    [[ -n $source_file ]] || { echo "gate.sh real: no 'def fused_marlin_moe' under $site" >&2; exit 2; }
    cp -as "$site" "$changed"  # a copy made of symlinks; the one edited file is a real file
    target=$changed/${source_file#"$site"/}
    rm "$target" && cp "$source_file" "$target"
    cat >> "$target" <<'PY'


# decodebench's validation edit: an unfused, out-of-place copy of the layer's output (two more
# small kernels per call); the result is unchanged, so the correctness check passes. wraps()
# keeps the signature, which decodebench's binding reads.
import functools as _decodebench_functools

_fused_marlin_moe_before_edit = fused_marlin_moe


@_decodebench_functools.wraps(_fused_marlin_moe_before_edit)
def fused_marlin_moe(*args, **kwargs):
    return _fused_marlin_moe_before_edit(*args, **kwargs).clone().mul_(1.0)
PY
    rest=$(echo "$PYTHONPATH" | tr ':' '\n' | grep -vx "$site" | paste -sd: -)
    wrapper=$work/python-b  # side B: this python3 with the edited copy first on the path
    printf '#!/bin/sh\nexport PYTHONPATH=%s\nexec python3 "$@"\n' "$changed:$rest" > "$wrapper"; chmod +x "$wrapper"
    sel=(-k "vllm and (fused- or add-)" "${@:3}")
    step 150 real-true-a python3 -m pytest "${kernels[@]}" "${sel[@]}" --benchmark-json "$work/true-a.json"
    step 150 real-true-b "$wrapper" -m pytest "${kernels[@]}" "${sel[@]}" --benchmark-json "$work/true-b.json"
    step 280 real-ab python3 -m pytest "${kernels[@]}" "${sel[@]}" --ab-python "$wrapper" --gate 5% \
        --benchmark-json "$work/real-ab.json" --summary-md "$work/real-ab.summary.md"
    python3 validation/gpu/true_change.py "$work/true-a.json" "$work/true-b.json" "$work/real-ab.json" | tee "$work/real.md"
    cp "$work/real.md" "$out/" 2>/dev/null
    ;;
ab)
    wrapper=$work/python-b; printf '#!/bin/sh\nexec python3 "$@"\n' > "$wrapper"; chmod +x "$wrapper"
    step 590 ab env DECODEBENCH_GATE=5% ci/ab "$wrapper" -k vllm -q --benchmark-json "$work/ab.json" \
        --summary-md "$work/ab.summary.md" "${@:3}"
    ;;
*)
    echo "unknown part '$part': nightly, power, stored-power, real or ab" >&2; exit 2 ;;
esac
cp "$work"/*.summary.md "$work/steps.txt" "$out"/ 2>/dev/null || true
