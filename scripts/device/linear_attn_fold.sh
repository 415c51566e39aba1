#!/usr/bin/env bash
# One device call on nvidia-h200 (<= 10 min), for issue 8: linear attention's normaliser carried by the
# recurrence (harness.mixers.linear_attn.normalised_in_the_recurrence: one value column of ones in fla's kernel
# instead of a float32 cumsum over T). Its GPU layer tests against the reference and the bf16 floor (every
# parameter gradient; prefill state -> reference steps), its kernel bench at the 1.7B layout (runs 12 before it:
# 4.94 ms at batch 4, 7.61 at batch 8), then the DeepSpeed engine through the real stage 3 with the fused student
# blocks (tests/gpu/test_stages_one_gpu.py -k deepspeed: ZeRO-3's gathering hooks with fla's norm kernels).
# Runs 13 (its first version) found fla's 16-bit backward refusing an odd V (65) and passed the fused student
# block against the PyTorch block, which this version no longer runs.
#
#   bash scripts/device/linear_attn_fold.sh      (from the repository root, .devbundle carried)
#
# Returns two JSON files under $OUT/fold and one tgz of tables and logs.
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"
out=${OUT:-device-out}/fold
work=/tmp/linear-attn-fold
mkdir -p "$out" "$work"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mixer_layers.py -k linear_attn > "$work/layer-tests.log" 2>&1
tail -4 "$work/layer-tests.log" | cut -c1-400
for batch in 4 8; do
  timeout 60 python3 -m harness.cli bench --what kernels --shape 1.7B --mixer linear_attn --kernel-batch "$batch" \
    --seq 2048 --out "$work/14-kernels-1.7b-linear_attn-b$batch.json" >> "$work/log" 2>&1
done
grep -h "^| linear_attn" "$work"/*.md | cut -c1-400
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_stages_one_gpu.py -k deepspeed > "$work/stages.log" 2>&1
tail -3 "$work/stages.log" | cut -c1-400
cp "$work"/*.json "$out"/ 2>/dev/null
tar czf "$out/tables-and-logs.tgz" -C "$work" $(cd "$work" && ls *.md *.log log 2>/dev/null)
