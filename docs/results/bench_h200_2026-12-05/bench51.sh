#!/usr/bin/env bash
# Issue 51 side by side: the stage-3 step bench of the code before the one loop (.cache/before51) and after (repo root).
source .devbundle/setup.sh || exit 4
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/machine.txt"
ARGS="bench --what step --shape 135M --mixer gated_deltanet --engine plain --teacher-placement replicated --micro-batch 32 --seq 2048 --steps 20 --warmup 5"
echo "args: $ARGS" >>"$OUT/machine.txt"
(cd .cache/before51 && timeout ${T1:-240} python3 -m harness.cli $ARGS --out "$OUT/before.json") >"$OUT/before.log" 2>&1
echo "before rc $? at ${SECONDS}s"
timeout ${T2:-150} python3 -m harness.cli $ARGS --out "$OUT/after.json" >"$OUT/after.log" 2>&1
echo "after rc $? at ${SECONDS}s"
(cd .cache/before51 && timeout ${T3:-100} python3 -m harness.cli $ARGS --out "$OUT/before2.json") >"$OUT/before2.log" 2>&1
echo "before2 rc $? at ${SECONDS}s"
tail -n 25 "$OUT"/*.md 2>/dev/null | cut -c1-250
