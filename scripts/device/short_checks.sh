#!/usr/bin/env bash
# The GPU checks that fit a lease too short for a job (under ~1,100 s of device time), one part per argument, each
# under its own timeout, everything it writes under $OUT (a call returns at most 8 files):
#
#   align      benchmarks/align_step.py at the 135M stage-1 shape (30 layers, 8 x 2048): stage 1's step phase by
#              phase (the teacher's capture, the layers, the clip, the optimizer)
#   hidden     the stage-3 step bench of the default student and of the same with stage 3's hidden-state term
#              (step_repeat.sh ORDER="default hidden"): that the term runs on CUDA, and what it costs
#   quadratic  issue 52's fox and path on their fla kernels: `harness mixers check` and the GPU tests naming them
#
# On a warm machine whose bundle is in (devbundle_in.sh base), with the kernel cache of a job's lease unpacked where
# it was carried (.cache/kernel-cache/*.tar.xz -> .cache/triton, .cache/inductor):
#   bash scripts/device/short_checks.sh align hidden
# A CPU rehearsal (tiny shapes, no kernel cache unpacked): DEVBUNDLE= SMALL=1 OUT=/tmp/sc bash scripts/device/short_checks.sh align hidden
set -u
source "$(dirname "${BASH_SOURCE[0]}")/bench_env.sh"  # DEVBUNDLE, OUT, TRITON_CACHE_DIR, PY, CODE
for archive in .cache/kernel-cache/kernel-cache.tar.xz .cache/kernel-cache/inductor-cache.tar.xz; do
  [ -z "${SMALL:-}" ] && [ -f "$archive" ] && tar -C .cache -xJf "$archive" && echo "unpacked $archive"
done
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
echo "code: $CODE" | tee "$OUT/short_checks.txt"
ALIGN_ARGS=""
export T0=${T0:-200} T=${T:-120}
if [ -n "${SMALL:-}" ]; then  # the CPU rehearsal's shapes (step_repeat.sh reads SHAPE, MICRO, STEPS, WARMUP)
  ALIGN_ARGS="--device cpu --layers 2 --batch 1 --seq 64 --steps 1 --warmup 0 --option chunk_size=16 --option backend=reference"
  export SHAPE="--shape tiny --device cpu --seq 64 --option chunk_size=16" MICRO=2 STEPS=2 WARMUP=0
fi
for part in "$@"; do
  start=$SECONDS
  case $part in
    align)
      timeout "${ALIGN_T:-240}" $PY benchmarks/align_step.py $ALIGN_ARGS --out "$OUT/align_step.json" 2>&1 | tail -3 ;;
    hidden)
      rm -rf /tmp/step-hidden
      ORDER="default hidden" OUT=/tmp/step-hidden DEVBUNDLE= PY="$PY" bash scripts/device/step_repeat.sh >/dev/null 2>&1
      cp /tmp/step-hidden/summary.txt "$OUT/step_hidden_summary.txt" 2>/dev/null
      cp /tmp/step-hidden/01-default.json "$OUT/step_default.json" 2>/dev/null
      cp /tmp/step-hidden/02-hidden.json "$OUT/step_hidden.json" 2>/dev/null
      cat "$OUT/step_hidden_summary.txt" 2>/dev/null ;;
    quadratic)
      for m in fox path; do timeout "${CHECK_T:-150}" $PY -m harness.cli mixers check $m 2>&1 | tail -8; done
      timeout "${QUAD_TEST_T:-240}" $PY -m pytest -q tests/gpu -k "fox or path" 2>&1 | tail -6 ;;
    *) echo "unknown part $part: allowed are align, hidden, quadratic"; exit 2 ;;
  esac
  echo "$part: $((SECONDS - start)) s" | tee -a "$OUT/short_checks.txt"
done
