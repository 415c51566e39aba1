#!/usr/bin/env bash
# One device call on nvidia-h200 (<= 10 min), for issue 8's kernel target (every mixer's kernel path >= 5x its
# PyTorch reference at the 1.7B layout). `harness bench --what kernels` for the mixers that miss it, with where
# the kernel layer's time goes: the recurrence alone against the reference's recurrence, the GPU-busy share and
# the top operators (harness.bench.kernels.compare_layer). First at batch 4 (the earlier runs' batch), then at batch 8
# (stage 3's micro-batch at 1.7B) in a second process that finds the first's Triton cache on disk.
#
#   bash scripts/device/kernel_breakdown.sh [PREFIX]      (from the repository root, .devbundle carried)
#   DEVBUNDLE=DIR MIXERS=... SHAPE=... BATCHES=... EXTRA=... bash scripts/device/kernel_breakdown.sh
#
# Returns one JSON per batch under $OUT/kernels (PREFIX-kernels-1.7b-bN.json) and one tgz of tables and logs.
set -u
prefix=${1:-12}
source "${DEVBUNDLE:-.devbundle}/setup.sh"  # DEVBUNDLE: another set-up script's folder
out=${OUT:-device-out}/kernels
work=/tmp/kernel-breakdown
mkdir -p "$out" "$work"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
mixers=${MIXERS:-linear_attn,retnet,deltanet,gated_deltanet}
limit=${FIRST_LIMIT:-400}  # the first process compiles every mixer's kernels (~70-110 s each on a fresh machine)
for batch in ${BATCHES:-4 8}; do
  timeout "$limit" python3 -m harness.cli bench --what kernels --shape "${SHAPE:-1.7B}" --mixer "$mixers" \
    --kernel-batch "$batch" --seq 2048 --max-seconds $((limit - 60)) ${EXTRA:-} \
    --out "$work/$prefix-kernels-1.7b-b$batch.json" >> "$work/log" 2>&1
  limit=${NEXT_LIMIT:-150}
done
cp "$work"/*.json "$out"/ 2>/dev/null
tar czf "$out/tables-and-logs.tgz" -C "$work" $(cd "$work" && ls *.md log 2>/dev/null)
grep -h "^| linear_attn\|^| retnet\|^| deltanet\|^| gated_deltanet\|^| gla\|^| kda\|^| mlstm" "$work"/*.md | cut -c1-400
