# Shared by the GPU scripts that run in parts (validation/gpu/gate.sh, validation/gpu/validate.sh); sourced, not run.
#
#   gpu_part_setup PART OUTDIR   cd to the repository, make OUTDIR and a scratch dir ($work), put the
#                                checkout first on PYTHONPATH, and pack $work into OUTDIR/PART.tgz on exit
#   step SECONDS NAME CMD...     run CMD bounded by `timeout`, its output in $work/NAME.log; print what
#                                STEP_SHOW selects of the log (a grep -E pattern; default: its last 25
#                                lines), then the exit status and duration, also appended to
#                                $work/steps.txt; never aborts the part
#   versions                     the GPU, its clocks, torch and vLLM, as the part's first record

gpu_part_setup() {
    part=$1
    cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
    out=$(mkdir -p "$2" && cd "$2" && pwd) || exit 2
    work=$(mktemp -d)
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    trap 'tar czf "$out/$part.tgz" -C "$work" . 2>/dev/null' EXIT
}

step() {
    local limit=$1 name=$2; shift 2
    echo "== $name ($(date -u +%T), limit ${limit}s)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$work/$name.log" 2>&1
    local rc=$?
    if [[ -n ${STEP_SHOW:-} ]]; then
        grep -E "$STEP_SHOW" "$work/$name.log" | tail -n 12
    else
        tail -n 25 "$work/$name.log"
    fi
    echo "== $name exit $rc after $((SECONDS - start)) s" | tee -a "$work/steps.txt"
}

versions() {
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
    python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
}
