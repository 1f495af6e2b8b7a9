#!/usr/bin/env bash
# The cross-GPU check and the box's TPOT from the raw files of this folder (README.md says which).
# Usage: validation/projection/make.sh [PYTHON]   (from the repository root)
set -euo pipefail
py=${1:-python}
here=validation/projection
h200=baselines/nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130
profiles=(--layer-profiles docs/h200/attribution-L2.json docs/h200/attribution-L4.json
          --idle-profile docs/h200/attrib/L4u-attribution.txt --published "$here/published.json")

# two sessions of the same GPU model (two H200 machines): the noise under any cross-GPU error
"$py" -m decodebench.attribution.crosscheck "$h200/0005_h200-vllm-nightly-gated.json" \
    "$h200/0002_h200-vllm-nightly.json" --target-a h200-x8-nvlink --target-b h200-x8-nvlink \
    --batch 1,64,256 --out "$here/h200-vs-h200" >/dev/null
