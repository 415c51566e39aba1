#!/usr/bin/env bash
# One device call on nvidia-h200 (<= 10 min), for issue 8: why the plain engine's 1.7B stage-3 step ends with NaN
# losses (runs 8 and 15: every timed 1.7B plain step; ZeRO-2's 1.7B steps stayed finite, and 135M is finite under
# both). The plain engine now skips an optimizer step whose gradient is not finite, as DeepSpeed's bf16
# optimizer does (check_grad_overflow), and warns with the names of the parameters whose gradients are not finite;
# the bench records every step's loss and the engine's skipped steps (losses_each, skipped_steps, health).
#   1. the plain engine at 1.7B, micro-batch 8: do steps get skipped, and which parameters' gradients are bad?
#   2. ZeRO-2 at 1.7B, same steps: does DeepSpeed skip steps too (it never said so: the bench did not record it)?
#
#   bash scripts/device/nan_1.7b.sh      (from the repository root, .devbundle carried)
#   DEVBUNDLE=DIR LARGE=tiny EXTRA="--device cpu --seq 64 --steps 2 --warmup 1" bash scripts/device/nan_1.7b.sh
#
# Returns two JSON files under $OUT/nan (prefix 16-) and one tgz of tables and logs.
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"
out=${OUT:-device-out}/nan
work=/tmp/nan-1.7b
mkdir -p "$out" "$work"
source scripts/device/plain_bench.sh  # CUDA_VISIBLE_DEVICES, bench=(...), small, large
timeout 280 "${bench[@]}" --shape "$large" --micro-batch 8 --steps 6 ${EXTRA:-} --out "$work/16-1.7b-plain.json" > "$work/plain.log" 2>&1
grep -h "skipped\|not trained\|health" "$work/plain.log" | cut -c1-600 | head -8
zero2=("${bench[@]/#plain/zero3}")  # --engine zero3: the DeepSpeed engine, its ZeRO stage from zero2.json
timeout 250 "${zero2[@]}" --shape "$large" --micro-batch 8 --steps 6 ${EXTRA:-} --out "$work/16-1.7b-zero2.json" > "$work/zero2.log" 2>&1
grep -h "skipped\|OVERFLOW\|Overflow\|not trained" "$work/zero2.log" | cut -c1-400 | head -5
cp "$work"/*.json "$out"/ 2>/dev/null
tar czf "$out/tables-and-logs.tgz" -C "$work" $(cd "$work" && ls *.md *.log 2>/dev/null)
python3 - "$work" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for r in json.loads(f.read_text()).get("step", []):
        print(f.name, r.get("engine"), "losses", r.get("losses_each"), "grad norms", r.get("grad_norms_each"),
              "skipped", r.get("skipped_steps"), r.get("error", ""))
PY
