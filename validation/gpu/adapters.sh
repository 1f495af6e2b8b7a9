#!/usr/bin/env bash
# Every vLLM kernel adapter on one CUDA GPU with a real vLLM, at the smoke sweep: each backend runs,
# or skips with how its absence was found; none may fail (an adapter that no longer fits this vLLM
# fails instead of skipping). About 2 minutes on an H200.
# Usage: validation/gpu/adapters.sh OUTDIR -> OUTDIR/adapters.tgz (logs, junit XML); the skips and failures last.
source "$(dirname "$0")/lib.sh"
gpu_part_setup adapters "${1:?usage: validation/gpu/adapters.sh OUTDIR}"
versions > "$work/versions.txt" 2>&1
common=(-p no:cacheprovider -rs --sweep smoke --budget-ms 100 "--benchmark-storage=file://$work/store")
STEP_SHOW='passed|failed|error|SKIPPED|FAILED' step 300 kernels python3 -m pytest \
    benchmarks/test_rmsnorm.py benchmarks/test_dense.py benchmarks/test_routing.py benchmarks/test_moe.py \
    benchmarks/test_mla.py --mla-backends all "${common[@]}" -k vllm --junitxml "$work/kernels.xml"
python3 - "$work/kernels.xml" <<'PY' | tee "$work/summary.txt"
import pathlib
import sys
import xml.etree.ElementTree as ET

if not pathlib.Path(sys.argv[1]).exists():
    sys.exit("adapters: pytest wrote no report (see kernels.log in adapters.tgz)")
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
skipped = [c for c in cases if c.find("skipped") is not None]
reasons = {}
for c in skipped:
    reasons.setdefault(c.find("skipped").get("message", ""), []).append(c.get("name"))
for reason, names in sorted(reasons.items()):
    print(f"SKIP x{len(names)}: {reason[:220]}")
for c in failed:
    node = c.find("failure") if c.find("failure") is not None else c.find("error")
    print(f"FAIL {c.get('name')}: {(node.get('message') or '')[:220]}")
print(f"adapters: {len(cases) - len(failed) - len(skipped)} ran, {len(skipped)} skipped, {len(failed)} failed")
PY
