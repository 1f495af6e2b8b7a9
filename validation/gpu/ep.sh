#!/usr/bin/env bash
# validation/gpu/ep.sh OUTDIR -- expert parallelism on one CUDA GPU with a real vLLM (about 80-110 s on an
# H200 with vLLM 0.26; every step bounded by `timeout`, the whole under 120 s):
#   1. moe: one EP-8 rank of Kimi-K2.5 (48 whole experts: gate_up N=4096 K=7168, down N=7168 K=2048),
#      vLLM's fused_marlin_moe with its expert_map on the step's M tokens (the busiest rank of the
#      case's routing), uniform and skewed routing, M = 1..256 as the nightly sweep has them, each
#      checked against the float32 torch reference before it is timed (kernel-only timer);
#   2. dispatch: the EP collectives (all-to-all; all-gather + reduce-scatter, vLLM's
#      allgather_reducescatter) at EP-8 message sizes over one rank: the code-path check (nothing
#      crosses a link), CUDA events and CUDA-graph replay.
# Run from anywhere with the python3 that imports vLLM (PYTHONPATH may already hold it; the checkout
# is put first). Writes under OUTDIR: versions.txt, moe-ep.log + moe-ep.json, dispatch.log +
# dispatch.json (pytest-benchmark JSON with raw samples and extra_info: commit them as baselines),
# summary.txt (one line per result) and steps.txt (each step's exit status). A failing step is
# logged and the next one runs. EP_SMOKE=1 runs the same steps on the CPU (torch backend, a tiny
# INT4 model, 2 gloo ranks): plumbing only.
set -uo pipefail
out=${1:?usage: validation/gpu/ep.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${DECODEBENCH_PYTHON:-python3}
moe=(--model kimi-k2.5 --tp 8 --ep 8 --device cuda --timer kernel --sweep nightly --budget-ms 300 -k "vllm and ep8")
dispatch=(--model kimi-k2.5 --tp 8 --ep 8 --device cuda:0 --world-size 1 --sweep nightly --budget-ms 60)
if [[ ${EP_SMOKE:-0} == 1 ]]; then
    "$py" - "$out/tiny-kimi-int4.json" <<'PY'
import json, sys
from decodebench.model import load_model_spec  # noqa: F401  (the bundled configs' folder below)
from pathlib import Path
tiny = json.loads(Path("decodebench/models/tiny-kimi/config.json").read_text())
kimi = json.loads(Path("decodebench/models/kimi-k2.5/config.json").read_text())
quant = kimi.get("quantization_config") or kimi["text_config"]["quantization_config"]
Path(sys.argv[1]).write_text(json.dumps({**tiny, "quantization_config": quant}))
PY
    moe=(--model "$out/tiny-kimi-int4.json" --tp 1 --ep 4 --device cpu --sweep smoke --budget-ms 30 -k "torch and ep4")
    dispatch=(--model tiny-kimi --tp 1 --ep 4 --device cpu --world-size 2 --sweep smoke --budget-ms 30)
fi

step() {  # step NAME SECONDS COMMAND...: run with a time limit, record its exit status
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T), limit ${limit}s)" >&2
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@"
    echo "$name exit $? after $((SECONDS - start)) s" >>"$out/steps.txt"
}

step versions 8 "$py" -c "
import torch
from decodebench.hardware import vllm_version
print('torch', torch.__version__, 'cuda', torch.version.cuda)
print('vllm', vllm_version())
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')
" >"$out/versions.txt" 2>&1

step moe "${EP_MOE_LIMIT:-200}" "$py" -m pytest benchmarks/test_moe.py "${moe[@]}" -p no:cacheprovider -p no:randomly -rs \
    --benchmark-storage "file://$out/store" --benchmark-json "$out/moe-ep.json" >"$out/moe-ep.log" 2>&1

step dispatch 40 "$py" -m pytest benchmarks/test_dispatch.py "${dispatch[@]}" -p no:cacheprovider -p no:randomly \
    -rs --benchmark-storage "file://$out/store" --benchmark-json "$out/dispatch.json" >"$out/dispatch.log" 2>&1

step summary 5 "$py" - "$out" >"$out/summary.txt" 2>&1 <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("moe-ep.json", "dispatch.json"):
    path = out / name
    if not path.exists():
        print(f"{name}: missing (see {name.replace('.json', '.log')})")
        continue
    report = json.loads(path.read_text())
    print(f"{name}: {len(report['benchmarks'])} results, fingerprint "
          f"{report['machine_info']['decodebench']['fingerprint']['key']}")
    for bench in sorted(report["benchmarks"], key=lambda b: b["name"]):
        info, shape = bench["extra_info"], bench["extra_info"]["shape"]
        line = (f"  {bench['name']}: median {bench['stats']['median'] * 1e6:.2f} us, {info.get('timer')}, "
                f"ref err {info.get('reference_error', float('nan')):.2e}, stop {info.get('stop_reason')}")
        if info.get("component") == "moe":
            line += (f", rank {shape.get('rank')}: {shape.get('rank_slots')} slots, "
                     f"{shape.get('distinct_experts')} experts, {info.get('achieved_gbps', 0):.0f} GB/s "
                     f"({info.get('frac_peak_bw') or 0:.0%} of peak)")
        else:
            line += f", {info.get('message_bytes')} B over {info.get('world_size')} rank(s)"
        print(line)
PY
rm -rf "$out/store"  # the same numbers as the JSON files
cat "$out/summary.txt"
cat "$out/steps.txt"
