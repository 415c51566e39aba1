#!/usr/bin/env bash
# One device call on nvidia-h200 (<= 10 min), for issue 8: stage 3's plain engine (deepspeed.student_engine=plain)
# with bf16 weights and fp32 master copies, as DeepSpeed keeps them (runs 7 measured its first version, fp32
# weights under autocast: 34,674 tokens/s at 135M mb 8, slower than ZeRO-2). One after another on one GPU (the
# 135M step is host-bound): 135M at micro-batch 8 and 16 (compare ZeRO-2 37,720 / 60,030 in runs 4), then 1.7B
# at micro-batch 8 (compare ZeRO-2 20,552 tokens/s, optimizer 125 ms, 81.6 GiB in runs 5 and 7) with and without
# 6 of 24 blocks recomputed. Runs 8: 52,245 / 78,252 tokens/s at 135M; 1.7B 45.2% MFU, 43.4% at 74.0 GiB recomputing.
# The first run's timeout is the longest: a fresh machine compiles the Triton kernels for ~2 min in it (in runs 8
# a 160 s limit cut it).
#
#   bash scripts/device/step_plain.sh        (from the repository root, .devbundle carried)
#   DEVBUNDLE=DIR SMALL=tiny LARGE=tiny EXTRA="--device cpu --seq 64 --steps 2 --warmup 1" bash scripts/device/step_plain.sh
#
# Returns four JSON files under $OUT/plain (prefix 8-) and one tgz of the Markdown tables and the log.
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"  # DEVBUNDLE: another set-up script's folder (a CPU rehearsal)
out=${OUT:-device-out}/plain
work=/tmp/step-plain
mkdir -p "$out" "$work"
source scripts/device/plain_bench.sh  # CUDA_VISIBLE_DEVICES, bench=(...), small, large
timeout 240 "${bench[@]}" --shape "$small" --micro-batch 8 --steps 10 ${EXTRA:-} --out "$work/8-135m-plain-mb8.json" >> "$work/log" 2>&1
timeout 80 "${bench[@]}" --shape "$small" --micro-batch 16 --steps 10 ${EXTRA:-} --out "$work/8-135m-plain-mb16.json" >> "$work/log" 2>&1
timeout 180 "${bench[@]}" --shape "$large" --micro-batch 8 --steps 6 ${EXTRA:-} --out "$work/8-1.7b-plain.json" >> "$work/log" 2>&1
timeout 90 "${bench[@]}" --shape "$large" --micro-batch 8 --steps 6 --grad-ckpt-fraction 0.25 ${EXTRA:-} \
  --out "$work/8-1.7b-plain-ckpt.json" >> "$work/log" 2>&1
cp "$work"/*.json "$out"/ 2>/dev/null
tar czf "$out/tables-and-logs.tgz" -C "$work" $(cd "$work" && ls *.md log 2>/dev/null)
grep -h "^| $small \|^| $large " "$work"/*.md | cut -c1-300
