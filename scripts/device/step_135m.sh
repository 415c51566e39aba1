#!/usr/bin/env bash
# One device call on nvidia-h200 or -x2 (~6 min), for issue 8's 135M target: the 135M Gated DeltaNet stage-3 step
# on DeepSpeed ZeRO-2 against stage 3's plain one-process engine (deepspeed.student_engine=plain), at micro-batch
# 8 and 16, one after another on GPU 0 (the step is host-bound: runs side by side would share the host).
# Compare runs 4: ZeRO-2 37,720 tokens/s (mb 8), 60,030 (mb 16), optimizer ~80 ms per step.
#
#   bash scripts/device/step_135m.sh        (from the repository root, .devbundle carried)
#   DEVBUNDLE=DIR SHAPE=tiny EXTRA="--device cpu --seq 64 --steps 2 --warmup 1" bash scripts/device/step_135m.sh
#
# Returns the four JSON files under $OUT/step135 (prefix 7-) and one tgz of the Markdown tables and the log.
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"  # DEVBUNDLE: another set-up script's folder (a CPU rehearsal)
out=${OUT:-device-out}/step135
work=/tmp/step-135m
mkdir -p "$out" "$work"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
bench=(python3 -m harness.cli bench --shape "${SHAPE:-135M}" --mixer gated_deltanet --seq 2048 --steps 10 --warmup 3
       --profile-steps 1 --student-ds-config ds_configs/zero2.json)
for mb in 8 16; do
  timeout 150 "${bench[@]}" --micro-batch $mb ${EXTRA:-} --out "$work/7-135m-zero2-mb$mb.json" >> "$work/log" 2>&1
  timeout 150 "${bench[@]}" --micro-batch $mb ${EXTRA:-} --engine plain --out "$work/7-135m-plain-mb$mb.json" \
    >> "$work/log" 2>&1
done
cp "$work"/*.json "$out"/ 2>/dev/null
tar czf "$out/tables-and-logs.tgz" -C "$work" $(cd "$work" && ls *.md log 2>/dev/null)
grep -h "^| ${SHAPE:-135M} " "$work"/*.md | cut -c1-300
