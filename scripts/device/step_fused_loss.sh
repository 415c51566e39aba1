#!/usr/bin/env bash
# One device call on nvidia-h200 (<= 10 min), for issue 8: the distillation loss's Triton row kernel
# (harness.loss_kernel). First its GPU tests (the kernel against the PyTorch form, the bf16 chunked loss against
# the fp32 direct one, peak memory), then the plain-engine stage-3 step at 135M (micro-batch 16 and 32; runs 8
# without the kernel: 78,252 / 94,952 tokens/s, loss 119 / 238 ms) and at 1.7B with 6 of 24 blocks recomputed
# (runs 8: 43.4% MFU, 74.0 GiB). The first bench's timeout is the longest: a fresh machine compiles fla's kernels
# for ~2 min in it.
#
#   bash scripts/device/step_fused_loss.sh        (from the repository root, .devbundle carried)
#   DEVBUNDLE=DIR SMALL=tiny LARGE=tiny EXTRA="--device cpu --seq 64 --steps 2 --warmup 1" bash scripts/device/step_fused_loss.sh
#
# Returns three JSON files under $OUT/fused-loss (prefix 9-) and one tgz of the Markdown tables and the logs.
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"  # DEVBUNDLE: another set-up script's folder (a CPU rehearsal)
out=${OUT:-device-out}/fused-loss
work=/tmp/step-fused-loss
mkdir -p "$out" "$work"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_losses_gpu.py > "$work/tests.log" 2>&1
tail -3 "$work/tests.log"
bench=(python3 -m harness.cli bench --mixer gated_deltanet --seq 2048 --warmup 3 --profile-steps 1 --engine plain
       --student-ds-config ds_configs/zero2.json)
small=${SMALL:-135M}
large=${LARGE:-1.7B}
timeout 240 "${bench[@]}" --shape "$small" --micro-batch 16 --steps 10 ${EXTRA:-} --out "$work/9-135m-plain-mb16.json" >> "$work/log" 2>&1
timeout 80 "${bench[@]}" --shape "$small" --micro-batch 32 --steps 6 ${EXTRA:-} --out "$work/9-135m-plain-mb32.json" >> "$work/log" 2>&1
timeout 120 "${bench[@]}" --shape "$large" --micro-batch 8 --steps 6 --grad-ckpt-fraction 0.25 ${EXTRA:-} \
  --out "$work/9-1.7b-plain-ckpt.json" >> "$work/log" 2>&1
cp "$work"/*.json "$out"/ 2>/dev/null
tar czf "$out/tables-and-logs.tgz" -C "$work" $(cd "$work" && ls *.md *.log log 2>/dev/null)
grep -h "^| $small \|^| $large " "$work"/*.md | cut -c1-300
