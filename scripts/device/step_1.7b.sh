#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (~9 min), for issue 8's 1.7B targets. GPU 0: the ZeRO-2 stage-3 step with
# torch's fused AdamW (compare runs 5: 20,552 tokens/s, optimizer 131 ms); GPU 1: the same with 3 of 24 blocks
# recomputed (--grad-ckpt-fraction 0.125), for the one-GPU peak <= 80 GiB target (runs 5: 81.6 GiB). Then the
# kernels not measured at 1.7B since the fusions: gla, retnet on GPU 0; linear_attn, mlstm on GPU 1.
#
#   bash scripts/device/step_1.7b.sh        (from the repository root, .devbundle carried)
#   DEVBUNDLE=DIR SHAPE=tiny EXTRA="--device cpu ..." bash scripts/device/step_1.7b.sh    (a CPU rehearsal)
#
# Returns the four JSON files under $OUT/step (prefix 7-) and one tgz of the Markdown tables and logs: the device
# tool brings back at most eight files per call.
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"  # DEVBUNDLE: another set-up script's folder (a CPU rehearsal)
out=${OUT:-device-out}/step
work=/tmp/step-1.7b
mkdir -p "$out" "$work"
bench=(python3 -m harness.cli bench --shape "${SHAPE:-1.7B}" --mixer gated_deltanet --micro-batch 8 --seq 2048 --steps 6
       --warmup 2 --profile-steps 1 --student-ds-config ds_configs/zero2.json ${EXTRA:-})
kernels=(python3 -m harness.cli bench --what kernels --shape "${SHAPE:-1.7B}" --micro-batch 4 --seq 2048 --max-seconds 200 ${EXTRA:-})
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 300 "${bench[@]}" --grad-ckpt-fraction 0.125 --out "$work/7-1.7b-z2-ckpt.json" > "$work/gpu1.log" 2>&1
  timeout 240 "${kernels[@]}" --mixer linear_attn,mlstm --out "$work/7-kernels-1.7b-b.json" >> "$work/gpu1.log" 2>&1
) &
export CUDA_VISIBLE_DEVICES=0
timeout 300 "${bench[@]}" --out "$work/7-1.7b-z2.json" > "$work/gpu0.log" 2>&1
timeout 240 "${kernels[@]}" --mixer gla,retnet --out "$work/7-kernels-1.7b-a.json" >> "$work/gpu0.log" 2>&1
wait
cp "$work"/*.json "$out"/ 2>/dev/null
tar czf "$out/tables-and-logs.tgz" -C "$work" $(cd "$work" && ls *.md *.log 2>/dev/null)
grep -h "^| 1.7B\|^| gla\|^| retnet\|^| linear_attn\|^| mlstm" "$work"/*.md | cut -c1-300
