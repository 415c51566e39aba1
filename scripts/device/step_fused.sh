#!/usr/bin/env bash
# Device calls on nvidia-h200 (<= 10 min each), for issue 8: the fused distillation loss (harness.loss_kernel, its
# bf16 gradient), the student blocks' fused norms and SwiGLU (fla's kernels, harness.student.StudentBlock)
# and the teacher's compiled decoder layers (stages.distill.compile_teacher, harness.engine.compile_decoder_layers).
#   part a: GPU tests of the loss and the fused block, then the plain-engine stage-3 step at 135M, micro-batch 32
#           (runs 8 before them: 94,952 tokens/s; runs 9 with the first loss kernel: 119,192; runs 10 with the fused
#           block too: 138,009), and 1.7B at micro-batch 8 with 6 of 24 blocks recomputed (runs 8: 43.4% MFU, 74.0 GiB);
#   part c (the call after runs 10 found the teacher building a KV cache, which kept its compiled layers from
#           sharing one graph): the fused-block test against the bf16 floor, 135M at micro-batch 32, and as much of
#           the plain engine's real stage 3 as the call leaves time for;
#   part b (next session): 1.7B at micro-batch 8 with 6 of 24 blocks recomputed (runs 8: 43.4% MFU, 74.0 GiB) and
#           without (45.2%, 86.4 GiB), then the DeepSpeed engine through the real stage 3 with the fused blocks
#           (tests/gpu/test_stages_one_gpu.py -k deepspeed; its plain-engine cases passed in part c).
# The first bench's timeout is the longest: a fresh machine compiles fla's kernels for ~2 min in it.
#
#   bash scripts/device/step_fused.sh a        (from the repository root, .devbundle carried)
#   DEVBUNDLE=DIR SMALL=tiny LARGE=tiny EXTRA="--device cpu --seq 64 --steps 2 --warmup 1" bash scripts/device/step_fused.sh a
#
# Returns at most three JSON files under $OUT/fused (prefixes 10-12: runs
# 10-12 in docs/BENCHMARKS.md) and one tgz of the Markdown tables and the logs.
set -u
part=${1:?usage: step_fused.sh a|b|c}
source "${DEVBUNDLE:-.devbundle}/setup.sh"  # DEVBUNDLE: another set-up script's folder (a CPU rehearsal)
out=${OUT:-device-out}/fused
work=/tmp/step-fused-$part
mkdir -p "$out" "$work"
source scripts/device/plain_bench.sh  # CUDA_VISIBLE_DEVICES, bench=(...), small, large
if [ "$part" = a ]; then
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_losses_gpu.py \
    tests/gpu/test_mixer_layers.py::test_fused_student_block_matches_the_pytorch_block > "$work/tests.log" 2>&1
  grep -E "^\{|passed|failed" "$work/tests.log" | cut -c1-400
  timeout 200 "${bench[@]}" --shape "$small" --micro-batch 32 --steps 6 ${EXTRA:-} --out "$work/10-135m-plain-mb32.json" >> "$work/log" 2>&1
  timeout 170 "${bench[@]}" --shape "$large" --micro-batch 8 --steps 6 --grad-ckpt-fraction 0.25 ${EXTRA:-} \
    --out "$work/10-1.7b-plain-ckpt.json" >> "$work/log" 2>&1
elif [ "$part" = c ]; then
  timeout 190 python3 -m pytest -q -s -p no:cacheprovider \
    tests/gpu/test_mixer_layers.py::test_fused_student_block_matches_the_pytorch_block > "$work/tests.log" 2>&1
  grep -E "^\{|passed|failed" "$work/tests.log" | cut -c1-600
  timeout 150 "${bench[@]}" --shape "$small" --micro-batch 32 --steps 6 ${EXTRA:-} --out "$work/11-135m-plain-mb32.json" >> "$work/log" 2>&1
  timeout 110 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_stages_one_gpu.py -k plain > "$work/stages.log" 2>&1
  tail -3 "$work/stages.log"
else
  timeout 240 "${bench[@]}" --shape "$large" --micro-batch 8 --steps 6 --grad-ckpt-fraction 0.25 ${EXTRA:-} \
    --out "$work/12-1.7b-plain-ckpt.json" >> "$work/log" 2>&1
  timeout 100 "${bench[@]}" --shape "$large" --micro-batch 8 --steps 6 ${EXTRA:-} --out "$work/12-1.7b-plain.json" >> "$work/log" 2>&1
  timeout 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_stages_one_gpu.py -k deepspeed > "$work/stages.log" 2>&1
  tail -3 "$work/stages.log"
fi
cp "$work"/*.json "$out"/ 2>/dev/null
tar czf "$out/tables-and-logs-$part.tgz" -C "$work" $(cd "$work" && ls *.md *.log log 2>/dev/null)
grep -h "^| $small \|^| $large " "$work"/*.md 2>/dev/null | cut -c1-300
