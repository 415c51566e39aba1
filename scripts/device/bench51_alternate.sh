#!/usr/bin/env bash
# Issue 51's side-by-side measurement, alternating: the 135M stage-3 step bench of the code before the one training
# loop (e35f1f9, unpacked in .cache/before51) and of this checkout, one process after another on one GPU with a shared
# Triton cache, in the order ORDER gives. The default starts with a warm-up process of the code before (it pays the
# kernels' compilation and its number is not used), then before, loop, before, loop. From the repository root:
#
#   mkdir -p .cache/before51 && git archive e35f1f9 harness ds_configs pyproject.toml | tar -C .cache/before51 -x   # here, once
#   bash scripts/device/bench51_alternate.sh        # on the device, carrying .devbundle and .cache/before51
#   DEVBUNDLE= PY=.venv/bin/python SHAPE="--shape tiny --device cpu --seq 64" MICRO=2 STEPS=1 WARMUP=0 \
#     ORDER="before loop" bash scripts/device/bench51_alternate.sh  # CPU rehearsal (tests/test_bench51_alternate_script.py)
#
# Each process gets T seconds (the first T0). Writes $OUT/NN-CODE.json and .log for each and $OUT/summary.txt (the
# machine, the arguments and one line per process: exit code, wall time, tokens/s, peak memory). Eight processes at
# most come back in one call (a device call returns 8 files): split longer orders over calls within 30 s.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/bench_env.sh"  # DEVBUNDLE, OUT, TRITON_CACHE_DIR, PY
ORDER=${ORDER:-warm before loop before loop}
SHAPE=${SHAPE:---shape 135M --seq 2048}
ARGS="bench --what step $SHAPE --mixer ${MIXER:-gated_deltanet} --engine plain --teacher-placement replicated --micro-batch ${MICRO:-32} --steps ${STEPS:-20} --warmup ${WARMUP:-5}"
BEFORE=${BEFORE:-.cache/before51}
for code in $ORDER; do
  case $code in warm|before|loop) ;; *) echo "ORDER has $code: allowed are warm, before, loop"; exit 2 ;; esac
done
test -d "$BEFORE/harness" || { echo "missing $BEFORE/harness: see this script's header"; exit 3; }
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || uname -m; } >"$OUT/summary.txt"
echo "args: $ARGS | order: $ORDER | this checkout: $CODE" >>"$OUT/summary.txt"
i=0
for code in $ORDER; do
  case $code in warm|before) dir=$BEFORE ;; *) dir=. ;; esac
  i=$((i + 1)); tag=$(printf '%02d-%s' "$i" "$code")
  if [ "$i" = 1 ]; then t=${T0:-240}; else t=${T:-110}; fi
  [ "$i" -le 2 ] && echo "$code imports $(cd "$dir" && $PY -c 'import harness, os; print(os.path.dirname(os.path.abspath(harness.__file__)))')" >>"$OUT/summary.txt"
  start=$SECONDS
  (cd "$dir" && timeout "$t" $PY -m harness.cli $ARGS --out "$OUT/$tag.json") >"$OUT/$tag.log" 2>&1
  rc=$?
  got=$($PY -c "import json,sys; s=json.load(open(sys.argv[1]))['step'][0]; print(round(s['tokens_per_s']), 'tokens/s', round(s['peak_mem_gib'], 1), 'GiB')" "$OUT/$tag.json" 2>/dev/null)
  echo "$tag exit $rc, ${SECONDS}s in, $((SECONDS - start)) s: ${got:-no result}" | tee -a "$OUT/summary.txt"
done
