#!/usr/bin/env bash
# The cross-GPU check and the box's TPOT from the raw files of this folder (README.md says which).
# Usage: validation/projection/make.sh [PYTHON]   (from the repository root)
# MAKE_OUT=DIR writes the outputs under DIR instead of beside the raw files (validation/tests checks that they
# reproduce the committed ones).
set -euo pipefail
py=${1:-python}
here=validation/projection
dest=${MAKE_OUT:-$here}
h200=baselines/nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130
profiles=(--layer-profiles validation/h200/attribution-L2.json validation/h200/attribution-L4.json
          --idle-profile validation/tp8/h100-2026-12-05/profile-24-layers.json --published "$here/published.json")

# the published box figures' page (every figure of published.json in one table)
"$py" validation/projection/published.py > "$dest/published.md"

# two sessions of the same GPU model (two H200 machines): the noise under any cross-GPU error
"$py" "$here/crosscheck.py" "$h200/0005_h200-vllm-nightly-gated.json" \
    "$h200/0002_h200-vllm-nightly.json" --target-a h200-x8-nvlink --target-b h200-x8-nvlink \
    --batch 1,64,256 --out "$dest/h200-vs-h200" >/dev/null

# the cross-GPU check, each GPU by the product's fit of its results (python -m decodebench fit's): the committed H200
# run (kernel timer) and the fresh H100 run (kernel timer); the H100's step-timer run joins its fit, never the comparison
h100=validation/tp8/h100-2026-12-05
"$py" "$here/crosscheck.py" "$h200/0005_h200-vllm-nightly-gated.json" "$h100/kernel.json.gz" \
    --also-b "$h100/step.json.gz" --target-a h200-x8-nvlink --target-b "$here/targets/h100-x8-nvlink.json" \
    --batch 1,64,256 --out "$dest/h200-vs-h100" >/dev/null

# pairs 2-5: TP-8 sets of the same benchmark code (run.sh kernels), each GPU fitted on both its timers: "H200 H100 out"
# (pair 2: lent H200 GPU-482174ea and H100 GPU-1d9e4d81; pair 3: that H200 and H100 GPU-cd54cb47, run at 9fb6de2;
# pair 4: that H200 and H100 GPU-4191876d, run at 5205d5b after the rule was fixed; pair 5: a second H200, GPU-77c2e4b5,
# run at 993be5b, and that H100)
tp8=validation/tp8
for pair in "h200-2026-12-06 h100-2026-12-06 h200-vs-h100-2026-12-06" \
            "h200-2026-12-06 h100-2026-12-06-b h200-vs-h100-2026-12-06-b" \
            "h200-2026-12-06 h100-2026-12-06-c h200-vs-h100-2026-12-06-c" \
            "h200-2026-12-06-b h100-2026-12-06-c h200-vs-h100-2026-12-06-d"; do
    read -r a b out <<< "$pair"
    "$py" "$here/crosscheck.py" "$tp8/$a/kernel.json.gz" "$tp8/$b/kernel.json.gz" --also-a "$tp8/$a/step.json.gz" \
        --also-b "$tp8/$b/step.json.gz" --target-a h200-x8-nvlink --target-b "$here/targets/h100-x8-nvlink.json" \
        --batch 1,64,256 --out "$dest/$out" >/dev/null
done

# the box's TPOT by the product's one projection path (scenarios --project-to's): the H100's step-timer results
# (the default timer) and TRITON_MLA from the H200's all-backend MLA run, each GPU's rule fitted on those results
# alone; every like-for-like published figure's residual; TRITON_MLA at both cache dtypes from the H100 run of
# 2026-12-07 (what an fp8 cache changes of it); then the bands the product prints, from these files
for target in rtx-pro-6000-x8-pcie "$here/targets/rtx-pro-6000-x8-pcie-host-default-nccl.json"; do
    out="$dest/box-$(basename "$target" .json)"
    "$py" "$here/box.py" "$h100/step.json.gz" "$h200/0004_h200-vllm-mla-all-backends.json" --target "$target" \
        "${profiles[@]}" --kv-dtypes validation/tp8/h100-2026-12-07/step.json.gz --batch 1,64,128 --out "$out" >/dev/null
done
# the package's bands (read by --project-to) from the committed checks and box; not with MAKE_OUT, which
# writes only beside the folder's own outputs (validation/tests holds bands.json to bands.py)
if [ -z "${MAKE_OUT:-}" ]; then "$py" "$here/bands.py" > decodebench/attribution/predict/bands.json; fi
# the beta scan: the unexplained time scaled with the traffic instead of kept (the rule keeps it), per GPU
"$py" "$here/beta.py" > "$dest/beta.txt"
# the facts under the rule's fused MoE and DRAM rate: overlap share per SM-count run, the check with each GPU's own
# share (from its SM-count runs) beside the product's, and the shares that would give each direction its own figures
"$py" validation/projection/overlap.py > "$dest/overlap.txt"
# the p of a p-norm of the MoE's SM and memory times (the rule uses the overlap share instead), from the MoE timed
# beside programs that take a share of DRAM bandwidth (raw run in bandwidth-share-h100/, made on a lent H100 by
# bandwidth_share.py --out) and in green contexts of fewer SMs (raw runs in sm-count-<gpu>*/, made on lent GPUs by
# sm_count.py --out), each at its GPU's fit in h200-vs-h100/: the DRAM rate, and the floor per launch times the fused
# MoE's 6 kernel calls (H100: 3083 GB/s, 1.488 µs x 6 = 8.93 µs; H200: 4377 GB/s, 1.449 µs x 6 = 8.69 µs)
mkdir -p "$dest/bandwidth-share-h100"
"$py" validation/projection/bandwidth_share.py --analyse "$here/bandwidth-share-h100/bandwidth-share.json" \
    --dram-gbs 3083 > "$dest/bandwidth-share-h100/analysis.txt"
for gpu_fit in "h100 3083 8.93" "h200 4377 8.69"; do
    read -r gpu gbs floor <<< "$gpu_fit"
    for run in "$here"/sm-count-"$gpu"*/; do
        mkdir -p "$dest/$(basename "$run")"
        for by in waves control two-stage; do
            "$py" validation/projection/sm_count.py --analyse "${run}sm-count.json" --dram-gbs "$gbs" \
                --floor-us "$floor" --slowdown "$by"
        done > "$dest/$(basename "$run")/analysis.txt"
    done
done
