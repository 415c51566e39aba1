#!/usr/bin/env bash
# One device call (docs/BENCHMARKS.md, "The sliding window on the GPU"): the window's fla kernel against its PyTorch
# form (tests/gpu/test_window_gpu.py), then the 135M gated_deltanet stage-3 step without a window, with a 16-token
# window on fla's parallel_attn and on the blockwise PyTorch form (window_backend=blockwise), one process each,
# after one another (a shared Triton cache: the first pays the compilation). From the repository root:
#
#   bash scripts/device/window_lease.sh            # on the device (sources $DEVBUNDLE/setup.sh, default .devbundle)
#   DEVBUNDLE= TESTS= PY=.venv/bin/python SHAPE="--shape tiny --device cpu --seq 128" STEPS=2 WARMUP=1 bash scripts/device/window_lease.sh   # CPU rehearsal
#
# Writes window_tests.log and bench/*.json (and .md, .err) under $WORK (default /tmp/window-lease) and, after each
# step, all of it as $OUT/window-lease.tgz (a device call returns at most 8 files); prints each bench's table row.
# TESTS= (empty) skips the tests. MICRO (default 16) is the micro-batch of the three benches; MICRO32=1 adds the kernel window at micro-batch 32
# (the window16 job's 32 x 1 ran out of an H100's memory on the PyTorch form).
set -u
DEVBUNDLE=${DEVBUNDLE-.devbundle}
[ -z "$DEVBUNDLE" ] || source "$DEVBUNDLE/setup.sh"
OUT=${OUT:-/tmp/window-lease-out}
WORK=${WORK:-/tmp/window-lease}
mkdir -p "$OUT" "$WORK/bench"
pack() { tar -C "$WORK" -czf "$OUT/window-lease.tgz" .; }
SHAPE=${SHAPE:---shape 135M --seq 2048}
STEPS=${STEPS:-20}
MICRO=${MICRO:-16}
PY=${PY:-python3}
if [ -n "${TESTS-1}" ]; then
  timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -q -rfE tests/gpu/test_window_gpu.py > "$WORK/window_tests.log" 2>&1
  echo "window tests: exit $? ($(tail -1 "$WORK/window_tests.log"))"
  pack
fi
bench() {  # NAME MICRO OPTION...
  local name=$1 micro=$2; shift 2
  $PY -m harness.cli bench --what step $SHAPE --mixer gated_deltanet --engine plain --teacher-placement replicated \
    --micro-batch "$micro" --steps "$STEPS" --warmup "${WARMUP:-3}" --profile-steps "${PROFILE:-0}" "$@" --out "$WORK/bench/$name.json" 2>"$WORK/bench/$name.err" \
    | grep "^| " | tail -1
  echo "$name: exit ${PIPESTATUS[0]}"
  pack
}
bench plain-m$MICRO "$MICRO"
bench window16-kernel-m$MICRO "$MICRO" --option window=16
bench window16-blockwise-m$MICRO "$MICRO" --option window=16 --option window_backend=blockwise
[ -z "${MICRO32-}" ] || bench window16-kernel-m32 32 --option window=16
